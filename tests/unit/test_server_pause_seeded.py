"""A seeded call keeps its random stream across a pause that loads no weights (/probe/, /check_weights/), on the
HF-generate fallback as on the fast decoder: a two-row call paused mid-way samples the tokens of the same call
left alone, on a real uvicorn server (in a thread, 127.0.0.1) started with --fast_decode false."""

from __future__ import annotations

import threading

import httpx
import pytest
from test_server_deadlines import _Probe
from transformers import LogitsProcessorList

from grpokit.server.app import create_app
from grpokit.server.state import ServerOptions, build_state
from grpokit.testing import serve_in_thread
from grpokit.wire.checksum import tensor_sums


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    state = build_state(ServerOptions(model=str(tiny_model_dir), torch_dtype="float32", fast_decode=False))
    with serve_in_thread(create_app(state)) as (url, _port):
        yield state.engine, url


def pause_body(route: str, engine) -> dict:
    """The body of one of the two routes that pause a running generation and load nothing."""
    if route == "/probe/":
        return {"prompt": "hi", "max_tokens": 2}
    name, w = next(iter(engine.model.named_parameters()))
    return {"buckets": [[{"name": name, "dtype": "float32", "sums": tensor_sums(w.detach()).tolist()}]]}


@pytest.mark.parametrize("route", ["/probe/", "/check_weights/"])
def test_a_seeded_call_on_hf_generate_samples_the_same_tokens_across_a_pause(served, route, monkeypatch):
    engine, url = served
    assert not engine.fast_decode
    body = {
        "requests": [
            {"messages": [{"role": "user", "content": "count"}]},
            {"messages": [{"role": "user", "content": "go"}]},
        ],
        "request_config": {"max_tokens": 40, "temperature": 1.0, "seed": 11},
    }
    generated = []
    monkeypatch.setattr(engine, "_hf_generate", _counting(engine._hf_generate, generated))

    def sampled(pause: bool) -> list[list[int]]:
        probe = _Probe(engine.template.eos_token_id)
        monkeypatch.setattr(engine, "logits_processor_factory", lambda config, width: LogitsProcessorList([probe]))
        answer = {}
        call = threading.Thread(target=lambda: answer.update(r=httpx.post(url + "/infer/", json=body, timeout=120)))
        call.start()
        if pause:
            assert probe.decoding.wait(30), "generation did not start"
            r = httpx.post(url + route, json=pause_body(route, engine), timeout=60)
            assert r.status_code == 200, r.text
        call.join(120)
        return [row["response"]["choices"][0]["token_ids"] for row in answer["r"].json()]

    alone = sampled(pause=False)
    resumes = engine.partial_resumes
    again = sampled(pause=True)
    assert engine.partial_resumes == resumes + 2  # both rows were paused, and went on
    assert again == alone
    assert len(generated) >= 3  # every sampling call ran HF generate


def _counting(fn, calls: list):
    def wrapped(*args, **kwargs):
        calls.append(1)
        return fn(*args, **kwargs)

    return wrapped
