"""Shared-prompt forward equals the plain forward in value and gradient (full model and LoRA)."""

from __future__ import annotations

import pytest
import torch

from grpokit.engines.prefix import completion_logits, shared_prompts

# numerics: run again by .ci/run under the other dtype choice and torch's default thread count;
# a shared-prefix forward equals the plain forward within float tolerance
pytestmark = pytest.mark.numerics


def _batch(vocab: int):
    # two prompts of different lengths (left-padded), each with three completions of different lengths
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (5,), generator=g), torch.randint(3, vocab, (3,), generator=g)]
    comps = [torch.randint(3, vocab, (n,), generator=g) for n in (4, 2, 3, 4, 1, 3)]
    p, c = 5, 4
    ids = torch.zeros(6, p + c, dtype=torch.long)
    att = torch.zeros(6, p + c, dtype=torch.long)
    for row in range(6):
        pr, co = prompts[row // 3], comps[row]
        ids[row, p - len(pr) : p] = pr
        att[row, p - len(pr) : p] = 1
        ids[row, p : p + len(co)] = co
        att[row, p : p + len(co)] = 1
    pos = (att.cumsum(-1) - 1).clamp(min=0)
    return ids, att, pos, c


# The shared forward computes the same sums as the plain one in another order: the prompt is encoded once at
# batch 2 instead of 6, its gradient comes back through an expand (three completions summed first, then over
# the sequence), and the BLAS splits each reduction by its thread count. In float32 such a reordering moves a
# sum by about eps (1.2e-7) times the magnitudes of its terms, not of its result: an entry that cancels to near zero
# keeps the error of its large terms. So the bound is relative to the scale of the whole tensor: measured on
# the tiny model, at most 1.1e-6 of it with 1, 3 or 4 threads and 4.5e-6 (about 40 eps) with 2 or 8 threads, in a
# LoRA A gradient, where an entry of 4.9e-3 in a tensor of scale 7.9 moved by 1.2e-5. 5e-5 leaves a margin of 10;
# a real sharing bug (a wrong position, mask or row) moves entries by a sizeable fraction of the scale.
# (The log-probabilities, of magnitude ~6 with nothing cancelling, moved by at most 4.8e-7: 1e-5 still holds.)
SUMMATION_ORDER_RTOL = 5e-5


def assert_equal_up_to_summation_order(got: torch.Tensor, want: torch.Tensor, name: str) -> None:
    scale = want.abs().max().item()
    worst = (got - want).abs().max().item()
    assert worst <= SUMMATION_ORDER_RTOL * scale, (
        f"{name}: max |difference| {worst:.3g} > {SUMMATION_ORDER_RTOL:g} × max |value| {scale:.3g}"
    )


@pytest.mark.parametrize("lora", [False, True])
def test_shared_prompt_forward_matches_plain(tiny_model_dir, lora):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    model.train()
    ids, att, pos, c = _batch(model.config.vocab_size if not lora else model.base_model.model.config.vocab_size)
    first, inverse = shared_prompts(ids, c)
    assert inverse.tolist() == [inverse[0].item()] * 3 + [inverse[3].item()] * 3 and len(first) == 2
    mask = att[:, -c:].bool()
    grads = []
    for share in (False, True):
        model.zero_grad()
        logits = completion_logits(model, ids, att, pos, c, share_prompts=share)
        logps = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, -c:].unsqueeze(-1)).squeeze(-1)
        (logps * mask).sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        if share:
            shared_logps = logps.detach()
        else:
            plain_logps = logps.detach()
    assert torch.allclose(shared_logps[mask], plain_logps[mask], atol=1e-5)
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name in grads[0]:
        assert_equal_up_to_summation_order(grads[1][name], grads[0][name], name)


def test_no_sharing_when_prompts_are_distinct():
    ids = torch.arange(12).reshape(4, 3)
    assert shared_prompts(ids, 1) is None


def test_engine_greedy_output_is_the_same_with_shared_prefill(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpokit.engines.transformers_engine import TransformersEngine
    from grpokit.protocol import RequestConfig, RolloutInferRequest
    from grpokit.template.encode import ChatTemplate

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    engine = TransformersEngine(model, ChatTemplate(AutoTokenizer.from_pretrained(tiny_model_dir)))
    engine.share_prompts = True  # forced: a tiny model is below the size where "auto" shares
    reqs = [
        RolloutInferRequest(messages=[{"role": "user", "content": text}])
        for text in ("What is 1 + 2?", "Hi there, what is seven plus eight?")
        for _ in range(3)
    ]
    cfg = RequestConfig(max_tokens=8, temperature=0.0, logprobs=True)
    shared = engine.infer(reqs, cfg)
    engine.share_prompts = False
    plain = engine.infer(reqs, cfg)
    for a, b in zip(shared, plain):
        assert a.choices[0].token_ids == b.choices[0].token_ids
        la = [x["logprob"] for x in a.choices[0].logprobs["content"]]
        lb = [x["logprob"] for x in b.choices[0].logprobs["content"]]
        assert torch.allclose(torch.tensor(la), torch.tensor(lb), atol=1e-4)


def test_sharing_is_automatic_only_for_models_big_enough(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from grpokit.engines.prefix import SHARE_MIN_PARAMS, worth_sharing

    tiny = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert sum(p.numel() for p in tiny.parameters()) < SHARE_MIN_PARAMS and not worth_sharing(tiny)
    big = torch.nn.Linear(4000, 3000)  # 12M parameters
    assert worth_sharing(big)
