"""One chat-completions call, engine side: body → messages → prompt ids → the engine → the answer, recorded in
its episode when it belongs to one. The HTTP routes (grpokit/server/openai_routes.py) call ``ChatService``."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from grpokit.agents.budget import check_prompt_chars, check_prompt_tokens, message_chars
from grpokit.agents.chat import (
    ChatBody,
    ChatError,
    check_body,
    completion_answer,
    reply_message,
    request_config,
    template_messages,
    token_logprobs,
)
from grpokit.agents.engine import CANCEL, PROMPT_IDS
from grpokit.agents.episodes import ChoiceRecord, Episode
from grpokit.errors import GrpokitError, RolloutError
from grpokit.protocol import RequestConfig, RolloutInferRequest, choice_logprobs

PREPARE_WORKERS = 2  # threads that render and tokenize calls' messages (off the endpoint's event loop)


class ChatService:
    """Serves ``/v1/chat/completions`` from ``engine`` (its template renders the prompts).

    ``defaults``: the sampling settings a call starts from (the trainer's, for episodes; its ``max_tokens`` bounds
    every call); ``version``: the policy version a call is recorded with (windows trained so far); ``context``:
    the served context length, when known: a call without ``max_tokens`` (an episode's: every call) gets what is
    left of it after its prompt (at most ``defaults.max_tokens``); ``max_prompt``: the longest prompt in tokens
    (the trainer's --max_length, for episodes); ``max_n``: the most choices one call may ask for (the rollout
    server's --max_batch_requests: each choice is a sequence of the batch). A call's messages are rendered and
    tokenized by a worker thread, never on the endpoint's event loop (other agents' calls go on meanwhile)."""

    def __init__(
        self,
        engine,
        model_name: str,
        defaults: RequestConfig | None = None,
        version: Callable[[], int] = lambda: 0,
        context: int | None = None,
        max_n: int | None = None,
        max_prompt: int | None = None,
    ) -> None:
        self.engine = engine
        self.template = getattr(engine, "template", None)  # None: a stub state (the schema only)
        self.model_name = model_name
        self.defaults = defaults or RequestConfig(max_tokens=4096)
        self.version = version
        self.context = context
        self.max_n = max_n
        self.max_prompt = max_prompt
        self.inflight = 0  # calls inside the engine now (the endpoint's event loop is the only writer)
        self._prepare_pool = ThreadPoolExecutor(PREPARE_WORKERS, thread_name_prefix="grpokit-chat-prepare")
        self._max_token_chars: int | None = None

    async def complete(self, body: ChatBody, episode: Episode | None = None) -> dict:
        """The ``chat.completion`` answer; ChatError (4xx) for a body the engine cannot serve."""
        check_body(body)
        if self.max_n is not None and body.n > self.max_n:
            raise ChatError(
                413,
                f"n {body.n} exceeds this server's --max_batch_requests {self.max_n} (each choice is "
                "a sequence of one batch); ask for fewer choices per call",
            )
        if episode is not None and not episode.open:
            raise ChatError(410, f"episode {episode.id} has ended ({episode.status}); its calls are final")
        config = request_config(body, self.defaults, fixed_sampling=episode is not None)
        data: dict = {} if episode is None else {CANCEL: episode.ended}
        loop = asyncio.get_running_loop()
        try:
            messages, config, parent, between = await loop.run_in_executor(
                self._prepare_pool, self._prepared, body, config, episode, data
            )
            request = RolloutInferRequest(messages=messages, data_dict=data)
            self.inflight += 1
            try:
                response = await self.engine.infer_async(request, config)
            finally:
                self.inflight -= 1
        except ChatError:
            raise
        except ValueError as e:  # ConfigError: the prompt does not fit, the template cannot render it
            raise ChatError(400, f"{type(e).__name__}: {e}") from e
        except (RolloutError, GrpokitError) as e:
            raise ChatError(500, f"{type(e).__name__}: {e}") from e
        return self._answer(body, episode, response, messages, data, parent, between)

    def _answer(self, body: ChatBody, episode, response, messages, data, parent, between) -> dict:
        prompt_ids = list(response.prompt_token_ids or data.get(PROMPT_IDS) or [])
        parse_tools = bool(body.tools) and body.tool_choice != "none"
        choices, records, sampled = [], [], 0
        for k, c in enumerate(response.choices):
            text = c.message.get("content") or ""
            reply, finish = reply_message(text, parse_tools, single_call=body.parallel_tool_calls is False)
            lps = choice_logprobs(c)
            sampled += len(c.token_ids)
            choice = {
                "index": k,
                "message": reply,
                "finish_reason": finish or c.finish_reason,
                "logprobs": token_logprobs(self.template.tokenizer, c.token_ids, lps)
                if body.logprobs and len(lps) == len(c.token_ids)
                else None,
                "token_ids": list(c.token_ids),
                "weight_versions": c.weight_versions,  # per token, the weight version that sampled it (None: unknown)
            }
            choices.append(choice)
            records.append(ChoiceRecord(list(c.token_ids), lps, text, c.finish_reason, reply))
        if episode is not None:
            try:
                episode.record(messages, prompt_ids, records, self.version(), parent, between)
            except RolloutError as e:
                raise ChatError(410, str(e)) from e
        return completion_answer(body.model, choices, len(prompt_ids), sampled, prompt_ids)

    def _prepared(
        self, body: ChatBody, config: RequestConfig, episode: Episode | None, data: dict
    ) -> tuple[list[dict], RequestConfig, tuple[int, int] | None, list[int]]:
        """(messages, config, the choice extended, the tokens between) of a call, in a worker thread: the messages
        rendered, their size checked before tokenizing, the planned prompt ids (into ``data``) checked against
        the prompt limit, ``max_tokens`` from what the context leaves, the episode's budget reserved. ChatError
        (4xx) for what cannot be served."""
        messages = template_messages(body)
        content_chars, kept_chars = message_chars(messages)
        limit, what = self._prompt_limit()
        if limit is not None:
            check_prompt_chars(content_chars, limit, self._token_chars(), what)
        if episode is not None:
            messages = episode.restore_replies(messages)
        parent, between = None, []
        unset = episode is not None or (body.max_tokens is None and body.max_completion_tokens is None)
        try:
            if episode is not None:
                prompt_ids, parent, between = episode.plan(messages, self.template, body.n)
                data[PROMPT_IDS] = prompt_ids
            used = (
                len(data[PROMPT_IDS])
                if PROMPT_IDS in data
                else len(self.template.encode_prompt(messages))
                if self.context is not None and unset
                else None
            )
        except Exception as e:  # noqa: BLE001 - jinja2 and the template's raise_exception: a bad conversation
            raise ChatError(
                400, f"the chat template cannot render these messages: {type(e).__name__}: {str(e)[:200]}"
            ) from e
        if used is not None and limit is not None:
            check_prompt_tokens(used, limit, what, parent is not None)
        if used is not None and self.context is not None and unset:
            config = config.model_copy(update={"max_tokens": max(1, min(config.max_tokens, self.context - used))})
        if episode is not None:
            episode.usage.reserve(
                episode.budget,
                calls=1,
                trajectories=body.n if parent is None else 0,
                tokens=(used or 0) + body.n * config.max_tokens,
                retained_chars=kept_chars,
            )
        return messages, config, parent, between

    def _prompt_limit(self) -> tuple[int | None, str]:
        """The most tokens a prompt may have (one fewer than the context: one token must be sampled) and what
        sets it."""
        options = [(self.max_prompt, "--max_length"), (None if self.context is None else self.context - 1, "")]
        known = [(n, what) for n, what in options if n is not None]
        if not known:
            return None, ""
        n, what = min(known)
        return n, what or f"the model's context of {self.context} tokens less one:"

    def _token_chars(self) -> int:
        """The most characters one token of the vocabulary spells."""
        if self._max_token_chars is None:
            vocab = self.template.tokenizer.get_vocab()
            self._max_token_chars = max((len(t) for t in vocab), default=1) or 1
        return self._max_token_chars
