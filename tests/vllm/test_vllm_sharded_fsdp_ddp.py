"""vLLM colocate under torchrun with `--fsdp` and with plain DDP: test_vllm_sharded.py's check (after every weight
sync each rank's engine greedy output equals that of the trainer's own weights) for the two other ways of
distributing the trainer."""

from __future__ import annotations

import pytest
from test_vllm_sharded import _check_engines_follow, _train

pytestmark = pytest.mark.vllm


@pytest.mark.parametrize("sharding", [("--fsdp", "true"), ()], ids=["fsdp", "ddp"])
def test_each_rank_engine_follows_the_sharded_trainer(tiny128, tmp_path, sharding):
    _check_engines_follow(_train(tiny128, tmp_path, *sharding))
