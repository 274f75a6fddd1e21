"""Shared fixtures: a tiny model + tokenizer built offline once per session, and small datasets.

Every test starts from the same process state, whatever ran before it (the suite passes in any order, see
pytest-randomly in the README): the autouse fixture ``_restore_process_state`` gives each test a fresh empty working
directory and, after the test, puts back what tests and the code under test change in this process: accelerate's
singleton states, torch's thread count, default dtype, grad mode and RNG, python's and numpy's RNG, environment
variables, ``sys.path``, logging levels, and grpokit's registries (what plugins register).

A skipped test fails the run unless its reason is in ``ALLOWED_SKIPS`` (each entry says why that skip is expected
somewhere): a test that stops testing because something is missing (a system package, an extra, a download) must
not pass silently. ``pytest_sessionfinish`` sets the exit status; the summary lists the skips with their reasons.

Environment variables for the test run:
  GRPOKIT_TEST_THREADS=N   torch threads for the whole run (default: torch's own choice for this machine; on
                           pytest-xdist workers the CPUs shared out between the workers, at least one each)
  GRPOKIT_CPU_BF16=0|1     `--torch_dtype auto` on a CPU: float32 / bfloat16 (default: by AVX512-BF16/AMX)
  GRPOKIT_TEST_ALLOW_SKIPS=1  list unexpected skips without failing the run (a machine without bubblewrap, ...;
                           CI never sets it)
"""

from __future__ import annotations

import json
import logging
import os
import random
import sys
import time
from pathlib import Path

# torch's C++ log lines carry a stack trace each, and several tests make a weight-sync peer or a rank go away on
# purpose (c10d's "recvValue failed", a store's connect retries): a passing suite prints none of them. What fails
# still reaches Python as an exception, with its message. torch reads the level once, on import.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

THREADS_ENV = "GRPOKIT_TEST_THREADS"
ALLOW_SKIPS_ENV = "GRPOKIT_TEST_ALLOW_SKIPS"
BASELINE: dict = {}  # torch settings every test starts from (set in pytest_configure)
# skip reasons that do not fail the run (matched as substrings of the reason), each with why it is expected
ALLOWED_SKIPS = {
    "needs a CUDA device": "GPU-only: CI runs on CPU machines",
    "auto follows the GPU there": "the CPU rule of --torch_dtype auto does not apply on a machine with a GPU",
    "vllm is installed here": "checks the error without vLLM; the vLLM environment (scripts/test_vllm.sh) has it",
    "finds the sandbox by its slot uid": "root-only: slot uids are switched to as root; unprivileged runs skip",
    "the fallback is for root": "root-only: the fallback path exists only for root without user namespaces",
}
_SKIPS = pytest.StashKey[list]()
_CONFIG: list = []  # the run's config, for pytest_runtest_logreport (reports carry none)
_WORKERS: list = []  # on the xdist controller: how many workers it started (pytest_configure_node)


def _absolute_import_paths() -> None:
    """Tests run in a temporary working directory: keep `PYTHONPATH=.`-style entries pointing where they pointed."""
    sys.path[:] = [os.path.abspath(p) if not os.path.isabs(p) else p for p in sys.path]
    if os.environ.get("PYTHONPATH"):
        os.environ["PYTHONPATH"] = os.pathsep.join(
            os.path.abspath(p) if p and not os.path.isabs(p) else p for p in os.environ["PYTHONPATH"].split(os.pathsep)
        )


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _worker_threads(config) -> int | None:
    """Torch threads of an xdist worker when none were asked for: the CPUs shared out between the workers (at
    least one), instead of torch's default of every core in every worker (2 workers of 2 threads on 2 cores).
    The whole main suite took as long either way in CI (871 s with 2 threads a worker, 875 s with 1: most of its
    time is in subprocesses, which run one thread already); a subset heavy in in-process runs (the unit suite and
    eight integration files) gave 242 s against 181 s in one sitting, and 4 workers of 1 thread 197 s."""
    workers = getattr(config, "workerinput", {}).get("workercount")
    return _threads_per_worker(int(workers)) if workers else None


