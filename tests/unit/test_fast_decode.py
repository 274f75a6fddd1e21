"""grpokit's decode loop reproduces the model's forward and HF generate's sampling, or steps aside."""

from __future__ import annotations

import logging
import math
import re

import pytest
import torch

from grpokit.engines.fast_decode import FastDecoder, Unsupported
from grpokit.engines.sampling import inverse_cdf, sampling_processors

# numerics: run again by .ci/run under the other dtype choice and torch's default thread count;
# greedy tokens of the fast decoder equal HF generate's; the sum order follows the threads
pytestmark = pytest.mark.numerics

COMMON = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.3,
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=None,
)


def _model(arch: str, **overrides):
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    torch.manual_seed(0)
    if arch == "qwen3":  # q/k RMSNorm over the head dim, tied embeddings
        cfg = Qwen3Config(**COMMON, head_dim=8, tie_word_embeddings=True)
    elif arch == "qwen2":  # q/k/v biases, untied head
        cfg = Qwen2Config(**COMMON, tie_word_embeddings=False)
    else:  # every bias, a scaled RoPE, multi-query attention
        cfg = LlamaConfig(
            **{**COMMON, "num_key_value_heads": 1},
            attention_bias=True,
            mlp_bias=True,
            rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
        )
    for k, v in overrides.items():
        setattr(cfg, k, v)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # HF initialises biases to zero; make them matter
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    return model


def _prompts(shared: bool):
    g = torch.Generator().manual_seed(1)
    lengths = [7, 7, 7, 4, 4, 4, 2] if shared else [7, 5, 4, 3, 6, 2, 7]
    distinct = {n: torch.randint(2, 97, (n,), generator=g) for n in set(lengths)}
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    att = torch.zeros_like(ids)
    for row, n in enumerate(lengths):  # left padding, as the engine pads
        ids[row, width - n :] = distinct[n] if shared else torch.randint(2, 97, (n,), generator=g)
        att[row, width - n :] = 1
    return ids, att


def _lora(model, **extra):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    return get_peft_model(
        model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False, **extra)
    )


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama", "qwen3+lora", "llama+lora"])
@pytest.mark.parametrize("shared", [True, False])
def test_sampled_tokens_logprobs_equal_the_models_forward(arch, shared):
    """Prefill, cache, rotary positions, left padding and shared prompts: each sampled token's log-probability
    equals the model's own forward over the finished sequence. With LoRA the model stays unmerged and its forward
    (base + adapters) is the reference."""
    model = _model(arch.split("+")[0])
    if arch.endswith("+lora"):
        model = _lora(model)
        before = {n: p.clone() for n, p in model.named_parameters()}
    _check_logprobs(model, shared)
    if arch.endswith("+lora"):  # the adapters were read, not merged into the weights
        assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def _check_logprobs(model, shared: bool, device: str = "cpu") -> None:
    model = model.to(device)
    ids, att = (t.to(device) for t in _prompts(shared))
    torch.manual_seed(0)
    new, lps = FastDecoder(model).generate(
        ids, att, 6, eos_token_id=-1, pad_token_id=0, greedy=False, want_logprobs=True
    )
    assert new.shape == (7, 6)
    full = torch.cat([ids, new], 1)
    full_att = torch.cat([att, torch.ones_like(new)], 1)
    with torch.no_grad():
        logits = model(
            input_ids=full, attention_mask=full_att, position_ids=(full_att.cumsum(-1) - 1).clamp(min=0)
        ).logits
    ref = logits[:, ids.shape[1] - 1 : -1].log_softmax(-1).gather(-1, new[..., None])[..., 0]
    torch.testing.assert_close(lps, ref, atol=2e-5, rtol=1e-5)


def test_kv_cache_growth_keeps_what_is_written(monkeypatch):
    """The cache grows in CACHE_CHUNK steps; with a chunk of 2 it grows twice in 6 tokens."""
    import grpokit.engines.fast_decode as fd

    monkeypatch.setattr(fd, "CACHE_CHUNK", 2)
    _check_logprobs(_model("qwen3"), shared=True)


