"""``redacting_logs``: every log record made in the block is redacted before any handler sees it, a handler added
inside the block and a third-party logger's included; the record factory is put back after it."""

from __future__ import annotations

import io
import logging

from grpokit.redaction import REDACTED, redacting_logs, remember_secrets


def test_records_made_in_the_block_are_redacted_whatever_handler_gets_them(monkeypatch):
    monkeypatch.setenv("ACME_SERVICE_TOKEN", "tok-env-5f1e2d3c")
    remember_secrets({"rollout_api_key": "flag-key-99aa77"})
    before = logging.getLogRecordFactory()
    stream = io.StringIO()
    log = logging.getLogger("some_library.http")
    log.propagate = False
    log.setLevel(logging.INFO)
    with redacting_logs():
        handler = logging.StreamHandler(stream)  # added after the block began: no filter of grpokit's on it
        log.addHandler(handler)
        log.info("GET %s with %s and %s", "https://bob:hunter2@example.com/x", "tok-env-5f1e2d3c", "flag-key-99aa77")
        log.info("bad format %d", "not a number")  # a record that does not format is left to its handler
    log.info("after: tok-env-5f1e2d3c")
    log.removeHandler(handler)
    lines = stream.getvalue().splitlines()
    assert lines[0] == f"GET https://bob:{REDACTED}@example.com/x with {REDACTED} and {REDACTED}"
    assert lines[-1] == "after: tok-env-5f1e2d3c"  # outside the block the caller's logging is its own
    assert logging.getLogRecordFactory() is before
