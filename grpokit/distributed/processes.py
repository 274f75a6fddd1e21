"""Many processes: check --deepspeed / --fsdp against accelerate's set-up, refuse what cannot work, and the few
collectives the loop needs (metrics averaged over ranks, objects gathered, a full state dict for saving).

No home-made parallelism: DDP is accelerate's; --deepspeed is DeepSpeed's engine, driven by zero.py, and --fsdp is
PyTorch's FSDP2, applied by sharding.py, because accelerate runs both only on GPUs. What each rank does is in
docs/distributed.md.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from pathlib import Path
from typing import Any

from grpokit.config.plan import world_size
from grpokit.distributed.zero import full_state_dict as zero_full_state_dict
from grpokit.distributed.zero import is_zero3, load_spec, stage_of
from grpokit.errors import ConfigError

logger = logging.getLogger(__name__)

# metrics that are a maximum: reduced by max over micro-steps and processes, not averaged
MAX_METRICS = frozenset({"mismatch/max_abs"})
_SHARDED_HINT = (
    "use plain DDP (drop the flag) or --deepspeed zero2 with the in-process engine, or run the "
    "rollouts on a `grpokit rollout` server (--vllm_mode server, see docs/distributed.md)"
)


def deepspeed_stage(spec: str) -> int:
    """The ZeRO stage of ``--deepspeed PRESET|file.json`` (ms-swift's presets: zero0 ... zero3_offload)."""
    return stage_of(load_spec(spec), spec)


def accelerate_plugins(args) -> dict:
    """Keyword arguments for ``accelerate.Accelerator`` from the training options."""
    if args.deepspeed and args.fsdp:
        raise ConfigError("--deepspeed and --fsdp both set: choose one")
    if args.deepspeed:
        deepspeed_stage(args.deepspeed)  # a bad spec is reported before the missing package
        if importlib.util.find_spec("deepspeed") is None:
            raise ConfigError(
                f"--deepspeed {args.deepspeed}: the deepspeed package is not installed "
                "(pip install 'grpokit[deepspeed]'), or drop --deepspeed to train with plain DDP"
            )
    # --deepspeed (every stage): distributed/zero.py drives DeepSpeed itself; --fsdp: sharding.py shards the model;
    # accelerate runs plain (multi-)process in both cases, the same on CPU and GPU
    return {}


def has_accelerator() -> bool:
    """Whether torch sees a GPU or another accelerator (CUDA, ROCm, XPU, MPS, a TPU through torch_xla, ...)."""
    import torch
    from accelerate.utils import is_torch_xla_available

    if is_torch_xla_available():
        return True
    if hasattr(torch, "accelerator"):  # torch >= 2.6: every device type torch knows, plug-ins included
        return torch.accelerator.is_available()
    mps = getattr(torch.backends, "mps", None)
    xpu = getattr(torch, "xpu", None)
    return torch.cuda.is_available() or bool(xpu and xpu.is_available()) or bool(mps and mps.is_available())


def use_cpu(args) -> bool:
    """accelerate's ``cpu`` argument: --use_cpu, or on by itself when a launcher started several processes on a
    machine without accelerators. accelerate forms its gloo group of CPU processes only with cpu=True; without it
    each process would train its own copy of the model."""
    if args.use_cpu or world_size() == 1 or has_accelerator():
        return args.use_cpu
    if int(os.environ.get("RANK", "0")) == 0:
        logger.info("%d processes and no GPU: training on CPU in one gloo group, as with --use_cpu true", world_size())
    return True


def check_backend(accelerator, args) -> None:
    """Refuse processes that accelerate left out of a group (each would train a copy of its own), and FSDP or
    DeepSpeed turned on in an `accelerate config` file (grpokit drives both itself). --fsdp and --deepspeed run in
    one process too (a one-process group: zero.ensure_process_group)."""
    from accelerate.utils import DistributedType

    kind = accelerator.distributed_type
    where = f"{accelerator.num_processes} process(es) on {accelerator.device.type}"
    if world_size() > 1 and accelerator.num_processes == 1:
        raise ConfigError(
            f"the launcher started {world_size()} processes (WORLD_SIZE) but accelerate "
            f"joined them in no group ({kind.value}, {where}): each would train a copy of its own; "
            "add --use_cpu true to train them together on CPU (gloo), or launch one process"
        )
    if args.fsdp and kind == DistributedType.FSDP:
        raise ConfigError(
            "--fsdp and an accelerate config that turns on FSDP: grpokit shards the model itself "
            "with --fsdp; drop FSDP from the accelerate config"
        )
    if kind == DistributedType.DEEPSPEED:
        flag = f"--deepspeed {args.deepspeed} and an" if args.deepspeed else "An"
        raise ConfigError(
            f"{flag} accelerate config that turns on DeepSpeed: grpokit drives DeepSpeed itself; "
            "pass --deepspeed zero0-zero3_offload (or a JSON file) and drop DeepSpeed from the "
            "accelerate config"
        )


def is_fsdp2(model) -> bool:
    """True for a model sharded with FSDP2 (``fully_shard``), as --fsdp does."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def shards_parameters(accelerator) -> bool:
    """True when accelerate shards the weights of what it prepares (FSDP from an accelerate config on GPUs);
    --fsdp is grpokit's own, see ``is_fsdp2``; --deepspeed ZeRO-3, ``zero.is_zero3``."""
    from accelerate.utils import DistributedType

    return accelerator.distributed_type == DistributedType.FSDP


def check_engine(accelerator, engine) -> None:
    """The in-process transformers engine generates with the live weights: they must be whole on each rank
    (with --fsdp it samples from a whole copy, sharding.GatheredWeightsEngine)."""
    model = getattr(engine, "model", None)
    if model is not None and is_fsdp2(model):
        raise ConfigError(
            "the in-process transformers engine was given the FSDP-sharded policy; let the trainer "
            "build its engine (it samples from a whole copy) or use --vllm_mode server"
        )
    if shards_parameters(accelerator) and getattr(engine, "engine_type", "") == "transformers":
        raise ConfigError(
            f"{accelerator.distributed_type.value} shards the parameters, but the in-process "
            f"transformers engine generates with the live (sharded) weights; {_SHARDED_HINT}"
        )


def full_state_dict(accelerator, model) -> dict | None:
    """The whole state dict for ``save_pretrained`` when parameters are sharded (a collective: call on every
    rank), else None (save the unwrapped model as it is)."""
    if is_zero3(model):
        return zero_full_state_dict(model)
    if is_fsdp2(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not shards_parameters(accelerator):
        return None
    return accelerator.get_state_dict(model)


def gather_objects(accelerator, items: list) -> list:
    """Concatenate a picklable list over processes, in rank order (every rank gets the whole list)."""
    if accelerator.num_processes == 1:
        return items
    from accelerate.utils import gather_object

    return gather_object(list(items))


def mean_over_processes(accelerator, metrics: dict[str, float]) -> dict[str, float]:
    """Each metric averaged over the ranks that report it (a rank's value is already its micro-step mean); a
    maximum (``MAX_METRICS``) is the ranks' maximum."""
    if accelerator.num_processes == 1:
        return metrics
    per_rank: list[dict[str, Any]] = gather_objects(accelerator, [metrics])
    keys = list(dict.fromkeys(k for m in per_rank for k in m))
    return {
        k: max(m[k] for m in per_rank if k in m)
        if k in MAX_METRICS
        else sum(m[k] for m in per_rank if k in m) / sum(1 for m in per_rank if k in m)
        for k in keys
    }


def scalar(x) -> float:
    """A Python float from a number, tensor or (replicated) DTensor."""
    if hasattr(x, "full_tensor"):
        x = x.full_tensor()
    return float(x)


def gather_rows(accelerator, t):
    """Concatenate a tensor's rows over processes, in rank order (every rank gets them all)."""
    if accelerator.num_processes == 1:
        return t
    import torch
    from accelerate.utils import gather_object

    return torch.cat(gather_object([t.cpu()]), dim=0)


def row_offset(accelerator, local_n: int) -> int:
    """Where this process's rows start in the concatenation of every process's rows."""
    if accelerator.num_processes == 1:
        return 0
    from accelerate.utils import gather_object

    sizes = gather_object([local_n])
    return sum(sizes[: accelerator.process_index])


def gather_cat(accelerator, t):
    """Concatenate a 1-D tensor of any length over processes."""
    if accelerator.num_processes == 1:
        return t
    import torch

    padded = accelerator.pad_across_processes(t.detach(), dim=0, pad_index=float("nan"))
    allv = accelerator.gather(padded)
    return allv[~torch.isnan(allv)]


# the threads torch's process-group backends run: gloo's workers (pt_gloo_runloop) and its TCP loop, NCCL's watchdog
# and heartbeat monitor
_C10D_THREAD_PREFIXES = ("pt_gloo", "gloo_tcp", "pt_nccl")


def c10d_threads() -> list[str] | None:
    """Names of the process-group backend threads alive in this process now (Linux: /proc/self/task), or None
    where the threads cannot be listed."""
    try:
        tasks = list(Path("/proc/self/task").iterdir())
    except OSError:
        return None
    names = []
    for task in tasks:
        try:
            names.append((task / "comm").read_text().strip())
        except OSError:  # the thread ended meanwhile
            continue
    return [n for n in names if n.startswith(_C10D_THREAD_PREFIXES)]


def exit_if_groups_linger(code: int) -> None:
    """End the process now with ``code`` when process-group backend threads outlived their group; else return (the
    caller exits as usual). Call on the main thread at the end of ``grpokit train``, after the group was destroyed
    (``GRPOTrainer._finish`` destroys it on every rank after a barrier).

    torch keeps the C++ side of a destroyed gloo group alive whenever something still references it (DDP's
    reducer, FSDP2's device mesh in DTensor's sharding caches), so its worker threads never stop. A worker that
    finishes a collective late (a loaded machine) drops the last reference to the collective's tensors, which
    takes the GIL when Python owned them; if that happens while the interpreter is being finalized, Python ends
    the thread (pthread_exit) inside a C++ destructor and the process aborts: "terminate called without an active
    exception", SIGABRT, after a run that logged "done" (docs/distributed.md, "A clean exit"). So when such threads
    are alive, the process does what finalization does that matters, in the same order (non-daemon threads joined,
    atexit handlers run, stdio flushed) and leaves without finalizing the interpreter."""
    threads = c10d_threads()
    if threads == [] or (threads is None and "torch.distributed" not in sys.modules):
        return
    logger.debug(
        "process-group threads outlived their group (%s): leaving without finalizing the interpreter",
        ", ".join(threads or ["not listed"]),
    )
    import atexit
    import threading

    threading._shutdown()  # what finalization runs first: join non-daemon threads (thread pools' exit hooks too)
    atexit._run_exitfuncs()  # then the atexit handlers (logging.shutdown among them), as Py_FinalizeEx does
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing left to write
            pass
    os._exit(code)
