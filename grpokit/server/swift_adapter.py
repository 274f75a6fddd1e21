"""ms-swift's ``POST /update_adapter_flattened_param/`` on the rollout server: the trainer's LoRA adapter (its PEFT
config and one flattened bucket of factors) loaded as a new version over the model as the server loaded it, by the
same code as grpokit's own adapter-only sync (engines/adapter_store.py). ``/update_adapter_param/`` (one broadcast
per tensor) answers 501: ms-swift's trainer sends the flattened form unless told otherwise.
"""

from __future__ import annotations

from fastapi import FastAPI, HTTPException
from pydantic import ValidationError

from grpokit.engines.adapter_store import LOADED_BASE
from grpokit.server.swift_weights import QueueFull, SwiftWeightGroup, swift_adapter_name, tensor_metas
from grpokit.wire.bodies import AdapterBody
from grpokit.wire.swift import SwiftAdapterBody, SwiftFlattenedBody

UNSERVED = {  # PEFT config keys that make an adapter more than a low-rank delta per linear layer
    "use_dora": "DoRA",
    "modules_to_save": "modules_to_save",
    "rank_pattern": "a per-module rank_pattern",
    "alpha_pattern": "a per-module alpha_pattern",
    "lora_bias": "lora_bias",
}


def adapter_spec(peft_config: dict) -> AdapterBody:
    """The adapter's scale from ms-swift's PEFT config; HTTPException 422 for one this server cannot serve."""
    for key, what in UNSERVED.items():
        if peft_config.get(key):
            raise HTTPException(422, f"peft_config.{key}: {what} cannot be served unmerged; sync merged weights")
    try:
        return AdapterBody(
            r=peft_config.get("r", 8),
            lora_alpha=peft_config.get("lora_alpha", 8),
            use_rslora=bool(peft_config.get("use_rslora", False)),
            base_id=LOADED_BASE,
        )
    except ValidationError as e:
        raise HTTPException(422, f"peft_config: {e.errors()[0]['loc'][0]}: {e.errors()[0]['msg']}") from e


def add_adapter_routes(app: FastAPI, state, group: SwiftWeightGroup, check) -> None:
    """``check(metas, nbytes)``: swift_routes' checks of a bucket against the group and the served model."""

    @app.post("/update_adapter_flattened_param/")
    async def update_adapter_flattened_param(body: SwiftAdapterBody) -> dict:
        if getattr(state.engine, "adapters", None) is None:
            raise HTTPException(
                501,
                "/update_adapter_flattened_param/: this server runs with --vllm_enable_lora false (LoRA adapters "
                "are not served); restart it with --vllm_enable_lora true",
            )
        spec = adapter_spec(body.peft_config)
        try:
            flat = SwiftFlattenedBody(metadatas=(body.model_extra or {}).get("metadatas") or [])
        except ValidationError as e:
            raise HTTPException(422, f"metadatas: {e.errors()[0]['msg']}") from e
        metas = [m.model_copy(update={"name": swift_adapter_name(m.name)}) for m in tensor_metas(flat)]
        check(metas, flat.metadatas[-1].end_idx)
        try:
            group.receive_adapter(flat, spec)
        except QueueFull as e:
            raise HTTPException(429, str(e), headers={"Retry-After": "5"}) from e
        return {"message": "Request received, updating adapter"}

    @app.post("/update_adapter_param/")
    async def update_adapter_param(body: SwiftAdapterBody) -> dict:
        raise HTTPException(
            501,
            "/update_adapter_param/: adapters one tensor at a time are not implemented; grpokit rollout loads "
            "them flattened (POST /update_adapter_flattened_param/, ms-swift's default)",
        )
