"""verifiers (0.4) environments, defined here, train 2 steps each through ``--verifiers_env`` on the tiny model: a
single-turn one and a multi-turn one whose harness offers a calculator tool. Each rollout is the environment's
own (``env.run_episode``: its harness, verifiers' interception proxy, its reward functions); every model call
goes through the trainer's endpoint, recorded token-in-token-out. Asserted: each reward function's score is
logged (``rewards/<name>/mean``) and the episode reward (``gym_reward``) is their weighted sum, per sample.

The harnesses run in process (verifiers' documented alternative to launching a program: every model call still
goes through the interception endpoint); the agent seat runs in verifiers' local ``subprocess`` runtime.
Runs in the verifiers environment (``bash scripts/test_agents.sh``; marker ``agents_env``, deselected by the
main suite): verifiers is imported only inside the tests and the plugin file they write.
"""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path

import pytest
from support import flags

pytestmark = [pytest.mark.agents_env, pytest.mark.slow]

PLUGIN = textwrap.dedent('''
    import json

    import openai
    import verifiers.v1 as vf
    from verifiers.v1.runtimes import ProgramResult

    CALCULATOR = {"type": "function", "function": {
        "name": "calculator", "description": "Evaluate a + b.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                       "required": ["a", "b"]}}}


    class Sum(vf.TaskData):
        a: int = 0
        b: int = 0


    def _replies(trace):
        return [m for m in (trace.branches[-1].messages if trace.branches else []) if m.role == "assistant"]


    class SumTask(vf.Task[Sum, vf.State, vf.TaskConfig]):
        @vf.reward(weight=1.0)
        async def correct(self, task, trace) -> float:
            replies = _replies(trace)
            return float(bool(replies) and str(task.a + task.b) in str(replies[-1].content or ""))

        @vf.reward(weight=0.5)
        async def length(self, task, trace) -> float:
            replies = _replies(trace)
            return min(len(str(replies[-1].content or "")), 20) / 20 if replies else 0.0


    class TurnsTask(SumTask):
        @vf.reward(weight=0.25)
        async def turns(self, task, trace) -> float:
            return len(_replies(trace)) / 3


    class SumTaskset(vf.Taskset[SumTask, vf.TasksetConfig]):
        def load(self):
            for a, b in ((2, 3), (4, 1)):
                yield SumTask(Sum(prompt=f"What is {a} + {b}?", a=a, b=b), self.config.task)


    class TurnsTaskset(vf.Taskset[TurnsTask, vf.TasksetConfig]):
        def load(self):
            for a, b in ((2, 3), (4, 1)):
                yield TurnsTask(Sum(prompt=f"Use the calculator: {a} + {b}?", system_prompt="You add numbers.",
                                    a=a, b=b), self.config.task)


    def _messages(data):
        head = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
        return head + [{"role": "user", "content": data.prompt}]


    class OneCall(vf.Harness[vf.HarnessConfig]):
        """Single turn: one model call on the task's prompt."""
        APPENDS_SYSTEM_PROMPT, EXECUTES_CODE, NEEDS_CONTAINER = True, False, False

        async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **kwargs):
            client = openai.AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0)
            await client.chat.completions.create(model=ctx.model, messages=_messages(data))
            return ProgramResult(0, "", "")


    class CalculatorLoop(vf.Harness[vf.HarnessConfig]):
        """Three model calls offering the calculator tool: a tool call is run and answered as a tool message;
        a reply without one gets the calculator's result as the next user turn (the harness calls it itself)."""
        APPENDS_SYSTEM_PROMPT, EXECUTES_CODE, NEEDS_CONTAINER = True, False, False

        async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **kwargs):
            client = openai.AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0)
            a, b = (int(x) for x in data.prompt.rstrip("?").split(": ")[1].split(" + "))
            messages = _messages(data)
            for _ in range(3):
                r = await client.chat.completions.create(model=ctx.model, messages=messages, tools=[CALCULATOR])
                reply = r.choices[0].message
                messages.append(reply.model_dump(exclude_none=True))
                calls = reply.tool_calls or []
                for call in calls:
                    args = json.loads(call.function.arguments or "{}")
                    messages.append({"role": "tool", "tool_call_id": call.id,
                                     "content": str(int(args.get("a", 0)) + int(args.get("b", 0)))})
                if not calls:
                    messages.append({"role": "user", "content": f"Observation: calculator({a}, {b}) = {a + b}"})
            return ProgramResult(0, "", "")


    def _env(taskset_id, harness_id):
        return vf.load_environment(vf.resolve_env_config({
            "taskset": {"id": taskset_id},
            "agent": {"runtime": {"type": "subprocess"}, "harness": {"id": harness_id}}}))
''')

