"""``POST /score_tokens/`` (server/score_route.py) on a real server in a thread: the served model's logprobs of
given tokens at a temperature and over a top-k kept set, against a plain forward of the same model here; and
hostile bodies answered with one clear status, never a 500."""

from __future__ import annotations

import httpx
import pytest
import torch

from grpokit.engines.teacher_client import TeacherServer
from grpokit.errors import ServerError
from grpokit.modeling import load_causal_lm
from grpokit.server.app import create_app
from grpokit.server.state import ServerOptions, build_state
from grpokit.testing import serve_in_thread

PROMPTS = [[5, 17, 33, 2], [9, 40]]
COMPLETIONS = [[60, 61, 7], [100, 3, 44, 45, 46]]


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    state = build_state(ServerOptions(model=str(tiny_model_dir), torch_dtype="float32", max_batch_requests=8))
    with serve_in_thread(create_app(state)) as (url, _port):
        yield url


def _by_hand(model, prompt, completion, temperature, top_k=0):
    """log q(y_t): the logits predicting each completion token / T, renormalised over the top-k ∪ {y_t}."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].double() / temperature
    out = []
    for z, y in zip(logits, completion, strict=True):
        if top_k:
            keep = torch.zeros_like(z, dtype=torch.bool)
            keep[torch.topk(z, top_k).indices] = True
            keep[y] = True
            z = torch.where(keep, z, float("-inf"))
        out.append(float(torch.log_softmax(z, -1)[y]))
    return out


@pytest.mark.parametrize("temperature, top_k", [(1.0, 0), (0.7, 0), (0.9, 5), (1.0, 10**6)])
def test_scores_match_a_plain_forward(served, tiny_model_dir, temperature, top_k):
    model = load_causal_lm(str(tiny_model_dir), torch.float32).eval()
    support = {"top_k": top_k, "top_p": 1.0, "min_p": 0.0, "blocked": []} if top_k else None
    got = TeacherServer(served).score(PROMPTS, COMPLETIONS, temperature, support)
    top_k = 0 if top_k > 512 else top_k  # a top-k past the vocabulary keeps all of it
    for p, c, row in zip(PROMPTS, COMPLETIONS, got, strict=True):
        assert row == pytest.approx(_by_hand(model, p, c, temperature, top_k), abs=1e-4)


@pytest.mark.parametrize(
    "body, status, says",
    [
        ({"sequences": [{"prompt_ids": [1], "completion_ids": [10**6]}]}, 400, "outside the vocabulary"),
        ({"sequences": [{"prompt_ids": [-1], "completion_ids": [2]}]}, 400, "outside the vocabulary"),
        ({"sequences": [{"prompt_ids": [1], "completion_ids": [2]}] * 9}, 413, "at most 8"),
        ({"sequences": [{"prompt_ids": [1], "completion_ids": []}]}, 422, ""),
        ({"sequences": [{"prompt_ids": [1], "completion_ids": [2]}], "temperature": 0}, 422, "temperature"),
        ({"sequences": [{"prompt_ids": [1] * 2000, "completion_ids": [2]}]}, 400, "exceed the served context"),
        ({"sequences": [{"prompt_ids": [1], "completion_ids": [2]}], "support": {"top_k": "x"}}, 422, ""),
        ({"sequences": "all of them"}, 422, ""),
    ],
)
def test_hostile_bodies_get_a_clear_status(served, body, status, says):
    r = httpx.post(f"{served}/score_tokens/", json=body, timeout=30)
    assert r.status_code == status and says in r.text


def test_the_client_names_the_server_when_the_route_is_missing(served):
    with pytest.raises(ServerError, match=r"teacher server http://127\.0\.0\.1:\d+/nothing-here: .* answered 404"):
        TeacherServer(served + "/nothing-here").score([[1]], [[2]], 1.0, None)
