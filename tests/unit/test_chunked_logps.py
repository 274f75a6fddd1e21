"""Chunked logps (the output head applied a chunk of rows at a time, in the head's place) equal the plain path's
full-logits logps in value and gradient: float64, to 1e-6, for tied and untied heads, biases, LoRA (also on the
head), temperature != 1, entropies, prompt sharing and a DDP wrapper."""

from __future__ import annotations

import gc
from unittest import mock

import pytest
import torch
from support import padded_batch
from torch import nn

from grpokit.algorithms.chunked_logps import chunked_lm_head_logps
from grpokit.algorithms.logps import entropy_from_logits, selective_log_softmax
from grpokit.engines.chunked_head import plain_reason
from grpokit.trainers.packing import ForwardOptions, completion_logps

# numerics: run again by .ci/run under the other dtype choice and torch's default thread count;
# chunked head log-probs equal the full head's within float tolerance
pytestmark = pytest.mark.numerics

TOL = 1e-6


def test_gradcheck_hidden_weight_bias():
    # float64 finite differences against the hand-written backward, chunks of 3 rows over 2×5 = 10 rows
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 5, 7, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(11, 7, dtype=torch.float64, generator=g, requires_grad=True)
    bias = torch.randn(11, dtype=torch.float64, generator=g, requires_grad=True)
    targets = torch.randint(0, 11, (2, 5), generator=g)

    def f(h, w, b):
        return chunked_lm_head_logps(h, w, b, targets, temperature=0.7, chunk_size=3)[0]

    assert torch.autograd.gradcheck(f, (hidden, weight, bias))


