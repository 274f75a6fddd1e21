"""Secrets kept out of what a run writes: args.json's options, a resume's warning line, log lines."""

from __future__ import annotations

import logging

from grpokit.redaction import REDACTED, RedactingFilter, is_secret_name, redacted, remember_secrets
from grpokit.runs.run_args import check_resume_args, normalised

SECRET_OPTIONS = {
    "vllm_server_api_key": "sk-live-0123456789",
    "hub_token": "hf_abcdefghij",
    "wandb-password": "pw-12345678",
    "reward_kwargs": {"client_secret": "cs-123456789", "model": "judge"},
}


def test_secret_names_are_words_not_substrings():
    assert all(is_secret_name(k) for k in ("api_key", "HUB_TOKEN", "client-secret", "db.password", "OPENAI_API_KEY"))
    assert not any(is_secret_name(k) for k in ("max_tokens", "max_new_tokens", "keyword", "tokenizer", "monkey"))
    assert not is_secret_name("teacher_tag_key") and is_secret_name("teacher_api_key")  # a lookup key is no secret


def test_args_json_holds_no_secret_from_flags_yaml_or_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("MY_JUDGE_TOKEN", "judge-token-0123")
    flat = {
        **SECRET_OPTIONS,
        "vllm_server_base_url": "http://trainer:s3cr3t-pw@10.0.0.2:8000",
        "system": "call the judge with judge-token-0123",  # a value the environment says is secret
        "max_new_tokens": 64,
        "output_dir": tmp_path,
    }
    args = normalised(flat)
    text = str(args)
    for value in ("sk-live-0123456789", "hf_abcdefghij", "pw-12345678", "cs-123456789", "s3cr3t-pw", "judge-token"):
        assert value not in text, value
    assert args["vllm_server_api_key"] == REDACTED and args["reward_kwargs"]["model"] == "judge"
    assert args["max_new_tokens"] == 64 and args["output_dir"] == str(tmp_path)


def test_a_resume_compares_and_shows_redacted_options(tmp_path):
    old = {"vllm_server_api_key": "sk-old-0123456789", "max_steps": 2}  # an args.json written before redaction
    changes = check_resume_args(old, {"vllm_server_api_key": "sk-new-0123456789", "max_steps": 4}, tmp_path)
    assert changes == ["--max_steps 2 → 4"]  # the key's change is neither refused nor shown


def test_log_lines_hold_no_secret(monkeypatch):
    monkeypatch.setenv("SERVICE_API_KEY", "env-key-0123456789")
    remember_secrets({"vllm_server_api_key": "flag-key-0123456789", "max_tokens": "12345678"})
    record = logging.LogRecord("x", logging.WARNING, __file__, 1, "keys %s %s url %s", None, None)
    record.args = ("env-key-0123456789", "flag-key-0123456789", "https://u:hunter2@host/v1")
    assert RedactingFilter().filter(record)
    assert record.getMessage() == f"keys {REDACTED} {REDACTED} url https://u:{REDACTED}@host/v1"
    assert redacted({"nested": [{"token": "t-0123456789"}]}) == {"nested": [{"token": REDACTED}]}
