"""Chat encoding: messages (+ per-turn token ids and loss masks) → training tensors.

The prompt is rendered by the tokenizer's chat template. The completion is never re-encoded when token ids
exist: each assistant segment is taken as the engine produced it (``response_token_ids[k]`` with
``response_loss_mask[k]``); only the text *between* assistant turns (end-of-turn markers, tool results, user
tips, the next assistant header) is rendered by the template and tokenized, with loss mask 0. A template that
rewrites earlier turns (drops their ``<think>`` blocks) still gives that text; the sampled ids stay as sampled,
and a multi-turn trajectory's later turns are sampled from those same ids (``pin_ids``, ``docs/multi_turn.md``).

Render options travel with a prompt (its tools and chat-template keyword arguments: ``attach``, ``detach``). They
ride on the prompt's first message as JSON text (keys ``tools`` and ``chat_template_kwargs``), so every place that
renders the conversation (the trainer, an in-process engine, a rollout server reading a request body, a multi-turn
scheduler's later turns, which extend the same message list) renders it the same way. ``ChatTemplate`` takes them
off before calling the tokenizer's chat template.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from grpokit.errors import RolloutError
from grpokit.protocol import RolloutOutput
from grpokit.wire.json_text import loads

TOOLS_KEY = "tools"
KWARGS_KEY = "chat_template_kwargs"


def attach(messages: list[dict], *, tools: list[dict] | None = None, kwargs: dict | None = None) -> list[dict]:
    """A copy of ``messages`` whose first message carries ``tools`` and ``kwargs`` (each only when not empty)."""
    messages = [dict(m) for m in messages]
    if tools:
        messages[0][TOOLS_KEY] = json.dumps(tools, ensure_ascii=False)
    if kwargs:
        messages[0][KWARGS_KEY] = json.dumps(kwargs, ensure_ascii=False)
    return messages


def _loaded(value: Any, key: str) -> Any:
    """A carried value; JsonTextError (a ValueError) when its text is not JSON within bounds (a request body's)."""
    return loads(value, what=f"messages[0].{key}") if isinstance(value, str) else value


def detach(messages: list[dict]) -> tuple[list[dict], list[dict] | None, dict]:
    """Messages without the carried keys, the tools (None when none) and the keyword arguments they carried."""
    tools, kwargs, out = None, {}, []
    for m in messages:
        if TOOLS_KEY in m or KWARGS_KEY in m:
            if m.get(TOOLS_KEY) is not None and tools is None:
                tools = _loaded(m[TOOLS_KEY], TOOLS_KEY)
            if m.get(KWARGS_KEY) is not None and not kwargs:
                kwargs = _loaded(m[KWARGS_KEY], KWARGS_KEY)
                if not isinstance(kwargs, dict):
                    raise ValueError(f"messages[0].{KWARGS_KEY}: send a JSON object, got {kwargs!r:.40}")
                kwargs = dict(kwargs)
            m = {k: v for k, v in m.items() if k not in (TOOLS_KEY, KWARGS_KEY)}
        out.append(m)
    return out, tools, kwargs


@dataclass
class EncodedSample:
    prompt_ids: list[int]
    completion_ids: list[int]
    completion_mask: list[int]  # 1 = trained token
    rollout_logprobs: list[float] | None = None  # one per completion token (NaN where the engine gave none)
    extra: dict[str, Any] = field(default_factory=dict)


_PROMPT_MEMO_SIZE = 4096


TRUNCATION_STRATEGIES = ("left", "right", "delete", "raise")


class ChatTemplate:
    """Renders conversations with a Hugging Face tokenizer's chat template.

    ``chat_template_kwargs`` go to every ``apply_chat_template`` call (``enable_thinking``, …); those a prompt
    carries (``grpokit.template.encode``) win over them, and the tools it carries go as ``tools=``. With
    ``max_length``, prompt ids longer than it are cut to their last (``left``) or first (``right``) ``max_length``
    tokens; ``delete`` and ``raise`` act on the dataset before training (``grpokit.template.prompts``), so they
    leave the ids alone here.
    """

    def __init__(
        self,
        tokenizer,
        system: str | None = None,
        *,
        chat_template_kwargs: dict | None = None,
        max_length: int | None = None,
        truncation_strategy: str = "left",
    ) -> None:
        self.tokenizer = tokenizer
        self.system = system
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.max_length = max_length
        self.truncation_strategy = truncation_strategy
        # messages → prompt ids. The num_generations requests of a group share their prompt, which the engine
        # encodes to sample and the trainer again to build the batch; rendering the template costs ~0.5 ms each.
        self._prompt_ids: dict[str, list[int]] = {}
        # request_id → (its conversation's key, ids): a later turn of a multi-turn trajectory is sampled from the
        # trajectory's own ids (prompt, turns as trained, template text between), never from a re-render
        self._pinned_ids: dict[str, tuple[tuple | str, list[int]]] = {}
        if getattr(tokenizer, "chat_template", None) is None:
            raise RolloutError(
                "the tokenizer has no chat_template; use an instruct/chat model or set "
                "tokenizer.chat_template in the model folder"
            )
        self.eos_token_id = tokenizer.eos_token_id
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    # -- rendering -------------------------------------------------------------------------------------------
    def with_system(self, messages: list[dict]) -> list[dict]:
        if self.system and (not messages or messages[0]["role"] != "system"):
            return [{"role": "system", "content": self.system}, *messages]
        return messages

    def render_prompt(self, messages: list[dict]) -> str:
        """Text the model continues: a generation header, or the open last assistant message."""
        messages, tools, carried = detach(self.with_system(messages))
        kwargs = {**self.chat_template_kwargs, **carried}
        if tools:
            kwargs["tools"] = tools
        if messages[-1]["role"] == "assistant":
            return self.tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True, **kwargs)
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def encode_prompt(self, messages: list[dict]) -> list[int]:
        return self.encode_prompts([messages])[0]

    def encode_prompts(self, conversations: list[list[dict]]) -> list[list[int]]:
        """Prompt ids of each conversation (copies: callers may edit them). Memoised; the conversations not seen
        yet are rendered one by one and tokenized in one call."""
        keys = [_memo_key(m) for m in conversations]
        missing = {k: m for k, m in zip(keys, conversations, strict=True) if k not in self._prompt_ids}
        if missing:
            texts = [self.render_prompt(m) for m in missing.values()]
            if len(self._prompt_ids) + len(missing) > _PROMPT_MEMO_SIZE:
                self._prompt_ids.clear()
            ids = [self._truncated(i) for i in self.tokenizer(texts, add_special_tokens=False)["input_ids"]]
            self._prompt_ids.update(zip(missing, ids, strict=True))
        return [list(self._prompt_ids[k]) for k in keys]

    def encode_requests(self, requests: list) -> list[list[int]]:
        """The engine's prompt ids of each request: the pinned ids of a later turn (``pin_ids``) while its
        conversation is the one pinned, else ``encode_prompts`` of its messages."""
        out: list[list[int] | None] = [None] * len(requests)
        missing = []
        for k, r in enumerate(requests):
            pinned = self._pinned_ids.get(r.request_id) if self._pinned_ids else None
            if pinned is not None and pinned[0] == _memo_key(r.messages):
                out[k] = list(pinned[1])
            else:
                missing.append(k)
        for k, ids in zip(missing, self.encode_prompts([requests[k].messages for k in missing]), strict=True):
            out[k] = ids
        return out  # type: ignore[return-value]

    def pin_ids(self, request_id: str, messages: list[dict], ids: list[int]) -> None:
        """The next turn of ``request_id`` is sampled from ``ids`` while its conversation is ``messages``."""
        self._pinned_ids[request_id] = (_memo_key(messages), list(ids))

    def unpin_ids(self, request_id: str) -> None:
        self._pinned_ids.pop(request_id, None)

    def prompt_lengths(self, conversations: list[list[dict]]) -> list[int]:
        """Token count of each rendered prompt, before any truncation."""
        texts = [self.render_prompt(m) for m in conversations]
        return [len(ids) for ids in self.tokenizer(texts, add_special_tokens=False)["input_ids"]]

    def _truncated(self, ids: list[int]) -> list[int]:
        if self.max_length is None or len(ids) <= self.max_length:
            return ids
        if self.truncation_strategy == "left":
            return ids[-self.max_length :]
        if self.truncation_strategy == "right":
            return ids[: self.max_length]
        return ids

    # -- trajectories ----------------------------------------------------------------------------------------
    def encode_output(self, prompt_messages: list[dict], output: RolloutOutput) -> EncodedSample:
        """Prompt ids + the trajectory's completion ids/masks, aligned token by token."""
        prompt_ids = self.encode_prompt(prompt_messages)
        segments = output.response_token_ids
        masks, logprob_segments = segment_masks(output)
        turns = self._assistant_turns(prompt_messages, output.messages, len(segments), output.request_id)
        ids: list[int] = []
        mask: list[int] = []
        lps: list[float] = []
        for k, seg in enumerate(segments):
            ids.extend(seg)
            mask.extend(masks[k])
            if logprob_segments is not None:
                it = iter(logprob_segments[k])
                lps.extend(next(it) if m else float("nan") for m in masks[k])
            if k + 1 < len(segments):
                between = self.encode_between(output.messages, turns[k], turns[k + 1], seg)
                ids.extend(between)
                mask.extend([0] * len(between))
                lps.extend([float("nan")] * len(between))
        return EncodedSample(prompt_ids, ids, mask, lps if logprob_segments is not None else None)

    def _assistant_turns(self, prompt: list[dict], full: list[dict], n: int, rid: str) -> list[int]:
        """Indices in ``full`` of the assistant messages that the n token segments stand for."""
        start = len(prompt)
        if prompt and prompt[-1]["role"] == "assistant":  # the first segment continues a prefilled reply
            start -= 1
        idx = [i for i in range(start, len(full)) if full[i]["role"] == "assistant"]
        if n == 1 and not idx:  # single turn: the scheduler may not have appended the reply
            return [len(full)]
        if len(idx) != n:
            raise RolloutError(
                f"request {rid}: {n} response_token_ids segment(s) but {len(idx)} assistant "
                "message(s) after the prompt; a scheduler must return one segment per assistant "
                "message (extend the last segment when it continues a message)"
            )
        return idx

    def encode_between(self, full: list[dict], i: int, j: int, seg: list[int]) -> list[int]:
        """Tokens after assistant message i (whose ids are ``seg``) up to where assistant message j starts."""
        return self.tokenize(self.between_text(full, i, j, seg))

    def between_text(self, full: list[dict], i: int, j: int, seg: list[int]) -> str:
        """The rendered text that ``encode_between`` tokenizes (a processor template expands its images)."""
        msgs = self.with_system(full)
        off = len(msgs) - len(full)
        before = self.render_prompt(msgs[: i + off])
        content = msgs[i + off]["content"]
        after = self.render_prompt(msgs[: j + off])
        head = before + content
        if after.startswith(head):
            text = after[len(head) :]
        else:  # the template rewrites earlier turns (drops their <think> blocks): the text after message i's
            text = self._text_after(msgs[: j + off], i + off)  # content is still the template's own
        if seg and seg[-1] == self.eos_token_id:  # the model already produced the end-of-turn token
            eos_text = self.tokenizer.decode([self.eos_token_id])
            if text.startswith(eos_text):
                text = text[len(eos_text) :]
        return text

    def _text_after(self, msgs: list[dict], i: int) -> str:
        """What the template renders after message ``i``'s content up to the end of ``msgs``'s prompt, found
        with that content replaced by a marker the template has no reason to rewrite (no <think> block)."""
        marked = [*msgs[:i], {**msgs[i], "content": _MARKER}, *msgs[i + 1 :]]
        rendered = self.render_prompt(marked)
        if rendered.count(_MARKER) != 1:
            raise RolloutError(
                "the chat template does not render an earlier assistant message's text (it rewrites "
                "or drops it); multi-turn token alignment needs a template that renders every "
                "message's content, earlier <think> blocks aside"
            )
        return rendered[rendered.index(_MARKER) + len(_MARKER) :]


