"""The ports of ms-swift's GRPO example scripts (examples/ms-swift/*.sh), each read as written by bash with
``MODEL``, ``DATASET`` (a local jsonl in the hub dataset's columns), ``HOST``, ``PORT``, ``PLUGIN``, ``EXAMPLES`` set.

Every port's ``grpokit train`` command line is parsed and validated in this process and its whole set-up runs
(plugins, datasets, the policy and reference models, DeepSpeed, the engine or the connection to the rollout server,
reward functions and reward models, the trainer), stopping where training would start (``set_up_only``). Three
ports (``TRAINED``) also train 2 steps end to end as the user runs them: bash, with ``grpokit`` this interpreter's
``python -m grpokit``. A ``grpokit rollout`` line inside a port is skipped: the test starts that server itself (one
per configuration, shared by the ports that use it), with the port's server options less the GPU-only ones
(listed in SERVERS).

Without vLLM installed (CI), ``--use_vllm true`` in colocate mode is read as ``--use_vllm false``: the one
substitution the test makes, since the in-process transformers engine samples the same policy; the vllm-marked
tests (tests/vllm) cover the vLLM engine itself. Server-mode ports keep it (the server is grpokit's). A port's
``--report_to`` (trackers not installed here) and ``--eval_steps`` (no validation data) stay: ms-swift makes them
moot here, and grpokit warns once at start-up and trains, as the set-up test checks.

``PLUGIN`` is tests/integration/swift_style_plugin.py with its imports renamed (third_party.py), except where
PLUGINS names grpokit's own.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support import write_jsonl
from test_server_support import rollout_server
from third_party import swift_plugin

from grpokit.config.moot import installed_trackers
from grpokit.server.cli import vllm_installed
from grpokit.testing import build_tiny_model
from grpokit.testing_vlm import build_tiny_vlm

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples" / "ms-swift"
PORTS = sorted(p.name for p in EXAMPLES.glob("*.sh"))
PLUGINS = {"plugin_gsm8k.sh": EXAMPLES / "plugin" / "gsm8k_plugin.py"}  # others: the swift-style plugin (third_party)
HAS_VLLM = vllm_installed()  # not find_spec alone: under pytest tests/vllm is a namespace package named vllm

# dataset rows in the columns of the hub datasets the scripts name
NUMINA = [
    {"problem": f"What is {a} + {b}?", "solution": f"The answer is $\\boxed{{{a + b}}}$."}
    for a in range(1, 5)
    for b in range(1, 5)
]
GSM8K = [
    {
        "question": f"Tom has {a} apples and buys {b} more. How many apples does he have?",
        "answer": f"{a} + {b} = {a + b}\n#### {a + b}",
    }
    for a in range(1, 5)
    for b in range(1, 5)
]
# xlam-function-calling-60k's `grpo` subset, as ms-swift's preprocessor delivers it: the raw columns plus `solution`,
# one of the answers written as the ReAct call the toolbench reward compares with
XLAM = [
    {
        "query": f"What is the weather in city {i}?",
        "tools": json.dumps(
            [
                {
                    "name": "get_weather",
                    "description": "weather of a city",
                    "parameters": {"city": {"type": "str", "description": "city name"}},
                }
            ]
        ),
        "answers": json.dumps([{"name": "get_weather", "arguments": {"city": f"city {i}"}}]),
        "solution": f'Action: get_weather\nAction Input: {{"city": "city {i}"}}',
    }
    for i in range(16)
]
DATASETS = {"plugin_gsm8k.sh": GSM8K, "external_agent.sh": XLAM}  # others: NUMINA
# ports of vision-language scripts: a tiny Qwen2-VL, and rows in the columns of the image datasets they name
VLM_PORTS = {"plugin_run_external_reward_func.sh"}


def clevr_rows(folder: Path) -> list[dict]:
    """Rows shaped like clevr_cogen_a_train's (problem, one image, an <answer> solution), with small PNGs."""
    from PIL import Image

    rows = []
    for k in range(16):
        path = folder / f"clevr_{k}.png"
        Image.new("RGB", (16, 16), ((60 * k) % 256, (90 * k) % 256, 128)).save(path)
        rows.append(
            {
                "problem": "How many objects are in the picture?",
                "images": [str(path)],
                "solution": f"<answer> {k % 5} </answer>",
            }
        )
    return rows


