"""What one agent episode may cost, over the episode routes of a real ``LocalEndpoint`` and a fake fast engine:
budgets checked before the engine works, every prompt (a call continuing earlier replies included) bounded by
--max_length and the model's context before it is tokenized, tokenizing off the endpoint's event loop, unguessable
ids with one answer for an unknown id and a wrong key, JSON text in tool calls that no parser can choke on, and
an agent blocking the event loop noticed."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from types import SimpleNamespace

import httpx
import openai
import pytest
from agents_fakes import EchoEngine, tiny_template

from grpokit.agents.budget import EpisodeBudget
from grpokit.agents.scheduler import AgentScheduler
from grpokit.aio import run_sync
from grpokit.protocol import RequestConfig, RolloutInferRequest
from grpokit.server.openai_routes import LocalEndpoint

pytestmark = pytest.mark.slow
MAX_LENGTH, CONTEXT = 48, 96


@pytest.fixture(scope="module")
def template(tiny_model_dir):
    return tiny_template(tiny_model_dir, max_length=MAX_LENGTH)


def _episodes(engine, agent, rows: int = 1, context: int = CONTEXT, **kw) -> tuple[AgentScheduler, list]:
    """Play ``rows`` episodes of ``agent``; (the scheduler, its outputs). The fake engine's model says its
    context is ``context`` positions."""
    engine.model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=context))
    scheduler = AgentScheduler(agent, serve=LocalEndpoint, infer_engine=engine, **kw)
    requests = [_request(i) for i in range(rows)]
    try:
        return scheduler, run_sync(scheduler.async_infer(requests, RequestConfig(max_tokens=8)))
    finally:
        scheduler.close()


def _request(i: int) -> RolloutInferRequest:
    return RolloutInferRequest(messages=[{"role": "user", "content": f"task {i}"}], data_dict={"k": i})


async def _refused(call) -> str:
    with pytest.raises(openai.BadRequestError) as e:
        await call
    return str(e.value)


def test_an_episodes_calls_choices_and_tokens_are_budgeted_before_the_engine_works(template):
    seen = {}

    async def agent(client, row):
        first = await client.chat.completions.create(model="m", messages=row["messages"], n=3)
        assert len(first.choices) == 3
        seen["choices"] = await _refused(client.chat.completions.create(model="m", messages=row["messages"], n=3))
        for _ in range(2):  # the 4th and 5th trajectories, the 2nd and 3rd calls: a refused call costs nothing
            await client.chat.completions.create(model="m", messages=row["messages"])
        seen["calls"] = await _refused(client.chat.completions.create(model="m", messages=row["messages"]))
        return 1.0

    engine = EchoEngine(template)
    _, outputs = _episodes(engine, agent, budget=EpisodeBudget(calls=3, trajectories=5))
    assert "budget of 5 trajectories" in seen["choices"] and "budget of 3 calls" in seen["calls"]
    assert engine.calls == 3 and len(outputs) == 5  # the refused calls never reached the engine

    async def greedy(client, row):
        seen["tokens"] = await _refused(client.chat.completions.create(model="m", messages=row["messages"], n=4))
        return 0.0

    _episodes(EchoEngine(template), greedy, budget=EpisodeBudget(tokens=30))  # a prompt + 4 x 8 tokens > 30
    assert "budget of 30 tokens" in seen["tokens"]


def test_every_prompt_fits_max_length_a_continued_one_too_and_long_text_is_refused_untokenized(template):
    seen, tokenized = {}, []
    encode = template.encode_prompt

    def counting(messages):
        tokenized.append(sum(len(m["content"]) for m in messages))
        return encode(messages)

    async def agent(client, row):
        messages = list(row["messages"])
        r = await client.chat.completions.create(model="m", messages=messages)
        messages += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "more " * 60}]
        seen["continued"] = await _refused(client.chat.completions.create(model="m", messages=messages))
        huge = [{"role": "user", "content": "x" * 2_400_000}]
        seen["huge"] = await _refused(client.chat.completions.create(model="m", messages=huge))
        return 1.0

    template.encode_prompt = counting
    try:
        _, (out,) = _episodes(EchoEngine(template), agent)
    finally:
        del template.encode_prompt
    assert f"within --max_length {MAX_LENGTH}" in seen["continued"] and "continues earlier replies" in seen["continued"]
    assert "characters are at least" in seen["huge"] and max(tokenized) < 1000  # refused before tokenizing
    assert len(out.response_token_ids) == 1  # only the first call trained


def test_a_slow_tokenization_leaves_the_endpoint_serving_other_agents(template):
    """One call's rendering waits until another episode's call has been answered: on the event loop it could
    never be (the loop would be held), so the other answer arriving first shows that rendering runs beside it."""
    answered, order = threading.Event(), []
    encode = template.encode_prompt

    def slow(messages):
        if messages[-1]["content"] == "slow":
            order.append(("slow call answered by another first", answered.wait(30)))
        return encode(messages)

    async def agent(client, row):
        if row["k"] == 0:
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "slow"}])
        else:
            await asyncio.sleep(0.2)
            await client.chat.completions.create(model="m", messages=row["messages"])
            answered.set()
        return 1.0

    template.encode_prompt = slow
    try:
        _, outputs = _episodes(EchoEngine(template), agent, rows=2)
    finally:
        del template.encode_prompt
    assert order == [("slow call answered by another first", True)]
    assert [o.rollout_infos["agent_status"] for o in outputs] == ["done", "done"]


def test_ids_are_unguessable_and_an_unknown_id_answers_as_a_wrong_key(template):
    answers = {}

    async def agent(client, row):
        base = str(client.base_url).rstrip("/")
        episode_id = base.split("/")[-2]
        answers["id"] = episode_id
        other = base.replace(episode_id, episode_id[:-1] + ("A" if episode_id[-1] != "A" else "B"))
        body = {"model": "m", "messages": row["messages"]}
        async with httpx.AsyncClient(timeout=30) as http:
            for name, url, key in (("unknown id", other, client.api_key), ("wrong key", base, "k" * 43)):
                r = await http.post(url + "/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"})
                answers[name] = (r.status_code, r.json())
        return 1.0

    _episodes(EchoEngine(template), agent)
    assert len(answers["id"]) >= 24  # secrets.token_urlsafe: ~144 bits
    assert answers["unknown id"] == answers["wrong key"] and answers["wrong key"][0] == 401


DEEP = "[" * 20_000 + "]" * 20_000
HUGE_NUMBER = '{"x": ' + "9" * 5000 + "}"


def test_json_text_in_tool_calls_is_a_parse_failure_never_a_500(tiny_model_dir):
    statuses = []
    script = f'<tool_call>{{"name": "f", "arguments": {HUGE_NUMBER}}}</tool_call><tool_call>{DEEP}</tool_call>'

    async def agent(client, row):
        for arguments in (DEEP, HUGE_NUMBER, "{" * 300):
            call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
            messages = [*row["messages"], {"role": "assistant", "content": None, "tool_calls": [call]}]
            messages.append({"role": "tool", "tool_call_id": "c1", "content": "ok"})
            r = await client.chat.completions.with_raw_response.create(model="m", messages=messages, tools=[TOOL])
            statuses.append(r.status_code)
            reply = r.parse().choices[0].message
            assert reply.tool_calls is None and reply.content == script  # the model's blocks stay text
        return 1.0

    _episodes(EchoEngine(tiny_template(tiny_model_dir), script), agent, context=1 << 20)
    assert statuses == [200, 200, 200]


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def test_an_agent_blocking_the_event_loop_is_noticed_in_the_log(template, caplog, monkeypatch):
    monkeypatch.setattr("grpokit.agents.runner.BLOCKED_S", 0.3)

    async def agent(client, row):
        await client.chat.completions.create(model="m", messages=row["messages"])
        time.sleep(1.0)  # synchronous: nothing else on the loop runs meanwhile
        return 1.0

    with caplog.at_level(logging.WARNING, logger="grpokit.agents.runner"):
        _, (out,) = _episodes(EchoEngine(template), agent)
    assert out.rollout_infos["agent_status"] == "done"
    assert any("held the event loop" in r.getMessage() and "'agent'" in r.getMessage() for r in caplog.records)
