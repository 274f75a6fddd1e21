"""An ``--agent`` rollout that brings many more trajectories than the window planned trains in micro-steps of
``--per_device_train_batch_size`` rows: each episode asks for 4 choices (2 prompts x 2 episodes, 16 rows where 4
were planned, one micro-batch of 16), and no forward of the loss sees more than 4 rows."""

from __future__ import annotations

import json
import textwrap

import pytest
from agents_fakes import agent_run_argv

from grpokit.trainers.factory import TrainerFactory
from grpokit.trainers.grpo_trainer import GRPOTrainer

pytestmark = pytest.mark.slow

WIDE_AGENT = textwrap.dedent("""
    from grpokit.agents import agents

    @agents.register("wide_agent")
    async def wide_agent(client, row):
        r = await client.chat.completions.create(model="any", messages=row["messages"], n=4, max_tokens=6)
        return sum(len(c.message.content or "") for c in r.choices) % 4 / 3
""")


class PieceRecorder(GRPOTrainer):
    rows: list[int] = []
    windows: list[int] = []

    def _prepare_inputs(self, prompts, rollout=None):
        window = super()._prepare_inputs(prompts, rollout)
        PieceRecorder.windows.append(len(window.batch))
        return window

    def _compute_loss_and_metrics(self, model, inputs):
        PieceRecorder.rows.append(len(inputs))
        return super()._compute_loss_and_metrics(model, inputs)


def test_an_oversized_agent_window_trains_in_micro_batches_of_the_configured_size(tiny_model_dir, tmp_path):
    from grpokit.config.parse import parse_train_args
    from grpokit.pipeline.train import run_train

    saved = TrainerFactory.TRAINER_MAPPING["grpo"]
    TrainerFactory.TRAINER_MAPPING["grpo"] = PieceRecorder
    try:
        argv, out = agent_run_argv(tiny_model_dir, tmp_path, WIDE_AGENT, "wide_agent", 1)
        trainer = run_train(parse_train_args(argv))
        trainer.scheduler.close()
    finally:
        TrainerFactory.TRAINER_MAPPING["grpo"] = saved
    assert PieceRecorder.windows == [16]  # 2 prompts x 2 episodes x 4 choices, where 4 rows were planned
    assert PieceRecorder.rows == [4] * 4  # the one micro-step of 16 rows, in 4 pieces of 4
    logs = [json.loads(line) for line in (out / "logging.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logs if "loss" in r] == [1]
