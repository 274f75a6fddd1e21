"""The rollout server's adapter-only updates (``UpdateWeightsBody.adapter``), around the receive of the buckets:
``begin`` stages a new LoRA version in the engine's ``adapters`` (an ``AdapterStaging``: the transformers
engine's ``AdapterVersions``, engines/adapter_store.py, or the vLLM engine's ``ServedVllmAdapters``,
engines/vllm_adapters.py), ``end`` commits it (or puts the version in service back when the receive failed);
``refusal`` says, with the dry run, why an update cannot be served at all. A merged update makes the engine forget
its versions: the weights then hold what came.
"""

from __future__ import annotations

from grpokit.engines.adapters import AdapterSpec
from grpokit.errors import ServerError
from grpokit.wire.bodies import UpdateWeightsBody


class AdapterUpdateError(ServerError):
    """An adapter update that arrived incomplete or cannot be served (answered 422; the group stays open)."""


def held_base(engine) -> dict:
    """What the dry-run answer tells the trainer: the base its adapters apply to (absent or None: send it)."""
    adapters = getattr(engine, "adapters", None)
    return {} if adapters is None else {"adapter_base": adapters.base_id}


def refusal(engine, body: UpdateWeightsBody) -> list[str]:
    """Why this server cannot take the adapter update ``body`` at all ([] where it can): checked with the
    dry run, before any bytes move."""
    adapters = getattr(engine, "adapters", None)
    if body.adapter is None or adapters is None:
        return []
    problem = adapters.refusal(body.adapter.keep)
    return [problem] if problem else []


def begin(engine, body: UpdateWeightsBody, next_version: int, names: list[str] | None = None) -> None:
    """Before the buckets arrive (the engine's lock held); ``names``: the tensors coming (default: the body's)."""
    adapters = getattr(engine, "adapters", None)
    if body.adapter is None:
        if adapters is not None:
            adapters.forget()
        return
    if adapters is None:
        raise AdapterUpdateError("an adapter-only update, but this server runs with --vllm_enable_lora false")
    a = body.adapter
    names = [m.name for b in body.buckets for m in b.tensors] if names is None else names
    version = body.version if body.version is not None else next_version
    spec = AdapterSpec(r=a.r, lora_alpha=a.lora_alpha, use_rslora=a.use_rslora)
    adapters.begin(version, spec, a.base_id, a.keep, names)


def end(engine, body: UpdateWeightsBody, ok: bool) -> None:
    """After the buckets arrived (``ok``) or failed to: commit the staged version, or drop it."""
    adapters = getattr(engine, "adapters", None)
    if body.adapter is None or adapters is None or not adapters.staging:
        return
    if not ok:
        adapters.abort()
        return
    try:
        adapters.commit()
    except ServerError as e:
        raise AdapterUpdateError(str(e)) from e
