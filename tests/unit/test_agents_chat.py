"""The OpenAI body, the tool-call parser and the episode bookkeeping (grpokit/agents), without an engine."""

from __future__ import annotations

import json

import pytest

from grpokit.agents import agents
from grpokit.agents.chat import ChatBody, ChatError, check_body, parse_tool_calls, request_config, template_messages
from grpokit.agents.episodes import ChoiceRecord, Episode, episode_outputs
from grpokit.agents.runner import checked_reward
from grpokit.protocol import RequestConfig
from grpokit.template.encode import ChatTemplate, detach


def _body(**kw) -> ChatBody:
    return ChatBody(model="m", messages=[{"role": "user", "content": "hi"}], **kw)


def test_hermes_tool_calls_are_parsed_out_of_the_content():
    text = 'Let me add.<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>'
    content, calls = parse_tool_calls(text)
    assert content == "Let me add."
    assert [c["function"]["name"] for c in calls] == ["calculator"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"expression": "2+3"}  # OpenAI: arguments as JSON text
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")


def test_a_tool_call_block_that_is_not_json_stays_text():
    text = "<tool_call>{not json}</tool_call> and <tool_call>[1, 2]</tool_call>"
    assert parse_tool_calls(text) == (text, [])


def test_messages_take_the_templates_form():
    body = ChatBody(
        model="m",
        tools=[{"type": "function", "function": {"name": "calc", "parameters": {}}}],
        messages=[
            {"role": "developer", "content": [{"type": "text", "text": "be brief"}]},
            {
                "role": "assistant",
                "content": None,
                "refusal": None,
                "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "calc", "arguments": '{"x": 1}'}}],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "1"},
        ],
    )
    messages, tools, _ = detach(template_messages(body))
    assert tools == body.tools  # carried to the chat template's tools=
    assert messages[0] == {"role": "system", "content": "be brief"}
    assert messages[1]["content"] == "" and "refusal" not in messages[1]
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"x": 1}


@pytest.mark.parametrize(
    ("kw", "status", "words"),
    [
        ({"stream": True}, 400, "stream true"),
        ({"top_logprobs": 3}, 400, "top_logprobs 3"),
        ({"presence_penalty": 0.5}, 400, "presence_penalty 0.5"),
        ({"store": True}, 400, "store true"),
        ({"max_tokens": 4, "max_completion_tokens": 5}, 400, "differ"),
    ],
)
def test_unsupported_fields_are_refused_by_name(kw, status, words):
    with pytest.raises(ChatError, match=words) as e:
        check_body(_body(**kw))
    assert e.value.status == status


def test_stop_is_a_string_or_a_bounded_list():
    assert _body(stop="x" * 100).stop == "x" * 100
    with pytest.raises(ValueError, match="at most 16 items"):
        _body(stop=["x"] * 17)


def test_an_unknown_role_is_refused():
    with pytest.raises(ChatError, match="messages\\[0\\].role 'robot'"):
        template_messages(ChatBody(model="m", messages=[{"role": "robot", "content": "x"}]))


def test_an_episode_keeps_the_trainers_sampling():
    defaults = RequestConfig(max_tokens=16, temperature=1.0, stop=["END"])
    cfg = request_config(_body(max_tokens=64, stop="STOP", n=2), defaults, fixed_sampling=True)
    assert (cfg.max_tokens, cfg.stop, cfg.n, cfg.logprobs) == (16, ["END", "STOP"], 2, True)  # bounded, joined
    with pytest.raises(ChatError, match="temperature 0.5: an episode samples at the trainer's --temperature 1"):
        request_config(_body(temperature=0.5), defaults, fixed_sampling=True)
    assert request_config(_body(temperature=0.5), defaults, fixed_sampling=False).temperature == 0.5


@pytest.mark.parametrize("value", [True, float("nan"), "1", [1.0]])
def test_an_agents_reward_must_be_a_finite_number_or_none(value):
    assert checked_reward(None, "a") is None and checked_reward(2, "a") == 2.0
    with pytest.raises(ValueError, match="agent 'a' returned"):
        checked_reward(value, "a")


def test_agents_is_a_registry_with_a_decorator():
    @agents.register("unit_test_agent")
    async def agent(client, row):
        return 1.0

    assert agents["unit_test_agent"] is agent
    with pytest.raises(Exception, match="--agent 'nope': unknown agent"):
        agents.get_or_raise("nope")


