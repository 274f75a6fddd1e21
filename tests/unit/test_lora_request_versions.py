"""Requests name the LoRA version they sample (``RequestConfig.weight_version``) on a real served transformers
engine (tiny model, float32, in process): with two versions loaded, a request naming the older one samples it (its
logprobs are the old adapter's, its tokens tagged with it), one naming none samples the newest, and one naming a
version that is not loaded is answered 400 with one line naming it and the loaded ones."""

from __future__ import annotations

import copy

import pytest
import torch
from support import lora_policy, shake_lora, token_logps
from test_swift_adapter_route import _client

from grpokit.engines.adapters import AdapterSpec, adapter_tensors, base_tensors
from grpokit.engines.client import RolloutClient
from grpokit.protocol import RequestConfig, RolloutInferRequest
from grpokit.testing import build_tiny_model

SPEC = AdapterSpec(r=4, lora_alpha=8, use_rslora=False)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


def _load_version(engine, policy, version: int, base: bool) -> None:
    """One adapter-only update as the weight route stages it (the bytes handed over in process)."""
    named = (list(base_tensors(policy)) if base else []) + list(adapter_tensors(policy))
    with engine.lock:
        engine.adapters.begin(version, SPEC, "base-0", 2, [n for n, _ in named])
        engine.load_weights(named)
        engine.adapters.commit()
    engine.set_policy_version(version)


@pytest.fixture(scope="module")
def served(tiny):
    """A server holding versions 1 and 2 (different adapters over one base), and the two policies."""
    client, state = _client(tiny)
    old = lora_policy(tiny, 1)
    new = copy.deepcopy(old)
    shake_lora(new)
    _load_version(state.engine, old, 1, base=True)
    _load_version(state.engine, new, 2, base=False)
    assert state.engine.adapters.loaded == [1, 2]
    return client, {1: old, 2: new}


@pytest.mark.parametrize("asked", [1, None])
def test_a_request_samples_the_version_it_names(served, asked, monkeypatch):
    monkeypatch.delenv("GRPOKIT_API_KEY", raising=False)
    client, policies = served
    config = {"max_tokens": 8, "temperature": 1.0, "logprobs": True, "seed": 3}
    if asked is not None:
        config["weight_version"] = asked
    answer = client.post("/infer/", json={"requests": [{"messages": [{"role": "user", "content": "count"}]}],
                                          "request_config": config})  # fmt: skip
    assert answer.status_code == 200, answer.text
    response = answer.json()[0]["response"]
    choice = response["choices"][-1]
    version = asked if asked is not None else 2  # none named: the newest
    assert choice["weight_versions"] == [version] * len(choice["token_ids"])
    engine = torch.tensor([x["logprob"] for x in choice["logprobs"]["content"]])
    want = token_logps(policies[version], response["prompt_token_ids"], choice["token_ids"])
    torch.testing.assert_close(engine, want, atol=1e-4, rtol=1e-4)
    other = token_logps(policies[3 - version], response["prompt_token_ids"], choice["token_ids"])
    assert not torch.allclose(engine, other, atol=1e-3)  # the two versions do differ on these tokens


def test_a_version_not_loaded_is_refused_naming_the_loaded_ones(served, monkeypatch):
    monkeypatch.delenv("GRPOKIT_API_KEY", raising=False)
    client, _ = served
    answer = client.post("/infer/", json={"requests": [{"messages": [{"role": "user", "content": "count"}]}],
                                          "request_config": {"max_tokens": 4, "weight_version": 5}})  # fmt: skip
    assert answer.status_code == 400, answer.text
    message = answer.json()["error"]
    assert "weight_version 5: not loaded on this server (loaded: [1, 2])" in message and "\n" not in message
    assert client.get("/get_engine_type/").json()["lora_versions"] == [1, 2]  # what a request may name


def test_an_unset_version_stays_off_the_wire():
    """The trainer's client leaves an unset version out of the body (a server without the field takes it)."""
    client = RolloutClient(base_urls=["http://127.0.0.1:9"], wait=False)
    try:
        conf, _ = client._wire([RolloutInferRequest(messages=[{"role": "user", "content": "x"}])], RequestConfig())
        assert "weight_version" not in conf
        conf, _ = client._wire([], RequestConfig(weight_version=4))
        assert conf["weight_version"] == 4
    finally:
        client.close()
