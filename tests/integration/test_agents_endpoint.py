"""The ``openai`` package, unmodified, against grpokit's OpenAI-compatible endpoint: the rollout server's ``/v1``
routes on the tiny model (the hardened transport in a thread), and the episode routes over a fake fast engine for
the tool-call parser, 64 concurrent episodes, and agents that raise or hang."""

from __future__ import annotations

import asyncio

import openai  # the 'agents' extra (in dev): a missing install fails loudly, never skips
import pytest
from agents_fakes import EchoEngine, tiny_template

from grpokit.agents.scheduler import AgentScheduler
from grpokit.aio import run_sync
from grpokit.protocol import RequestConfig, RolloutInferRequest
from grpokit.server.openai_routes import LocalEndpoint
from grpokit.server.options import TransportLimits
from grpokit.server.surface import BackgroundServer

pytestmark = pytest.mark.slow
KEY = "test-key"
CALC = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "evaluate arithmetic",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}


@pytest.fixture(scope="module")
def rollout_v1(tiny_model_dir):
    from grpokit.server.app import create_app
    from grpokit.server.state import ServerOptions, build_state

    options = ServerOptions(
        model=str(tiny_model_dir),
        torch_dtype="float32",
        api_key=KEY,
        vllm_max_model_len=256,
        served_model_name="tiny-policy",
    )
    served = BackgroundServer(create_app(build_state(options)), TransportLimits(), name="test rollout server")
    yield openai.OpenAI(base_url=f"{served.url}/v1", api_key=KEY, max_retries=0)
    served.close()


def test_chat_completions_with_n_and_logprobs(rollout_v1):
    assert [m.id for m in rollout_v1.models.list().data] == ["tiny-policy"]
    r = rollout_v1.chat.completions.create(
        model="anything",
        messages=[{"role": "user", "content": "What is 2+3?"}],
        n=3,
        max_tokens=6,
        logprobs=True,
        seed=1,
    )
    assert [c.index for c in r.choices] == [0, 1, 2]
    for c in r.choices:
        ids = c.model_extra["token_ids"]  # grpokit's extra field: the sampled ids
        assert c.model_extra["weight_versions"] is None  # no update has carried a version yet: unknown
        assert 1 <= len(ids) <= 6 and len(c.logprobs.content) == len(ids)
        assert all(t.logprob <= 0 for t in c.logprobs.content)
        assert c.finish_reason in ("stop", "length") and c.message.role == "assistant"
    assert r.usage.completion_tokens == sum(len(c.model_extra["token_ids"]) for c in r.choices)
    assert r.usage.prompt_tokens == len(r.model_extra["prompt_token_ids"])


def test_chat_completions_with_tools_and_a_tool_result(rollout_v1):
    messages = [
        {"role": "user", "content": "What is 2+3?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "calculator", "arguments": '{"expression": "2+3"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "5"},
    ]
    r = rollout_v1.chat.completions.create(model="m", messages=messages, tools=[CALC], max_tokens=4)
    assert len(r.choices) == 1 and r.choices[0].logprobs is None  # logprobs only when asked


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"stream": True}, "BadRequestError", "stream true"),
        ({"n": 0}, "UnprocessableEntityError", "n: Input should be greater than or equal to 1"),
        ({"extra_body": {"frobnicate": 1}}, "UnprocessableEntityError", "frobnicate"),
        ({"top_logprobs": 2, "logprobs": True}, "BadRequestError", "top_logprobs 2"),
    ],
)
def test_bad_bodies_are_the_servers_4xx(rollout_v1, kwargs, error, words):
    with pytest.raises(getattr(openai, error)) as e:
        rollout_v1.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}], max_tokens=2, **kwargs
        )
    assert words in e.value.message and e.value.body["code"] == str(e.value.status_code)  # OpenAI's error shape


@pytest.mark.parametrize("arguments", ["[" * 20_000 + "]" * 20_000, '{"x": ' + "9" * 5000 + "}"])
def test_json_text_in_tool_call_arguments_is_never_a_500(rollout_v1, arguments):
    call = {"id": "c1", "type": "function", "function": {"name": "calculator", "arguments": arguments}}
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [call]}]
    try:  # the template renders the text as it came; a prompt past the context is the server's 400
        status = rollout_v1.chat.completions.with_raw_response.create(
            model="m", messages=messages, tools=[CALC], max_tokens=2
        ).status_code
    except openai.APIStatusError as e:
        status = e.status_code
    assert status in (200, 400)


def test_the_servers_api_key_guards_v1(rollout_v1):
    wrong = openai.OpenAI(base_url=str(rollout_v1.base_url), api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="API key"):
        wrong.models.list()


# -- episodes over a fake engine ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def template(tiny_model_dir):
    return tiny_template(tiny_model_dir)


def _requests(n: int, groups: int = 1) -> list[RolloutInferRequest]:
    return [
        RolloutInferRequest(
            messages=[{"role": "user", "content": f"task {i}"}], data_dict={"k": i}, prompt_id=str(i % groups)
        )
        for i in range(n)
    ]


