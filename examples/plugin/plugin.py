"""A complete grpokit plugin for the Countdown task: rewards, a multi-turn scheduler, an environment, a trainer
subclass, an optimizer and a callback, all registered when the file is imported.

Run it (``builtin:countdown`` rows carry the columns ``nums``, ``target`` and ``solution``)::

    grpokit train --external_plugins examples/plugin/plugin.py \\
        --dataset builtin:countdown --reward_funcs countdown countdown_judge --reward_weights 1.0 0.2 \\
        --multi_turn_scheduler countdown_retry --max_turns 2 \\
        --optimizer lion --learning_rate 3e-7 --callbacks reward_summary \\
        --num_generations 8 --max_completion_length 256

Loading is ``--external_plugins``' job: this file is imported as the top-level module ``plugin`` with its folder
on ``sys.path`` (so the sibling ``countdown_check.py`` imports as ``countdown_check``), before anything is looked
up. What it registers:

| registry          | name              | what                                                              |
|-------------------|-------------------|-------------------------------------------------------------------|
| orms              | countdown         | 1 when the equation uses each number once and hits the target     |
| orms              | countdown_judge   | async judge: partial credit for getting close to the target       |
| multi_turns       | countdown_retry   | a wrong answer gets the checker's verdict and another try         |
| envs              | countdown         | the same game as a gym env (gym_scheduler --gym_env countdown)    |
| TRAINER_MAPPING   | grpo              | plugin.CountdownTrainer: logs how advantages spread over tokens   |
| optimizers_map    | lion              | Lion: the sign of interpolated momentum (arXiv:2302.06675)        |
| callbacks_map     | reward_summary    | writes output_dir/reward_summary.json (reward curve, best step)   |

docs/plugins.md explains every extension point.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import torch
from countdown_check import check

from grpokit.errors import RolloutError
from grpokit.rewards import ORM, AsyncORM, orms
from grpokit.rollout.env import Env, envs
from grpokit.rollout.multi_turn import MultiTurnScheduler, multi_turns
from grpokit.trainers.callbacks import TrainerCallback, callbacks_map
from grpokit.trainers.factory import TrainerFactory
from grpokit.trainers.grpo_trainer import GRPOTrainer
from grpokit.trainers.optimizers import optimizers_map


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


# ------------------------------------------------------------------------------------------------------------
# rewards: --reward_funcs countdown countdown_judge
# ------------------------------------------------------------------------------------------------------------
class CountdownORM(ORM):
    """1.0 when the last ``<answer>…</answer>`` uses each of ``nums`` exactly once and equals ``target``, else 0.0.

    ``target`` and ``nums`` are dataset columns: naming them in ``__call__`` makes the pre-training column check
    fail early (with the dataset's columns listed) on data that lacks them. ``last_metrics`` is logged by the
    trainer as ``rewards/countdown/<key>``: how many replies had an answer tag, and how many used the numbers right.
    """

    def __init__(self, args: Any = None, **kwargs: Any) -> None:
        super().__init__(args)
        self.last_metrics: dict[str, float] = {}

    def __call__(self, completions: list[str], target: list[int], nums: list[list[int]], **kwargs: Any) -> list[float]:
        verdicts = [check(c, n, t) for c, n, t in zip(completions, nums, target, strict=True)]
        self.last_metrics = {
            "has_answer": _mean([float(v.equation is not None) for v in verdicts]),
            "uses_numbers": _mean([float(v.uses_numbers) for v in verdicts]),
        }
        return [1.0 if v.correct else 0.0 for v in verdicts]


class CountdownJudge(AsyncORM):
    """Stands in for an LLM judge behind HTTP: partial credit ``1 - |value - target| / target`` (floored at 0) for
    an equation that uses the right numbers, 0 otherwise.

    Each sample is one coroutine and all of a batch are in flight together (at most ``max_concurrency``), as
    requests to a judge server would be; ``_ask`` is where an ``await client.post(...)`` goes. The rule runs
    offline, behind ``await asyncio.sleep(0)``. ``last_metrics['max_in_flight']`` shows the concurrency reached.
    """

    def __init__(self, args: Any = None, max_concurrency: int = 32, **kwargs: Any) -> None:
        super().__init__(args)
        self.max_concurrency = max_concurrency
        self.last_metrics: dict[str, float] = {}

    async def _ask(self, completion: str, nums: list[int], target: int) -> float:
        await asyncio.sleep(0)  # the network round trip of a real judge
        verdict = check(completion, nums, target)
        if not verdict.uses_numbers or verdict.value is None:
            return 0.0
        return max(0.0, 1.0 - float(abs(verdict.value - int(target))) / max(abs(int(target)), 1))

    async def __call__(
        self, completions: list[str], target: list[int], nums: list[list[int]], **kwargs: Any
    ) -> list[float]:
        gate = asyncio.Semaphore(self.max_concurrency)
        in_flight, peak = 0, 0

        async def one(completion: str, n: list[int], t: int) -> float:
            nonlocal in_flight, peak
            async with gate:
                in_flight += 1
                peak = max(peak, in_flight)
                try:
                    return await self._ask(completion, n, t)
                finally:
                    in_flight -= 1

        scores = await asyncio.gather(*(one(c, n, t) for c, n, t in zip(completions, nums, target, strict=True)))
        self.last_metrics = {"max_in_flight": float(peak)}
        return list(scores)


orms["countdown"] = CountdownORM
orms["countdown_judge"] = CountdownJudge


# ------------------------------------------------------------------------------------------------------------
# multi-turn: --multi_turn_scheduler countdown_retry --max_turns N   (or gym_scheduler --gym_env countdown)
# ------------------------------------------------------------------------------------------------------------
def _problem(data: dict[str, Any], who: str) -> tuple[list[int], int]:
    if "nums" not in data or "target" not in data:
        raise RolloutError(
            f"{who} needs the dataset columns nums and target (e.g. --dataset builtin:countdown); "
            f"the row has {', '.join(sorted(data)) or 'no columns'}"
        )
    return [int(n) for n in data["nums"]], int(data["target"])


class CountdownRetryScheduler(MultiTurnScheduler):
    """Until the answer is right (or ``--max_turns`` is reached), reply to the model as the user with what is wrong
    ("(4 + 2) * 3 = 18, not 24") and let it try again. A reply cut off by the token limit gets another try too.

    Only ``step()`` and ``check_finished()`` are written; the default loop keeps the model's token ids as
    generated, and the feedback (a user message) is template text with loss mask 0. The reward scores the last
    reply; ``rollout_infos['countdown_retries']`` counts the feedback messages.
    """

    def check_finished(self, infer_request, response_choice, current_turn: int) -> bool:
        if current_turn >= self.max_turns:
            return True
        nums, target = _problem(infer_request.data_dict, "countdown_retry")
        return check(infer_request.messages[-1]["content"], nums, target).correct

    def step(self, infer_request, response_choice, current_turn: int) -> dict:
        nums, target = _problem(infer_request.data_dict, "countdown_retry")
        verdict = check(infer_request.messages[-1]["content"], nums, target)
        if response_choice.finish_reason == "length":
            feedback = "Your reply was cut off. Give only the equation inside <answer></answer>."
        else:
            feedback = f"Not yet: {verdict.reason}. Try again; put the equation inside <answer></answer>."
        infer_request.messages.append({"role": "user", "content": feedback})
        return {"infer_request": infer_request, "rollout_infos": {"countdown_retries": current_turn}}


class CountdownEnv(Env):
    """The retry game as a gym env: reward 1 and done for a correct equation; otherwise the verdict as the next
    observation (reward 0). The problem comes from the request's row (``nums``, ``target``)."""

    def __init__(self, env_config: dict[str, Any] | None = None) -> None:
        super().__init__(env_config)
        self.nums: list[int] = []
        self.target = 0

    async def reset(self, config) -> tuple[str, dict[str, Any]]:
        self.nums, self.target = _problem(config.data_dict, "countdown env")
        return "", {"nums": self.nums, "target": self.target}  # the prompt already states the problem

    async def step(self, action: list[dict[str, Any]]) -> tuple[str, float, bool, dict[str, Any]]:
        verdict = check(str(action[-1].get("content") or ""), self.nums, self.target)
        if verdict.correct:
            return "Correct!", 1.0, True, {"equation": verdict.equation}
        return f"Not yet: {verdict.reason}. Try again.", 0.0, False, {"equation": verdict.equation}


multi_turns["countdown_retry"] = CountdownRetryScheduler
envs["countdown"] = CountdownEnv


# ------------------------------------------------------------------------------------------------------------
# trainer: TRAINER_MAPPING['grpo'] = 'plugin.CountdownTrainer'
# ------------------------------------------------------------------------------------------------------------
class CountdownTrainer(GRPOTrainer):
    """GRPOTrainer plus two diagnostics per micro-step: the share of trained tokens whose advantage is positive,
    and the token-weighted mean |advantage|. Long completions weigh more in a token-mean loss; these show how much.
    ``loss_calls`` counts the calls (a test reads it to see that this class trained)."""

    loss_calls = 0

    def _compute_loss_and_metrics(self, model, inputs) -> tuple[torch.Tensor, dict]:
        loss, metrics = super()._compute_loss_and_metrics(model, inputs)
        self.loss_calls += 1
        tokens = inputs.completion_mask.sum(1)  # [B] trained tokens per sample
        adv = inputs.advantages.to(tokens.device)  # [B]
        total = tokens.sum().clamp(min=1)
        metrics["plugin/positive_adv_token_frac"] = (tokens * (adv > 0)).sum() / total
        metrics["plugin/abs_adv_token_mean"] = (tokens * adv.abs()).sum() / total
        return loss, metrics


# The file is imported as the module `plugin`, so this is "plugin.CountdownTrainer"; __name__ keeps it right
# if the file is copied under another name.
TrainerFactory.TRAINER_MAPPING["grpo"] = f"{__name__}.CountdownTrainer"


# ------------------------------------------------------------------------------------------------------------
# optimizer: --optimizer lion
# ------------------------------------------------------------------------------------------------------------
class Lion(torch.optim.Optimizer):
    """Lion (arXiv:2302.06675): step by ``lr · sign(β1·m + (1-β1)·g)``, then ``m ← β2·m + (1-β2)·g``, with
    decoupled weight decay. Every element moves by exactly ``lr`` (or 0), so Lion wants a learning rate 3-10×
    smaller than AdamW's. ``steps_taken`` counts real steps (accelerate skips the accumulation micro-steps)."""

    def __init__(
        self, params, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.0
    ) -> None:
        if lr <= 0 or not all(0.0 <= b < 1.0 for b in betas) or weight_decay < 0:
            raise ValueError(f"Lion: need lr > 0, 0 <= betas < 1, weight_decay >= 0; got {lr}, {betas}, {weight_decay}")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay})
        self.steps_taken = 0

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (beta1, beta2), wd = group["lr"], group["betas"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                momentum = self.state[p].setdefault("exp_avg", torch.zeros_like(p))
                if wd:
                    p.mul_(1 - lr * wd)
                p.add_(torch.sign(momentum * beta1 + p.grad * (1 - beta1)), alpha=-lr)
                momentum.mul_(beta2).add_(p.grad, alpha=1 - beta2)
        self.steps_taken += 1
        return loss


def build_lion(params, args) -> Lion:
    """``--optimizer lion``: ``--learning_rate`` and ``--weight_decay``; betas are the paper's (0.9, 0.99)."""
    return Lion(params, lr=args.learning_rate, weight_decay=args.weight_decay)


optimizers_map["lion"] = build_lion


# ------------------------------------------------------------------------------------------------------------
# callback: --callbacks reward_summary
# ------------------------------------------------------------------------------------------------------------
class RewardSummary(TrainerCallback):
    """Collects ``reward`` (and each ``rewards/<name>/mean``) at every logging step; at the end writes
    ``output_dir/reward_summary.json``: the curve, the best step and its reward (main process only)."""

    FILE = "reward_summary.json"

    def __init__(self) -> None:
        self.curve: list[dict[str, float]] = []

    def on_train_begin(self, trainer) -> None:
        self.curve = []

    def on_log(self, trainer, logs: dict) -> None:
        if "reward" in logs:
            row = {"step": logs["step"], "reward": logs["reward"]}
            row.update({k: v for k, v in logs.items() if k.startswith("rewards/") and k.endswith("/mean")})
            self.curve.append(row)

    def on_train_end(self, trainer) -> None:
        if not trainer.accelerator.is_main_process or not self.curve:
            return
        best = max(self.curve, key=lambda r: r["reward"])
        summary = {"best_step": best["step"], "best_reward": best["reward"], "curve": self.curve}
        (trainer.output_dir / self.FILE).write_text(json.dumps(summary, indent=2))


callbacks_map["reward_summary"] = RewardSummary