# -- episodes: chains of calls -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def template(tiny_model_dir):
    from grpokit.modeling import load_tokenizer

    return ChatTemplate(load_tokenizer(tiny_model_dir))


def _call(episode: Episode, template, messages, ids):
    prompt, parent, between = episode.plan(messages, template)
    text = template.tokenizer.decode(ids, skip_special_tokens=True)
    episode.record(
        messages,
        prompt,
        [ChoiceRecord(ids, [-1.0] * len(ids), text, "stop", {"role": "assistant", "content": text})],
        0,
        parent,
        between,
    )
    return prompt, text


def test_a_call_that_extends_a_reply_continues_its_prompt_ids(template):
    tok = template.tokenizer
    eos = tok.eos_token_id
    ep = Episode(row={})
    m1 = [{"role": "user", "content": "What is 2 + 3?"}]
    # sampled ids that are not the tokenizer's own split of their text: re-rendering would change them
    c1 = [tok.convert_tokens_to_ids(t) for t in "5"] + tok("  x", add_special_tokens=False)["input_ids"][::-1] + [eos]
    p1, t1 = _call(ep, template, m1, c1)
    m2 = [*m1, {"role": "assistant", "content": t1}, {"role": "tool", "content": "5"}]
    c2 = tok("done", add_special_tokens=False)["input_ids"] + [eos]
    p2, t2 = _call(ep, template, m2, c2)
    gap = tok("\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    assert p2 == p1 + c1 + gap  # the sampled ids as sampled, then the template's tokens
    (out,) = episode_outputs(ep)
    sample = template.encode_output(out.prompt_messages, out)  # what the trainer encodes
    assert sample.prompt_ids == p1
    assert sample.completion_ids == c1 + gap + c2
    assert sample.completion_mask == [1] * len(c1) + [0] * len(gap) + [1] * len(c2)
    # a call that rewrites the history starts a trajectory of its own, rendered afresh
    m3 = [{"role": "user", "content": "Summary: 5"}]
    p3, _ = _call(ep, template, m3, [eos])
    assert p3 == template.encode_prompt(m3)
    assert [len(o.response_token_ids) for o in episode_outputs(ep)] == [2, 1]


def test_a_failed_episode_trains_nothing(template):
    ep = Episode(row={"messages": [{"role": "user", "content": "hi"}]})
    assert episode_outputs(ep)[0].response_token_ids == [[]]  # no call: one empty trajectory on the row's prompt
    _call(ep, template, [{"role": "user", "content": "hi"}], [5, 6])
    ep.finish("failed", 0.0, "ValueError: boom")
    (out,) = episode_outputs(ep, train=False)
    assert out.response_loss_mask == [[0, 0]] and out.rollout_infos["total_reward"] == 0.0
    assert out.rollout_infos["agent_status"] == "failed"


def test_the_docs_examples_compile():
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "agents.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", doc, flags=re.DOTALL)
    assert len(blocks) >= 3  # the plugin, the openai tool agent, the Agents SDK agent
    for i, block in enumerate(blocks):
        compile(block, f"docs/agents.md[python block {i}]", "exec")


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"multi_turn_scheduler": "tool_call_scheduler"}, "the agent drives the episode itself"),
        ({"use_vllm": True}, "--use_vllm true is not implemented"),
        ({"vllm_mode": "server", "vllm_server_host": "127.0.0.1"}, "--vllm_mode server is not implemented"),
    ],
)
def test_agent_refuses_the_options_it_cannot_go_with(options, words):
    from grpokit.agents.scheduler import check_agent_options
    from grpokit.config.args import RolloutArguments
    from grpokit.errors import ConfigError

    with pytest.raises(ConfigError, match=words):
        check_agent_options(RolloutArguments(agent="a", **options))


def test_agent_without_the_openai_package_fails_at_start(monkeypatch):
    import importlib.util

    from grpokit.agents.scheduler import AgentScheduler
    from grpokit.config.args import RolloutArguments
    from grpokit.errors import ConfigError

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "openai" else real(name, *a))
    with pytest.raises(ConfigError, match=r"pip install 'grpokit\[agents\]'"):
        AgentScheduler.from_args(RolloutArguments(agent="a"), serve=None)