def _scheduler(engine, agent, **kw) -> AgentScheduler:
    return AgentScheduler(agent, serve=LocalEndpoint, infer_engine=engine, **kw)


def test_a_models_tool_call_reaches_the_agent_parsed(template):
    script = 'Adding.<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>'
    seen = []

    async def agent(client, row):
        r = await client.chat.completions.create(model="m", messages=row["messages"], tools=[CALC])
        seen.append(r.choices[0])
        return 1.0

    scheduler = _scheduler(EchoEngine(template, script), agent)
    try:
        (out,) = run_sync(scheduler.async_infer(_requests(1), RequestConfig(max_tokens=64)))
    finally:
        scheduler.close()
    (choice,) = seen
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Adding."
    call = choice.message.tool_calls[0]
    assert call.function.name == "calculator" and call.function.arguments == '{"expression": "2+3"}'
    assert out.messages[-1]["content"] == script  # the transcript keeps the text the model wrote


def test_64_concurrent_episodes_keep_their_own_calls(template):
    async def agent(client, row):
        messages = list(row["messages"])
        for k in range(3):
            messages.append({"role": "user", "content": f"row {row['k']} call {k}"})
            r = await client.chat.completions.create(model="m", messages=messages)
            messages.append(r.choices[0].message.model_dump(exclude_none=True))
            await asyncio.sleep(0)  # let the other episodes interleave
        return float(row["k"])

    engine = EchoEngine(template)
    scheduler = _scheduler(engine, agent, concurrency=64)
    try:
        outputs = run_sync(scheduler.async_infer(_requests(64, groups=8), RequestConfig(max_tokens=64)))
    finally:
        scheduler.close()
    assert engine.calls == 64 * 3 and len(outputs) == 64  # every call landed, each episode one trajectory
    assert scheduler.rollout_metrics() == {
        "agent/episodes": 64,
        "agent/failures": 0,
        "agent/timeouts": 0,
        "agent/calls_mean": 3.0,
    }
    for i, o in enumerate(outputs):
        assert o.rollout_infos["total_reward"] == float(i) and o.prompt_id == str(i % 8)
        replies = [m["content"] for m in o.messages if m["role"] == "assistant"]
        assert replies == [f"ack row {i} call {k}" for k in range(3)]
        assert len(o.response_token_ids) == 3 and o.rollout_infos["agent_segments"] == 1


def test_an_agent_that_raises_or_hangs_is_cut_off_and_counted(template):
    async def agent(client, row):
        await client.chat.completions.create(model="m", messages=row["messages"])
        if row["k"] == 1:
            raise RuntimeError("the agent's own bug")
        if row["k"] == 2:
            await asyncio.sleep(3600)
        return 1.0

    scheduler = _scheduler(EchoEngine(template), agent, timeout=1.0)
    try:
        outputs = run_sync(scheduler.async_infer(_requests(3), RequestConfig(max_tokens=64)))
    finally:
        scheduler.close()
    status = [o.rollout_infos["agent_status"] for o in outputs]
    assert status == ["done", "failed", "timeout"]
    assert [o.rollout_infos["total_reward"] for o in outputs] == [1.0, 0.0, 0.0]
    assert [sum(map(sum, o.response_loss_mask)) > 0 for o in outputs] == [True, False, False]  # masked
    assert "RuntimeError: the agent's own bug" in outputs[1].rollout_infos["agent_error"]
    assert scheduler.rollout_metrics()["agent/failures"] == 1 and scheduler.rollout_metrics()["agent/timeouts"] == 1
    assert len(scheduler.recorder) == 0  # every session closed


def test_an_agent_stuck_in_a_call_is_cut_off_and_its_generation_stopped(template):
    async def agent(client, row):
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "stall"}])
        return 1.0

    engine = EchoEngine(template, stall="stall")
    scheduler = _scheduler(engine, agent, timeout=0.5)
    try:
        (out,) = run_sync(scheduler.async_infer(_requests(1), RequestConfig(max_tokens=64)))
    finally:
        scheduler.close()
    assert out.rollout_infos["agent_status"] == "timeout" and out.rollout_infos["agent_calls"] == 0
    assert engine.cancelled == 1 and scheduler.service.inflight == 0  # stopped before the rollout returned


def test_an_episodes_session_needs_its_key_and_ends_with_its_agent(template):
    leaked = {}

    async def agent(client, row):
        leaked["url"], leaked["key"] = str(client.base_url), client.api_key
        stranger = openai.AsyncOpenAI(base_url=str(client.base_url), api_key="not-the-key", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await stranger.chat.completions.create(model="m", messages=row["messages"])
        await stranger.close()
        return 0.0

    scheduler = _scheduler(EchoEngine(template), agent)
    try:
        run_sync(scheduler.async_infer(_requests(1), RequestConfig(max_tokens=64)))
        late = openai.OpenAI(base_url=leaked["url"], api_key=leaked["key"], max_retries=0)
        with pytest.raises(openai.AuthenticationError, match="no open episode"):  # as a wrong key: one answer
            late.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    finally:
        scheduler.close()
