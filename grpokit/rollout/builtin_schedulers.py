"""Built-in multi-turn schedulers, one per customisation route (names as in ms-swift):

- ``math_tip_trick`` (``MathTipsScheduler``): ``step()`` + token masks. A wrong answer is cut before the answer,
  a tip is appended inside the same assistant message (tip tokens: loss mask 0), and the model continues.
- ``thinking_tips_scheduler`` (``ThinkingTipsScheduler``): overrides ``run()``. Each round is its own
  ``RolloutOutput``; earlier rounds' replies stay in the history without their ``<think>`` part; with
  ``--loss_scale last_round`` only the last round trains.
- ``gym_scheduler`` (``GYMScheduler``): hooks. ``on_trajectory_start`` resets an ``Env``, ``on_turn_end`` steps it
  and reports ``total_reward``/``step_rewards``; ``step()`` only appends the observation as a user message.
- ``tool_call_scheduler`` (``ToolCallScheduler``): ReAct ``Action:``/``Action Input:`` calls to the safe calculator;
  the result is a new message, so the chat template masks it.
"""

from __future__ import annotations

import copy
import inspect
import logging
import re
from dataclasses import dataclass, field
from typing import Any

from grpokit.data.images import row_images
from grpokit.errors import ConfigError, DataError, RolloutError
from grpokit.protocol import (
    ChatCompletionResponseChoice,
    RequestConfig,
    RolloutInferRequest,
    RolloutOutput,
    choice_logprobs,
)
from grpokit.rewards.math_rewards import answer_matches
from grpokit.rollout.env import Env, envs, reset_images, reset_values, start_messages
from grpokit.rollout.multi_turn import MultiTurnScheduler, Trajectory, multi_turns
from grpokit.rollout.tools import parse_action, run_tool
from grpokit.rollout.turn_images import check_takes_images

logger = logging.getLogger(__name__)

_THINK_RE = re.compile(r"<think>.*?(</think>\s*|$)", re.DOTALL)


# -- answer checking -------------------------------------------------------------------------------------------
def is_correct(completion: str, solution: Any) -> bool:
    """grpokit's ``accuracy`` check (math-verify, then the last answer)."""
    return answer_matches(completion, str(solution))


def _solution(scheduler: MultiTurnScheduler, request: RolloutInferRequest) -> Any:
    if request.data_dict.get("solution") is None:
        raise DataError(
            f"{type(scheduler).__name__} checks answers against a 'solution' column; request "
            f"{request.request_id} has columns {sorted(request.data_dict)}"
        )
    return request.data_dict["solution"]


def _last_assistant_text(request: RolloutInferRequest) -> str:
    return next((m.get("content") or "" for m in reversed(request.messages) if m["role"] == "assistant"), "")


# -- math_tip_trick --------------------------------------------------------------------------------------------
@multi_turns.register("math_tip_trick")
class MathTipsScheduler(MultiTurnScheduler):
    """On a wrong answer: keep the reasoning up to ``<answer>``/``</think>``, append ``tips_prompt`` (mask 0) and
    let the model continue the same assistant message. Tips are given at most ``max_tips`` times."""

    tips_prompt = "\nWait, that answer does not look right. Let me check each step again.\n"
    max_tips = 1

    def check_finished(
        self, infer_request: RolloutInferRequest, response_choice: ChatCompletionResponseChoice, current_turn: int
    ) -> bool:
        if current_turn > self.max_tips:
            return True
        if is_correct(_last_assistant_text(infer_request), _solution(self, infer_request)):
            return True
        return super().check_finished(infer_request, response_choice, current_turn)

    def step(
        self, infer_request: RolloutInferRequest, response_choice: ChatCompletionResponseChoice, current_turn: int
    ) -> dict:
        text = response_choice.message.get("content") or ""
        cuts = [i for i in (text.find("<answer>"), text.find("</think>")) if i >= 0]
        keep = cut_token_prefix(self.tokenizer, response_choice.token_ids, text, min(cuts, default=len(text)))
        kept_ids = list(response_choice.token_ids[:keep])
        kept_text = self.tokenizer.decode(kept_ids, skip_special_tokens=True)
        tip_ids = self.encode_text(self.tips_prompt)
        last = infer_request.messages[-1]
        earlier = last["content"][: len(last["content"]) - len(text)]  # text of earlier turns of this message
        infer_request.messages[-1] = {**last, "content": earlier + kept_text + self.tips_prompt}
        lps = choice_logprobs(response_choice)
        return {
            "infer_request": infer_request,
            "response_token_ids": kept_ids + tip_ids,
            "response_loss_mask": [1] * len(kept_ids) + [0] * len(tip_ids),
            "rollout_logprobs": lps[:keep] if lps else [],
            "rollout_infos": {"tips_given": current_turn},
        }


