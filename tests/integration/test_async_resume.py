"""The fault matrix of issue 33: a run killed with SIGKILL at chosen points, resumed with
``--resume_from_checkpoint latest`` each time, then let finish, trains every prompt of the epoch exactly once,
in sync mode (K = 0), with --max_staleness 1, with --max_staleness 2, with --max_staleness 2 and
--partial_rollouts true (longer completions, so that weight updates interrupt rows), and with --max_staleness 2
and --stream_groups true (the buffer holds groups: "full" is K groups ready), all against one rollout server.

One run per mode, killed at successive points (each launch dies at one point, the next resumes and dies at the
next), then a last launch that finishes the epoch (24 prompts, 2 per step: 12 steps, a checkpoint every 2):

=============  =====================================================================  ====  =====  =====
point          where the process dies                                                  sync  K = 1  K = 2
=============  =====================================================================  ====  =====  =====
generating     inside the reward function (in the producer thread when K ≥ 1)          x     x      x
full buffer    after step 4's checkpoint, once the producer has K windows ready              x      x
mid-step       between backward and the optimizer step (on_pre_optimizer_step)         x     x      x
saving         checkpoint-6.tmp written, not sealed (before finish_checkpoint)         x     x      x
saved          right after checkpoint-8 is sealed (on_save)                            x     x      x
between steps  after step 9, which has no checkpoint (on_step_end)                     x     x      x
=============  =====================================================================  ====  =====  =====

With partial rollouts, a window in flight at a kill may hold rows paused and continued across a weight update;
nothing of it is saved (it is pending), and the resumed run rolls it out again whole.

The check, on the last launch's outputs: completions.jsonl has steps 1..12, each with 2 prompts × 4 rows; every
stream position 0..23 (``group``) and every dataset prompt is trained in exactly one step, with its 4 rows; and
with K ≥ 1 no row is older than K steps (``step - 1 - weight_version``). The kills come from the plugin below:
the test tells each launch where to die through the environment, and the plugin says where it died in a file.
"""

from __future__ import annotations

import json
import os
import textwrap
import time
from collections import Counter, defaultdict
from pathlib import Path
from types import SimpleNamespace

import pytest
from cli_process import run_grpokit
from support import flags, write_jsonl
from test_server_support import rollout_server

pytestmark = pytest.mark.slow

PLUGIN = textwrap.dedent('''
    """Kills its own process (SIGKILL) at the point RESUME_KILL names ("KIND:N"), after writing to RESUME_NOTE
    where it was; for tests/integration/test_async_resume.py."""
    import os
    import signal
    import threading
    import time
    from pathlib import Path

    from transformers import TrainerCallback as HFCallback

    import grpokit.runs.run_outputs as run_outputs
    from grpokit.rewards import ORM, orms
    from grpokit.trainers.callbacks import TrainerCallback, callbacks_map

    KIND, _, AT = os.environ.get("RESUME_KILL", "none:0").partition(":")
    AT = int(AT)


    def die(where):
        Path(os.environ["RESUME_NOTE"]).write_text(where)
        os.kill(os.getpid(), signal.SIGKILL)


    class EvenLength(ORM):
        """A 0/1 reward a random model earns about half the time; "reward:N" dies in its N-th call."""
        calls = 0

        def __call__(self, completions, **kwargs):
            EvenLength.calls += 1
            if KIND == "reward" and EvenLength.calls == AT:
                die(f"reward call {AT} on {threading.current_thread().name}")
            return [float(len(c) % 2 == 0) for c in completions]


    class Kill(TrainerCallback):
        """"step_end:N": after step N; "saved:N": once checkpoint-N is sealed; "full:N": after step N (its
        checkpoint saved), once the producer has filled the buffer (the loop waits here, the producer does not)."""

        def on_step_end(self, trainer):
            step = trainer.state.global_step
            if KIND == "step_end" and step == AT:
                die(f"after step {step}")
            if KIND == "full" and step == AT:
                buffer, deadline = trainer._async, time.monotonic() + 60
                while len(buffer._ready) < buffer.depth:
                    assert time.monotonic() < deadline, "the producer never filled the buffer"
                    time.sleep(0.01)
                die(f"after step {step}, {len(buffer._ready)} windows ready, pending {buffer.pending()}")

        def on_save(self, trainer, checkpoint_dir):
            if KIND == "saved" and trainer.state.global_step == AT:
                die(f"after {Path(checkpoint_dir).name} was sealed")


    class KillMidStep(HFCallback):
        """"mid_step:N": in optimizer step N, after its backward and before the optimizer steps."""

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            if KIND == "mid_step" and state.global_step + 1 == AT:
                die(f"inside step {AT}, before the optimizer step")


    _finish_checkpoint = run_outputs.finish_checkpoint


    def finish_checkpoint(tmp, ckpt, loop):
        """"saving:N": checkpoint-N.tmp holds every file but the state file that seals it."""
        if KIND == "saving" and loop["global_step"] == AT:
            die(f"saving {Path(ckpt).name}: {sorted(p.name for p in Path(tmp).iterdir())} in {Path(tmp).name}")
        return _finish_checkpoint(tmp, ckpt, loop)


    run_outputs.finish_checkpoint = finish_checkpoint
    orms["resume_even_length"] = EvenLength
    callbacks_map["resume_kill"] = Kill
    callbacks_map["resume_kill_mid_step"] = KillMidStep
''')

