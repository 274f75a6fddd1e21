"""``--agent`` end to end on the tiny model (CPU): a calculator agent written with the ``openai`` package trains 3
steps, the same agent written with the OpenAI Agents SDK trains 2.

A random tiny model never writes a tool call, so the agent drives the tool: after each reply it runs the
calculator itself (on the model's call when there is one, else on the row's expression) and sends the result as a
``tool`` message, 2 to 4 calls an episode. What is asserted exactly: the ids each episode trains are the ids the
endpoint returned to the agent (prompt and sampled), tool results are masked, and the advantages are the group's
GRPO advantages of the rewards the agent returned.
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from agents_fakes import agent_run_argv
from support import grpo_trainer_class

from grpokit.trainers.grpo_trainer import GRPOTrainer

pytestmark = pytest.mark.slow

OPENAI_AGENT = textwrap.dedent('''
    import json

    from grpokit.agents import agents
    from grpokit.rollout.tools import ToolError, calculator

    CALLS, REWARDS = {}, {}  # by episode id: (prompt_token_ids, token_ids) per call, the reward returned
    TOOL = {"type": "function", "function": {"name": "calculator", "description": "evaluate arithmetic",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}

    def run_calculator(message, row):
        """The model's own call when it made one, else the row's expression: the agent drives the tool."""
        expression = row["expression"]
        if message.tool_calls:
            expression = json.loads(message.tool_calls[0].function.arguments).get("expression", expression)
        try:
            return calculator(expression)
        except ToolError as e:
            return f"error: {e}"

    @agents.register("calculator_agent")
    async def calculator_agent(client, row):
        episode = str(client.base_url).rstrip("/").split("/")[-2]
        messages = list(row["messages"])
        calls = 2 + row["extra_calls"]
        for k in range(calls):
            r = await client.chat.completions.create(model="any", messages=messages, tools=[TOOL], max_tokens=6)
            CALLS.setdefault(episode, []).append((r.model_extra["prompt_token_ids"],
                                                  r.choices[0].model_extra["token_ids"]))
            message = r.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if k + 1 < calls:
                messages.append({"role": "tool", "tool_call_id": f"call_{k}",
                                 "content": "RESULT " + run_calculator(message, row)})
        REWARDS[episode] = len(message.content or "") % 4 / 3
        return REWARDS[episode]
''')

SDK_AGENT = textwrap.dedent('''
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled

    from grpokit.agents import agents as registry
    from grpokit.rollout.tools import calculator as calc

    set_tracing_disabled(True)  # no network: traces would go to OpenAI

    @function_tool
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression."""
        return calc(expression)

    @registry.register("sdk_calculator")
    async def sdk_calculator(client, row):
        model = OpenAIChatCompletionsModel(model="policy", openai_client=client)
        agent = Agent(name="calc", instructions="Use the calculator tool.", tools=[calculator], model=model,
                      model_settings=ModelSettings(max_tokens=6))
        result = await Runner.run(agent, row["messages"][-1]["content"], max_turns=4)
        return len(str(result.final_output)) % 4 / 3
''')


class RecordingTrainer(GRPOTrainer):
    windows: list = []

    def _prepare_inputs(self, prompts, rollout=None):
        window = super()._prepare_inputs(prompts, rollout)
        RecordingTrainer.windows.append(window)
        return window


@pytest.fixture
def recording_trainer():
    RecordingTrainer.windows = []
    with grpo_trainer_class(RecordingTrainer):
        yield RecordingTrainer


def _train(model_dir: Path, tmp_path: Path, plugin: str, agent: str, steps: int):
    from grpokit.config.parse import parse_train_args
    from grpokit.pipeline.train import run_train

    argv, out = agent_run_argv(model_dir, tmp_path, plugin, agent, steps)
    cfg = parse_train_args(argv)
    trainer = run_train(cfg)
    trainer.scheduler.close()
    logs = [json.loads(line) for line in (out / "logging.jsonl").read_text().splitlines()]
    return trainer, [r for r in logs if "loss" in r], sys.modules[f"{agent}_plugin"]


def _grpo_advantages(rewards: list[float]) -> list[float]:
    # groups of 2 (num_generations): A = (r − mean) / (Bessel std + 1e-4); std of (a, b) = |a − b| / √2
    out = []
    for a, b in zip(rewards[::2], rewards[1::2], strict=True):
        m, s = (a + b) / 2, abs(a - b) / 2**0.5
        out += [(a - m) / (s + 1e-4), (b - m) / (s + 1e-4)]
    return out


def test_an_openai_agent_trains_on_the_ids_the_endpoint_sampled(tiny_model_dir, tmp_path, recording_trainer):
    trainer, logs, plugin = _train(tiny_model_dir, tmp_path, OPENAI_AGENT, "calculator_agent", steps=3)
    assert trainer.state.global_step == 3 and len(logs) == 3
    assert trainer.reward_names == ["gym_reward"]
    tok = trainer.tokenizer
    for window in recording_trainer.windows:
        batch, width = window.batch, window.batch.input_ids.shape[1] - window.batch.completion_mask.shape[1]
        rewards = []
        for i, o in enumerate(window.outputs):
            calls = plugin.CALLS[o.rollout_infos["episode_id"]]
            assert 2 <= len(calls) <= 4 and o.rollout_infos["agent_segments"] == 1  # one trajectory an episode
            prompt, full = calls[0][0], calls[-1][0] + calls[-1][1]
            trained = [1] * 0
            for (p, c), nxt in zip(calls, [*calls[1:], None]):
                trained += [0] * (len(p) - len(prompt) - len(trained)) + [1] * len(c)
                if nxt is not None:
                    assert nxt[0][: len(p) + len(c)] == p + c  # each call extends the last: no re-tokenising
            n = len(full) - len(prompt)
            assert batch.input_ids[i, width - len(prompt) : width].tolist() == prompt
            assert batch.input_ids[i, width : width + n].tolist() == full[len(prompt) :]
            assert batch.completion_mask[i, :n].tolist() == [float(t) for t in trained]
            assert batch.completion_mask[i, n:].sum() == 0
            masked = [t for t, m in zip(full[len(prompt) :], trained) if not m]
            assert tok.decode(masked).count("RESULT") == len(calls) - 1  # tool results are never trained
            rewards.append(plugin.REWARDS[o.rollout_infos["episode_id"]])
        assert window.rewards_per_func[:, 0].tolist() == pytest.approx(rewards)
        assert batch.advantages.tolist() == pytest.approx(_grpo_advantages(rewards), abs=1e-5)
    assert any(r["grad_norm"] > 0 for r in logs)
    # the episode counts reach the log every step (4 episodes a step: 2 prompts × num_generations 2)
    assert [(r["agent/episodes"], r["agent/failures"], r["agent/timeouts"]) for r in logs] == [(4, 0, 0)] * 3


def test_an_agents_sdk_agent_trains(tiny_model_dir, tmp_path, recording_trainer):
    trainer, logs, _ = _train(tiny_model_dir, tmp_path, SDK_AGENT, "sdk_calculator", steps=2)
    assert trainer.state.global_step == 2 and len(logs) == 2
    for window in recording_trainer.windows:
        assert all(o.rollout_infos["agent_status"] == "done" for o in window.outputs)
        assert all(o.rollout_infos["agent_calls"] >= 1 for o in window.outputs)
        assert torch.isfinite(window.batch.advantages).all()
        assert window.batch.completion_mask.sum() > 0
