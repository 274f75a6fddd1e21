"""Multi-turn rollouts: ``MultiTurnScheduler``'s default loop, its ``step()`` contract, and the ``multi_turns``
registry that ``--multi_turn_scheduler`` names are looked up in.

One trajectory = turns until the scheduler says stop. Each turn is one engine call; between turns ``step()``
builds the next request (append a tool result, a tip, an environment observation, or continue the last assistant
message). Text and tokens travel side by side: the loop keeps ``messages`` for rewards and the next turn, and per
assistant message one segment of token ids + loss mask (+ logprobs) exactly as the engine produced them, so the
trainer never re-encodes a completion (``ChatTemplate.encode_output``), and each later turn is sampled from the
trajectory's own ids, never from a re-render of its messages (token in, token out: ``grpokit/rollout/tito.py``).

Three ways to customise (``docs/multi_turn.md``): implement ``step()`` (and ``check_finished()``) and keep this
loop; override ``run()`` entirely (it may return several ``RolloutOutput``s); or put environment logic in the
hooks ``on_trajectory_start``/``on_turn_end``.

Per-trajectory state lives in ``run()``'s locals, never on ``self``: one scheduler instance runs every
trajectory of a batch concurrently.

Images (vision-language models, ``docs/multi_turn.md``): the row's images stay in every turn's prompt; ``step()``
may return ``images`` for the ``<image>`` placeholders of the messages it appended. They join the trajectory's
images (the next request's ``data_dict['images']``, the output's ``rollout_infos['images']`` as in ms-swift), and
``turn_images.TrajectoryImages`` hands the engine each later turn's prompt as the trainer will encode it.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

from grpokit.data.images import row_images
from grpokit.errors import ConfigError, RolloutError
from grpokit.protocol import (
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    RequestConfig,
    RolloutInferRequest,
    RolloutOutput,
    choice_logprobs,
)
from grpokit.registry import Registry
from grpokit.rollout.scheduler import RolloutScheduler
from grpokit.rollout.tito import TurnRecord
from grpokit.rollout.turn_images import TrajectoryImages, take_entry_images, take_start_images, warn_unheld
from grpokit.rollout.turns import StepResult, Trajectory, append_completion, check_step
from grpokit.template.encode import ChatTemplate
from grpokit.template.prefix_audit import PrefixAudit, audit_prefix

logger = logging.getLogger(__name__)

DEFAULT_MAX_TURNS = 3
LENGTH_SCOPES = ("total", "per_round")
LOSS_SCALES = ("default", "last_round")

multi_turns = Registry("multi-turn scheduler", "--multi_turn_scheduler")


class MultiTurnScheduler(RolloutScheduler):
    """Base class of multi-turn schedulers; the default ``run()`` drives the turn loop.

    Subclasses implement ``step()`` (what the next request is) and may override ``check_finished()`` (default:
    the model hit its token limit, or ``max_turns`` turns were played). ``max_turns`` is enforced by ``run()``
    whatever ``check_finished()`` says. ``stop_words`` are added to every turn's stop strings.
    """

    stop_words: tuple[str, ...] = ()
    multi_turn = True  # the trainer audits its trajectories token in, token out (rollout/tito.py)
    _audit: PrefixAudit | None = None  # the template's prefix audit, made before the first trajectory

    def __init__(
        self,
        infer_engine=None,
        max_turns: int | None = None,
        tokenizer=None,
        rollout_args=None,
        template: ChatTemplate | None = None,
        **kwargs,
    ) -> None:
        scope = kwargs.pop("completion_length_limit_scope", None)
        loss_scale = kwargs.pop("loss_scale", None)
        max_turns = DEFAULT_MAX_TURNS if max_turns is None else max_turns
        if max_turns < 1:
            raise ConfigError(f"--max_turns {max_turns}: must be ≥ 1")
        super().__init__(infer_engine, max_turns, **kwargs)
        self._tokenizer = tokenizer
        self.rollout_args = rollout_args
        self.completion_length_limit_scope = (
            scope or getattr(rollout_args, "completion_length_limit_scope", None) or "per_round"
        )
        self.loss_scale = loss_scale or getattr(rollout_args, "loss_scale", None) or "default"
        if self.completion_length_limit_scope not in LENGTH_SCOPES:
            raise ConfigError(
                f"--completion_length_limit_scope {self.completion_length_limit_scope!r}: use one of "
                f"{', '.join(LENGTH_SCOPES)}"
            )
        if self.loss_scale not in LOSS_SCALES:
            raise ConfigError(f"--loss_scale {self.loss_scale!r}: use one of {', '.join(LOSS_SCALES)}")
        self._template = template  # the run's (the trainer's); None: built from the tokenizer when first needed

    # -- tokenizer and template ----------------------------------------------------------------------------
    @property
    def tokenizer(self):
        """The engine's tokenizer (the one that made the token ids), else the one given at construction."""
        engine_tok = getattr(self.infer_engine, "tokenizer", None)
        return engine_tok if engine_tok is not None else self._tokenizer

    @tokenizer.setter
    def tokenizer(self, value) -> None:
        self._tokenizer = value

    def encode_text(self, text: str) -> list[int]:
        """Token ids of inserted text (tips, tool output inside an assistant message), no special tokens added."""
        if self.tokenizer is None:
            raise RolloutError(
                f"{type(self).__name__}: inserting text into a completion needs a tokenizer; pass "
                "tokenizer= to the scheduler or use an engine that has one"
            )
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def chat_template(self):
        """The ChatTemplate that renders text between assistant turns: the engine's, else the one given at
        construction, else one built once from the tokenizer (a scheduler made without the run's template)."""
        engine_template = getattr(self.infer_engine, "template", None)
        if engine_template is not None and hasattr(engine_template, "encode_between"):
            return engine_template
        if self._template is None or self._template.tokenizer is not self.tokenizer:
            if self.tokenizer is None or getattr(self.tokenizer, "chat_template", None) is None:
                return None
            self._template = ChatTemplate(self.tokenizer)
        return self._template

    def audit_template(self) -> PrefixAudit | None:
        """Whether the chat template keeps earlier turns' tokens when a conversation grows (once; None without a
        template). Where it does not, one line says so and what grpokit does about it."""
        template = self.chat_template()
        if self._audit is not None or template is None:
            return self._audit
        self._audit = audit_prefix(template)
        if self._audit.preserving is None:
            logger.debug("%s: cannot audit the chat template (%s)", type(self).__name__, self._audit.detail)
        elif not self._audit.preserving or getattr(self.infer_engine, "engine_type", "") == "server":
            # the engine samples from pinned ids where it renders with this template; a rollout client never does
            logger.warning("%s", self._audit.line(getattr(self.infer_engine, "template", None) is template))
        return self._audit

    # -- the contract --------------------------------------------------------------------------------------
    def step(
        self, infer_request: RolloutInferRequest, response_choice: ChatCompletionResponseChoice, current_turn: int
    ) -> dict:
        """The next turn's request. Returns ``{'infer_request': ...}`` plus optionally ``response_token_ids``
        and ``response_loss_mask`` (same length; they replace this turn's tokens, e.g. cut + inserted text with
        mask 0), ``rollout_logprobs`` (one per mask-1 token) and ``rollout_infos`` (merged into the output's)."""
        raise NotImplementedError(
            f"{type(self).__name__} must implement step(infer_request, response_choice, current_turn) -> "
            "{'infer_request': next_request, ...} (or override run())"
        )

    def check_finished(
        self, infer_request: RolloutInferRequest, response_choice: ChatCompletionResponseChoice, current_turn: int
    ) -> bool:
        """Stop when the model ran out of tokens or ``max_turns`` turns were played."""
        return response_choice.finish_reason == "length" or current_turn >= self.max_turns

    async def on_trajectory_end(self, infer_request: RolloutInferRequest) -> None:
        """Hook after the last turn, also when the trajectory failed (release per-trajectory resources)."""

    # -- the loop ------------------------------------------------------------------------------------------
    async def run(
        self, infer_request: RolloutInferRequest, request_config: RequestConfig, **kwargs
    ) -> RolloutOutput | list[RolloutOutput]:
        """Play one trajectory: infer → append/continue → on_turn_end → stop? → step() → next turn."""
        name = type(self).__name__
        request, traj, images, record = await self._start(infer_request)
        budget = (request.request_config or request_config).max_tokens
        total = self.completion_length_limit_scope == "total"
        turn = 1
        try:
            while True:
                remaining = budget - traj.completion_length() if total else None
                response = await self._infer_turn(request, request_config, remaining)
                choice = response.choices[0]
                record.sampled(response.prompt_token_ids, choice.token_ids)
                continuation = request.messages[-1]["role"] == "assistant"
                append_completion(request.messages, choice, continuation)
                turn_result = await self.on_turn_end(request, choice, turn) or {}
                traj.infos.update(turn_result.get("rollout_infos") or {})
                if turn_result.get("done") is not None:
                    stop, reason = bool(turn_result["done"]), "done"
                else:
                    stop, reason = self.check_finished(request, choice, turn), "finished"
                if not stop and turn >= self.max_turns:
                    stop, reason = True, "max_turns"
                model_turn = (list(choice.token_ids), [1] * len(choice.token_ids), choice_logprobs(choice))
                if not stop and total and remaining - len(choice.token_ids) <= 0:
                    stop, reason = True, "length_budget"
                if stop:
                    warn_unheld(request, images.images, f"{name}.on_turn_end at turn {turn}")
                    traj.add_turn(*model_turn, continuation)
                    record.kept(model_turn[0])
                    return self._output(traj, request.messages, response, turn, reason, record)
                before_step = copy.deepcopy(request.messages)
                result = self._check_step(self.step(request, choice, turn), choice, turn, images.images)
                seg = (traj.token_ids[-1] if continuation and traj.token_ids else []) + result.token_ids
                gap = images.between(f"{type(self).__name__}.step() at turn {turn}", result, seg)
                gap_ids = (
                    gap[0]
                    if gap is not None
                    else (self._between_ids(result.infer_request.messages, seg) if total or record.template else [])
                )
                between = len(gap_ids) if total else 0
                if total and budget - traj.completion_length() - len(result.token_ids) - between <= 0:
                    traj.add_turn(*model_turn, continuation)  # no room for another turn: end as the model left it
                    record.kept(model_turn[0])
                    return self._output(traj, before_step, response, turn, "length_budget", record)
                traj.add_turn(result.token_ids, result.loss_mask, result.logprobs, continuation)
                record.kept(result.token_ids)
                record.pin_next(result.infer_request, result.token_ids, gap_ids)
                traj.between_tokens += between
                traj.infos.update(result.rollout_infos)
                images.commit(result, gap, traj.infos)
                request = result.infer_request
                request.images = list(images.images)
                turn += 1
        finally:
            images.close()
            record.close()
            await self.on_trajectory_end(request)

    async def _start(
        self, infer_request: RolloutInferRequest
    ) -> tuple[RolloutInferRequest, Trajectory, TrajectoryImages, TurnRecord]:
        """Before the first turn: the audit (once), ``on_trajectory_start``, the first request, the bookkeeping."""
        name = type(self).__name__
        self.audit_template()
        take_entry_images(infer_request, name)
        known = row_images(infer_request.data_dict)
        infer_request.images = list(known)  # ms-swift's field while hooks run (turn_images.py)
        await self.on_trajectory_start([infer_request])  # in-place edits become the prompt the trainer encodes
        start_changed = take_start_images(infer_request, known, f"{name}.on_trajectory_start")
        request = infer_request.model_copy(deep=True)  # appended turns never touch the trainer's prompt
        traj = Trajectory()
        images = TrajectoryImages(self.chat_template(), request)
        if start_changed:
            traj.infos["images"] = list(images.images)
        request.images = list(images.images)
        return request, traj, images, TurnRecord(self.chat_template(), self.infer_engine)

    async def _infer_turn(
        self, request: RolloutInferRequest, request_config: RequestConfig, remaining: int | None
    ) -> ChatCompletionResponse:
        """One engine call with this turn's max_tokens (what is left of the budget) and stop strings."""
        own = request.request_config
        base = own or request_config
        update: dict[str, Any] = {}
        if remaining is not None and remaining < base.max_tokens:
            update["max_tokens"] = remaining
        extra_stops = [s for s in self.stop_words if s not in base.stop]
        if extra_stops:
            update["stop"] = [*base.stop, *extra_stops]
        cfg = base.model_copy(update=update) if update else base
        request.request_config = cfg if own is not None else None
        shown, request.images = request.images, []  # the engine reads data_dict['images'] (never twice)
        try:
            return await self.infer_engine.infer_async(request, cfg)
        finally:
            request.request_config, request.images = own, shown

    def _check_step(
        self, ret: Any, choice: ChatCompletionResponseChoice, turn: int, known: list | tuple = ()
    ) -> StepResult:
        """Validate ``step()``'s dict (turns.check_step), errors naming the scheduler and the turn."""
        return check_step(ret, choice, f"{type(self).__name__}.step() at turn {turn}", known)

    def _between_ids(self, messages: list[dict], seg: list[int]) -> list[int]:
        """Template tokens from the end of the last assistant message (whose ids are ``seg``) to the next turn's
        generation header ([] when the next turn continues the assistant message or no chat template is known)."""
        template = self.chat_template()
        last = next((i for i in range(len(messages) - 1, -1, -1) if messages[i]["role"] == "assistant"), None)
        if template is None or last is None or last == len(messages) - 1:
            return []
        return template.encode_between(messages, last, len(messages), seg)

    def _output(
        self,
        traj: Trajectory,
        messages: list[dict],
        response: ChatCompletionResponse,
        turn: int,
        reason: str,
        record: TurnRecord | None = None,
    ) -> RolloutOutput:
        """Pack the trajectory; apply loss_scale and the logprob-count check."""
        if self.loss_scale == "last_round":
            for k in range(len(traj.loss_mask) - 1):
                traj.loss_mask[k] = [0] * len(traj.loss_mask[k])
                traj.logprobs[k] = []
        _, dropped = traj.checked_logprobs()
        infos = {
            **traj.infos,
            **(record.infos() if record is not None else {}),
            "num_turns": turn,
            "stop_reason": reason,
        }
        if dropped:
            infos["logprobs_dropped"] = infos.get("logprobs_dropped", 0) + 1
            logger.debug("%s: rollout logprobs do not match the trained tokens; dropped", type(self).__name__)
        if reason == "length_budget" and response.choices[0].finish_reason != "length":
            choice = response.choices[0].model_copy(update={"finish_reason": "length"})
            response = response.model_copy(update={"choices": [choice, *response.choices[1:]]})
        return traj.output(response, messages, infos)