def cut_token_prefix(tokenizer, token_ids: list[int], text: str, cut: int) -> int:
    """Largest k such that ``token_ids[:k]`` decodes to a prefix of ``text[:cut]`` (no trailing special token)."""

    def decoded(k: int) -> str:
        return tokenizer.decode(token_ids[:k], skip_special_tokens=True)

    lo, hi = 0, len(token_ids)
    while lo < hi:  # binary search: decoded length grows with k
        mid = (lo + hi + 1) // 2
        if len(decoded(mid)) <= cut:
            lo = mid
        else:
            hi = mid - 1
    k = lo
    while k > 0 and not text.startswith(decoded(k)):
        k -= 1
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    while k > 0 and token_ids[k - 1] in special:
        k -= 1
    return k


# -- thinking_tips_scheduler -----------------------------------------------------------------------------------
def strip_think(text: str) -> str:
    """The reply without its ``<think>…</think>`` part (an unclosed ``<think>`` drops the rest)."""
    return _THINK_RE.sub("", text).strip()


@multi_turns.register("thinking_tips_scheduler")
class ThinkingTipsScheduler(MultiTurnScheduler):
    """Overrides ``run()``: one ``RolloutOutput`` per round. A wrong answer gets a user tip and another round;
    history keeps earlier replies without their thinking (as tokens with mask 0)."""

    tips_prompt = "Your answer is not correct. Check your reasoning carefully and answer again."

    def check_finished(
        self, infer_request: RolloutInferRequest, response_choice: ChatCompletionResponseChoice, current_turn: int
    ) -> bool:
        if is_correct(_last_assistant_text(infer_request), _solution(self, infer_request)):
            return True
        return super().check_finished(infer_request, response_choice, current_turn)

    async def run(
        self, infer_request: RolloutInferRequest, request_config: RequestConfig, **kwargs
    ) -> list[RolloutOutput]:
        await self.on_trajectory_start([infer_request])
        prompt = copy.deepcopy(infer_request.messages)
        history: list[dict] = []  # think-stripped replies and tips after the prompt
        hist_ids: list[list[int]] = []  # token ids of the replies in history (mask 0)
        rounds: list[tuple[list[dict], list[list[int]], Any, dict]] = []
        budget = (infer_request.request_config or request_config).max_tokens
        request = infer_request.model_copy(deep=True)
        try:
            for turn in range(1, self.max_turns + 1):
                request = infer_request.model_copy(deep=True, update={"messages": prompt + copy.deepcopy(history)})
                remaining = None
                if self.completion_length_limit_scope == "total":
                    remaining = budget - self._history_length(prompt, history, hist_ids)
                    if remaining <= 0:
                        break
                response = await self._infer_turn(request, request_config, remaining)
                choice = response.choices[0]
                text = choice.message.get("content") or ""
                request.messages.append({"role": "assistant", "content": text})
                turn_result = await self.on_turn_end(request, choice, turn) or {}
                done = turn_result.get("done")
                stop = self.check_finished(request, choice, turn) if done is None else bool(done)
                rounds.append(
                    (request.messages, [list(s) for s in hist_ids], response, turn_result.get("rollout_infos") or {})
                )
                if stop:
                    break
                reply = strip_think(text)
                history += [{"role": "assistant", "content": reply}, {"role": "user", "content": self.tips_prompt}]
                hist_ids.append(self.encode_text(reply))
        finally:
            await self.on_trajectory_end(request)
        return [self._round_output(k + 1, len(rounds), *r) for k, r in enumerate(rounds)]

    def _round_output(
        self, turn: int, num_rounds: int, messages: list[dict], hist_ids: list[list[int]], response, infos: dict
    ) -> RolloutOutput:
        choice = response.choices[0]
        trains = self.loss_scale != "last_round" or turn == num_rounds
        traj = Trajectory(infos=dict(infos))
        for ids in hist_ids:
            traj.add_turn(ids, [0] * len(ids), [], continuation=False)
        traj.add_turn(
            choice.token_ids,
            [int(trains)] * len(choice.token_ids),
            choice_logprobs(choice) if trains else [],
            continuation=False,
        )
        _, dropped = traj.checked_logprobs()
        info = {
            **traj.infos,
            "num_turns": turn,
            "round": turn,
            "num_rounds": num_rounds,
            "is_last_round": turn == num_rounds,
        }
        if dropped:
            info["logprobs_dropped"] = 1
        return traj.output(response, messages, info)

    def _history_length(self, prompt: list[dict], history: list[dict], hist_ids: list[list[int]]) -> int:
        """Completion tokens before this round's reply: history replies plus the template text around them."""
        n = sum(len(s) for s in hist_ids)
        template = self.chat_template()
        if template is None or not history:
            return n
        full = prompt + history
        idx = [i for i in range(len(prompt), len(full)) if full[i]["role"] == "assistant"]
        for k, i in enumerate(idx):
            j = idx[k + 1] if k + 1 < len(idx) else len(full)
            n += len(template.encode_between(full, i, j, hist_ids[k]))
        return n


