"""The packed rows (trainers/packed_groups.py): each distinct prompt once and the completions without their padding give
the padded forward's logps, entropies and gradients; batches it cannot pack take the padded path."""

from __future__ import annotations

import pytest
import torch
from test_prefix_sharing import _batch, assert_equal_up_to_summation_order

from grpokit.trainers import packed_groups
from grpokit.trainers.packing import ForwardOptions, completion_logps

# numerics: run again by .ci/run under the other dtype choice and torch's default thread count
pytestmark = pytest.mark.numerics


def _model(tiny_model_dir, lora: bool | str, attention: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation=attention)
    if lora:
        from peft import LoraConfig, get_peft_model

        targets = ["q_proj", "v_proj", "lm_head"] if lora == "head" else "all-linear"  # "head": the chunked head's
        model = get_peft_model(model, LoraConfig(r=4, target_modules=targets, init_lora_weights=False))  # LoRA term
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


@pytest.mark.parametrize(
    ("lora", "attention", "interleaved"),
    [(False, "sdpa", False), (True, "sdpa", False), ("head", "sdpa", True), (False, "eager", True)],
)
def test_packed_rows_equal_the_padded_forward(tiny_model_dir, monkeypatch, lora, attention, interleaved):
    model = _model(tiny_model_dir, lora, attention)
    ids, att, pos, c = _batch(model.get_input_embeddings().weight.shape[0])
    if interleaved:  # a group's rows need not be next to each other
        ids, att, pos = (x[[0, 3, 1, 4, 5, 2]] for x in (ids, att, pos))
    calls = []
    real = packed_groups.packed_group_logits
    monkeypatch.setattr("grpokit.trainers.packing.packed_group_logits", lambda *a: calls.append(1) or real(*a))
    packed = _logps_and_grads(model, ids, att, pos, c, share=False)  # one forward: packs without prompt sharing
    assert calls == [1]
    monkeypatch.setattr("grpokit.trainers.packing._packed_groups", lambda *a: None)
    plain = _logps_and_grads(model, ids, att, pos, c, share=False)
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
    assert not packed_groups.packable(model, {"input_ids": ids, "attention_mask": att, "position_ids": pos}, c)
    monkeypatch.setattr("grpokit.trainers.packing.packed_group_logits", lambda *a: pytest.fail("packed"))
    got = _logps_and_grads(model, ids, att, pos, c, share=True)[0]  # the cached prompt and the padded tail
    want = _logps_and_grads(model, ids, att, pos, c, share=False)[0]
    mask = att[:, -c:].bool()
    torch.testing.assert_close(got[mask], want[mask], atol=1e-5, rtol=1e-5)


def test_other_attention_or_sliding_window_is_not_packed(tiny_model_dir):
    model = _model(tiny_model_dir, False, "sdpa")
    ids, att, pos, c = _batch(model.get_input_embeddings().weight.shape[0])
    inputs = {"input_ids": ids, "attention_mask": att, "position_ids": pos}
    assert packed_groups.packable(model, inputs, c)
    assert not packed_groups.packable(model, {**inputs, "pixel_values": torch.zeros(1)}, c)
    model.config.layer_types = ["sliding_attention"] * len(model.config.layer_types)
    assert not packed_groups.packable(model, inputs, c)


def test_packing_runs_where_it_costs_less():
    plan = (torch.tensor([0, 4]), torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]))  # 2 prompts × 4 completions
    att = torch.zeros(8, 45 + 64, dtype=torch.long)
    att[:, :45] = 1
    for row, n in enumerate((64, 40, 30, 20, 64, 30, 20, 10)):  # much padding: packed
        att[row, 45 : 45 + n] = 1
    assert packed_groups.worth_packing(att, 64, plan, hidden=576)
    att[:, 45:] = 1  # no padding: nothing to save, more attention pairs
    assert not packed_groups.worth_packing(att, 64, plan, hidden=576)
    plan16 = (torch.arange(0, 16, 4), torch.arange(16) // 4)  # 4 groups of 4 long completions
    long = torch.ones(16, 512 + 1024, dtype=torch.long)
    long[:, 512 + 600 :] = 0  # much padding: packed, a row per group keeps the attention pairs bounded
    assert packed_groups.worth_packing(long, 1024, plan16, hidden=896)
    long[:, 512:] = 1
    long[:, 512 + 1000 :] = 0  # little padding in long rows: a group's attention would cost more than it saves
    assert not packed_groups.worth_packing(long, 1024, plan16, hidden=896)
