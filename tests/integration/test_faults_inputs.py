"""Faults and bad inputs that real runs meet, judged from outside the process (issue 27): rewards that hang, exit
or overflow float32, a run that diverges to NaN, bad data files, broken model folders, and a 10 MB row under a
6 GiB address-space limit. Each case is a real ``python -m grpokit train`` subprocess on the tiny model; a user
error must end it with a non-zero exit, exactly one ``grpokit: error:`` line (the last thing on stderr) and no
traceback.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from cli_process import run_grpokit
from support import flags

pytestmark = pytest.mark.slow

PLUGIN = textwrap.dedent("""
    import asyncio
    import sys
    import threading

    from grpokit.rewards import orms


    def spread(completions, **kwargs):          # a reward with signal, so that a huge learning rate diverges
        return [float(sum(map(ord, c)) % 7) for c in completions]


    def hangs(completions, **kwargs):           # a remote judge that never answers
        threading.Event().wait(3600)
        return [0.0] * len(completions)


    async def hangs_async(completions, **kwargs):
        await asyncio.sleep(3600)
        return [0.0] * len(completions)


    def exits(completions, **kwargs):
        sys.exit(0)


    def huge(completions, **kwargs):
        return [1e39] * len(completions)


    def wanders(completions, **kwargs):         # leaves servers behind and moves to another directory
        import os, subprocess, tempfile
        pids = os.environ["GRPOKIT_TEST_PIDS"]
        subprocess.run(["sh", "-c", f"sleep 300 > /dev/null & echo $! >> {pids}"], check=True)
        subprocess.run(["setsid", "sh", "-c", f"sleep 301 > /dev/null & echo $! >> {pids}"], check=True)
        os.chdir(tempfile.mkdtemp())
        return [0.0] * len(completions)


    orms.update(spread=spread, hangs=hangs, hangs_async=hangs_async, exits=exits, huge=huge, wanders=wanders)
