"""The rollout server's adapter-only updates (``UpdateWeightsBody.adapter``), around the receive of the buckets:
``begin`` stages a new LoRA version in the engine's ``AdapterVersions`` (engines/adapter_store.py), ``end``
commits it (or puts the version in service back when the receive failed). A merged update makes the engine forget
its versions: the parameters then hold what came.
"""

from __future__ import annotations

from grpokit.engines.adapters import lora_scale
from grpokit.errors import ServerError
from grpokit.wire.bodies import UpdateWeightsBody


class AdapterUpdateError(ServerError):
    """An adapter update that arrived incomplete or cannot be served (answered 422; the group stays open)."""


def held_base(engine) -> dict:
    """What the dry-run answer tells the trainer: the base its adapters apply to (absent or None: send it)."""
    adapters = getattr(engine, "adapters", None)
    return {} if adapters is None else {"adapter_base": adapters.base_id}


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
    adapters.begin(version, lora_scale(a.r, a.lora_alpha, a.use_rslora), a.base_id, a.keep, names)


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
