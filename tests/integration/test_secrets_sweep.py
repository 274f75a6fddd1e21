"""No secret in what a `grpokit train` run leaves or prints, wherever the secret came from: a rollout API key in a
``--config`` YAML file, a Hub token given as a flag, an environment variable's value used in an option, a URL
password; and no absolute local path in report.html. An error line printed by the command line holds none either.
One tiny run (2 steps) through ``grpokit.cli.main``, as a user runs it."""

from __future__ import annotations

import json

import pytest
from tiny_runs import tiny_run_args

from grpokit.cli.main import main

pytestmark = pytest.mark.slow
YAML_KEY, FLAG_TOKEN, ENV_SECRET, URL_PW = "yaml-key-5e6f7a8b", "hf_flagtoken9c0d", "env-secret-1a2b3c4d", "pw-77aa88bb"
SECRETS = (YAML_KEY, FLAG_TOKEN, ENV_SECRET, URL_PW)


def test_a_runs_outputs_and_lines_hold_no_secret_and_no_local_path(
    tiny_model_dir, math_jsonl, tmp_path, capfd, monkeypatch
):
    monkeypatch.setenv("ACME_API_KEY", ENV_SECRET)
    config = tmp_path / "run.yaml"
    config.write_text(f"vllm_server_api_key: {YAML_KEY}\n")
    out = tmp_path / "out"
    argv = tiny_run_args(
        tiny_model_dir,
        math_jsonl,
        out,
        "--max_steps",
        "1",
        "--config",
        str(config),
        "--hub_token",
        FLAG_TOKEN,
        "--system",
        f"Use the key {ENV_SECRET} at https://u:{URL_PW}@x.",
    )
    main(["train", *argv])
    written = {p.name: p.read_text() for p in out.iterdir() if p.is_file()}
    assert {"args.json", "logging.jsonl", "report.html"} <= set(written)
    printed = capfd.readouterr()
    for name, text in {**written, "stdout": printed.out, "stderr": printed.err}.items():
        for secret in SECRETS:
            assert secret not in text, (name, secret)
    assert str(tmp_path) not in written["report.html"]
    assert json.loads(written["args.json"])["vllm_server_api_key"] == "<redacted>"

    with pytest.raises(SystemExit) as stop:  # an error line naming the secret value the user gave
        main(["train", *tiny_run_args(tiny_model_dir, tmp_path / f"{ENV_SECRET}.jsonl", tmp_path / "o2")])
    err = capfd.readouterr().err
    assert stop.value.code == 2 and "error" in err and ENV_SECRET not in err
