"""tests/conftest.py's rule that a test cannot pass by skipping: a skip whose reason is not in ALLOWED_SKIPS fails
the run, in a pytest session of its own with this conftest (plain and under pytest-xdist)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"

TESTS = textwrap.dedent("""
    import pytest


    def test_runs():
        assert 1 + 1 == 2


    def test_skips_as_a_gpu_test_does():
        pytest.skip("needs a CUDA device")


    @pytest.fixture
    def missing_tool():
        pytest.skip(SKIP_REASON)


    def test_skips_in_a_fixture(missing_tool):
        pass


    @pytest.mark.xfail(reason="an expected failure is not a skip", strict=True)
    def test_expected_to_fail():
        assert False
""")


def _session(tmp_path: Path, reason: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    shutil.copy(CONFTEST, tmp_path / "conftest.py")
    (tmp_path / "test_probe.py").write_text(f"SKIP_REASON = {reason!r}\n" + TESTS)
    # the installed plugins are not loaded (schemathesis, hypothesis, anyio, ... cost seconds of start-up per
    # session and per xdist worker); the probe needs none but xdist, which `-n` loads by name
    plugins = ["-p", "xdist.plugin"] if "-n" in args else []
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *plugins, *args, "test_probe.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", **(env or {})},
    )


def test_an_unexpected_skip_fails_the_run_and_names_the_test(tmp_path):
    proc = _session(tmp_path, "bubblewrap is not installed")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "2 skipped" in out and "1 xfailed" in out and "1 passed" in out
    assert "1 skipped for a reason not in tests/conftest.py's ALLOWED_SKIPS" in out
    assert "test_probe.py::test_skips_in_a_fixture: bubblewrap is not installed" in out
    assert "test_skips_as_a_gpu_test_does" not in out.split("ALLOWED_SKIPS")[1]  # an allowed reason


def _fresh_conftest():
    """A private copy of tests/conftest.py's module, for its hooks on a made-up session."""
    spec = importlib.util.spec_from_file_location("conftest_copy_for_skips", CONFTEST)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("allow, status", [(None, pytest.ExitCode.TESTS_FAILED), ("1", pytest.ExitCode.OK)])
def test_the_variable_keeps_unexpected_skips_from_failing_the_run(monkeypatch, allow, status):
    hooks = _fresh_conftest()
    config = SimpleNamespace(stash=pytest.Stash())
    session = SimpleNamespace(config=config, exitstatus=pytest.ExitCode.OK)
    monkeypatch.setattr(hooks, "_CONFIG", [config])
    for reason in ("needs a CUDA device", "bubblewrap is not installed"):
        hooks.pytest_runtest_logreport(
            SimpleNamespace(skipped=True, nodeid=f"t.py::{reason[:5]}", longrepr=("t.py", 1, f"Skipped: {reason}"))
        )
    assert hooks._unexpected_skips(config) == [("t.py::bubbl", "bubblewrap is not installed")]
    if allow is None:
        monkeypatch.delenv("GRPOKIT_TEST_ALLOW_SKIPS", raising=False)
    else:
        monkeypatch.setenv("GRPOKIT_TEST_ALLOW_SKIPS", allow)
    hooks.pytest_sessionfinish(session, pytest.ExitCode.OK)
    assert session.exitstatus == status


@pytest.mark.skipif(importlib.util.find_spec("xdist") is None, reason="pytest-xdist (dev extra) is not installed")
def test_an_unexpected_skip_on_an_xdist_worker_fails_the_run(tmp_path):
    proc = _session(tmp_path, "bubblewrap is not installed", "-n", "2")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "test_probe.py::test_skips_in_a_fixture: bubblewrap is not installed" in proc.stdout
