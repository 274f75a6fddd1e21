"""Schemathesis over the episode routes (``/episodes/<id>/v1/...``), as test_server_fuzz.py does for the rollout
server's (its ``/v1`` routes included): generated bodies that fit the schema and bodies that do not, sent to an
open episode with its key, over a fake fast engine. Each must answer below 500 with OpenAI's error shape, and the
episode must still take a plain call afterwards."""

from __future__ import annotations

import pytest
import schemathesis
from agents_fakes import EchoEngine
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, settings
from schemathesis import GenerationMode

from grpokit.agents.budget import EpisodeBudget
from grpokit.agents.episodes import EpisodeRecorder
from grpokit.agents.service import ChatService
from grpokit.protocol import RequestConfig
from grpokit.server.openai_routes import episode_app

pytestmark = pytest.mark.slow
EXAMPLES = 100
UNBOUNDED = EpisodeBudget(calls=1 << 30, trajectories=1 << 30, tokens=1 << 40, retained_chars=1 << 40)


def _openapi() -> dict:
    return episode_app(ChatService(None, "policy"), EpisodeRecorder()).app.app.app.openapi()


schema = schemathesis.openapi.from_dict(_openapi())
schema.config.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE], max_examples=EXAMPLES)


@pytest.fixture(scope="module")
def session(tiny_model_dir):
    from grpokit.modeling import load_tokenizer
    from grpokit.template.encode import ChatTemplate

    recorder = EpisodeRecorder(UNBOUNDED)  # one episode takes every example: its budget is not under test here
    service = ChatService(
        EchoEngine(ChatTemplate(load_tokenizer(tiny_model_dir))), "policy", RequestConfig(max_tokens=16)
    )
    episode = recorder.open({"messages": [{"role": "user", "content": "hi"}]})
    with TestClient(
        episode_app(service, recorder), raise_server_exceptions=False, base_url="http://127.0.0.1"
    ) as client:
        yield client, episode


@schema.parametrize()
@settings(
    max_examples=EXAMPLES, derandomize=True, deadline=None, database=None, suppress_health_check=list(HealthCheck)
)
def test_episode_routes_answer_below_500_in_openais_error_shape(case, session):
    client, episode = session
    if case.path_parameters is not None:
        case.path_parameters = {**case.path_parameters, "episode_id": episode.id}
    kwargs = case.as_transport_kwargs(base_url="http://127.0.0.1")
    kwargs.pop("cookies", None)
    kwargs["headers"] = {**(kwargs.get("headers") or {}), "Authorization": f"Bearer {episode.key}"}
    response = client.request(**kwargs)
    assert response.status_code < 500, (case.method, case.path, case.body, response.text[:300])
    if response.status_code >= 400:
        error = response.json()["error"]
        assert isinstance(error, dict) and isinstance(error["message"], str) and error["message"]
    ok = client.post(
        f"/episodes/{episode.id}/v1/chat/completions",
        headers={"Authorization": f"Bearer {episode.key}"},
        json={"model": "m", "messages": [{"role": "user", "content": "still there?"}]},
    )
    assert ok.status_code == 200, ok.text[:300]
