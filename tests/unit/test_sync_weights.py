"""LoRA weights for an engine: ``iter_sync_weights`` merges each LoRA layer as ``W + delta`` without touching the
model, and gives exactly what peft's ``merge_adapter`` writes (plain, rsLoRA, several target kinds)."""

from __future__ import annotations

import copy

import pytest
import torch

from grpokit.engines.weights import iter_sync_weights, named_sync_tensors, plain_name

# numerics: run again by .ci/run under the other dtype choice and torch's default thread count;
# synced weights are compared with the policy's tensors
pytestmark = pytest.mark.numerics


def _peft_model(seed: int = 0, attention_bias: bool = False, **lora):
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        tie_word_embeddings=True,
        attention_bias=attention_bias,
    )
    model = get_peft_model(
        Qwen3ForCausalLM(config), LoraConfig(**{"r": 4, "lora_alpha": 8, "target_modules": "all-linear", **lora})
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:  # peft starts B at zero: a delta of zero would prove nothing
                p.normal_(std=0.1)
    return model


def _merged_by_peft(model) -> dict[str, torch.Tensor]:
    other = copy.deepcopy(model)
    other.merge_adapter()
    return {plain_name(n): p.detach().clone() for n, p in other.named_parameters() if plain_name(n) is not None}


@pytest.mark.parametrize("lora", [{}, {"use_rslora": True}, {"lora_dropout": 0.1, "lora_alpha": 3}])
def test_merged_weights_equal_peft_merge_adapter_and_leave_the_model_alone(lora):
    model = _peft_model(**lora)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    want = _merged_by_peft(model)
    got = dict(iter_sync_weights(model))
    assert list(got) == [n for n, _ in named_sync_tensors(model)]  # the order a server push plans its buckets in
    assert got.keys() == want.keys() and "model.layers.0.self_attn.q_proj.weight" in got
    for name in want:
        assert torch.equal(got[name], want[name]), name
    moved = (
        want["model.layers.0.mlp.down_proj.weight"]
        - before["base_model.model.model.layers.0.mlp.down_proj.base_layer.weight"]
    )
    assert moved.abs().max() > 1e-3  # the adapters did change the weights
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # nothing merged in place


def test_disabled_adapter_layers_are_not_merged():
    model = _peft_model()
    model.base_model.set_adapter([])  # no active adapter: merge_adapter merges nothing either
    got = dict(iter_sync_weights(model))
    base = dict(model.named_parameters())["base_model.model.model.layers.1.self_attn.o_proj.base_layer.weight"]
    assert torch.equal(got["model.layers.1.self_attn.o_proj.weight"], base)


def test_stable_tensors_outlive_the_next_step():
    model = _peft_model()
    gen = iter_sync_weights(model, stable=True)
    first_name, first = next(gen)
    snapshot = first.clone()
    rest = dict(gen)
    assert first_name not in rest and torch.equal(first, snapshot)


@pytest.mark.parametrize(
    "lora",
    [
        {"use_dora": True},  # a LoRA bias needs a base bias: the attention's here
        {"lora_bias": True, "attention_bias": True, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
    ],
)
def test_dora_and_lora_bias_go_through_peft_merge_of_the_layer_and_are_undone(lora):
    model = _peft_model(**lora)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_magnitude_vector" in name or ("lora_B" in name and name.endswith("bias")):
                p.add_(torch.randn_like(p) * 0.1)  # make the magnitude and the LoRA bias matter too
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    want = _merged_by_peft(model)
    got = dict(iter_sync_weights(model))
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    for n, p in model.named_parameters():  # merged and unmerged again: the weights as they were
        assert torch.allclose(p, before[n], atol=1e-6), n