FLAKY = PLUGIN + textwrap.dedent('''
    class Flaky(OneCall):
        """Plays the first task; the harness breaks on the second."""

        async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **kwargs):
            if data.a == 4:
                raise RuntimeError("harness broke")
            return await super().launch(ctx, trace, runtime, endpoint, secret, mcp_urls, data, **kwargs)

    def load_environment():
        return _env("vf_flaky", "vf_flaky")

    __all__ = ["SumTaskset", "Flaky"]
''')
SINGLE = PLUGIN + textwrap.dedent("""
    def load_environment():
        return _env("vf_single", "vf_single")

    __all__ = ["SumTaskset", "OneCall"]
""")
TOOLS = PLUGIN + textwrap.dedent("""
    def load_environment():
        return _env("vf_tools", "vf_tools")

    __all__ = ["TurnsTaskset", "CalculatorLoop"]
""")


def _train(model_dir: Path, tmp_path: Path, plugin: Path, spec: str):
    from grpokit.config.parse import parse_train_args
    from grpokit.pipeline.train import run_train

    out = tmp_path / "out"
    cfg = parse_train_args(
        flags(
            {"--model": model_dir, "--output_dir": out, "--verifiers_env": spec, "--external_plugins": plugin},
            "--tuner_type full --max_steps 2 --reward_funcs format --num_generations 2",
            "--per_device_train_batch_size 4 --max_completion_length 8 --learning_rate 1e-3 --beta 0",
            "--torch_dtype float32 --seed 0 --disable_tqdm true --plots false --save_final_model false",
            "--log_completions true",
        )
    )
    trainer = run_train(cfg)
    logs = [json.loads(line) for line in (out / "logging.jsonl").read_text().splitlines()]
    completions = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    return trainer, [r for r in logs if "loss" in r], completions, out


def _check_rubric_logged(trainer, logs, completions, weights: dict[str, float]) -> None:
    assert trainer.state.global_step == 2 and len(logs) == 2
    assert trainer.reward_names == ["format", *weights, "gym_reward"]
    for row in logs:
        for name in weights:
            assert math.isfinite(row[f"rewards/{name}/mean"])
    assert len(completions) >= 4
    for c in completions:  # the episode reward is the rubric's weighted sum, sample by sample
        assert c["gym_reward"] == pytest.approx(sum(w * c[name] for name, w in weights.items()))


def test_a_single_turn_verifiers_env_trains_with_its_rubric(tiny_model_dir, tmp_path):
    pytest.importorskip("verifiers")
    plugin = tmp_path / "vf_single.py"
    plugin.write_text(SINGLE)
    trainer, logs, completions, out = _train(tiny_model_dir, tmp_path, plugin, "vf_single:load_environment")
    _check_rubric_logged(trainer, logs, completions, {"correct": 1.0, "length": 0.5})
    tasks = [json.loads(line) for line in (out / "verifiers_tasks.jsonl").read_text().splitlines()]
    assert tasks == [
        {"messages": [{"role": "user", "content": "What is 2 + 3?"}], "verifiers_task": 0},
        {"messages": [{"role": "user", "content": "What is 4 + 1?"}], "verifiers_task": 1},
    ]
    assert {c["prompt"] for c in completions} == {"What is 2 + 3?", "What is 4 + 1?"}


def test_a_multi_turn_tool_verifiers_env_trains_as_one_trajectory_per_episode(tiny_model_dir, tmp_path):
    pytest.importorskip("verifiers")
    plugin = tmp_path / "vf_tools.py"
    plugin.write_text(TOOLS)
    trainer, logs, completions, _ = _train(tiny_model_dir, tmp_path, plugin, "vf_tools:load_environment")
    _check_rubric_logged(trainer, logs, completions, {"correct": 1.0, "length": 0.5, "turns": 0.25})
    for c in completions:
        assert c["turns"] == pytest.approx(1.0)  # three replies recorded in verifiers' trace
        said = [m for m in c["messages"] if m["role"] != "system"]
        # each call extends the one before: one trajectory of three replies, the tool results between them
        assert [m["role"] for m in said] == ["user", "assistant", "user", "assistant", "user", "assistant"]
        assert said[2]["content"].startswith("Observation: calculator(")


def test_an_episode_verifiers_marks_failed_is_a_failed_episode_not_a_failed_run(tiny_model_dir, tmp_path):
    pytest.importorskip("verifiers")
    plugin = tmp_path / "vf_flaky.py"
    plugin.write_text(FLAKY)
    trainer, logs, completions, _ = _train(tiny_model_dir, tmp_path, plugin, "vf_flaky:load_environment")
    assert trainer.state.global_step == 2
    broken = [c for c in completions if c["prompt"] == "What is 4 + 1?"]
    played = [c for c in completions if c["prompt"] == "What is 2 + 3?"]
    assert broken and played
    for c in broken:  # reward 0, no rubric score (nothing of it trained: the agent path's failure rule)
        assert c["gym_reward"] == 0 and c["correct"] is None and c["length"] is None
    for c in played:
        assert c["gym_reward"] == pytest.approx(c["correct"] + 0.5 * c["length"])
