"""ms-swift's ``/update_adapter_flattened_param/`` on a real served transformers engine (tiny model, gloo, in
process): the trainer's PEFT state-dict keys and config load as a new LoRA version whose served weights equal the
merged ones; what cannot be served unmerged is refused before any broadcast."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

from grpokit.engines.weights import iter_sync_weights
from grpokit.modeling import load_causal_lm
from grpokit.rollout.scheduler import RolloutScheduler
from grpokit.server.app import create_app
from grpokit.server.state import ServerOptions, ServerState, build_served_engine
from grpokit.testing import build_tiny_model, free_port
from grpokit.wire.swift_group import broadcast, open_group

CONFIG = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


def _client(tiny):
    from fastapi.testclient import TestClient

    options = ServerOptions(model=str(tiny), engine="transformers", max_sync_timeout_s=30.0, torch_dtype="float32")
    engine = build_served_engine("transformers", str(tiny), "float32")
    engine.serve_adapters(options.vllm_max_lora_rank)
    state = ServerState(options, engine, RolloutScheduler(engine))
    return TestClient(create_app(state), base_url="http://127.0.0.1"), state


def _flat(state_dict: dict) -> tuple[torch.Tensor, list[dict]]:
    chunks, metas, at = [], [], 0
    for name, t in state_dict.items():
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
        metas.append({"name": name, "shape": list(t.shape), "dtype": "torch.float32", "start_idx": at,
                      "end_idx": at + raw.numel(), "numel": raw.numel()})  # fmt: skip
        chunks.append(raw)
        at += raw.numel()
    return torch.cat(chunks), metas


def test_an_ms_swift_adapter_loads_as_a_version(tiny, monkeypatch):
    monkeypatch.delenv("GRPOKIT_API_KEY", raising=False)
    client, state = _client(tiny)
    assert client.post("/get_engine_type/").json()["enable_lora"] is True
    policy = get_peft_model(load_causal_lm(str(tiny), torch.float32), LoraConfig(**CONFIG))
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.1)
    flat, metas = _flat(get_peft_model_state_dict(policy))  # base_model.model.<module>.lora_A.weight
    refused = client.post("/update_adapter_flattened_param/", json={"peft_config": {**CONFIG, "use_dora": True},
                                                                    "metadatas": metas})  # fmt: skip
    assert refused.status_code == 422 and "DoRA" in refused.json()["error"]
    port = free_port()
    init = client.post("/init_communicator/", json={"host": "0.0.0.0", "port": port, "world_size": 2})
    assert init.status_code == 200
    comm = open_group("127.0.0.1", port, 1, 2, "gloo", 30.0)
    try:
        answer = client.post("/update_adapter_flattened_param/", json={"peft_config": CONFIG, "metadatas": metas})
        assert answer.status_code == 200, answer.text
        broadcast(comm, flat, src=1)
        done = client.post("/process_weights_after_loading/")
        assert done.status_code == 200, done.text
    finally:
        client.post("/close_communicator/")
        comm.close()
    served = state.engine._params
    for name, want in iter_sync_weights(policy, stable=True):
        assert torch.equal(served[name], want), name
    assert state.engine.adapters.active == state.weight_version == 1