# server options per port that needs one (the port's commented `swift rollout` command, ms-swift names); dropped
# on CPU: --vllm_gpu_memory_utilization (GPU memory; the transformers engine refuses it), --vllm_tensor_parallel_size
# and --data_parallel_size (several GPUs)
PLAIN = ()
SERVERS = {
    "external_grpo_7b.sh": PLAIN,
    "external_grpo_32b_full.sh": PLAIN,
    "external_agent.sh": PLAIN,
    "internal_real.sh": PLAIN,
    "external_moe_full.sh": ("--vllm_max_model_len", "1024", "--vllm_enable_prefix_caching", "true"),
    "external_moe_lora.sh": ("--vllm_max_model_len", "1024", "--vllm_enable_prefix_caching", "true"),
    "external_vllm_gym.sh": (
        "--max_turns",
        "3",
        "--multi_turn_scheduler",
        "gym_scheduler",
        "--use_gym_env",
        "true",
        "--gym_env",
        "math_env",
    ),
    "external_vllm_multi_turn.sh": (
        "--vllm_use_async_engine",
        "true",
        "--multi_turn_scheduler",
        "thinking_tips_scheduler",
        "--vllm_max_model_len",
        "1024",
        "--max_turns",
        "3",
    ),
    "plugin_run_external_scheduler.sh": (
        "--vllm_use_async_engine",
        "true",
        "--external_plugins",
        "{plugin}",
        "--multi_turn_scheduler",
        "tool_call_scheduler",
        "--vllm_max_model_len",
        "1024",
        "--max_turns",
        "5",
    ),
}

# The ports trained end to end, chosen so that together they take the most paths the others only set up:
# - external_vllm_multi_turn.sh: server mode with the multi-turn loop inside the server (thinking_tips_scheduler on
#   the async engine), a plugin reward that reads every round (trajectory_inputs), ZeRO-2, sequence-level IS,
#   steps_per_generation 8 (several optimizer steps per window);
# - plugin_run_external_reward_func.sh: a vision-language model with images through the in-process engine,
#   ZeRO-1, model offload between phases, clip-higher and token-level IS;
# - internal_chord.sh: CHORD's SFT loss mixed in from a second dataset, ZeRO-3, offload, colocate rollout.
# GRPOKIT_TRAIN_ALL_PORTS=1 trains every port 2 steps instead (a few minutes on 2 cores; CI trains these three)
TRAINED = ("external_vllm_multi_turn.sh", "plugin_run_external_reward_func.sh", "internal_chord.sh")
if os.environ.get("GRPOKIT_TRAIN_ALL_PORTS") == "1":
    TRAINED = tuple(PORTS)


def _script(name: str, script: str | None = None) -> str:
    """The port as written, with one change for this machine: vLLM colocate off without vLLM. The trackers the
    ports name (tensorboard, wandb, swanlab) are kept though none is installed here: each run warns once and
    reports to logging.jsonl (grpokit/config/moot.py)."""
    script = (EXAMPLES / name).read_text() if script is None else script
    if not HAS_VLLM and "--vllm_mode colocate" in script:
        script = script.replace("--use_vllm true", "--use_vllm false")
    return script


def _run_port(name: str, env: dict, cwd: Path, script: str | None = None) -> subprocess.CompletedProcess:
    """The port as the user runs it: bash, each ``grpokit train`` a ``python -m grpokit`` process."""
    prelude = (
        f'grpokit() {{ if [ "$1" = rollout ]; then echo "(server started by the test)"; return 0; fi; '
        f'"{sys.executable}" -m grpokit "$@"; }}\nset -e\n'
    )
    return subprocess.run(
        ["bash", "-c", prelude + _script(name, script)], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )


