"""Structured outputs on the transformers engine with a tiny random model (whose free text matches nothing), in
process and through the rollout server's HTTP layer (an invalid constraint is a 400, the server keeps serving)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from fastapi.testclient import TestClient
from support import QUIET, flags

from grpokit.engines.transformers_engine import TransformersEngine
from grpokit.errors import ConfigError
from grpokit.modeling import load_causal_lm, load_tokenizer
from grpokit.protocol import RequestConfig, RolloutInferRequest
from grpokit.template.encode import ChatTemplate

ANSWER = r"<answer>[0-9]{1,3}</answer>"
SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "value"],
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "value": {"type": "integer", "minimum": 0, "maximum": 999},
    },
}


def validates(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    model = load_causal_lm(str(tiny_model_dir), torch.float32)
    return TransformersEngine(model, ChatTemplate(load_tokenizer(str(tiny_model_dir))))


def _requests(k: int) -> list[RolloutInferRequest]:
    return [RolloutInferRequest(messages=[{"role": "user", "content": f"What is {i} + 7?"}]) for i in range(k)]


def _texts(responses) -> list[str]:
    return [c.message["content"] for r in responses for c in r.choices]


def test_every_completion_matches_the_regex(engine):
    free = _texts(engine.infer(_requests(4), RequestConfig(n=4, max_tokens=24, seed=0)))
    assert not any(re.fullmatch(ANSWER, t) for t in free)  # the random model does not do it by itself
    out = engine.infer(
        _requests(4), RequestConfig(n=4, max_tokens=24, seed=0, logprobs=True, structured_outputs_regex=ANSWER)
    )
    texts = _texts(out)
    assert len(texts) == 16 and all(re.fullmatch(ANSWER, t) for t in texts), texts
    assert len(set(texts)) > 1  # still sampled, not forced to one string
    for choice in (c for r in out for c in r.choices):
        assert choice.finish_reason == "stop" and choice.token_ids[-1] == engine.template.eos_token_id
        assert len(choice.logprobs["content"]) == len(choice.token_ids)


def test_every_completion_validates_against_the_schema(engine):
    free = _texts(engine.infer(_requests(2), RequestConfig(n=4, max_tokens=40, seed=1)))
    assert not any(validates(t, SCHEMA) for t in free)
    texts = _texts(
        engine.infer(
            _requests(2), RequestConfig(n=4, max_tokens=40, seed=1, structured_outputs_json=json.dumps(SCHEMA))
        )
    )
    assert len(texts) == 8 and all(validates(t, SCHEMA) for t in texts), texts


def test_a_per_request_constraint_applies_to_that_request_only(engine):
    import asyncio

    async def both():
        plain, constrained = _requests(2)
        constrained.request_config = RequestConfig(max_tokens=24, structured_outputs_regex="(yes|no)")
        return await asyncio.gather(
            engine.infer_async(plain, RequestConfig(max_tokens=8)),
            engine.infer_async(constrained, RequestConfig(max_tokens=8)),
        )

    plain, constrained = asyncio.run(both())
    assert constrained.choices[0].message["content"] in ("yes", "no")
    assert plain.choices[0].message["content"] not in ("yes", "no")


def test_invalid_constraints_are_config_errors(engine):
    with pytest.raises(ConfigError, match="structured_outputs_regex .*unclosed"):
        engine.infer(_requests(1), RequestConfig(structured_outputs_regex="<answer>[0-9"))
    with pytest.raises(ConfigError, match="structured_outputs_json"):
        engine.infer(_requests(1), RequestConfig(structured_outputs_json='{"type": 3}'))


def test_server_answers_400_for_an_invalid_regex_and_keeps_serving(tiny_model_dir):
    from grpokit.rollout.scheduler import RolloutScheduler
    from grpokit.server.app import create_app
    from grpokit.server.state import ServerOptions, ServerState, build_served_engine

    engine = build_served_engine("transformers", str(tiny_model_dir), "float32")
    state = ServerState(ServerOptions(model=str(tiny_model_dir)), engine, RolloutScheduler(engine))
    client = TestClient(create_app(state), base_url="http://127.0.0.1")  # a Host the server answers
    body = {
        "requests": [{"messages": [{"role": "user", "content": "hi"}]}],
        "request_config": {"max_tokens": 24, "structured_outputs_regex": "(a"},
    }
    resp = client.post("/infer/", json=body)
    assert resp.status_code == 400 and "structured_outputs_regex" in resp.json()["error"]
    body["request_config"]["structured_outputs_regex"] = ANSWER
    resp = client.post("/infer/", json=body)
    assert resp.status_code == 200
    assert re.fullmatch(ANSWER, resp.json()[0]["messages"][-1]["content"])


@pytest.mark.slow
def test_a_constrained_training_run_logs_only_matching_completions(tiny_model_dir, tmp_path):
    from grpokit.config.parse import parse_train_args
    from grpokit.pipeline.train import run_train

    out = tmp_path / "out"
    cfg = parse_train_args(
        flags(
            {"--model": tiny_model_dir, "--structured_outputs_regex": ANSWER, "--output_dir": out},
            "--tuner_type full --dataset builtin:arithmetic --reward_funcs accuracy --max_steps 2",
            "--num_generations 4 --per_device_train_batch_size 8 --max_completion_length 16 --log_completions true",
            QUIET,
        )
    )
    run_train(cfg)
    rows = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert len(rows) == 16 and all(re.fullmatch(ANSWER, r["completion"]) for r in rows)
