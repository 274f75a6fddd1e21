"""Built-in gym environments beyond ``guess_number`` (env.py), registered in ``envs`` under ms-swift's names.

- ``math_env`` (``MathEnv``): the environment ms-swift's ``examples/train/grpo/external/vllm_gym.sh`` names
  (``--use_gym_env true --gym_env math_env`` with ``gym_scheduler``). Same contract as ms-swift's: ``reset``
  returns the row's ``problem`` as the observation and a system message asking for ``<think>…</think>`` then
  ``<answer>…</answer>``; ``step`` scores the last reply against the row's ``solution`` (grpokit's ``accuracy``
  check); a correct answer ends the episode with reward 1.0, a wrong one gets reward 0.0 and a user turn asking
  the model to check its work again, until ``--max_turns``. The step's info holds ``math_reward`` and, when the
  episode ends, ``stop_reason``. The prose of both messages is grpokit's own.

  ms-swift also ends an episode once the conversation reaches 2048 tokens of Qwen2.5-3B-Instruct's tokenizer
  (downloaded at each step). grpokit does not fetch a tokenizer: the episode is bounded by ``--max_turns`` and
  the scheduler's completion-length limits instead.
"""

from __future__ import annotations

from typing import Any

from grpokit.errors import DataError
from grpokit.protocol import RolloutInferRequest
from grpokit.rewards.math_rewards import answer_matches
from grpokit.rollout.env import Env, envs

MATH_SYSTEM = (
    "You are solving a math problem for the user. Reason about it first, inside <think> and </think>, "
    "then give only the final result inside <answer> and </answer>, like this: "
    "<think> your reasoning </think><answer> the result </answer>"
)
MATH_RETRY = (
    "That answer is wrong. Go through your solution again step by step, find the mistake, and give the "
    "corrected result inside <answer> and </answer>."
)


class MathEnv(Env):
    """A math problem answered over several turns; reward 1.0 for the turn whose answer matches the solution."""

    system_prompt = MATH_SYSTEM
    retry_prompt = MATH_RETRY

    def __init__(self, env_config: dict[str, Any] | None = None) -> None:
        super().__init__(env_config)
        self.solution = ""

    async def reset(self, config: RolloutInferRequest) -> tuple[str, dict[str, Any], str]:
        """The row's ``problem`` (its last user message when the row has no such column) and the system message;
        the row needs a ``solution`` (pass the columns to the server: --vllm_server_pass_dataset true)."""
        data = config.data_dict
        if data.get("solution") in (None, ""):
            raise DataError(
                f"math_env: request {config.request_id} has no 'solution' column (columns: "
                f"{sorted(data) or 'none'}); give rows a solution, and in server mode pass them with "
                "--vllm_server_pass_dataset true"
            )
        self.solution = str(data["solution"])
        problem = data.get("problem")
        if problem in (None, ""):
            problem = next((m.get("content") or "" for m in reversed(config.messages) if m["role"] == "user"), "")
        if not isinstance(problem, str) or not problem:
            raise DataError(
                f"math_env: request {config.request_id} has no problem text: give a 'problem' column or a user message"
            )
        return problem, {}, self.system_prompt

    async def step(self, action: list[dict[str, Any]]) -> tuple[str, float, bool, dict[str, Any]]:
        reply = str(action[-1].get("content") or "") if action else ""
        if answer_matches(reply, self.solution):
            return self.retry_prompt, 1.0, True, {"math_reward": 1.0, "stop_reason": "Correct"}
        return self.retry_prompt, 0.0, False, {"math_reward": 0.0}


envs["math_env"] = MathEnv
