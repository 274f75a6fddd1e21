"""CI runs the system set-up beside the Python install (.ci/run); tests/conftest.py holds the session back until
the set-up's exit status is written, and stops it with one line when the set-up failed."""

from __future__ import annotations

import importlib.util
import threading
import time
from pathlib import Path

import pytest

CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"


def _hooks():
    spec = importlib.util.spec_from_file_location("conftest_copy_for_system_setup", CONFTEST)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_session_waits_for_the_status_then_goes_on(tmp_path, monkeypatch):
    status = tmp_path / "setup.log.status"
    monkeypatch.setenv("GRPOKIT_SYSTEM_SETUP_STATUS", str(status))
    writer = threading.Timer(0.6, status.write_text, ("0\n",))
    writer.start()
    begin = time.monotonic()
    _hooks()._wait_for_system_setup()
    assert status.exists() and time.monotonic() - begin >= 0.5
    writer.join()


def test_a_failed_set_up_stops_the_session_naming_its_log(tmp_path, monkeypatch):
    status = tmp_path / "setup.log.status"
    status.write_text("100\n")
    monkeypatch.setenv("GRPOKIT_SYSTEM_SETUP_STATUS", str(status))
    with pytest.raises(pytest.UsageError, match=r"setup_system\.sh failed with status 100; its log is .*setup\.log$"):
        _hooks()._wait_for_system_setup()


def test_without_the_variable_nothing_waits(monkeypatch):
    monkeypatch.delenv("GRPOKIT_SYSTEM_SETUP_STATUS", raising=False)
    _hooks()._wait_for_system_setup()
