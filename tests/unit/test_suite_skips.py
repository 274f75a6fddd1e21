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

import pytest

CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"

TESTS = textwrap.dedent('''
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
''')


def _session(tmp_path: Path, reason: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    shutil.copy(CONFTEST, tmp_path / "conftest.py")
    (tmp_path / "test_probe.py").write_text(f"SKIP_REASON = {reason!r}\n" + TESTS)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                           *args, "test_probe.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


def test_an_unexpected_skip_fails_the_run_and_names_the_test(tmp_path):
    proc = _session(tmp_path, "bubblewrap is not installed")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "2 skipped" in out and "1 xfailed" in out and "1 passed" in out
    assert "1 skipped for a reason not in tests/conftest.py's ALLOWED_SKIPS" in out
    assert "test_probe.py::test_skips_in_a_fixture: bubblewrap is not installed" in out
    assert "test_skips_as_a_gpu_test_does" not in out.split("ALLOWED_SKIPS")[1]  # an allowed reason


def test_the_variable_lists_unexpected_skips_without_failing(tmp_path):
    proc = _session(tmp_path, "bubblewrap is not installed", env={"GRPOKIT_TEST_ALLOW_SKIPS": "1"})
    assert proc.returncode == 0 and "(listed only;" in proc.stdout, proc.stdout + proc.stderr
    assert "test_probe.py::test_skips_in_a_fixture: bubblewrap is not installed" in proc.stdout


@pytest.mark.skipif(importlib.util.find_spec("xdist") is None, reason="pytest-xdist (dev extra) is not installed")
def test_an_unexpected_skip_on_an_xdist_worker_fails_the_run(tmp_path):
    proc = _session(tmp_path, "bubblewrap is not installed", "-n", "2")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "test_probe.py::test_skips_in_a_fixture: bubblewrap is not installed" in proc.stdout
