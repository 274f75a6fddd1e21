"""The packed tail (trainers/packed_tail.py): shared prompts once and the completions without their padding give
the padded forward's logps, entropies and gradients; batches it cannot pack take the padded path."""

from __future__ import annotations

import pytest
import torch
from test_prefix_sharing import _batch, assert_equal_up_to_summation_order

from grpokit.trainers import packed_tail
from grpokit.trainers.packing import ForwardOptions, completion_logps

# numerics: run again by .ci/run under the other dtype choice and torch's default thread count
pytestmark = pytest.mark.numerics


def _model(tiny_model_dir, lora: bool, attention: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation=attention)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    return model.train()


def _logps_and_grads(model, ids, att, pos, c, share: bool):
    model.zero_grad()
    opts = ForwardOptions(temperature=0.7, chunk_size=1024, padding_free=False, share_prompts=share)
    inputs = {"input_ids": ids, "attention_mask": att, "position_ids": pos}
    logps, ent = completion_logps(model, inputs, c, opts, compute_entropy=True)
    mask = att[:, -c:].bool()
    (logps * mask).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logps.detach(), ent, grads


@pytest.mark.parametrize(("lora", "attention"), [(False, "sdpa"), (True, "sdpa"), (False, "eager")])
def test_packed_tail_equals_the_padded_forward(tiny_model_dir, monkeypatch, lora, attention):
    model = _model(tiny_model_dir, lora, attention)
    ids, att, pos, c = _batch(model.get_input_embeddings().weight.shape[0])
    calls = []
    real = packed_tail.packed_tail_logits
    monkeypatch.setattr("grpokit.trainers.packing.packed_tail_logits", lambda *a: calls.append(1) or real(*a))
    plain = _logps_and_grads(model, ids, att, pos, c, share=False)
    packed = _logps_and_grads(model, ids, att, pos, c, share=True)
    assert calls == [1]  # the packed tail ran (and only with sharing on)
    mask = att[:, -c:].bool()
    torch.testing.assert_close(packed[0][mask], plain[0][mask], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed[1][mask], plain[1][mask], atol=1e-5, rtol=1e-5)
    assert (packed[0][~mask] == 0).all()  # padding is not computed
    assert packed[2].keys() == plain[2].keys() and packed[2]
    for name, grad in plain[2].items():
        assert_equal_up_to_summation_order(packed[2][name], grad, name)


def test_a_completion_with_a_hole_takes_the_padded_path(tiny_model_dir, monkeypatch):
    model = _model(tiny_model_dir, False, "sdpa")
    ids, att, pos, c = _batch(model.get_input_embeddings().weight.shape[0])
    att[0, -c + 1] = 0  # a masked token inside row 0's completion: not "real tokens, then padding"
    assert not packed_tail.packable(model, {"input_ids": ids, "attention_mask": att, "position_ids": pos}, c)
    monkeypatch.setattr("grpokit.trainers.packing.packed_tail_logits", lambda *a: pytest.fail("packed"))
    got = _logps_and_grads(model, ids, att, pos, c, share=True)[0]
    want = _logps_and_grads(model, ids, att, pos, c, share=False)[0]
    mask = att[:, -c:].bool()
    torch.testing.assert_close(got[mask], want[mask], atol=1e-5, rtol=1e-5)


def test_other_attention_or_sliding_window_is_not_packed(tiny_model_dir):
    model = _model(tiny_model_dir, False, "sdpa")
    ids, att, pos, c = _batch(model.get_input_embeddings().weight.shape[0])
    inputs = {"input_ids": ids, "attention_mask": att, "position_ids": pos}
    assert packed_tail.packable(model, inputs, c)
    assert not packed_tail.packable(model, {**inputs, "pixel_values": torch.zeros(1)}, c)
    model.config.layer_types = ["sliding_attention"] * len(model.config.layer_types)
    assert not packed_tail.packable(model, inputs, c)
