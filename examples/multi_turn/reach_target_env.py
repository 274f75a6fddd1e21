"""Route 3 — hooks: the environment lives in ``on_trajectory_start`` / ``on_turn_end``; no loop code.

The built-in ``gym_scheduler`` is this route: its ``on_trajectory_start`` makes an ``Env`` per trajectory and
calls ``reset``; its ``on_turn_end`` calls ``step`` and reports ``total_reward``/``step_rewards`` through
``rollout_infos``; its ``step()`` only appends the observation as the next user message. So the whole plugin is
an ``Env``: here a counting game where each reply adds 1, 2 or 3 to a running total and hitting the target
exactly earns reward 1. The trainer adds ``total_reward`` as the reward column ``gym_reward``.

As a plugin (each row names its env in ``env_config``, or pass --gym_env reach_target):
    grpokit train --external_plugins examples/multi_turn/reach_target_env.py \\
        --multi_turn_scheduler gym_scheduler --max_turns 6 --reward_funcs format --reward_weights 0.1 ...
Run directly (a tiny offline model, or --model DIR) to train two steps:
    python examples/multi_turn/reach_target_env.py
"""

from __future__ import annotations

import re

from grpokit.rollout.env import Env, envs


class ReachTargetEnv(Env):
    """``env_config``: ``target`` (default 6). Overshooting ends the episode with reward 0."""

    async def reset(self, config):
        self.target = int(self.env_config.get("target", 6))
        self.total = 0
        rules = (
            f"We start at 0 and must reach exactly {self.target}. Each turn, reply with 1, 2 or 3 "
            "to add it to the total."
        )
        return rules, {"target": self.target}, ""  # the observation replaces the row's prompt (as in ms-swift)

    async def step(self, action):
        numbers = re.findall(r"\b[123]\b", action[-1]["content"])  # action[-1] is the model's reply
        if not numbers:
            return "Reply with 1, 2 or 3.", 0.0, False, {"total": self.total}
        self.total += int(numbers[-1])
        if self.total == self.target:
            return f"The total is {self.total}: exactly right!", 1.0, True, {"total": self.total}
        if self.total > self.target:
            return f"The total is {self.total}: too far.", 0.0, True, {"total": self.total}
        return f"The total is {self.total}. Add 1, 2 or 3.", 0.0, False, {"total": self.total}


envs["reach_target"] = ReachTargetEnv


def main() -> None:
    """Train two steps with gym_scheduler and this env on a tiny offline model (or --model DIR)."""
    import argparse
    import json
    import tempfile
    from pathlib import Path

    from grpokit.config.parse import parse_train_args
    from grpokit.pipeline.train import run_train
    from grpokit.testing import build_tiny_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a Hugging Face model folder (default: a tiny random model)")
    parser.add_argument("--max_steps", default="2")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="grpokit_reach_target_"))
    model = args.model or str(build_tiny_model(work / "model"))
    rows = [
        {
            "messages": [{"role": "user", "content": "Let's play a counting game."}],
            "env_config": {"name": "reach_target", "target": t},
        }
        for t in range(4, 12)
    ]
    (work / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = parse_train_args(
        [
            "--model",
            model,
            "--dataset",
            str(work / "data.jsonl"),
            "--output_dir",
            str(work / "out"),
            "--multi_turn_scheduler",
            "gym_scheduler",
            "--max_turns",
            "6",
            "--reward_funcs",
            "format",
            "--reward_weights",
            "0.1",
            "--num_generations",
            "2",
            "--per_device_train_batch_size",
            "4",
            "--max_completion_length",
            "16",
            "--max_steps",
            args.max_steps,
            "--beta",
            "0",
            "--plots",
            "false",
            "--save_final_model",
            "false",
        ]
    )
    run_train(cfg)


if __name__ == "__main__":
    main()
