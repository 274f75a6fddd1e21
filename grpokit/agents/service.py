"""One chat-completions call, engine side: body → messages → prompt ids → the engine → the answer, recorded in
its episode when it belongs to one. The HTTP routes (grpokit/server/openai_routes.py) call ``ChatService``."""

from __future__ import annotations

from collections.abc import Callable

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


class ChatService:
    """Serves ``/v1/chat/completions`` from ``engine`` (its template renders the prompts).

    ``defaults``: the sampling settings a call starts from (the trainer's, for episodes; its ``max_tokens`` bounds
    every call); ``version``: the policy version a call is recorded with (windows trained so far); ``context``:
    the served context length, when known: a call without ``max_tokens`` gets what is left of it after its prompt
    (at most ``defaults.max_tokens``); ``max_n``: the most choices one call may ask for (the rollout server's
    --max_batch_requests: each choice is a sequence of the batch)."""

    def __init__(
        self,
        engine,
        model_name: str,
        defaults: RequestConfig | None = None,
        version: Callable[[], int] = lambda: 0,
        context: int | None = None,
        max_n: int | None = None,
    ) -> None:
        self.engine = engine
        self.template = getattr(engine, "template", None)  # None: a stub state (the schema only)
        self.model_name = model_name
        self.defaults = defaults or RequestConfig(max_tokens=4096)
        self.version = version
        self.context = context
        self.max_n = max_n
        self.inflight = 0  # calls inside the engine now (the endpoint's event loop is the only writer)

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
        messages = template_messages(body)
        if episode is not None:
            messages = episode.restore_replies(messages)
        data: dict = {} if episode is None else {CANCEL: episode.ended}
        try:
            config, parent, between = self._planned(body, config, messages, episode, data)
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
            }
            choices.append(choice)
            records.append(ChoiceRecord(list(c.token_ids), lps, text, c.finish_reason, reply))
        if episode is not None:
            try:
                episode.record(messages, prompt_ids, records, self.version(), parent, between)
            except RolloutError as e:
                raise ChatError(410, str(e)) from e
        return completion_answer(body.model, choices, len(prompt_ids), sampled, prompt_ids)

    def _planned(
        self, body: ChatBody, config: RequestConfig, messages: list[dict], episode: Episode | None, data: dict
    ) -> tuple[RequestConfig, tuple[int, int] | None, list[int]]:
        """The episode's planned prompt ids (into ``data``) and a call's max_tokens from what the context leaves;
        ChatError (400) when the chat template cannot render the messages."""
        parent, between = None, []
        unset = body.max_tokens is None and body.max_completion_tokens is None
        try:
            if episode is not None:
                prompt_ids, parent, between = episode.plan(messages, self.template, body.n)
                data[PROMPT_IDS] = prompt_ids
            if self.context is not None and unset:
                used = len(data[PROMPT_IDS]) if PROMPT_IDS in data else len(self.template.encode_prompt(messages))
                config = config.model_copy(update={"max_tokens": max(1, min(config.max_tokens, self.context - used))})
        except Exception as e:  # noqa: BLE001 - jinja2 and the template's raise_exception: a bad conversation
            raise ChatError(
                400, f"the chat template cannot render these messages: {type(e).__name__}: {str(e)[:200]}"
            ) from e
        return config, parent, between