PROMPTS, PER_STEP, GENERATIONS = 24, 2, 4
STEPS = PROMPTS // PER_STEP
# (RESUME_KILL, what the note must say): one launch each, in order; the last one finishes the epoch
SYNC_POINTS = [
    ("reward:3", "on MainThread"),
    ("mid_step:5", "inside step 5"),
    ("saving:6", "saving checkpoint-6"),
    ("saved:8", "after checkpoint-8 was sealed"),
    ("step_end:9", "after step 9"),
]
ASYNC_POINTS = [("reward:3", "on grpokit-rollout"), ("full:4", "windows ready")] + SYNC_POINTS[1:]
MODES = {
    "sync": (0, SYNC_POINTS, []),
    "k1": (1, ASYNC_POINTS, []),
    "k2": (2, ASYNC_POINTS, []),
    "k2_partial": (2, ASYNC_POINTS, ["--partial_rollouts", "true", "--max_completion_length", "96"]),
    "k2_groups": (2, ASYNC_POINTS, ["--stream_groups", "true"]),  # pending: single prompts, not windows
}
TIMES: dict[str, list[float]] = {}


@pytest.fixture(scope="module")
def setup(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("async_resume")
    rows = [{"query": f"Q{i}: what is {i} + {i % 5}?", "solution": str(i + i % 5)} for i in range(PROMPTS)]
    data = write_jsonl(root / "prompts.jsonl", rows)
    plugin = root / "resume_plugin.py"
    plugin.write_text(PLUGIN)
    t0 = time.perf_counter()
    with rollout_server(tiny_model_dir, root, "--torch_dtype", "float32") as server:
        TIMES["server start"] = [time.perf_counter() - t0]
        yield SimpleNamespace(
            root=root,
            model=tiny_model_dir,
            data=data,
            plugin=plugin,
            port=server.port,
            queries=[r["query"] for r in rows],
        )
    print(
        "\ntest_async_resume timings (s): "
        + "; ".join(f"{name}: {sum(t):.1f} ({' '.join(f'{x:.1f}' for x in t)})" for name, t in TIMES.items())
    )


def _args(s: SimpleNamespace, out: Path, k: int, extra: list[str]) -> list[str]:
    return flags(
        "train",
        {"--model": s.model},
        "--tuner_type full",
        {"--dataset": s.data, "--output_dir": out, "--external_plugins": s.plugin},
        "--reward_funcs resume_even_length --callbacks resume_kill resume_kill_mid_step --vllm_mode server",
        "--vllm_server_host 127.0.0.1",
        {"--vllm_server_port": s.port},
        "--vllm_server_timeout 60",
        {"--max_staleness": k, "--num_generations": GENERATIONS},
        {"--per_device_train_batch_size": PER_STEP * GENERATIONS},
        "--num_train_epochs 1 --max_completion_length 8 --learning_rate 1e-3 --torch_dtype float32 --seed 5",
        "--save_steps 2 --log_completions true --logging_steps 1 --disable_tqdm true --plots false",
        "--save_final_model false --resume_from_checkpoint latest",
        *extra,
    )


def _launch(s, out: Path, k: int, kill: str, mode: str, extra: list[str]):
    note = out.parent / f"{out.name}-note"
    note.unlink(missing_ok=True)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "RESUME_KILL": kill,
        "RESUME_NOTE": str(note),
    }
    t0 = time.perf_counter()
    res = run_grpokit(_args(s, out, k, extra), env=env, timeout=180)  # a forked process (cli_process.py)
    TIMES.setdefault(mode, []).append(time.perf_counter() - t0)
    return res, note.read_text() if note.exists() else None


