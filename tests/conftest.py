"""Shared fixtures: a tiny model + tokenizer built offline once per session, and small datasets."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from grpokit.testing import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def tiny_rm_dir(tmp_path_factory) -> Path:
    from grpokit.testing import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_rm") / "rm", seq_cls=True)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def math_jsonl(tmp_path) -> Path:
    rows = [{"query": f"What is {a} + {b}? Answer with just the number.", "solution": str(a + b)}
            for a in range(1, 5) for b in range(1, 5)]
    return write_jsonl(tmp_path / "math.jsonl", rows)
