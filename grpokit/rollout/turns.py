"""A multi-turn trajectory's turn bookkeeping: its token segments (``Trajectory``), ``step()``'s dict checked
(``check_step`` -> ``StepResult``) and each turn's text added to the messages. The turn loop itself is
``MultiTurnScheduler.run`` (multi_turn.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from grpokit.errors import RolloutError
from grpokit.protocol import (
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    RolloutInferRequest,
    RolloutOutput,
    choice_logprobs,
)
from grpokit.rollout.turn_images import same_images, step_images, take_appended


@dataclass
class Trajectory:
    """Token bookkeeping of one trajectory: one segment per assistant message after the prompt."""

    token_ids: list[list[int]] = field(default_factory=list)
    loss_mask: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    infos: dict[str, Any] = field(default_factory=dict)
    between_tokens: int = 0  # template tokens between assistant messages (tool results, headers); mask 0

    def add_turn(self, ids: list[int], mask: list[int], lps: list[float], continuation: bool) -> None:
        """Extend the last segment when the turn continued an assistant message, else open a new one."""
        if continuation and self.token_ids:
            self.token_ids[-1].extend(ids)
            self.loss_mask[-1].extend(mask)
            self.logprobs[-1].extend(lps)
        else:
            self.token_ids.append(list(ids))
            self.loss_mask.append(list(mask))
            self.logprobs.append(list(lps))

    def completion_length(self) -> int:
        """Tokens the trainer will see after the prompt so far (model, inserted and template tokens)."""
        return sum(len(s) for s in self.token_ids) + self.between_tokens

    def output(self, response: ChatCompletionResponse, messages: list[dict], infos: dict) -> RolloutOutput:
        """The trajectory packed as the trainer takes it, its logprobs kept only when they match (checked_logprobs;
        a caller that counts the dropped ones checks first)."""
        logprobs, _ = self.checked_logprobs()
        return RolloutOutput(
            response=response,
            messages=messages,
            response_token_ids=self.token_ids,
            response_loss_mask=self.loss_mask,
            rollout_infos=infos,
            rollout_logprobs=logprobs,
        )

    def checked_logprobs(self) -> tuple[list[list[float]], bool]:
        """(logprobs, dropped): usable only when each segment has one logprob per mask-1 token."""
        if not any(self.logprobs):
            return [], False
        if all(len(lp) == sum(m) for lp, m in zip(self.logprobs, self.loss_mask, strict=True)):
            return self.logprobs, False
        return [], True


@dataclass
class StepResult:
    """``step()``'s dict, validated: the next request and this turn's tokens as they will be trained."""

    infer_request: RolloutInferRequest
    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    rollout_infos: dict[str, Any]
    images: list = field(default_factory=list)  # images of the placeholders in the messages step() appended


def check_step(ret: Any, choice: ChatCompletionResponseChoice, where: str, known: list | tuple = ()) -> StepResult:
    """Validate ``step()``'s dict; a RolloutError starting with ``where`` (the scheduler and the turn) otherwise.
    ``known``: the trajectory's images, which the request's ``images`` showed to the hooks (what follows them is
    new)."""
    if not isinstance(ret, dict) or ret.get("infer_request") is None:
        raise RolloutError(
            f"{where} returned {type(ret).__name__} without 'infer_request'; return "
            "{'infer_request': next_request, ...}"
        )
    req = ret["infer_request"]
    if isinstance(req, dict):
        req = RolloutInferRequest.model_validate(req)
    if not isinstance(req, RolloutInferRequest):
        raise RolloutError(f"{where}: 'infer_request' is a {type(req).__name__}, not a RolloutInferRequest")
    ids, mask = ret.get("response_token_ids"), ret.get("response_loss_mask")
    if ids is not None and mask is None:
        raise RolloutError(
            f"{where} returned response_token_ids without response_loss_mask; return both, "
            "same length (1 = trained, 0 = inserted text)"
        )
    ids = list(choice.token_ids) if ids is None else list(ids)
    mask = [1] * len(ids) if mask is None else list(mask)
    if len(mask) != len(ids):
        raise RolloutError(
            f"{where}: response_loss_mask has {len(mask)} entries for {len(ids)} "
            "response_token_ids; they must have the same length"
        )
    if any(m not in (0, 1) for m in mask):
        raise RolloutError(f"{where}: response_loss_mask must hold only 0 and 1")
    lps = ret.get("rollout_logprobs")
    lps = choice_logprobs(choice) if lps is None else [float(x) for x in lps]
    infos = ret.get("rollout_infos") or {}
    if not isinstance(infos, dict):
        raise RolloutError(f"{where}: rollout_infos must be a dict, got {type(infos).__name__}")
    appended = take_appended(req, list(known), where)
    if "images" in infos:  # ms-swift's override: accepted when it is the request's own list (DeepEyes)
        if not same_images(infos["images"], req.images):
            raise RolloutError(
                f"{where}: rollout_infos['images'] is kept by the loop (every image so far); "
                "append the new message's images to infer_request.images or return them as "
                "'images' in step()'s dict"
            )
        infos = {k: v for k, v in infos.items() if k != "images"}
    images = step_images(ret.get("images"), where)
    if appended and images and not same_images(images, appended):
        raise RolloutError(
            f"{where}: {len(appended)} image(s) appended to infer_request.images and "
            f"{len(images)} other(s) returned as 'images'; give the new images in one of them"
        )
    return StepResult(req, ids, mask, lps, infos, appended or images)


def append_completion(messages: list[dict], choice: ChatCompletionResponseChoice, continuation: bool) -> None:
    """Add the turn's text: extend the open assistant message, or append a new one."""
    text = choice.message.get("content") or ""
    if continuation:
        messages[-1] = {**messages[-1], "content": (messages[-1].get("content") or "") + text}
    else:
        messages.append({"role": "assistant", "content": text})
