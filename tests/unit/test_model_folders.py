"""Model folders: missing tokenizer, broken weights or config, a non-causal-LM checkpoint, a hub id without
network, a tokenizer that does not fit the model, and prompt + completion against the model's context (issue 27)."""

from __future__ import annotations

import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from grpokit.config.args import ModelArguments
from grpokit.errors import ConfigError
from grpokit.modeling import load_causal_lm, load_tokenizer, warn_if_not_causal_lm
from grpokit.pipeline.models import bound_prompt_length, check_model_source, check_tokenizer_covers, load_policy


def copy_of(src: Path, tmp_path: Path, name: str = "model") -> Path:
    out = tmp_path / name
    shutil.copytree(src, out)
    return out


def test_missing_tokenizer_files_are_refused_before_anything_loads(tiny_model_dir, tmp_path):
    folder = copy_of(tiny_model_dir, tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).unlink()
    with pytest.raises(ConfigError, match=r"--model .*: the folder has no tokenizer \(none of tokenizer.json, "):
        load_tokenizer(str(folder))
    with pytest.raises(ConfigError, match="the folder has no tokenizer"):
        load_policy(ModelArguments(model=str(folder)), beta=0.0)


def test_truncated_weights_name_the_file(tiny_model_dir, tmp_path):
    folder = copy_of(tiny_model_dir, tmp_path)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ConfigError) as err:
        load_causal_lm(str(folder), torch.float32)
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith(
        f"model {folder}: cannot load model.safetensors (truncated or not a safetensors file) (SafetensorError: "
    ), msg


def test_bad_config_names_the_file(tiny_model_dir, tmp_path):
    folder = copy_of(tiny_model_dir, tmp_path)
    (folder / "config.json").write_text('{"model_type": "qwen3", ')
    with pytest.raises(ConfigError, match=rf"model {folder}: cannot load config.json \("):
        load_causal_lm(str(folder), torch.float32)


def test_a_sequence_classification_checkpoint_is_warned_about(tiny_rm_dir, tiny_model_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="grpokit.modeling"):
        assert not warn_if_not_causal_lm(str(tiny_model_dir))
        model = load_causal_lm(str(tiny_rm_dir), torch.float32)  # it still loads, as before, but not silently
    assert model is not None
    lines = [r.getMessage() for r in caplog.records if r.name == "grpokit.modeling"]
    assert len(lines) == 1 and "ForSequenceClassification, not a causal language model" in lines[0], lines


def test_a_hub_id_without_network_fails_at_once(monkeypatch):
    monkeypatch.setattr("grpokit.pipeline.models.hub_unreachable_reason", lambda: "ConnectError for https://hf.co")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as err:
        load_policy(ModelArguments(model="Qwen/Qwen3-0.6B"), beta=0.0)
    assert time.monotonic() - t0 < 5
    assert str(err.value) == (
        "--model Qwen/Qwen3-0.6B: no such local folder; grpokit loads local Hugging Face "
        "folders, and the hub cannot be reached (ConnectError for https://hf.co); then pass the "
        "folder"
    )
    monkeypatch.setattr("grpokit.pipeline.models.hub_unreachable_reason", lambda: None)
    with pytest.raises(ConfigError, match="download it first: huggingface-cli download Qwen/Qwen3-0.6B"):
        check_model_source("Qwen/Qwen3-0.6B")
    with pytest.raises(ConfigError, match=r"^--ref_model ./nowhere: no such folder$"):
        check_model_source("./nowhere", "--ref_model")


def test_a_tokenizer_larger_than_the_embedding_is_refused(tiny_model_dir):
    model = load_causal_lm(str(tiny_model_dir), torch.float32)
    tokenizer = load_tokenizer(str(tiny_model_dir))
    check_tokenizer_covers(model, tokenizer, "m")  # its own tokenizer fits
    model.resize_token_embeddings(len(tokenizer) - 10)
    with pytest.raises(
        ConfigError,
        match=rf"--model m: the tokenizer has {len(tokenizer)} tokens but the model's "
        rf"embedding only {len(tokenizer) - 10} rows",
    ):
        check_tokenizer_covers(model, tokenizer, "m")


@dataclass
class Data:
    max_length: int | None = None


class Ctx:
    def __init__(self, n):
        self.config = type("Config", (), {"max_position_embeddings": n})()


def test_prompt_and_completion_are_checked_against_the_context():
    lines = []
    data = Data()
    assert bound_prompt_length(Ctx(1024), data, 256, "m", log=lambda *a, **k: lines.append(a[0])) == 768
    assert data.max_length is None and "prompts are bounded to 768 tokens" in lines[0]  # args.json keeps None
    assert bound_prompt_length(Ctx(1024), Data(500), 256, "m", log=print) == 500  # fits: kept
    with pytest.raises(
        ConfigError,
        match=r"--max_length 900 \+ --max_completion_length 256 = 1156 tokens, past the "
        r"model's context of 1024 .*at most 768",
    ):
        bound_prompt_length(Ctx(1024), Data(900), 256, "m")
    with pytest.raises(ConfigError, match=r"--max_completion_length 1024: the model m has a context of 1024"):
        bound_prompt_length(Ctx(1024), Data(), 1024, "m")
    assert bound_prompt_length(Ctx(None), Data(), 10**6, "m") is None  # no stated context: nothing to check
