"""--stream_groups against two real rollout servers (tiny model, transformers engine, float32), one producer each.
The servers' scheduler (a plugin) holds every trajectory of the prompt marked SLOW at a gate, a file the trainer's
callback writes only once step 1 has trained: so step 1 can only train if groups that are done train while the
SLOW group is still generating (a windowed buffer would wait for it forever). The SLOW group then trains within
the bound, every prompt trains exactly once, and both servers' producers fed the windows."""

from __future__ import annotations

import json
import os
import textwrap
from collections import defaultdict

import pytest
from cli_process import run_grpokit
from support import flags, write_jsonl
from test_server_support import rollout_server

pytestmark = pytest.mark.slow

PLUGIN = textwrap.dedent('''
    """The gate of tests/integration/test_stream_groups.py: a scheduler for the servers, a callback for the trainer."""
    import asyncio
    import os
    from pathlib import Path

    from grpokit.rewards import orms
    from grpokit.rollout.multi_turn import MultiTurnScheduler, multi_turns
    from grpokit.trainers.callbacks import TrainerCallback, callbacks_map

    GATE = Path(os.environ["STREAM_GATE"])


    @multi_turns.register("gated")
    class Gated(MultiTurnScheduler):
        """One turn; a SLOW prompt's trajectories wait until the gate file exists."""

        async def on_trajectory_start(self, requests):
            for r in requests:
                while "SLOW" in r.messages[-1]["content"] and not GATE.exists():
                    await asyncio.sleep(0.05)

        def check_finished(self, infer_request, response_choice, current_turn):
            return True


    class OpenGate(TrainerCallback):
        """Opens the gate after step 1, noting which prompts had trained by then."""

        def on_step_end(self, trainer):
            if trainer.state.global_step == 1:
                GATE.write_text("open")


    orms["stream_even_length"] = lambda completions, **kw: [float(len(c) % 2 == 0) for c in completions]
    callbacks_map["stream_open_gate"] = OpenGate
''')

PROMPTS, PER_STEP, GENERATIONS = 12, 2, 2


def test_a_group_that_is_done_trains_while_another_still_generates(tiny_model_dir, tmp_path):
    plugin = tmp_path / "gate_plugin.py"
    plugin.write_text(PLUGIN)
    rows = [{"query": f"{'SLOW ' if i == 0 else ''}what is {i} + 1?", "solution": str(i + 1)} for i in range(PROMPTS)]
    data = write_jsonl(tmp_path / "prompts.jsonl", rows)
    env = {**os.environ, "STREAM_GATE": str(tmp_path / "gate"), "OMP_NUM_THREADS": "1"}
    served = ("--torch_dtype", "float32", "--external_plugins", str(plugin), "--multi_turn_scheduler", "gated")
    out = tmp_path / "run"
    with (
        rollout_server(tiny_model_dir, tmp_path, *served, env=env) as first,
        rollout_server(tiny_model_dir, tmp_path, *served, env=env) as second,
    ):
        res = run_grpokit(
            flags(
                "train",
                {"--model": tiny_model_dir},
                "--tuner_type full",
                {"--dataset": data},
                "--dataset_shuffle false",
                {"--output_dir": out, "--external_plugins": plugin},
                "--reward_funcs stream_even_length --callbacks stream_open_gate --vllm_mode server",
                "--vllm_server_host 127.0.0.1 127.0.0.1",
                {"--vllm_server_port": first.port},
                str(second.port),
                "--vllm_server_timeout 60 --max_staleness 2 --stream_groups true",
                {"--num_generations": GENERATIONS, "--per_device_train_batch_size": PER_STEP * GENERATIONS},
                "--num_train_epochs 1 --max_completion_length 8 --torch_dtype float32 --log_completions true",
                "--logging_steps 1 --disable_tqdm true --plots false --save_final_model false",
            ),
            env=env,
            timeout=180,
        )
    assert res.returncode == 0, res.stderr[-3000:]
    logs = [json.loads(line) for line in (out / "logging.jsonl").read_text().splitlines() if '"loss"' in line]
    completions = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    steps_of = defaultdict(set)
    for r in completions:
        steps_of[int(r["group"])].add(r["step"])
    assert sorted(steps_of) == list(range(PROMPTS)) and all(len(s) == 1 for s in steps_of.values()), steps_of
    first_step = {g for g, s in steps_of.items() if s == {1}}
    assert len(first_step) == PER_STEP and 0 not in first_step  # step 1 trained groups drawn after the SLOW one
    assert steps_of[0] <= {2, 3}  # and the SLOW group within K = 2 steps of the weights it began on
    assert logs[0]["async/groups_overtaken"] == PER_STEP
    assert all(r["async/staleness_max"] <= 2 for r in logs)
    assert all(sum(r[f"async/producer{i}_groups"] for r in logs) > 0 for i in (0, 1))  # both servers fed the windows