# -- gym_scheduler ---------------------------------------------------------------------------------------------
async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


@dataclass
class _Episode:
    env: Env
    name: str
    reset_info: dict = field(default_factory=dict)
    step_rewards: list[float] = field(default_factory=list)
    observation: str = ""
    images: list = field(default_factory=list)  # the observation's images (info['images'] of the env's step)
    start_images: list = field(default_factory=list)  # after a reset with images: the row's, then reset's

    def infos(self, turn: int) -> dict[str, Any]:
        infos = {
            "env": self.name,
            "total_reward": float(sum(self.step_rewards)),
            "step_rewards": list(self.step_rewards),
            "reset_info": self.reset_info,
        }
        if turn == 1 and self.start_images:  # the loop's record of every image from the first step() on
            infos["images"] = list(self.start_images)
        return infos


@multi_turns.register("gym_scheduler")
class GYMScheduler(MultiTurnScheduler):
    """Hooks route: the environment lives in ``on_trajectory_start``/``on_turn_end``; ``step()`` only appends its
    observation as the next user message. The env is the row's ``env_config['name']``, else ``--gym_env``."""

    uses_env_reward = True

    def __init__(self, *args, gym_env: str | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.gym_env = gym_env or getattr(self.rollout_args, "gym_env", None)
        if self.gym_env:
            envs.get_or_raise(self.gym_env)
        self._episodes: dict[str, _Episode] = {}  # by request_id: one scheduler runs many trajectories at once

    def _make_env(self, request: RolloutInferRequest) -> tuple[str, Env]:
        env_config = request.data_dict.get("env_config") or {}
        if not isinstance(env_config, dict):
            raise DataError(f"request {request.request_id}: env_config must be a dict, got {type(env_config).__name__}")
        name = env_config.get("name") or self.gym_env
        if not name:
            raise ConfigError(
                "gym_scheduler: the row has no env_config.name and --gym_env is not set; name an "
                f"environment (registered: {', '.join(sorted(envs)) or '(none)'})"
            )
        return name, envs.get_or_raise(name)(env_config)

    async def on_trajectory_start(self, requests: list[RolloutInferRequest]) -> None:
        for req in requests:
            if req.request_id in self._episodes:
                raise RolloutError(f"gym_scheduler: two trajectories share request_id {req.request_id}")
            name, env = self._make_env(req)
            try:
                observation, info, system = reset_values(await _maybe_await(env.reset(req)), name)
                images = reset_images(info, observation, name)
                check_takes_images(self.chat_template(), "reset", images)
            except Exception as e:
                await self._close(_Episode(env, name), req.request_id)
                raise RolloutError(
                    f"request {req.request_id}: env {name!r} reset failed: {type(e).__name__}: {e}"
                ) from e
            req.messages[:] = start_messages(req.messages, observation, system)
            episode = _Episode(env, name, dict(info or {}))
            if images:  # after the row's; a new dict: the group's requests share the row's data_dict
                episode.start_images = row_images(req.data_dict) + images
                req.data_dict = {**req.data_dict, "images": list(episode.start_images)}
            self._episodes[req.request_id] = episode

    async def on_turn_end(
        self, infer_request: RolloutInferRequest, response_choice: ChatCompletionResponseChoice, current_turn: int
    ) -> dict:
        ep = self._episodes[infer_request.request_id]
        try:
            observation, reward, done, info = await _maybe_await(ep.env.step(copy.deepcopy(infer_request.messages)))
            reward = float(reward)
            if info is not None and not isinstance(info, dict):
                raise TypeError(f"step's info must be a dict, got {type(info).__name__}")
        except Exception as e:  # a broken env ends this trajectory only; training goes on
            logger.error(
                "request %s: env %r failed in step at turn %d: %s: %s",
                infer_request.request_id,
                ep.name,
                current_turn,
                type(e).__name__,
                e,
            )
            error = f"{type(e).__name__}: {e}"
            return {"done": True, "rollout_infos": {**ep.infos(current_turn), "env_error": error}}
        ep.step_rewards.append(reward)
        ep.observation = str(observation or "")
        ep.images = (info or {}).get("images") or []  # checked by the loop with step()'s return
        return {"done": bool(done), "rollout_infos": ep.infos(current_turn)}

    def step(
        self, infer_request: RolloutInferRequest, response_choice: ChatCompletionResponseChoice, current_turn: int
    ) -> dict:
        ep = self._episodes[infer_request.request_id]
        infer_request.messages.append({"role": "user", "content": ep.observation})
        return {"infer_request": infer_request, "images": ep.images}

    async def on_trajectory_end(self, infer_request: RolloutInferRequest) -> None:
        ep = self._episodes.pop(infer_request.request_id, None)
        if ep is not None:
            await self._close(ep, infer_request.request_id)

    @staticmethod
    async def _close(ep: _Episode, request_id: str) -> None:
        try:
            await _maybe_await(ep.env.close())
        except Exception as e:  # noqa: BLE001 - a failed close must not lose the trajectory
            logger.warning("request %s: env %r close failed: %s: %s", request_id, ep.name, type(e).__name__, e)


# -- tool_call_scheduler ---------------------------------------------------------------------------------------
@multi_turns.register("tool_call_scheduler")
class ToolCallScheduler(MultiTurnScheduler):
    """ReAct tool use: a reply with ``Action: calculator`` + ``Action Input: <expr>`` gets the result as a new
    ``observation_role`` message ("Observation: ..."); a reply without an action ends the trajectory."""

    stop_words = ("Observation:",)
    observation_role = "user"

    def check_finished(
        self, infer_request: RolloutInferRequest, response_choice: ChatCompletionResponseChoice, current_turn: int
    ) -> bool:
        if parse_action(response_choice.message.get("content") or "") is None:
            return True
        return super().check_finished(infer_request, response_choice, current_turn)

    def step(
        self, infer_request: RolloutInferRequest, response_choice: ChatCompletionResponseChoice, current_turn: int
    ) -> dict:
        text = response_choice.message.get("content") or ""
        name, tool_input = parse_action(text)
        result = run_tool(name, tool_input)
        content = result if text.rstrip().endswith("Observation:") else f"Observation: {result}"
        infer_request.messages.append({"role": self.observation_role, "content": content})
        errors = sum(
            1
            for m in infer_request.messages
            if m["role"] == self.observation_role and m["content"].removeprefix("Observation: ").startswith("error:")
        )
        return {"infer_request": infer_request, "rollout_infos": {"tool_calls": current_turn, "tool_errors": errors}}