def _pending(out: Path) -> list[int]:
    """The pending windows of the newest checkpoint (what the next launch draws again first)."""
    newest = max(out.glob("checkpoint-[0-9]*"), key=lambda p: int(p.name.split("-")[1]))
    return json.loads((newest / "trainer_state.json").read_text())["prompts_pending"]


@pytest.mark.parametrize("mode", list(MODES))
def test_killed_at_every_point_trains_each_prompt_once(setup, mode):
    k, points, extra = MODES[mode]
    out = setup.root / mode
    for kill, where in points:
        res, note = _launch(setup, out, k, kill, mode, extra)
        assert res.returncode == -9 and note is not None, (kill, res.returncode, res.stderr[-3000:])
        assert where in note, (kill, note)
        if k and kill.split(":")[0] in ("full", "saved"):  # killed with windows rolled out ahead, pending
            assert _pending(out), (kill, note)
    _assert_each_prompt_once(setup, out, k, mode, extra)


# --staleness_policy drop, uninterrupted: a dropped window (group) is rolled out again and trained before any
# window drawn after it, so the epoch's steps train the epoch's prompts, each once
DROP_MODES = {
    "drop_k1": (1, ["--staleness_policy", "drop"]),
    "drop_k1_groups": (1, ["--staleness_policy", "drop", "--stream_groups", "true"]),
}


@pytest.mark.parametrize("mode", list(DROP_MODES))
def test_dropped_windows_train_before_later_ones(setup, mode):
    k, extra = DROP_MODES[mode]
    logs = _assert_each_prompt_once(setup, setup.root / mode, k, mode, extra)
    assert sum(r["async/dropped"] for r in logs if "loss" in r) > 0  # windows were dropped and drawn again


def _assert_each_prompt_once(setup, out: Path, k: int, mode: str, extra: list[str]) -> list[dict]:
    """A last launch that finishes the epoch: steps 1..12 each trained 2 whole groups, every stream position and
    every dataset prompt in exactly one step; with K ≥ 1 no row older than K steps. Returns logging.jsonl."""
    res, note = _launch(setup, out, k, "none:0", mode, extra)
    assert res.returncode == 0 and note is None, res.stderr[-3000:]
    assert "Traceback" not in res.stderr, res.stderr[-3000:]

    logs = [json.loads(line) for line in (out / "logging.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logs if "loss" in r] == list(range(1, STEPS + 1))
    rows = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert Counter(r["step"] for r in rows) == {step: PER_STEP * GENERATIONS for step in range(1, STEPS + 1)}
    steps_of, prompts_of = defaultdict(list), defaultdict(list)
    for r in rows:
        steps_of[r["group"]].append(r["step"])
        prompts_of[r["prompt"]].append(r["step"])
    expected = {str(p) for p in range(PROMPTS)}  # the epoch's stream positions
    assert set(steps_of) == expected, (
        f"missing {sorted(expected - set(steps_of), key=int)}, "
        f"not of the epoch {sorted(set(steps_of) - expected, key=int)}"
    )
    for table in (steps_of, prompts_of):  # each position, and each dataset prompt, trained in one step, whole
        twice = {key: steps for key, steps in table.items() if len(steps) != GENERATIONS or len(set(steps)) != 1}
        assert not twice, twice
    assert sorted(prompts_of) == sorted(setup.queries)
    if "--stream_groups" not in extra:  # windows train in the order they were drawn: step s trains window s - 1
        order = {
            step: sorted(int(g) for g, steps in steps_of.items() if steps[0] == step) for step in range(1, STEPS + 1)
        }
        assert all(order[s] == [PER_STEP * (s - 1) + i for i in range(PER_STEP)] for s in order), order
    if k:
        ages = [r["step"] - 1 - r["weight_version"] for r in rows]
        assert 0 <= min(ages) and max(ages) <= k, ages
    if "--partial_rollouts" in extra:  # weight updates did interrupt rows, which then trained
        assert sum(r.get("async/partial_trajectories", 0) for r in logs) > 0, logs
    return logs
