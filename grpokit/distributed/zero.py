"""``--deepspeed`` (ms-swift's presets ``zero0`` ... ``zero3_offload`` or a DeepSpeed JSON file of any stage), driven
directly with ``deepspeed.initialize``: one code path for every stage, one or many processes, CPU and GPU.

accelerate runs DeepSpeed only on GPUs (on CPU it silently trains with DDP instead), so grpokit does not hand
DeepSpeed to accelerate: the Accelerator runs plain (multi-)process and this module wraps the policy (and, for
stage 3, the full-weight reference model) in DeepSpeed engines over the same process group. A single process
started without a launcher gets a one-process group of its own (``ensure_process_group``), so DeepSpeed never
looks for MPI; the run holds its lease and releases it.

- The loop's backward is the engine's (the trainer asks ``is_engine`` once; ``engine.backward`` scales by the
  accumulation steps as accelerate would, and ZeRO 2-3 refuse accelerate's ``no_sync``) and
  its ``optimizer.step()`` is the engine's step on every micro-step (``EngineStep``); DeepSpeed counts the
  micro-steps (its ``gradient_accumulation_steps`` is --gradient_accumulation_steps), reduces and steps at the
  boundary, and clips the gradient by the config's ``gradient_clipping`` (set from --max_grad_norm; DeepSpeed's own
  default would clip at 1.0).
- The optimizer is grpokit's torch optimizer (``zero_allow_untested_optimizer``), so no DeepSpeed op is compiled
  for it; the learning-rate schedule is grpokit's.
- Stage 3 partitions the weights: generation copy, checkpoint and final-model helpers mirror sharding.py's, whole
  weights come through ``deepspeed.zero.GatheredParameters`` one tensor at a time (``engines.weights.whole_weight``).
  Stages 0-2 keep whole weights on every rank: the in-process engine samples from the live policy.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
from pathlib import Path

import torch

from grpokit.engines.weights import whole_weight
from grpokit.errors import ConfigError

_ZERO3 = {
    "stage": 3,
    "overlap_comm": False,
    "contiguous_gradients": True,
    "sub_group_size": 1e9,
    "reduce_bucket_size": "auto",
    "stage3_prefetch_bucket_size": "auto",
    "stage3_param_persistence_threshold": "auto",
    "stage3_max_live_parameters": 1e9,
    "stage3_max_reuse_distance": 1e9,
    "stage3_gather_16bit_weights_on_model_save": True,
}
_OFFLOAD = {
    "offload_optimizer": {"device": "cpu", "pin_memory": True},
    "offload_param": {"device": "cpu", "pin_memory": True},
}
# ms-swift's preset names
PRESETS: dict[str, dict] = {
    "zero0": {"stage": 0},
    "zero1": {"stage": 1},
    "zero2": {"stage": 2},
    "zero2_offload": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}},
    "zero3": _ZERO3,
    "zero3_offload": {**_ZERO3, **_OFFLOAD},
}
DEEPSPEED_STATE_DIR = "deepspeed"  # inside a checkpoint's accelerate state folder


def load_spec(spec: str) -> dict:
    """The DeepSpeed config of ``--deepspeed PRESET|file.json`` (a fresh dict)."""
    if spec in PRESETS:
        return {"zero_optimization": copy.deepcopy(PRESETS[spec])}
    path = Path(spec)
    if not path.is_file():
        raise ConfigError(f"--deepspeed {spec}: use one of {', '.join(PRESETS)} or the path of a DeepSpeed JSON file")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"--deepspeed {spec}: not valid JSON ({e})") from e
    if not isinstance(config, dict):
        raise ConfigError(f"--deepspeed {spec}: the file must hold a JSON object, got {type(config).__name__}")
    return config


def stage_of(config: dict, spec: str) -> int:
    stage = config.get("zero_optimization", {}).get("stage", 0)
    if not isinstance(stage, int) or not 0 <= stage <= 3:
        raise ConfigError(f"--deepspeed {spec}: zero_optimization.stage must be an integer 0-3, got {stage!r}")
    return stage


def deepspeed_config(args, hidden_size: int, world: int) -> dict:
    """The DeepSpeed config of any stage with every "auto" filled from the training options and the model size; a
    value that disagrees with the options, or a section grpokit builds itself, is refused."""
    spec = args.deepspeed
    ds = load_spec(spec)
    stage_of(ds, spec)
    for section in ("optimizer", "scheduler"):
        if section in ds:
            raise ConfigError(
                f'--deepspeed {spec}: drop the "{section}" section; grpokit builds the optimizer and '
                "schedule from --optimizer/--learning_rate/--lr_scheduler_type"
            )
    micro, accumulation = args.per_device_train_batch_size, args.gradient_accumulation_steps
    want = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accumulation,
        "train_batch_size": micro * accumulation * world,
        "gradient_clipping": args.max_grad_norm if args.max_grad_norm > 0 else 0.0,
    }
    for key, value in want.items():
        if ds.get(key, "auto") not in ("auto", value):
            raise ConfigError(
                f"--deepspeed {spec}: {key} {ds[key]} in the file differs from the training options "
                f'({value}); set it to "auto" in the file'
            )
        ds[key] = value
    if ds.get("managed_gradient_accumulation") is False:
        raise ConfigError(
            f"--deepspeed {spec}: managed_gradient_accumulation false is not supported (grpokit "
            "steps the engine on every micro-step); drop it from the file"
        )
    zero = ds.setdefault("zero_optimization", {})
    auto = {
        "reduce_bucket_size": hidden_size * hidden_size,
        "allgather_bucket_size": hidden_size * hidden_size,
        "stage3_prefetch_bucket_size": int(0.9 * hidden_size * hidden_size),
        "stage3_param_persistence_threshold": 10 * hidden_size,
    }
    for key, value in auto.items():
        if zero.get(key) == "auto":
            zero[key] = value
    _check_precision(ds, spec)
    ds.setdefault("steps_per_print", 10**9)
    ds["zero_allow_untested_optimizer"] = True  # grpokit's torch optimizer: no DeepSpeed op to compile
    ds["zero_force_ds_cpu_optimizer"] = False  # the same with optimizer offload
    left = [k for k, v in _flat(ds) if v == "auto"]
    if left:
        raise ConfigError(f'--deepspeed {spec}: grpokit cannot fill "auto" for {", ".join(left)}; give values')
    return ds


def _check_precision(ds: dict, spec: str) -> None:
    """Precision is the model's dtype and --torch_dtype's autocast, as with DDP and --fsdp: float32 weights and
    bf16/fp16 compute. DeepSpeed's own bf16/fp16 mode would cast the weights themselves (float32 copies only in its
    optimizer) and compute other numbers (docs/distributed.md, "Precision"): "auto" turns it off, true is refused."""
    for section in ("bf16", "bfloat16", "fp16"):  # "bfloat16": DeepSpeed's older name of the bf16 section
        if section not in ds:
            continue
        value = ds[section]
        if not isinstance(value, dict):
            raise ConfigError(
                f'--deepspeed {spec}: the "{section}" section must be a JSON object such as '
                '{"enabled": "auto"}, got ' + json.dumps(value)
            )
        enabled = value.get("enabled", False)  # DeepSpeed's default
        if enabled == "auto":
            value["enabled"] = False
        elif enabled is not False:
            dtype = "float16" if section == "fp16" else "bfloat16"
            raise ConfigError(
                f"--deepspeed {spec}: {section}.enabled {json.dumps(enabled)} would make DeepSpeed train "
                f"{dtype} weights, which computes other numbers than DDP and --fsdp (float32 weights, "
                f'{dtype} autocast); set it to "auto" or false and pass --torch_dtype {dtype}'
            )


def _flat(d: dict, prefix: str = ""):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _flat(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def is_zero3(model) -> bool:
    """True for a DeepSpeed ZeRO-3 engine, or a module whose parameters ZeRO-3 partitioned."""
    if hasattr(model, "zero_optimization_stage"):
        return model.zero_optimization_stage() == 3
    return isinstance(model, torch.nn.Module) and any(hasattr(p, "ds_id") for p in model.parameters())


def is_engine(model) -> bool:
    """True for a DeepSpeed engine (what --deepspeed wraps the policy in)."""
    return hasattr(model, "zero_optimization_stage") and hasattr(model, "save_checkpoint")


class ProcessGroupLease:
    """The one-process group a run formed for itself (``ensure_process_group``) and the launcher variables it set;
    ``release()`` (idempotent) undoes both. The run that formed it holds it and releases it at its end or when its
    set-up fails: nothing about it is kept in this module."""

    def __init__(self, saved_env: dict[str, str | None] | None = None, owned: bool = False) -> None:
        """No arguments: a lease of nothing (a launcher's group, or a run that needs none)."""
        self._saved: dict[str, str | None] | None = saved_env  # the variables as they were (None: unset)
        self.owned = owned  # whether the group is this run's (else vLLM colocate's, which destroys it itself)

    @property
    def held(self) -> bool:
        """Whether releasing it still undoes something."""
        return bool(self._saved)

    def release(self) -> None:
        """The group destroyed after a barrier, with DeepSpeed's references to it
        (``deepspeed.comm.destroy_process_group``: a second run in this process would otherwise reach the dead group
        through them), and the launcher variables put back. Only the variables when vLLM formed the group (the
        engine's close destroys it)."""
        import sys

        import torch.distributed as dist

        saved, self._saved = self._saved, None
        if not saved:  # released already, or nothing held
            return
        if self.owned and dist.is_initialized():
            dist.barrier()
            comm = sys.modules.get("deepspeed.comm")  # imported only when --deepspeed ran
            if comm is not None and comm.is_initialized():
                comm.destroy_process_group()
            if dist.is_initialized():
                dist.destroy_process_group()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def ensure_process_group(device: torch.device) -> ProcessGroupLease:
    """A one-process group (gloo on CPU, NCCL on CUDA) on a free local port when no launcher formed one, with the
    variables a launcher would set (DeepSpeed requires LOCAL_RANK), so that DeepSpeed and FSDP2 run in a single
    process without MPI discovery (mpi4py). Returns the lease the caller releases at the end of its run (one of
    nothing when a launcher's group is there: accelerate's ``end_training`` destroys that one).

    A one-process group that vLLM colocate formed before (no launcher: vLLM starts its own) is used as it is, with
    the launcher variables set for DeepSpeed; its lease restores only the variables."""
    import socket

    import torch.distributed as dist

    joined = dist.is_initialized()
    if joined and (dist.get_world_size() > 1 or "LOCAL_RANK" in os.environ):  # a launcher's group
        return ProcessGroupLease()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launcher = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    saved = {key: os.environ.get(key) for key in launcher}
    for key, value in launcher.items():
        os.environ.setdefault(key, value)
    if not joined:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method="env://")
    return ProcessGroupLease(saved, owned=not joined)