def test_memory_follows_distinct_prompts_and_new_tokens(monkeypatch):
    """Rope tables are built for the distinct prompts, then one position per step (never rows × context at once),
    and a one-token answer fills no KV cache: a server asked for 1500 copies of a long prompt stays near idle."""
    decoder = FastDecoder(_model("qwen3"))
    shapes, reserved = [], []
    monkeypatch.setattr(decoder, "_rope_tables", lambda pos, f=decoder._rope_tables: shapes.append(pos.shape) or f(pos))
    monkeypatch.setattr(decoder, "_reserve", lambda rows, n, f=decoder._reserve: reserved.append(rows) or f(rows, n))
    ids, att = _prompts(shared=True)  # 7 rows, 3 distinct prompts, width 7
    one, _ = decoder.generate(ids, att, 1, eos_token_id=-1, pad_token_id=0, greedy=True)
    assert one.shape == (7, 1) and shapes == [(3, 7)] and reserved == []
    shapes.clear()
    three, _ = decoder.generate(ids, att, 3, eos_token_id=-1, pad_token_id=0, greedy=True)
    assert shapes == [(3, 7), (7, 1), (7, 1)] and reserved and torch.equal(three[:, :1], one)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen3", "llama+lora"])
def test_on_cuda_logprobs_equal_the_models_forward(arch):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    model = _model(arch.split("+")[0])
    _check_logprobs(_lora(model) if arch.endswith("+lora") else model, shared=True, device="cuda")


def test_sampling_matches_the_processed_distribution():
    """3000 draws of one next token under temperature, top-k and top-p: frequencies match the probabilities that
    HF's warpers give, and no token they exclude is ever drawn."""
    model = _model("qwen3")
    ids, att = _prompts(shared=True)
    ids, att = ids[:1].repeat(3000, 1), att[:1].repeat(3000, 1)
    procs = sampling_processors(greedy=False, temperature=0.7, top_k=6, top_p=0.9, repetition_penalty=1.0)
    torch.manual_seed(0)
    new, _ = FastDecoder(model).generate(ids, att, 1, eos_token_id=-1, pad_token_id=0, greedy=False, processors=procs)
    with torch.no_grad():
        logits = model(input_ids=ids[:1], attention_mask=att[:1]).logits[:, -1].float()
    expected = procs(ids[:1], logits).softmax(-1)[0]
    freq = torch.bincount(new[:, 0], minlength=expected.numel()).float() / len(new)
    assert (expected > 0).sum() >= 3  # the test means something: several tokens survive the warpers
    assert freq[expected == 0].sum() == 0
    assert (freq - expected).abs().max() < 0.035


def test_inverse_cdf_draws_only_tokens_with_probability():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]]).repeat(5, 1)
    u = torch.tensor([[0.0], [0.4999], [0.5], [0.75], [1 - 2**-24]])
    assert inverse_cdf(probs, u).tolist() == [1, 1, 3, 3, 3]


def test_eos_and_stop_criteria_end_rows_as_generate_does():
    """A row ends at eos or when a stopping criterion fires; pad follows; the loop stops once all rows ended."""
    model = _model("qwen3")
    ids, att = _prompts(shared=False)
    fast = FastDecoder(model)
    free, _ = fast.generate(ids, att, 5, eos_token_id=-1, pad_token_id=0, greedy=True)
    eos = int(free[0, 1])  # row 0's second greedy token becomes the eos
    new, _ = fast.generate(ids, att, 5, eos_token_id=eos, pad_token_id=0, greedy=True)
    for row in range(len(new)):
        hits = (free[row] == eos).nonzero()
        if len(hits):
            end = int(hits[0]) + 1
            assert new[row, :end].tolist() == free[row, :end].tolist()
            assert (new[row, end:] == 0).all()
        else:
            assert new[row].tolist() == free[row, : new.shape[1]].tolist()

    from transformers import StoppingCriteria, StoppingCriteriaList

    class StopAfterThree(StoppingCriteria):
        def __call__(self, input_ids, scores):
            return torch.full((input_ids.shape[0],), input_ids.shape[1] - ids.shape[1] >= 3)

    short, _ = fast.generate(
        ids, att, 5, eos_token_id=-1, pad_token_id=0, greedy=True, stopping=StoppingCriteriaList([StopAfterThree()])
    )
    assert short.tolist() == free[:, :3].tolist()  # every row stopped: no further forward


@pytest.mark.parametrize(
    "case", ["sliding_window", "generation_option", "dora", "architecture", "offloaded", "two_devices"]
)
def test_models_it_cannot_reproduce_are_refused(case):
    if case == "offloaded":  # accelerate's offloading leaves the weights on the meta device
        model = _model("qwen3").to("meta")
        match = "meta"
    elif case == "two_devices":
        model = _model("qwen3")
        model.hf_device_map = {"model.embed_tokens": 0, "model.layers": 1, "lm_head": 1}
        match = "spread over devices"
    elif case == "architecture":
        from transformers import GPT2Config, GPT2LMHeadModel

        model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=50))
        match = "GPT2LMHeadModel"
    elif case == "sliding_window":
        model = _model("qwen3", layer_types=["sliding_attention", "full_attention"])
        match = "sliding"
    elif case == "generation_option":
        model = _model("qwen3")
        model.generation_config.min_p = 0.05
        match = "min_p"
    else:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(_model("qwen3"), LoraConfig(r=2, target_modules="all-linear", use_dora=True))
        match = "DoRA"
    with pytest.raises(Unsupported, match=match):
        FastDecoder(model)


