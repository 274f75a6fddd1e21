"""Adapter-only weight sync's two ends without a network (engines/adapters.py, engines/adapter_store.py): the
served weights equal the trainer's merged ones bit for bit, versions are kept K + 1 deep and unloaded only once
no rollout holds them, an incomplete update is refused naming the tensor, and adapters that cannot be served
unmerged say why."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

from grpokit.engines.adapter_store import AdapterVersions
from grpokit.engines.adapters import AdapterSpec, AdapterSync, adapter_tensors, base_tensors, unmerged_reason
from grpokit.engines.weights import iter_sync_weights
from grpokit.errors import ServerError
from grpokit.testing import build_tiny_model

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


def _load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)


def _peft(path, **extra):
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0, **extra)
    model = get_peft_model(_load(path), cfg)
    with torch.no_grad():  # B starts at zero: give every factor a value so that the delta is not nothing
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.05)
    return model


def _served(path, max_rank=16):
    model = _load(path)
    params = dict(model.named_parameters(remove_duplicate=False))
    return model, params, AdapterVersions(params, max_rank)


def _sync(store, policy, version, base=True, keep=3, drop=()):
    named = list(base_tensors(policy)) if base else []
    named += list(adapter_tensors(policy))
    store.begin(version, AdapterSpec(r=4, lora_alpha=8, use_rslora=False), "base-0", keep, [n for n, _ in named])
    store.load([(n, t) for n, t in named if n not in drop])
    return store.commit()


def test_served_weights_equal_the_merged_sync(tiny):
    policy = _peft(tiny)
    _, params, store = _served(tiny)
    with torch.no_grad():  # the served model starts elsewhere: the base must come with the first update
        for p in params.values():
            p.add_(1.0)
    _sync(store, policy, 1)
    merged = dict(iter_sync_weights(policy, stable=True))
    assert set(merged) <= set(params)
    for name, want in merged.items():
        assert torch.equal(params[name], want), name


def test_versions_kept_and_unloaded_after_their_last_rollout(tiny):
    policy = _peft(tiny)
    _, params, store = _served(tiny)
    _sync(store, policy, 1, keep=2)
    first = {n: p.clone() for n, p in params.items()}
    store.hold(1)  # a rollout samples version 1
    for v in (2, 3):
        with torch.no_grad():
            for name, p in policy.named_parameters():
                if "lora_B" in name:
                    p.add_(0.01)
        _sync(store, policy, v, base=False, keep=2)
    assert list(store.versions) == [1, 2, 3]  # 1 is held beyond keep=2
    store.activate(1)
    assert all(torch.equal(params[n], first[n]) for n in first)
    store.activate(3)
    store.release(1)
    assert list(store.versions) == [2, 3]
    with pytest.raises(ServerError, match="weight version 1 is not loaded"):
        store.activate(1)


def test_incomplete_update_names_the_missing_tensor(tiny):
    policy = _peft(tiny)
    _, params, store = _served(tiny)
    _sync(store, policy, 1)
    served = {n: p.clone() for n, p in params.items()}
    gone = "model.layers.1.mlp.down_proj.lora_B.weight"
    with pytest.raises(ServerError, match=f"{gone} did not arrive"):
        _sync(store, policy, 2, base=False, drop=(gone,))
    assert store.active == 1 and all(torch.equal(params[n], served[n]) for n in served)
    assert store.check("model.layers.0.mlp.up_proj.lora_A.weight", [32, 64]) is not None  # rank above 16


@pytest.mark.parametrize(
    ("extra", "reason"),
    [
        ({"use_dora": True}, "DoRA"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"r": 32}, "rank 32 is above --vllm_max_lora_rank 16"),
    ],
)
def test_fallback_reasons(tiny, extra, reason, caplog):
    cfg = {"r": 4, "lora_alpha": 8, "target_modules": TARGETS, **extra}
    model = get_peft_model(_load(tiny), LoraConfig(**cfg))
    assert reason in unmerged_reason(model, 16)
    sync = AdapterSync(True, 16, "the rollout server")
    assert sync.update(model) is None and sync.update(model) is None
    assert sum(reason in r.message for r in caplog.records) == 1  # said once
