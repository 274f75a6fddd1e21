"""``--fsdp``: PyTorch FSDP2 (``torch.distributed.fsdp.fully_shard``) driven directly, the same way on CPU and GPU.

accelerate 1.15 turns FSDP on only across GPU processes and silently runs DDP instead on CPU, so grpokit does not
hand FSDP to accelerate: the Accelerator runs as plain multi-process (gloo on CPU, NCCL on GPUs) and this module
shards the model itself, each decoder layer (the model's ``_no_split_modules``) and then the root. FSDP2 averages
gradients over the ranks as DDP does, so the loss math is unchanged.

What the rest of the run needs from a sharded model is here too:
- generation: the in-process engine samples from a whole copy of the policy on each rank
  (``GatheredWeightsEngine``), refreshed from the shards one tensor at a time after every optimizer step;
- checkpoints: model and optimizer shards through ``torch.distributed.checkpoint`` (``checkpoint_hooks``), while
  accelerate saves the learning-rate schedule and the RNG states as usual;
- the final model: a full state dict gathered on rank 0 (``distributed.full_state_dict``), saved as a plain HF
  folder.
"""

from __future__ import annotations

import copy
import os

import torch

from grpokit.engines.transformers_engine import TransformersEngine
from grpokit.engines.weights import whole_weight
from grpokit.errors import ConfigError
from grpokit.template.encode import ChatTemplate

SHARDED_STATE_DIR = "fsdp_sharded"  # inside a checkpoint's accelerate state folder


def _hf_model(model):
    """The Hugging Face model inside a peft wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def decoder_layer_names(model) -> set[str]:
    """Class names of the model's decoder layers, the FSDP2 units (transformers' ``_no_split_modules``)."""
    names = set(getattr(_hf_model(model), "_no_split_modules", None) or [])
    found = {type(m).__name__ for m in model.modules()} & names
    if not found:
        raise ConfigError(
            f"--fsdp: {type(_hf_model(model)).__name__} names no decoder layer class "
            "(_no_split_modules) to shard; drop --fsdp (plain DDP) for this model"
        )
    return found


def shard_model(model, device: torch.device):
    """Shard ``model`` in place with FSDP2 over all processes: each decoder layer, then the root (embeddings, norm,
    lm_head). Every rank must call it, in a process group: a launcher's, or the one-process group the set-up forms
    for a single process started without one (``zero.ensure_process_group``): nothing is sharded then, but the run
    takes the same code path as under a launcher. Returns the model, now an FSDP module."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    model.to(device)
    layers = decoder_layer_names(model)
    for module in list(model.modules()):
        if type(module).__name__ in layers:
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def generation_copy(model):
    """A whole, frozen copy of the model (before sharding) for the in-process engine to sample from."""
    whole = copy.deepcopy(model)
    whole.requires_grad_(False)
    return whole.eval()


class GatheredWeightsEngine(TransformersEngine):
    """The in-process transformers engine for a sharded policy (FSDP2 or ZeRO-3): it samples from a whole copy on
    each rank, so ranks generate independently (no collective per token, any number of calls per rank).
    ``sync_weights`` copies the trainable weights over from the shards, one tensor gathered at a time: a
    collective that the trainer calls on every rank after each optimizer step and on resume."""

    def __init__(self, whole_model, template: ChatTemplate, device: torch.device, **options) -> None:
        super().__init__(whole_model.to(device), template, **options)  # fast_decode, infer_on_loop_thread

    @torch.no_grad()
    def sync_weights(self, model) -> None:
        own = dict(self.model.named_parameters())
        for name, param in model.named_parameters():
            if not param.requires_grad:  # frozen weights (a LoRA base) never change: the copy has them
                continue
            if name not in own:
                raise RuntimeError(
                    f"the generation copy has no parameter {name!r}: the sharded model's names "
                    "changed after the copy was taken"
                )
            with whole_weight(param) as whole:  # FSDP2 shards or ZeRO-3 partitions, gathered
                own[name].copy_(whole)


def checkpoint_hooks(accelerator, model, optimizer) -> None:
    """Save and load the model's and optimizer's shards with ``torch.distributed.checkpoint`` inside accelerate's
    ``save_state``/``load_state`` (each rank writes and reads its own shards; resume in the same world size)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def state() -> dict:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        return {"model": model_sd, "optimizer": optim_sd}

    def save(_models, _weights, output_dir: str) -> None:
        dcp.save(state(), checkpoint_id=os.path.join(output_dir, SHARDED_STATE_DIR))

    def load(_models, input_dir: str) -> None:
        path = os.path.join(input_dir, SHARDED_STATE_DIR)
        if not os.path.isdir(path):
            raise ConfigError(
                f"--resume_from_checkpoint: {input_dir} holds no FSDP shards ({SHARDED_STATE_DIR}); "
                "it was saved without --fsdp: resume it without --fsdp"
            )
        loaded = state()
        dcp.load(loaded, checkpoint_id=path)
        set_state_dict(model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optimizer"])

    accelerator.register_save_state_pre_hook(save)
    accelerator.register_load_state_pre_hook(load)