@contextlib.contextmanager
def released_on_error(lease: ProcessGroupLease):
    """A set-up step of the run holding ``lease``: the lease is released if it raises (nobody else would)."""
    try:
        yield
    except BaseException:
        lease.release()
        raise


class EngineStep:
    """What the loop calls ``optimizer``: ``step()`` is the engine's step on every micro-step (at the accumulation
    boundary: reduction, clipping, optimizer step, zeroing)."""

    def __init__(self, engine, optimizer) -> None:
        self.engine, self.optimizer = engine, optimizer
        self.grad_norm: float | None = None  # the last step's global gradient norm, before clipping

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def step(self, closure=None) -> None:
        boundary = self.engine.is_gradient_accumulation_boundary()
        norm = _stage0_grad_norm(self.engine) if boundary else None
        self.engine.step()
        if boundary:
            self.grad_norm = self.engine.get_global_grad_norm()
            self.grad_norm = norm if self.grad_norm is None else float(self.grad_norm)

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """The engine zeroes the gradients in its step."""


def _stage0_grad_norm(engine) -> float | None:
    """Stage 0 keeps no norm (its torch optimizer reports none): the 2-norm of the module's gradients, all-reduced
    in the boundary's backward, before the step clips them."""
    if engine.zero_optimization_stage() != 0:
        return None
    grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
    return float(torch.nn.utils.get_total_norm(grads)) if grads else None


