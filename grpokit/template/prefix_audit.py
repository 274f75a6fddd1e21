"""Does the run's chat template keep a conversation's tokens when the conversation grows?

Multi-turn training lays a trajectory out as prompt, turn 1's ids, the template's text up to turn 2, turn 2's ids,
... (``ChatTemplate.encode_output``). That is the conversation the template would render only when rendering a
longer conversation keeps the shorter one's tokens as a prefix. Some templates do not: Qwen3's drops the
``<think>`` block of every assistant message before the last user message. ``audit_prefix`` renders a short
synthetic conversation and one that extends it (a reply with a ``<think>`` block, an observation sent as a user
message, as the built-in schedulers send it, and another reply) with the run's own template, system prompt and
``chat_template_kwargs`` (``--enable_thinking``), and says whether the short one's ids are a prefix of the long
one's. Where they are not, re-rendering the conversation would give other ids than were sampled; grpokit never
does that (``docs/multi_turn.md``, "Token in, token out"), and says so once.
"""

from __future__ import annotations

from dataclasses import dataclass

FIRST = {"role": "user", "content": "What is 2 + 3?"}
REPLY = {"role": "assistant", "content": "<think>\nI add 2 and 3.\n</think>\n\nThe answer is 5."}
OBSERVATION = {"role": "user", "content": "Observation: correct. Now what is 5 + 4?"}
SECOND = {"role": "assistant", "content": "<think>\nI add 5 and 4.\n</think>\n\nThe answer is 9."}


@dataclass(frozen=True)
class PrefixAudit:
    """``preserving``: the short conversation's ids are a prefix of the long one's (None: the template cannot
    render the synthetic conversations, ``detail`` says why). ``at``: the first token that differs."""

    preserving: bool | None
    at: int = -1
    short_len: int = 0
    detail: str = ""

    def line(self, pinned: bool) -> str:
        """The one start-up line for a template that is not prefix-preserving (or for an engine that renders each
        turn itself); ``pinned``: the engine samples a later turn from the trajectory's own ids (it renders with
        this template), else it renders each turn."""
        if pinned:
            does = (
                "grpokit trains each multi-turn trajectory on the ids sampled and samples every later turn from "
                "the trajectory's own ids, never from a re-render of its messages"
            )
        else:
            does = (
                "this engine renders each turn's prompt itself (a single-turn rollout server), so later turns are "
                "sampled from a re-render; multi_turn/tito_violations counts the trajectories that then train on "
                "other ids (run the scheduler on the server: grpokit rollout --multi_turn_scheduler NAME)"
            )
        if self.preserving:
            return f"the chat template is prefix-preserving, but {does}; a reply's text may re-tokenize to other ids"
        return (
            f"the chat template is not prefix-preserving: rendering a longer conversation changes the tokens of "
            f"an earlier turn (token {self.at} of {self.short_len} differs; {self.detail}); {does}"
        )


def audit_prefix(template) -> PrefixAudit:
    """Render [user, reply] and [user, reply, observation, reply] with ``template`` (a ChatTemplate: its system
    prompt and chat_template_kwargs apply), each with its last reply left open, as a prompt is rendered; compare
    the ids."""
    try:
        short_text = template.render_prompt([FIRST, REPLY])
        long_text = template.render_prompt([FIRST, REPLY, OBSERVATION, SECOND])
    except Exception as e:  # noqa: BLE001 - jinja2 errors and a template's raise_exception: nothing to audit
        return PrefixAudit(None, detail=f"{type(e).__name__}: {str(e)[:200]}")
    short, long = template.tokenize(short_text), template.tokenize(long_text)
    if long[: len(short)] == short:
        return PrefixAudit(True, short_len=len(short))
    at = next((k for k, (a, b) in enumerate(zip(short, long)) if a != b), min(len(short), len(long)))
    detail = (
        "e.g. it drops earlier <think> blocks"
        if not long_text.startswith(short_text)
        else "the text is kept, but the reply's last token merges with the text after it"
    )
    return PrefixAudit(False, at=at, short_len=len(short), detail=detail)
