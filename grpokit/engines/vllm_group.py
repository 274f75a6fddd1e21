"""vLLM's place among several training processes, and its teardown.

Under torchrun (``WORLD_SIZE`` > 1) each training process runs its own colocated vLLM engine. The launcher's
torch.distributed group is formed before vLLM starts, and vLLM joins it with its ``external_launcher`` executor:
with tensor parallel size 1 every process is an engine of its own (vLLM's "external data parallelism"), sampling
its own prompts, while the trainer (accelerate, DeepSpeed, FSDP2) reuses the same group.
"""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger(__name__)


def shutdown(llm, joined_launcher: bool) -> None:
    """On the vLLM thread: stop the engine core and tear down vLLM's process-wide distributed state, but not the
    training processes' group that vLLM joined (the trainer still uses it after the engine is closed)."""
    from vllm.distributed import parallel_state

    destroy_all = parallel_state.destroy_distributed_environment
    if joined_launcher:
        # vLLM's engine core ends with destroy_distributed_environment(), which would destroy torch's default
        # group too: for this call it leaves the groups alone (vLLM's own world group, a subgroup of the
        # launcher's, goes with the process)
        parallel_state.destroy_distributed_environment = lambda: None
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001 - best effort on the way out
        logger.debug("vLLM engine core shutdown failed", exc_info=True)
    finally:
        parallel_state.destroy_distributed_environment = destroy_all
    try:
        parallel_state.destroy_model_parallel()
        if not joined_launcher:
            destroy_all()
    except Exception:  # noqa: BLE001
        logger.debug("vLLM distributed teardown failed", exc_info=True)


def launcher_rank() -> int:
    """This process's rank among the training processes (0 without a launcher)."""
    return int(os.environ.get("RANK", "0"))


def join_launcher_group(device: torch.device) -> bool:
    """With several training processes (torchrun's WORLD_SIZE > 1): form the launcher's torch.distributed group
    now, before vLLM starts (the trainer's accelerate and DeepSpeed reuse it), so that each process's vLLM joins
    it as one engine of its own (``external_launcher``) instead of forming a one-process group of its own."""
    import torch.distributed as dist

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    if not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method="env://")
    return True