def test_gradcheck_low_rank_term():
    # a LoRA head: logits = h·Wᵀ + u·Bᵀ with u = s·A(h); gradients reach u (hence A) and B
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(7, 6, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(9, 6, dtype=torch.float64, generator=g)  # frozen base weight: no gradient made
    u = torch.randn(7, 2, dtype=torch.float64, generator=g, requires_grad=True)
    lr_weight = torch.randn(9, 2, dtype=torch.float64, generator=g, requires_grad=True)
    targets = torch.randint(0, 9, (7,), generator=g)

    def f(h, u, b):
        return chunked_lm_head_logps(h, weight, None, targets, 1.2, 3, low_rank=(u, b))[0]

    assert torch.autograd.gradcheck(f, (hidden, u, lr_weight))
    want = selective_log_softmax(((hidden @ weight.T + u @ lr_weight.T) / 1.2)[None], targets[None])[0]
    assert torch.allclose(f(hidden, u, lr_weight), want, atol=TOL, rtol=0)


@pytest.mark.parametrize("chunk_size", [1, 4, 1000])
def test_values_and_entropy_equal_full_logits(chunk_size):
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(3, 6, 8, dtype=torch.float64, generator=g)
    weight = torch.randn(50, 8, dtype=torch.float64, generator=g)
    targets = torch.randint(0, 50, (3, 6), generator=g)
    logps, ent = chunked_lm_head_logps(hidden, weight, None, targets, 1.3, chunk_size, compute_entropy=True)
    logits = hidden @ weight.T / 1.3
    assert logps.shape == ent.shape == (3, 6)
    assert torch.allclose(logps, selective_log_softmax(logits, targets), atol=TOL, rtol=0)
    assert torch.allclose(ent, entropy_from_logits(logits), atol=TOL, rtol=0)


def test_bad_arguments_are_refused():
    h, w, t = torch.zeros(2, 3), torch.zeros(5, 3), torch.zeros(2, dtype=torch.long)
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        chunked_lm_head_logps(h, w, None, t, chunk_size=0)
    with pytest.raises(ValueError, match=r"weight \[V, H\]"):
        chunked_lm_head_logps(h, torch.zeros(5, 4), None, t)


def _model(tied: bool, lora: str | None = None, dropout: float = 0.0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        tie_word_embeddings=tied,
    )
    model = Qwen3ForCausalLM(cfg).to(torch.float64)
    if lora:
        from peft import LoraConfig, get_peft_model

        targets = ["q_proj", "v_proj", "lm_head"] if lora == "head" else "all-linear"
        model = get_peft_model(
            model, LoraConfig(r=4, target_modules=targets, lora_dropout=dropout, init_lora_weights=False)
        )
    model.train()
    return model


def _run(model, inputs, c, chunk_size, share=False, temperature=0.8, entropy=True):
    """logps, entropies and every parameter's gradient of Σ logps over real completion tokens."""
    model.zero_grad()
    torch.manual_seed(1)  # the same dropout masks in both paths
    opts = ForwardOptions(temperature=temperature, chunk_size=chunk_size, padding_free=False, share_prompts=share)
    with mock.patch("grpokit.trainers.packing._packed_groups", lambda *a: None):  # both heads on padded rows
        logps, ent = completion_logps(model, inputs, c, opts, compute_entropy=entropy)
    mask = inputs["attention_mask"][:, -c:].bool()
    (logps * mask).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logps.detach()[mask], (ent[mask] if ent is not None else None), grads


def _assert_same(chunked, plain):
    assert chunked[0].dtype == torch.float64
    assert torch.allclose(chunked[0], plain[0], atol=TOL, rtol=0)
    if plain[1] is not None:
        assert torch.allclose(chunked[1], plain[1], atol=TOL, rtol=0)
    assert chunked[2].keys() == plain[2].keys() and chunked[2]
    for name, grad in plain[2].items():
        assert torch.allclose(chunked[2][name], grad, atol=TOL, rtol=0), name


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("share", [False, True])
def test_model_logps_and_gradients_equal_plain_path(tied, share):
    model = _model(tied)
    inputs, c = padded_batch()
    assert plain_reason(model) is None  # the chunked head really runs
    chunked = _run(model, inputs, c, chunk_size=5, share=share)
    plain = _run(model, inputs, c, chunk_size=0, share=share)
    _assert_same(chunked, plain)
    head = "model.embed_tokens.weight" if tied else "lm_head.weight"
    assert plain[2][head].abs().sum() > 0  # the head's weight gradient is part of the comparison


@pytest.mark.parametrize("lora,dropout", [("all-linear", 0.0), ("head", 0.0), ("head", 0.3)])
def test_lora_logps_and_gradients_equal_plain_path(lora, dropout):
    model = _model(tied=False, lora=lora, dropout=dropout)
    inputs, c = padded_batch()
    assert plain_reason(model) is None
    chunked = _run(model, inputs, c, chunk_size=3)
    plain = _run(model, inputs, c, chunk_size=0)
    _assert_same(chunked, plain)
    if lora == "head":
        assert any("lm_head.lora_B" in n for n in plain[2])
        opts = [ForwardOptions(0.8, size, padding_free=False, share_prompts=False) for size in (3, 0)]
        with model.disable_adapter(), torch.no_grad():  # the reference forward: base head only (the chunked head
            ref_chunked, ref_plain = (completion_logps(model, inputs, c, o)[0] for o in opts)  # on packed rows)
        mask = inputs["attention_mask"][:, -c:].bool()
        assert torch.allclose(ref_chunked[mask], ref_plain[mask], atol=TOL, rtol=0)


def test_ddp_wrapper_goes_through_its_forward(tmp_path):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = _model(tied=True)
        ddp = DistributedDataParallel(model)
        inputs, c = padded_batch()
        calls = []
        ddp.register_forward_pre_hook(lambda *_: calls.append(1))
        chunked = _run(ddp, inputs, c, chunk_size=4)
        plain = _run(ddp, inputs, c, chunk_size=0)
        assert len(calls) == 2  # both forwards ran through DDP's own forward (its gradient hooks armed)
        _assert_same(chunked, plain)
    finally:
        # DDP's reducer holds the group: dropped after the group is destroyed, it joins gloo's worker threads in
        # the group's destructor and can wait for ever (seen once in CI; tests/integration/test_clean_exit.py)
        model = ddp = chunked = plain = None  # noqa: F841 (released here, before the group)
        gc.collect()
        dist.destroy_process_group()


def test_models_that_transform_the_head_output_take_the_plain_path():
    model = _model(tied=True)
    model.config.final_logit_softcapping = 30.0
    assert "final_logit_softcapping=30.0" in plain_reason(model)
    inputs, c = padded_batch()
    _assert_same(_run(model, inputs, c, chunk_size=4), _run(model, inputs, c, chunk_size=0))


class _ScaledLogits(nn.Module):
    """A causal LM whose forward scales the head's output without saying so in its config."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def get_output_embeddings(self):
        return self.inner.lm_head

    def forward(self, **kwargs):
        out = self.inner(**kwargs)
        out.logits = out.logits * 2.0
        return out


def test_an_unannounced_output_transform_is_refused():
    model = _ScaledLogits(_model(tied=True))
    inputs, c = padded_batch()
    with pytest.raises(RuntimeError, match="changes what its output head returns.*--logps_chunk_size 0"):
        _run(model, inputs, c, chunk_size=4)


@pytest.mark.parametrize("precision", ["bf16 weights", "bf16 autocast"])
def test_low_precision_matches_plain_path(precision):
    # both paths run the head's matmul in bfloat16 and the softmax in float32; the matmul's summation order
    # differs (rows in chunks), so values agree to bfloat16's resolution of the logits, not to float32's
    model = _model(tied=False).float()
    if precision == "bf16 weights":
        model = model.to(torch.bfloat16)
    inputs, c = padded_batch()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16 autocast"):
        chunked = _run(model, inputs, c, chunk_size=5)
        plain = _run(model, inputs, c, chunk_size=0)
    assert chunked[0].dtype == torch.float32
    assert torch.allclose(chunked[0], plain[0], atol=2e-2, rtol=0)
    for name, grad in plain[2].items():
        assert chunked[2][name].dtype == grad.dtype
        scale = grad.float().abs().max()
        assert (chunked[2][name].float() - grad.float()).abs().max() <= 2e-2 * scale, name


def test_option_default_and_bad_value():
    from grpokit.config.parse import parse_train_args
    from grpokit.errors import ConfigError

    cfg = parse_train_args(["--max_steps", "1"])
    assert cfg.training.logps_chunk_size == 1024 and cfg.training.padding_free is False
    assert parse_train_args(["--logps_chunk_size", "0"]).training.logps_chunk_size == 0  # the plain path
    with pytest.raises(ConfigError, match=r"--logps_chunk_size -1: must be ≥ 0"):
        parse_train_args(["--logps_chunk_size", "-1"])