def grad_norm(optimizer) -> float | None:
    """The gradient norm (before clipping) of the optimizer step just taken by a DeepSpeed engine (``EngineStep``),
    as the loop's clipping reports it without DeepSpeed; None for any other optimizer."""
    return optimizer.grad_norm if isinstance(optimizer, EngineStep) else None


def _without_the_cpu_shm_kernel() -> None:
    """On a CPU, DeepSpeed's comm layer compiles its shared-memory all-reduce kernel with g++ as it starts (about
    45 s on 2 cores, once per installation; an error where no compiler is installed). Only DeepSpeed's inference
    all-reduce calls it, never ZeRO training, whose collectives go through torch.distributed: marked unavailable in
    DeepSpeed's table of compatible ops (a module attribute it computes once and keeps), the layer starts without
    it and nothing is compiled."""
    import deepspeed.ops  # an optional heavy package, imported only with --deepspeed: not at the top
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() == "cpu":
        builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
        if builder is not None:
            deepspeed.ops.__compatible_ops__[builder.NAME] = False


def initialize(model, optimizer, config: dict):
    """A DeepSpeed engine over ``model`` (and ``optimizer`` when training) in the existing process group."""
    import deepspeed  # an optional heavy package, imported only with --deepspeed: not at the top

    _without_the_cpu_shm_kernel()
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=copy.deepcopy(config))
    return engine


def full_state_dict(engine) -> dict:
    """The module's whole parameters on rank 0 (CPU), empty elsewhere; a collective, one tensor at a time."""
    import torch.distributed as dist

    main = dist.get_rank() == 0
    out = {}
    for name, param in getattr(engine, "module", engine).named_parameters():
        with whole_weight(param) as whole:
            if main:
                out[name] = whole.detach().cpu().clone()
    return out


def checkpoint_hooks(accelerator, engine) -> None:
    """The engine's own checkpoint (weights and optimizer state, partitioned ones by every rank) inside
    accelerate's ``save_state``/``load_state``, next to the schedule and RNG states."""

    def save(_models, _weights, output_dir: str) -> None:
        engine.save_checkpoint(os.path.join(output_dir, DEEPSPEED_STATE_DIR), tag="state")

    def load(_models, input_dir: str) -> None:
        path = os.path.join(input_dir, DEEPSPEED_STATE_DIR)
        if not os.path.isdir(path):
            raise ConfigError(
                f"--resume_from_checkpoint: {input_dir} holds no DeepSpeed state "
                f"({DEEPSPEED_STATE_DIR}); it was saved without --deepspeed: resume it the same way"
            )
        engine.load_checkpoint(path, tag="state", load_optimizer_states=True, load_lr_scheduler_states=False)

    accelerator.register_save_state_pre_hook(save)
    accelerator.register_load_state_pre_hook(load)