def build_scheduler(
    rollout_args,
    tokenizer,
    infer_engine=None,
    template: ChatTemplate | None = None,
    uses_env_reward: bool | None = None,
) -> MultiTurnScheduler:
    """The scheduler named by ``--multi_turn_scheduler`` around ``infer_engine``, rendering with ``template`` (the
    run's). ``uses_env_reward`` (--use_gym_env) is passed only when set, so that a plugin's constructor written
    for ms-swift's arguments keeps working without it; a scheduler that drops it is refused."""
    cls = multi_turns.get_or_raise(rollout_args.multi_turn_scheduler)
    extra = {} if uses_env_reward is None else {"uses_env_reward": uses_env_reward}
    scheduler = cls(
        infer_engine=infer_engine,
        max_turns=rollout_args.max_turns,
        tokenizer=tokenizer,
        rollout_args=rollout_args,
        template=template,
        **extra,
    )
    if uses_env_reward is not None and bool(getattr(scheduler, "uses_env_reward", False)) != uses_env_reward:
        raise ConfigError(
            f"--use_gym_env {str(uses_env_reward).lower()}: the scheduler "
            f"{rollout_args.multi_turn_scheduler!r} ({type(scheduler).__name__}) did not take it; pass "
            "its constructor's keyword arguments on to MultiTurnScheduler.__init__"
        )
    if infer_engine is not None and getattr(scheduler, "infer_engine", None) is None:
        raise ConfigError(
            f"--multi_turn_scheduler {rollout_args.multi_turn_scheduler}: {type(scheduler).__name__} "
            "dropped its infer_engine argument; pass the constructor's arguments on to "
            "MultiTurnScheduler.__init__ (ms-swift's signature: infer_engine=None, max_turns=None, "
            "*args, **kwargs)"
        )
    return scheduler