_MARKER = "\u2063grpokit-earlier-turn\u2063"  # invisible separators: no text of a real conversation has it


def _memo_key(messages: list[dict]) -> tuple | str:
    """A hashable key of a conversation: (role, content) pairs for plain text messages, else its JSON text."""
    key = []
    for m in messages:
        if len(m) != 2 or type(m.get("role")) is not str or type(m.get("content")) is not str:
            return json.dumps(messages, sort_keys=True, default=str)
        key.append((m["role"], m["content"]))
    return tuple(key)


def segment_masks(output: RolloutOutput) -> tuple[list[list[int]], list[list[float]] | None]:
    """The loss mask of each response segment (all ones when the output gives none), checked against the segments'
    lengths, and the rollout logprobs when they are usable (``_logprobs_consistent``), else None."""
    segments = output.response_token_ids
    masks = output.response_loss_mask or [[1] * len(s) for s in segments]
    if len(masks) != len(segments) or any(len(a) != len(b) for a, b in zip(segments, masks)):
        raise RolloutError(
            f"request {output.request_id}: response_loss_mask lengths {[len(m) for m in masks]} "
            f"differ from response_token_ids lengths {[len(s) for s in segments]}"
        )
    return masks, output.rollout_logprobs if _logprobs_consistent(output, masks) else None


def _logprobs_consistent(output: RolloutOutput, masks: list[list[int]]) -> bool:
    """Rollout logprobs are usable when each segment has one per trained token (ms-swift's check)."""
    lps = output.rollout_logprobs
    if not lps or len(lps) != len(masks):
        return False
    return all(len(lp) == sum(m) for lp, m in zip(lps, masks))