def _train_argv(name: str, env: dict, cwd: Path, script: str | None = None) -> list[str]:
    """The options of the port's one ``grpokit train`` line, as bash expands them (quotes, variables, defaults)."""
    argv_file = cwd / "train_argv"
    prelude = (
        'grpokit() { if [ "$1" = rollout ]; then return 0; fi; '
        'if [ "$1" != train ] || [ -e "$ARGV_FILE" ]; then echo "not one grpokit train: $1" >&2; return 2; fi; '
        'shift; printf "%s\\0" "$@" > "$ARGV_FILE"; }\nset -e\n'
    )
    run = subprocess.run(
        ["bash", "-c", prelude + _script(name, script)],
        cwd=cwd,
        env={**env, "ARGV_FILE": str(argv_file)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0 and argv_file.exists(), f"{name}: {run.stderr[-2000:]}"
    return argv_file.read_text().split("\0")[:-1]


@contextlib.contextmanager
def set_up_only(monkeypatch):
    """run_train with everything but the training: the trainer class's train() records the trainer it was called
    on and returns. What a set-up holds for the run (a one-process DeepSpeed group, a server connection) is
    released afterwards, as the end of a run releases it."""
    from grpokit.trainers.factory import TrainerFactory

    built: list = []
    monkeypatch.setattr(TrainerFactory.get_trainer_cls("grpo"), "train", lambda self: built.append(self))
    try:
        yield built
    finally:
        for trainer in built:
            close = getattr(trainer.engine, "close", None)
            if getattr(trainer.engine, "engine_type", "") == "server" and close is not None:
                close()
            trainer.process_group.release()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("swift_models")
    return {
        "policy": build_tiny_model(root / "policy"),
        "rm": build_tiny_model(root / "rm", seq_cls=True),
        "vlm": build_tiny_vlm(root / "vlm", "qwen2_vl"),
    }


@pytest.fixture(scope="module")
def servers(models, tmp_path_factory):
    """One rollout server per distinct option set, started on first use and shared."""
    log_dir = tmp_path_factory.mktemp("swift_servers")
    running: dict[tuple, object] = {}
    with contextlib.ExitStack() as stack:

        def get(options: tuple[str, ...]):
            if options not in running:
                running[options] = stack.enter_context(rollout_server(models["policy"], log_dir, *options))
            return running[options]

        yield get


def _port_env(name, models, servers, cwd: Path, rows: list[dict], script: str | None = None) -> dict:
    """The variables the port reads, with its dataset written and its server (if any) running."""
    data = write_jsonl(cwd / "data.jsonl", rows)
    text = (EXAMPLES / name).read_text() if script is None else script
    if name in PLUGINS:
        plugin = PLUGINS[name]
    elif "${PLUGIN" in text or "{plugin}" in " ".join(SERVERS.get(name, ())):  # it loads ms-swift's plugin.py
        plugin = swift_plugin(cwd / "swift_plugin_renamed.py")
    else:
        plugin = cwd / "no_plugin_in_this_port"  # the port names no plugin
    model = models["vlm" if name in VLM_PORTS else "policy"]
    env = {
        **os.environ,
        "MODEL": str(model),
        "DATASET": str(data),
        "PLUGIN": str(plugin),
        "EXAMPLES": str(EXAMPLES),
        "JUDGE_MODEL": str(models["policy"]),
        "REWARD_MODEL": str(models["rm"]),
        "HOST": "127.0.0.1",
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": str(REPO),
    }
    if name in SERVERS:
        options = tuple(o.replace("{plugin}", str(plugin)) for o in SERVERS[name])
        env["PORT"] = str(servers(options).port)
    return env


def _check_trained(name, env: dict, cwd: Path, script: str | None = None) -> None:
    """Run the port (or ``script`` under its name) and check that 2 steps trained with rewards."""
    run = _run_port(name, env, cwd, script)
    assert run.returncode == 0, f"{name} failed:\n{(run.stdout + run.stderr)[-3000:]}"
    logged = [json.loads(line) for line in (cwd / "output" / "logging.jsonl").read_text().splitlines()]
    steps = [r for r in logged if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all("reward" in r and any(k.startswith("rewards/") for k in r) for r in steps)


def _rows(name: str, cwd: Path) -> list[dict]:
    return clevr_rows(cwd) if name in VLM_PORTS else DATASETS.get(name, NUMINA)


def _check_set_up(name, env: dict, cwd: Path, monkeypatch, script: str | None = None):
    """The port's command line parsed, validated and set up in this process; returns the trainer built."""
    from grpokit.config.parse import parse_train_args
    from grpokit.pipeline.train import run_train

    argv = _train_argv(name, env, cwd, script)
    with monkeypatch.context() as patch:
        for key in ("MODEL", "DATASET", "PLUGIN", "EXAMPLES", "JUDGE_MODEL", "REWARD_MODEL", "HOST", "PORT"):
            patch.delenv(key, raising=False)  # the set-up sees only the command line, as a user's process would
        with set_up_only(patch) as built:
            cfg = parse_train_args(argv)
            trainer = run_train(cfg)
    assert built == [trainer]
    assert trainer.state.global_step == 0  # nothing trained
    named = list(cfg.reward.reward_funcs) + [f"rm_{Path(p).name}" for p in cfg.reward.reward_model]
    # every reward the command line names was built (a gym port's reward is the environment's: gym_reward)
    assert trainer.reward_names and set(named) <= set(trainer.reward_names), (name, trainer.reward_names)
    return trainer


@pytest.mark.parametrize("name", PORTS)
def test_port_parses_validates_and_sets_up(name, models, servers, tmp_path, monkeypatch, caplog):
    env = _port_env(name, models, servers, tmp_path, _rows(name, tmp_path))
    with caplog.at_level(logging.WARNING, logger="grpokit.config.moot"):
        _check_set_up(name, env, tmp_path, monkeypatch)
    # the options ms-swift makes moot here (no validation data; trackers not installed): one warning each
    said = sorted(r.getMessage().split(" ")[0] for r in caplog.records if r.name == "grpokit.config.moot")
    script = (EXAMPLES / name).read_text()
    trackers_here = bool(installed_trackers(["all"]))
    assert said == [o for o in ("--eval_steps", "--report_to") if o in script and not (o[2] == "r" and trackers_here)]


@pytest.mark.parametrize("name", TRAINED)
def test_port_trains_two_steps(name, models, servers, tmp_path):
    env = _port_env(name, models, servers, tmp_path, _rows(name, tmp_path))
    _check_trained(name, env, tmp_path)


def test_a_server_port_with_more_server_mode_options_sets_up(models, servers, tmp_path, monkeypatch):
    """external_grpo_7b.sh with ms-swift's server-mode multi-turn options added (--loss_scale,
    --vllm_server_pass_dataset), less the options for a hub dataset and several processes, on rows with a
    `messages` column."""
    dropped = ("--load_from_cache_file", "--dataloader_num_workers", "--dataset_num_proc", "--deepspeed")
    script = "\n".join(
        line
        for line in (EXAMPLES / "external_grpo_7b.sh").read_text().splitlines()
        if not line.strip().startswith(dropped)
    )
    script = script.replace("--beta 0.04 \\", "--beta 0.04 --loss_scale last_round --vllm_server_pass_dataset true \\")
    assert "--vllm_server_pass_dataset true" in script
    rows = [{**r, "messages": [{"role": "user", "content": r["problem"]}]} for r in NUMINA]
    env = _port_env("external_grpo_7b.sh", models, servers, tmp_path, rows, script)
    trainer = _check_set_up("external_grpo_7b.sh", env, tmp_path, monkeypatch, script)
    assert trainer.cfg.rollout.loss_scale == "last_round" and trainer.cfg.rollout.vllm_server_pass_dataset is True
