"""The TRL API keeps secrets out of log lines as ``grpokit train`` does: a reward function logging an environment
key and a URL password through a logger and handler of its own (added while the run trains, so nothing of
grpokit's sits on it) writes them redacted; after ``train()`` the caller's logging is left as it was."""

from __future__ import annotations

import io
import logging

import pytest
from test_trl_api import math_rows, run

pytestmark = pytest.mark.slow


def test_a_trl_runs_log_lines_hold_no_secret(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("ACME_API_KEY", "acme-4b9f0c2e7d")
    stream = io.StringIO()
    factory = logging.getLogRecordFactory()
    scope = run(
        """
        import logging, os
        from trl import GRPOConfig, GRPOTrainer

        def keyed_reward(completions, **kwargs):
            log = logging.getLogger("acme.scoring")
            if not log.handlers:
                log.addHandler(logging.StreamHandler(STREAM))
                log.setLevel(logging.INFO)
            log.info("scored with %s at %s", os.environ["ACME_API_KEY"], "https://svc:pa55word@acme.test/score")
            return [float(len(c[0]["content"]) % 2) for c in completions]

        trainer = GRPOTrainer(model=MODEL, reward_funcs=keyed_reward, args=GRPOConfig(ARGS), train_dataset=dataset)
        result = trainer.train()
    """,
        tiny_model_dir,
        tmp_path,
        dataset=math_rows(),
        STREAM=stream,
    )
    lines = stream.getvalue().splitlines()
    assert scope["result"].global_step == 2 and lines
    assert set(lines) == {"scored with <redacted> at https://svc:<redacted>@acme.test/score"}
    assert logging.getLogRecordFactory() is factory
    logging.getLogger("acme.scoring").handlers.clear()