def _threads_per_worker(workers: int) -> int:
    return max(1, _cpus() // workers)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:
    _WORKERS[:] = [node.workerinput["workercount"]]


def _threads_line() -> str:
    asked = os.environ.get(THREADS_ENV)
    if _WORKERS and not asked:
        workers = _WORKERS[0]
        return f"torch threads {_threads_per_worker(workers)} in each of {workers} workers ({THREADS_ENV}=unset)"
    return f"torch threads {torch.get_num_threads()} ({THREADS_ENV}={asked or 'unset'})"


def _wait_for_system_setup() -> None:
    """CI (.ci/run) runs the README's system set-up beside the Python install and names, in
    GRPOKIT_SYSTEM_SETUP_STATUS, the file its exit status will be written to: nothing is collected before the
    packages the sandbox and viewer tests look for are there."""
    path = os.environ.get("GRPOKIT_SYSTEM_SETUP_STATUS")
    if not path:
        return
    deadline = time.monotonic() + 900
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise pytest.UsageError(f"scripts/setup_system.sh did not finish in 900 s (no {path})")
        time.sleep(0.5)
    with open(path) as f:
        status = f.read().strip()
    if status != "0":
        log = path.removesuffix(".status")  # .ci/run names the status file after the log
        raise pytest.UsageError(f"scripts/setup_system.sh failed with status {status}; its log is {log}")


def pytest_configure(config) -> None:
    _wait_for_system_setup()
    _CONFIG[:] = [config]
    _absolute_import_paths()
    threads = os.environ.get(THREADS_ENV)
    if threads:
        if not threads.isdigit() or int(threads) < 1:
            raise pytest.UsageError(f"{THREADS_ENV}={threads!r}: give a positive number of torch threads")
        torch.set_num_threads(int(threads))  # before collection: module imports and module fixtures see it too
    elif worker_threads := _worker_threads(config):
        torch.set_num_threads(worker_threads)
    BASELINE.update(
        threads=torch.get_num_threads(),
        dtype=torch.get_default_dtype(),
        deterministic=(
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
        ),
        matmul=torch.get_float32_matmul_precision(),
    )


def _dtype_auto_line() -> str:
    from grpokit.errors import ConfigError
    from grpokit.modeling import resolve_dtype_name

    forced = os.environ.get("GRPOKIT_CPU_BF16")
    try:
        how = f"GRPOKIT_CPU_BF16={forced}" if forced else "detected"
        return f"--torch_dtype auto → {resolve_dtype_name('auto')} ({how})"
    except ConfigError as e:
        return str(e)


def pytest_report_header(config) -> list[str]:
    return [f"grpokit: torch threads {torch.get_num_threads()}, {_dtype_auto_line()}"]


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    reason = str(longrepr[2]) if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return reason.removeprefix("Skipped: ")


def pytest_runtest_logreport(report) -> None:
    """Record every skip (a skip in set-up, e.g. by a fixture, included; xfail is not a skip)."""
    if report.skipped and not hasattr(report, "wasxfail") and _CONFIG:
        _CONFIG[0].stash.setdefault(_SKIPS, []).append((report.nodeid, _skip_reason(report)))


def _unexpected_skips(config) -> list[tuple[str, str]]:
    return [
        (node, reason)
        for node, reason in config.stash.get(_SKIPS, [])
        if not any(allowed in reason for allowed in ALLOWED_SKIPS)
    ]


def pytest_sessionfinish(session, exitstatus) -> None:
    """An unexpected skip fails the run (on an xdist worker the controller decides, from the workers' reports)."""
    if hasattr(session.config, "workerinput") or os.environ.get(ALLOW_SKIPS_ENV) == "1":
        return
    if _unexpected_skips(session.config) and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    """The same facts after a `-q` run (which prints no header), with the order, so a failure can be replayed;
    then the skips that fail the run."""
    unexpected = [] if hasattr(config, "workerinput") else _unexpected_skips(config)
    if unexpected:
        verdict = "listed only" if os.environ.get(ALLOW_SKIPS_ENV) == "1" else "these fail the run"
        terminalreporter.write_line(
            f"grpokit: {len(unexpected)} skipped for a reason not in tests/conftest.py's "
            f"ALLOWED_SKIPS ({verdict}; {ALLOW_SKIPS_ENV}=1 lists them only):",
            red=True,
        )
        for node, reason in unexpected:
            terminalreporter.write_line(f"  {node}: {reason}")
    seed = getattr(config.option, "randomly_seed", None) if config.pluginmanager.hasplugin("randomly") else None
    order = f"random order, -p randomly --randomly-seed={seed}" if seed is not None else "file order"
    terminalreporter.write_line(f"grpokit: {_threads_line()}, {_dtype_auto_line()}, {order}")


# ---------------------------------------------------------------------------------------------------------------
# process state, restored after every test
# ---------------------------------------------------------------------------------------------------------------
def _registries() -> list[dict]:
    """grpokit's registries (plain dicts that plugins write into) and the trainer factory's mapping."""
    from grpokit.registry import Registry
    from grpokit.trainers.factory import TrainerFactory

    found = {id(TrainerFactory.TRAINER_MAPPING): TrainerFactory.TRAINER_MAPPING}
    for name, module in list(sys.modules.items()):
        if name.startswith("grpokit") and module is not None:
            for value in list(vars(module).values()):
                if isinstance(value, Registry):
                    found[id(value)] = value
    return list(found.values())


def _loaded_plugin_modules() -> set[str]:
    """Names of the --external_plugins modules imported now."""
    from grpokit.plugins import loader

    return {name for name in loader._LOADED if name in sys.modules}


def _import_registry_modules() -> None:
    """Import every module that defines a registry, so that the first test to load a plugin does not also fill
    a registry nobody had snapshotted yet."""
    import grpokit.agents  # noqa: F401
    import grpokit.algorithms.advantages  # noqa: F401
    import grpokit.algorithms.losses  # noqa: F401
    import grpokit.algorithms.rollout_is  # noqa: F401
    import grpokit.data.builtin  # noqa: F401
    import grpokit.rewards.base  # noqa: F401
    import grpokit.rewards.rm_plugin  # noqa: F401
    import grpokit.rollout.env  # noqa: F401
    import grpokit.rollout.multi_turn  # noqa: F401
    import grpokit.rollout.tools  # noqa: F401
    import grpokit.trainers.callbacks  # noqa: F401
    import grpokit.trainers.optimizers  # noqa: F401


def _logging_levels() -> tuple:
    # a placeholder (a parent such as "grpokit" that nobody has asked for yet) becomes a logger, at NOTSET as it
    # acts now, so that a test's `getLogger("grpokit").setLevel(...)` is undone too
    loggers = [logging.getLogger()] + [logging.getLogger(name) for name in list(logging.Logger.manager.loggerDict)]
    return logging.root.manager.disable, {lg: (lg.level, lg.disabled) for lg in loggers}


def _restore_logging_levels(state: tuple) -> None:
    disable, saved = state
    logging.disable(disable)
    for lg, (level, disabled) in saved.items():
        if lg.level != level:
            lg.setLevel(level)
        lg.disabled = disabled


def _restore_environ(saved: dict) -> None:
    """Only the variables that differ: other threads (a server's watcher, a pool) may be reading os.environ."""
    for key in [k for k in os.environ if k not in saved]:
        del os.environ[key]
    for key, value in saved.items():
        if os.environ.get(key) != value:
            os.environ[key] = value


def _reset_accelerate() -> None:
    """accelerate keeps one process-wide AcceleratorState (mixed precision, device, ...): a second Accelerator with
    other settings raises. Each test that trains starts without one, as a fresh process would."""
    if "accelerate" not in sys.modules:
        return
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@pytest.fixture(scope="session", autouse=True)
def _session_baseline():
    _import_registry_modules()
    _reset_accelerate()
    yield


@pytest.fixture(autouse=True)
def _restore_process_state(tmp_path_factory, monkeypatch):
    monkeypatch.chdir(tmp_path_factory.mktemp("cwd"))  # an empty folder: nothing of the checkout's output/ leaks in
    environ = dict(os.environ)
    path = list(sys.path)
    grad = torch.is_grad_enabled()
    rng = (torch.get_rng_state(), random.getstate(), np.random.get_state())
    levels = _logging_levels()
    registries = [(r, dict(r)) for r in _registries()]
    plugins_before = _loaded_plugin_modules()
    yield
    _reset_accelerate()
    for reg, saved in registries:
        dict.clear(reg)
        dict.update(reg, saved)
    for name in _loaded_plugin_modules() - plugins_before:  # their registrations are undone: so is their import,
        sys.modules.pop(name, None)  # and the next test that names the file loads it again (load_plugins_once)
    _restore_logging_levels(levels)
    torch.set_rng_state(rng[0])
    random.setstate(rng[1])
    np.random.set_state(rng[2])
    # torch's settings go back to the run's baseline, not to what a module fixture may have set
    torch.use_deterministic_algorithms(BASELINE["deterministic"][0], warn_only=BASELINE["deterministic"][1])
    torch.set_float32_matmul_precision(BASELINE["matmul"])
    torch.set_default_dtype(BASELINE["dtype"])
    torch.set_num_threads(BASELINE["threads"])
    torch.set_grad_enabled(grad)
    sys.path[:] = path
    _restore_environ(environ)


@pytest.fixture
def one_torch_thread():
    """Pins this process to one torch thread, as `rollout_server` pins the server (OMP_NUM_THREADS=1): a float32
    matmul then sums in the same order in both processes, so greedy completions can be compared token for token.
    Restored after the test by `_restore_process_state`."""
    torch.set_num_threads(1)


# ---------------------------------------------------------------------------------------------------------------
# tiny models and data
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fault_file(tmp_path_factory) -> Path:
    """The file that tells tests/integration/sync_fault_plugin.py (loaded into a module's rollout server) which
    weight sync to break; each test writes its own ("none", "corrupt:B:N", "drop:B:N")."""
    path = tmp_path_factory.mktemp("fault") / "fault.txt"
    path.write_text("none")
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from grpokit.testing import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def tiny_rm_dir(tmp_path_factory) -> Path:
    from grpokit.testing import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_rm") / "rm", seq_cls=True)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    """``rows`` as JSON lines at ``path`` (support.write_jsonl's twin: tests copy this file alone into a folder of
    their own and run it there, so it imports nothing from tests/)."""
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def tiny_rm(tmp_path_factory):
    """(folder, model, tokenizer) of a tiny reward model of the module's own, loaded by grpokit's loader."""
    from grpokit.rewards import load_reward_model
    from grpokit.testing import build_tiny_model

    path = build_tiny_model(tmp_path_factory.mktemp("rm"), seq_cls=True)
    model, tokenizer = load_reward_model(str(path))
    return path, model, tokenizer


@pytest.fixture
def math_jsonl(tmp_path) -> Path:
    rows = [
        {"query": f"What is {a} + {b}? Answer with just the number.", "solution": str(a + b)}
        for a in range(1, 5)
        for b in range(1, 5)
    ]
    return write_jsonl(tmp_path / "math.jsonl", rows)
