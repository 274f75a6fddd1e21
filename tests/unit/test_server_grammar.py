"""Grammar limits on the served engine: a pattern past llguidance's limits is refused before sampling (400 naming
it), and a row whose matcher fails mid-generation ends that one request with a ConfigError while the other
requests of its batch get their completions."""

from __future__ import annotations

import asyncio

import pytest
from fastapi.testclient import TestClient

from grpokit.engines.grammar import GrammarLogitsProcessor
from grpokit.engines.structured import row_error
from grpokit.errors import ConfigError
from grpokit.protocol import ChatCompletionResponse, RequestConfig, RolloutInferRequest
from grpokit.server.app import create_app
from grpokit.server.state import ServerOptions, build_state


@pytest.fixture(scope="module")
def state(tiny_model_dir):
    return build_state(ServerOptions(model=str(tiny_model_dir), torch_dtype="float32"))


def _request(text: str) -> RolloutInferRequest:
    return RolloutInferRequest(messages=[{"role": "user", "content": text}])


def test_a_row_failing_mid_generation_ends_only_its_request(state, monkeypatch):
    engine = state.engine
    original = GrammarLogitsProcessor._bitmask
    calls: dict[int, int] = {}

    def bitmask(self, row):  # row 1's matcher hits the engine's limit on its third token
        calls[row] = calls.get(row, 0) + 1
        if row == 1 and calls[row] == 3:
            self._fail(row, row_error(self.constraint, "lexer error: too many expressions constructed", "token"))
            return None
        return original(self, row)

    monkeypatch.setattr(GrammarLogitsProcessor, "_bitmask", bitmask)
    config = RequestConfig(max_tokens=6, temperature=1.0, seed=1, structured_outputs_regex="[a-z]{1,40}")

    async def both():
        return await asyncio.gather(
            engine.infer_async(_request("one"), config),
            engine.infer_async(_request("two"), config),
            return_exceptions=True,
        )

    ok, failed = asyncio.run(both())
    assert calls.get(1, 0) >= 3  # both rows were in one generate call
    assert isinstance(ok, ChatCompletionResponse) and ok.choices[0].token_ids
    assert isinstance(failed, ConfigError)
    assert "structured_outputs_regex '[a-z]{1,40}'" in str(failed) and "grammar engine" in str(failed)
    assert not engine._failed and not engine._cancel


def test_a_pattern_past_the_grammar_limits_is_refused_before_sampling(state):
    client = TestClient(create_app(state), base_url="http://127.0.0.1")
    body = {
        "requests": [{"messages": [{"role": "user", "content": "x"}]}],
        "request_config": {"max_tokens": 4, "structured_outputs_regex": "((a{100}){100}){100}"},
    }
    resp = client.post("/infer/", json=body)
    assert resp.status_code == 400, resp.text
    assert "((a{100}){100}){100}" in resp.json()["error"] and "cannot follow it" in resp.json()["error"]
    deep = '{"a": ' * 3000 + "1" + "}" * 3000
    resp = client.post("/infer/", json={**body, "request_config": {"max_tokens": 4, "structured_outputs_json": deep}})
    assert resp.status_code == 400 and "nests deeper than 32" in resp.json()["error"], resp.text
    fine = client.post(
        "/infer/", json={**body, "request_config": {"max_tokens": 4, "structured_outputs_regex": "[0-9]{2}"}}
    )
    assert fine.status_code == 200, fine.text
