"""--fsdp in a single process started without a launcher (`python -m grpokit train --fsdp true`): grpokit forms a
one-process group (distributed/zero.py's, as for --deepspeed) and shards over it. Nothing is split, but the run takes
FSDP2's code path (DTensor parameters, the whole generation copy, torch.distributed.checkpoint shards), so one GPU
can check it (bench/gpu_shard_check.sh). It must give what the plain one-process run gives: rewards, advantages
and losses to 1e-5, parameters to 1e-4, the same grad_norm, a checkpoint of FSDP shards."""

from __future__ import annotations

import pytest
from test_deepspeed_stages import _check_one_process, _solo, plain, setup  # noqa: F401 (fixtures)
from test_distributed import B

pytestmark = pytest.mark.slow


def test_fsdp_in_one_process_without_a_launcher_matches_plain(setup, plain):  # noqa: F811
    fsdp = _solo(setup, "fsdp_solo", B * 2, "--fsdp", "true")
    _check_one_process(plain, fsdp)  # (with the grad_norm check)
    assert (fsdp / "out" / "checkpoint-2" / "state" / "fsdp_sharded").is_dir()