def test_generation_config_spelling_out_defaults_is_accepted():
    model = _model("qwen3")
    for key, value in {
        "min_length": 0,
        "num_beams": 1,
        "typical_p": 1.0,
        "no_repeat_ngram_size": 0,
        "remove_invalid_values": False,
        "bad_words_ids": [],
        "num_return_sequences": 1,
    }.items():
        setattr(model.generation_config, key, value)
    FastDecoder(model)


def _engine(model_dir, lora: bool, fast: bool):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpokit.engines.transformers_engine import TransformersEngine
    from grpokit.template.encode import ChatTemplate

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():  # spread the random model's logits, so that greedy text varies
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    engine = TransformersEngine(model, ChatTemplate(AutoTokenizer.from_pretrained(model_dir)))
    engine.fast_decode = fast
    return engine


@pytest.mark.parametrize("lora", [False, True])
def test_engine_greedy_outputs_equal_hf_generate(tiny_model_dir, lora):
    """Token ids, text, finish reasons and logprobs through the engine, fast loop against HF generate (greedy, a
    stop string, shared prompts, a merged LoRA adapter)."""
    from grpokit.protocol import RequestConfig, RolloutInferRequest

    requests = [
        RolloutInferRequest(messages=[{"role": "user", "content": q}])
        for q in ("What is 2 + 3?", "Name a colour.", "Count to five please")
    ]
    out = {}
    for fast in (True, False):
        engine = _engine(tiny_model_dir, lora, fast)
        first = engine.infer(requests, RequestConfig(n=2, max_tokens=12, temperature=0, logprobs=True))
        text = first[0].choices[0].message["content"]
        stop = re.findall(r"[a-z0-9]{2}", text)[-1]  # a plain string the greedy text reaches after a few tokens
        second = engine.infer(requests, RequestConfig(n=2, max_tokens=12, temperature=0, stop=[stop]))
        out[fast] = (first, second)
        assert not any(getattr(m, "merged", False) for m in engine.model.modules())  # merged for sampling only
    for asked, k in ((True, 0), (False, 1)):  # the first calls asked for logprobs, the stop-string calls did not
        assert len(out[True][k]) == len(requests)
        for fast_resp, hf_resp in zip(out[True][k], out[False][k], strict=True):
            assert len(fast_resp.choices) == len(hf_resp.choices) == 2
            for a, b in zip(fast_resp.choices, hf_resp.choices, strict=True):
                assert (a.token_ids, a.message, a.finish_reason) == (b.token_ids, b.message, b.finish_reason)
                if not asked:
                    assert a.logprobs is None and b.logprobs is None
                    continue
                # one logprob per generated token, for the token generated, on both paths
                for c in (a, b):
                    assert c.logprobs is not None
                    assert [x["token_id"] for x in c.logprobs["content"]] == c.token_ids
                lp_a = [x["logprob"] for x in a.logprobs["content"]]
                lp_b = [x["logprob"] for x in b.logprobs["content"]]
                assert all(math.isfinite(x) and x <= 0 for x in lp_a)
                for x, y in zip(lp_a, lp_b, strict=True):
                    assert x == pytest.approx(y, abs=1e-4)
    assert any(c.finish_reason == "stop" for r in out[True][1] for c in r.choices)


def test_engine_falls_back_to_hf_generate_and_says_why(tiny_model_dir, caplog):
    from grpokit.protocol import RequestConfig, RolloutInferRequest

    engine = _engine(tiny_model_dir, lora=False, fast=True)
    engine.model.generation_config.typical_p = 0.9
    with caplog.at_level(logging.INFO, logger="grpokit.engines.transformers_engine"):
        for _ in range(2):
            resp = engine.infer(
                [RolloutInferRequest(messages=[{"role": "user", "content": "hi"}])], RequestConfig(n=2, max_tokens=4)
            )
    assert len(resp[0].choices) == 2
    notes = [r.message for r in caplog.records if "HF generate" in r.message]
    assert len(notes) == 1 and "typical_p" in notes[0]


@pytest.mark.parametrize("flag, expected", [([], True), (["--fast_decode", "false"], False)])
def test_rollout_server_option_reaches_the_engine(tiny_model_dir, flag, expected):
    from grpokit.server.cli import options_from_argv
    from grpokit.server.state import build_state

    state = build_state(options_from_argv(["--model", str(tiny_model_dir), *flag]))
    try:
        assert state.engine.fast_decode is expected
    finally:
        state.engine.close()