""")

GOOD_ROW = {"query": "What is 1 + 1?", "solution": "2"}


def visible_lines(stderr: str) -> list[str]:
    """The non-empty lines a terminal shows (a carriage return overwrites the start of its line)."""
    return [s for s in (line.rsplit("\r", 1)[-1].strip() for line in stderr.split("\n")) if s]


def train(
    model: Path, out: Path, extra: list[str], *, prefix: list[str] | None = None, timeout: float = 300,
    cwd: Path | None = None,
) -> subprocess.CompletedProcess:  # fmt: skip
    args = flags(
        "--model",
        str(model),
        "--tuner_type full --dataset builtin:countdown#8",
        "--output_dir",
        str(out),
        "--num_generations 2 --per_device_train_batch_size 2 --max_completion_length 4",
        "--max_steps 1 --beta 0 --torch_dtype float32 --save_final_model false",
        "--plots false",
        *extra,
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if not prefix:  # a process forked from the test process's zygote (cli_process.py): no interpreter start-up
        return run_grpokit(["train", *args], env=env, timeout=timeout, cwd=str(cwd) if cwd else None)
    return subprocess.run(
        [*prefix, sys.executable, "-m", "grpokit", "train", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def assert_one_error_line(res: subprocess.CompletedProcess, *needles: str) -> str:
    assert res.returncode not in (0, None), (res.returncode, res.stderr[-3000:])
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    lines = visible_lines(res.stderr)
    errors = [line for line in lines if line.startswith("grpokit: error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0], res.stderr[-3000:]
    for needle in needles:
        assert needle in errors[0], (needle, errors[0])
    return errors[0]


@pytest.fixture(scope="module")
def plugin(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("faults_plugin") / "fault_rewards.py"
    path.write_text(PLUGIN)
    return path


# --- rewards ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("reward", ["hangs", "hangs_async"])
def test_a_hanging_reward_is_cut_off_by_reward_timeout(reward, tiny_model_dir, plugin, tmp_path):
    t0 = time.monotonic()
    res = train(
        tiny_model_dir,
        tmp_path / "out",
        ["--external_plugins", str(plugin), "--reward_funcs", reward, "--reward_timeout", "2"],
    )
    assert_one_error_line(res, f"reward {reward!r} timed out after 2 s (--reward_timeout 2)")
    assert time.monotonic() - t0 < 200  # the reward would hang for an hour


def test_what_a_reward_starts_ends_with_the_run_and_its_chdir_moves_no_run_file(
    tiny_model_dir, plugin, tmp_path, monkeypatch
):
    pids = tmp_path / "pids"
    monkeypatch.setenv("GRPOKIT_TEST_PIDS", str(pids))
    extra = ["--external_plugins", str(plugin), "--reward_funcs", "wanders"]
    res = train(tiny_model_dir, Path("out"), extra, cwd=tmp_path)  # a relative --output_dir
    assert res.returncode == 0, res.stderr[-3000:]
    assert (tmp_path / "out" / "logging.jsonl").is_file()
    found = [int(p) for p in pids.read_text().split()]
    assert len(found) >= 2
    assert not [p for p in found if Path(f"/proc/{p}").exists()]  # killed and reaped by the run's end


def test_sys_exit_in_a_reward_is_a_reward_error_not_a_clean_exit(tiny_model_dir, plugin, tmp_path):
    res = train(
        tiny_model_dir,
        tmp_path / "out",
        flags({"--external_plugins": plugin}, "--reward_funcs exits --max_steps 2 --save_final_model true"),
    )
    assert_one_error_line(res, "reward 'exits' raised SystemExit: exit status 0; a reward must return scores")
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_a_score_beyond_float32_is_refused(tiny_model_dir, plugin, tmp_path):
    res = train(tiny_model_dir, tmp_path / "out", ["--external_plugins", str(plugin), "--reward_funcs", "huge"])
    assert_one_error_line(res, "reward 'huge': sample 0 got score 1e+39 (beyond float32's range")


# --- NaN --------------------------------------------------------------------------------------------------------------

DIVERGE = flags(
    "--reward_funcs spread --num_generations 4 --per_device_train_batch_size 4 --max_completion_length 8",
    "--learning_rate 1e10 --max_steps 6",
)


def steps_logged(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "logging.jsonl").read_text().splitlines()]


def test_a_diverged_run_skips_nonfinite_steps_then_stops_with_one_line(tiny_model_dir, plugin, tmp_path):
    res = train(
        tiny_model_dir, tmp_path / "out", ["--external_plugins", str(plugin), *DIVERGE, "--max_nonfinite_steps", "2"]
    )
    err = assert_one_error_line(
        res, "non-finite", "in 2 optimizer steps in a row (--max_nonfinite_steps 2)", "lower --learning_rate"
    )
    skipped = [line for line in visible_lines(res.stderr) if "optimizer step skipped, weights unchanged" in line]
    assert len(skipped) == 1, res.stderr[-3000:]  # the first of the two; the second is the error
    assert "IndexError" not in res.stderr and err


def test_a_run_with_nonfinite_steps_trains_on_when_the_limit_allows(tiny_model_dir, plugin, tmp_path):
    out = tmp_path / "out"
    res = train(tiny_model_dir, out, ["--external_plugins", str(plugin), *DIVERGE, "--max_nonfinite_steps", "100"])
    assert res.returncode == 0, res.stderr[-3000:]
    assert "Traceback" not in res.stderr
    rows = steps_logged(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]  # every step counted, skipped or not
    skipped = [line for line in visible_lines(res.stderr) if "optimizer step skipped" in line]
    assert skipped and len(skipped) == sum(1 for r in rows if r.get("grad_norm") != r.get("grad_norm"))


# --- data -------------------------------------------------------------------------------------------------------------

DATA = {
    "malformed jsonl line": (
        "d.jsonl",
        (json.dumps(GOOD_ROW) + "\n" + '{"query": "x", "solution": 2\n').encode(),
        ["line 2 (row 1) column 29 is not valid JSON (Expecting ',' delimiter"],
    ),
    "duplicate json keys": (
        "d.jsonl",
        (json.dumps(GOOD_ROW) + '\n{"query": "a", "query": "b", "solution": "1"}\n').encode(),
        ["line 2 (row 1) has a duplicate key 'query'"],
    ),
    "non-utf-8 bytes": (
        "d.jsonl",
        json.dumps(GOOD_ROW).encode() + b'\n{"query": "caf\xe9", "solution": "1"}\n',
        ["line 2 is not UTF-8"],
    ),
    "lone surrogate escape": (
        "d.jsonl",
        (json.dumps(GOOD_ROW) + '\n{"query": "1 + \\ud800?", "solution": "2"}\n').encode(),
        ["line 2 (row 1) column 16 holds \\ud800, a lone UTF-16 surrogate"],
    ),
    "unknown role": (
        "d.jsonl",
        json.dumps({"messages": [{"role": "usr", "content": "1 + 1?"}], "solution": "2"}).encode() + b"\n",
        ["row 0: column 'messages': unknown role 'usr'"],
    ),
    "duplicate csv header": (
        "d.csv",
        b"query,solution,solution\n1 + 1?,2,3\n",
        ["the header (line 1) names column 'solution' twice"],
    ),
}


@pytest.mark.parametrize("case", list(DATA))
def test_bad_data_is_one_line_naming_the_row(case, tiny_model_dir, tmp_path):
    name, content, needles = DATA[case]
    path = tmp_path / name
    path.write_bytes(content)
    assert_one_error_line(
        train(tiny_model_dir, tmp_path / "out", ["--dataset", str(path)]), f"--dataset {str(path)!r}: ", *needles
    )


def test_a_10_mb_row_under_a_6_gib_address_space_ends_with_one_line(tiny_model_dir, tmp_path):
    if shutil.which("prlimit") is None:
        pytest.skip("util-linux prlimit is not installed")
    path = tmp_path / "big.jsonl"
    big = {"query": "word " * (2 << 20), "solution": "1"}  # 10 MiB on one line
    path.write_text(json.dumps(GOOD_ROW) + "\n" + json.dumps(big) + "\n")
    res = train(tiny_model_dir, tmp_path / "out", ["--dataset", str(path)], prefix=["prlimit", f"--as={6 << 30}"])
    assert_one_error_line(res, "line 2 is longer than --max_row_bytes 8388608 (8.0 MiB)")
    assert "MemoryError" not in res.stderr and res.returncode != -9


def test_a_prompt_past_the_context_is_cut_with_a_count(tiny_model_dir, tmp_path):
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps(GOOD_ROW) + "\n" + json.dumps({"query": "word " * 3000, "solution": "1"}) + "\n")
    res = train(tiny_model_dir, tmp_path / "out", ["--dataset", str(path)])
    assert res.returncode == 0, res.stderr[-3000:]
    assert "prompts are bounded to 1020 tokens (the model's context 1024 minus --max_completion_length 4)" in res.stdout
    assert "1 of 2 prompts are longer than --max_length 1020 tokens and will be cut on the left" in res.stderr


def test_a_completion_past_the_context_is_refused(tiny_model_dir, tmp_path):
    res = train(tiny_model_dir, tmp_path / "out", ["--max_completion_length", "2000"])
    assert_one_error_line(res, "--max_completion_length 2000: the model", "max_position_embeddings 1024")


# --- model folders ----------------------------------------------------------------------------------------------------


def broken_copy(src: Path, tmp_path: Path, how: str) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(src, folder)
    if how == "no tokenizer":
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (folder / name).unlink()
    elif how == "truncated weights":
        weights = folder / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 3])
    elif how == "bad config":
        (folder / "config.json").write_text('{"model_type": "qwen3",')
    return folder


@pytest.mark.parametrize(
    "how, needle",
    [
        ("no tokenizer", "the folder has no tokenizer (none of tokenizer.json, "),
        ("truncated weights", "cannot load model.safetensors (truncated or not a safetensors file) (SafetensorError: "),
        ("bad config", ": cannot load config.json ("),
    ],
)
def test_a_broken_model_folder_is_one_line_naming_the_file(how, needle, tiny_model_dir, tmp_path):
    folder = broken_copy(tiny_model_dir, tmp_path, how)
    assert_one_error_line(train(folder, tmp_path / "out", []), str(folder), needle)


def test_a_hub_id_without_network_fails_at_once(tiny_model_dir, tmp_path):
    t0 = time.monotonic()
    res = train(Path("Qwen/Qwen3-0.6B-no-such-folder"), tmp_path / "out", [])
    assert_one_error_line(res, "--model Qwen/Qwen3-0.6B-no-such-folder: no such local folder")
    assert time.monotonic() - t0 < 40  # today: 49 s of retries before the first word


def test_a_sequence_classification_checkpoint_is_warned_about(tiny_rm_dir, tmp_path):
    res = train(tiny_rm_dir, tmp_path / "out", [])
    assert res.returncode == 0, res.stderr[-3000:]
    warned = [line for line in visible_lines(res.stderr) if "not a causal language model" in line]
    assert len(warned) >= 1 and "ForSequenceClassification" in warned[0], res.stderr[-3000:]
