"""Prompt rendering options from ms-swift/TRL: agent templates (tools), chat-template kwargs, --max_length with
--truncation_strategy; all with the tiny test tokenizer (a real tokenizer, built offline)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import datasets
import pytest

from grpokit.errors import ConfigError, DataError
from grpokit.rewards.shape_rewards import ReActFormat
from grpokit.rewards.toolbench import ReactORM
from grpokit.template.agent import add_tools
from grpokit.template.encode import KWARGS_KEY, TOOLS_KEY
from grpokit.template.prompts import PromptOptions, check_data_options, prepare_prompts
from grpokit.testing import CHATML_TEMPLATE, build_tiny_tokenizer

WEATHER = {
    "name": "get_weather",
    "description": "Weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}
CLOCK = {"type": "function", "function": {"name": "now", "description": "The time.", "parameters": {}}}
# a chat template that renders tools= and enable_thinking, as Qwen3's does (shortened)
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTOOLS:{% for t in tools %}{{ t.function.name if t.function is defined "
    "else t.name }};{% endfor %}<|im_end|>\n{% endif %}"
    + CHATML_TEMPLATE
    + "{% if add_generation_prompt and enable_thinking is defined and not enable_thinking %}"
    "{{ '<think>\n\n</think>\n\n' }}{% endif %}"
)


def data_args(**kw) -> SimpleNamespace:
    base = dict(
        system=None,
        columns=None,
        max_length=None,
        truncation_strategy=None,
        dataset_num_proc=1,
        load_from_cache_file=False,
        agent_template=None,
        enable_thinking=None,
        chat_template_kwargs=None,
    )
    return SimpleNamespace(**{**base, **kw})


@pytest.fixture(scope="module")
def tokenizer():
    tok = build_tiny_tokenizer()
    tok.chat_template = TOOLS_TEMPLATE
    return tok


def rows(ds: datasets.Dataset) -> list[dict]:
    return [ds[i] for i in range(len(ds))]


def test_hermes_writes_tools_after_the_system_prompt():
    [system, user] = add_tools(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}], [WEATHER, CLOCK], "hermes"
    )
    text = system["content"]
    assert text.startswith("Be brief.\n\n# Tools\n") and user == {"role": "user", "content": "hi"}
    listed = text.split("<tools>\n")[1].split("\n</tools>")[0].splitlines()
    # each tool on one line in OpenAI's wrapped form, as Qwen2.5's template writes them
    assert [json.loads(line) for line in listed] == [{"type": "function", "function": WEATHER}, CLOCK]
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' in text


def test_react_en_makes_a_system_message_listing_the_tools():
    [system, _] = add_tools([{"role": "user", "content": "hi"}], [WEATHER, CLOCK], "react_en")
    text = system["content"]
    assert system["role"] == "system" and text.startswith("Answer the following questions as best you can.")
    assert "Action: the action to take, should be one of [get_weather,now]" in text
    assert "get_weather: Call this tool" in text and '"city": {"type": "string"}' in text
    assert text.rstrip().endswith("Begin!")


def test_react_grpo_lists_the_tools_and_asks_for_think_then_action():
    [system, user] = add_tools(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}], [WEATHER, CLOCK], "react_grpo"
    )
    text = system["content"]
    assert system["role"] == "system" and user == {"role": "user", "content": "hi"}
    assert "Be brief." not in text  # as react_en (and ms-swift's react templates): the tool prompt is the system
    # one line per tool: name, description, JSON parameters
    assert 'get_weather: Weather of a city. Parameters: {"type": "object", "properties": {"city": {"type": ' in text
    assert "now: The time. Parameters: {}" in text
    # the markers ms-swift's react_grpo uses, in its order
    layout = text.split("Reply layout:\n\n")[1]
    assert layout.startswith("<think>what to do next</think>\nAction: one name from [get_weather,now]\nAction Input: ")
    assert [m for m in ("Observation:", "Final Answer:") if m in layout] == ["Observation:", "Final Answer:"]
    assert text.rstrip().endswith("Begin!")


def test_a_reply_in_the_react_grpo_format_earns_the_react_rewards():
    reply = '<think>The user wants the weather.</think>\nAction: get_weather\nAction Input: {"city": "Paris"}'
    solution = 'Action: get_weather\nAction Input: {"city": "Paris"}'
    assert ReActFormat()([reply, "Action: get_weather"]) == [1.0, 0.0]
    assert ReactORM()([reply], solution=[solution]) == [1.0]


def test_native_tools_reach_the_chat_template_through_every_engine_path(tokenizer):
    opts = PromptOptions()
    ds = datasets.Dataset.from_list(
        [
            {"messages": [{"role": "user", "content": "hi"}], "tools": json.dumps([WEATHER, CLOCK])},
            {"messages": [{"role": "user", "content": "yo"}], "tools": None},
        ]
    )
    out = rows(prepare_prompts(ds, opts.template(tokenizer), opts, "d"))
    assert json.loads(out[0]["messages"][0][TOOLS_KEY]) == [WEATHER, CLOCK]
    template = opts.template(tokenizer)
    rendered = template.render_prompt(out[0]["messages"])
    assert rendered.startswith("<|im_start|>system\nTOOLS:get_weather;now;<|im_end|>\n<|im_start|>user\nhi")
    assert "TOOLS" not in template.render_prompt(out[1]["messages"])  # the row without tools
    assert template.encode_prompt(out[0]["messages"]) == tokenizer(rendered, add_special_tokens=False)["input_ids"]


def test_bad_tools_and_unknown_agent_template_are_refused():
    ds = datasets.Dataset.from_list([{"messages": [{"role": "user", "content": "hi"}], "tools": "[{"}])
    with pytest.raises(DataError, match="d: row 0: column 'tools' is not valid JSON"):
        prepare_prompts(ds, None, PromptOptions(), "d")
    ds = datasets.Dataset.from_list(
        [{"messages": [{"role": "user", "content": "hi"}], "tools": json.dumps([{"description": "x"}])}]
    )
    with pytest.raises(DataError, match="a tool has no name"):
        prepare_prompts(ds, None, PromptOptions(), "d")
    with pytest.raises(
        ConfigError, match="--agent_template glm4: not implemented in grpokit; use hermes, react_en or react_grpo"
    ):
        PromptOptions.from_args(data_args(agent_template="glm4"))


def test_enable_thinking_and_chat_template_kwargs_reach_the_template(tokenizer):
    msgs = [{"role": "user", "content": "hi"}]
    opts = PromptOptions.from_args(data_args(enable_thinking=False))
    assert opts.template(tokenizer).render_prompt(msgs).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    plain = PromptOptions().template(tokenizer)
    assert not plain.render_prompt(msgs).endswith("</think>\n\n")
    # the prompts carry the option, so a template without it (a rollout server's) renders them the same
    [row] = rows(prepare_prompts(datasets.Dataset.from_list([{"messages": msgs}]), plain, opts, "d"))
    assert json.loads(row["messages"][0][KWARGS_KEY]) == {"enable_thinking": False}
    assert plain.render_prompt(row["messages"]) == opts.template(tokenizer).render_prompt(msgs)
    opts = PromptOptions.from_args(data_args(chat_template_kwargs='{"enable_thinking": false, "x": 1}'))
    assert opts.chat_template_kwargs == {"enable_thinking": False, "x": 1}
    with pytest.raises(ConfigError, match="--chat_template_kwargs 'x=1': not valid JSON"):
        PromptOptions.from_args(data_args(chat_template_kwargs="x=1"))


def long_rows(tokenizer) -> tuple[datasets.Dataset, list[int]]:
    ds = datasets.Dataset.from_list(
        [{"messages": [{"role": "user", "content": "hi " * n}], "k": n} for n in (1, 40, 2)]
    )
    lengths = PromptOptions().template(tokenizer).prompt_lengths(ds["messages"])
    return ds, lengths


def test_max_length_delete_drops_long_prompts_and_counts_them(tokenizer, caplog):
    ds, lengths = long_rows(tokenizer)
    limit = max(lengths[0], lengths[2])
    assert lengths[1] > limit
    opts = PromptOptions(max_length=limit, truncation_strategy="delete")
    with caplog.at_level("WARNING"):
        out = prepare_prompts(ds, opts.template(tokenizer), opts, "--dataset 'd'")
    assert out["k"] == [1, 2]
    assert "dropped 1 of 3 rows whose prompt is longer than --max_length" in caplog.text
    opts = PromptOptions(max_length=1, truncation_strategy="delete")
    with pytest.raises(DataError, match="every prompt is longer than --max_length 1"):
        prepare_prompts(ds, opts.template(tokenizer), opts, "d")


def test_max_length_raise_names_the_row(tokenizer):
    ds, lengths = long_rows(tokenizer)
    opts = PromptOptions(max_length=lengths[2], truncation_strategy="raise")
    with pytest.raises(
        DataError,
        match=rf"d: row 1 has a {lengths[1]}-token prompt, over --max_length "
        rf"{lengths[2]} \(1 of 3 rows are\)",
    ):
        prepare_prompts(ds, opts.template(tokenizer), opts, "d")


@pytest.mark.parametrize("side", ["left", "right"])
def test_max_length_left_right_cut_the_prompt_ids(tokenizer, side):
    ds, lengths = long_rows(tokenizer)
    long = ds[1]["messages"]
    full = PromptOptions().template(tokenizer).encode_prompt(long)
    limit = max(lengths[0], lengths[2])
    opts = PromptOptions(max_length=limit, truncation_strategy=side)
    assert rows(prepare_prompts(ds, opts.template(tokenizer), opts, "d")) == rows(ds)  # rows kept
    ids = opts.template(tokenizer).encode_prompt(long)
    assert len(full) == lengths[1] > limit and ids == (full[-limit:] if side == "left" else full[:limit])
    short = ds[0]["messages"]
    assert opts.template(tokenizer).encode_prompt(short) == PromptOptions().template(tokenizer).encode_prompt(short)


def test_option_checks_without_a_model(caplog):
    with pytest.raises(ConfigError, match="--truncation_strategy split: ms-swift allows it for pre-training only"):
        PromptOptions.from_args(data_args(truncation_strategy="split"))
    with pytest.raises(ConfigError, match="--truncation_strategy middle: unknown"):
        PromptOptions.from_args(data_args(truncation_strategy="middle"))
    with pytest.raises(ConfigError, match="--max_length 0: must be a positive token count"):
        PromptOptions.from_args(data_args(max_length=0))
    colocate = SimpleNamespace(vllm_mode="colocate", multi_turn_scheduler=None)
    multi_turn = SimpleNamespace(vllm_mode="colocate", multi_turn_scheduler="math_tip_trick")
    server = SimpleNamespace(vllm_mode="server", multi_turn_scheduler=None)
    with pytest.raises(ConfigError, match="--system nope.txt"):
        check_data_options(data_args(system="nope.txt"), colocate)
    with pytest.raises(ConfigError, match="not implemented with multi-turn rollouts; use --truncation_strategy"):
        check_data_options(data_args(max_length=64, truncation_strategy="left"), multi_turn)
    assert check_data_options(data_args(max_length=64), colocate).truncation_strategy == "left"
    for rollout in (server, multi_turn):  # unset: ms-swift's left cannot apply there; delete, said at start-up
        with caplog.at_level("WARNING"):
            opts = check_data_options(data_args(max_length=64, enable_thinking=True), rollout)
        assert opts.truncation_strategy == "delete" and not opts.truncates_ids
    assert "--max_length 64: prompts longer than it are dropped (--truncation_strategy delete)" in caplog.text


def test_tools_read_by_arrow_lose_the_nulls_arrow_added(tokenizer):
    other = {
        "name": "add",
        "description": "Add.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
    }
    ds = datasets.Dataset.from_list([{"query": "hi", "tools": [t]} for t in (WEATHER, other)])
    assert ds[0]["tools"][0]["parameters"]["required"] is None  # what Arrow does to a key only some rows have
    from grpokit.data.loading import normalize_rows

    opts = PromptOptions(agent_template="hermes")
    out = prepare_prompts(normalize_rows(ds, None), opts.template(tokenizer), opts, "d")
    listed = [
        json.loads(out[i]["messages"][0]["content"].split("<tools>\n")[1].split("\n</tools>")[0]) for i in range(2)
    ]
    assert listed == [{"type": "function", "function": WEATHER}, {"type": "function", "function": other}]


def test_native_tools_survive_the_rollout_wire(tokenizer):
    """A rollout server gets the prompt as a JSON request body and renders it with its own template."""
    from grpokit.protocol import RolloutInferRequest

    msgs = add_tools([{"role": "user", "content": "hi"}], [WEATHER], None)
    body = RolloutInferRequest(messages=msgs).model_dump_json()
    received = RolloutInferRequest.model_validate_json(body).messages
    server_side = PromptOptions().template(tokenizer)
    assert server_side.render_prompt(received) == PromptOptions().template(tokenizer).render_prompt(msgs)
    assert "TOOLS:get_weather;" in server_side.render_prompt(received)


def test_row_chat_template_kwargs_win_over_the_run(tokenizer):
    opts = PromptOptions.from_args(data_args(enable_thinking=True))
    ds = datasets.Dataset.from_list(
        [
            {"query": "a", "chat_template_kwargs": json.dumps({"enable_thinking": False})},
            {"query": "b", "chat_template_kwargs": None},
        ]
    )
    from grpokit.data.loading import normalize_rows

    out = rows(prepare_prompts(normalize_rows(ds, None), opts.template(tokenizer), opts, "d"))
    assert [json.loads(r["messages"][0][KWARGS_KEY]) for r in out] == [
        {"enable_thinking": False},
        {"enable_thinking": True},
    ]
    assert opts.template(tokenizer).render_prompt(out[0]["messages"]).endswith("<think>\n\n</think>\n\n")
    bad = datasets.Dataset.from_list([{"messages": [{"role": "user", "content": "a"}], "chat_template_kwargs": "[1]"}])
    with pytest.raises(DataError, match="d: row 0: column 'chat_template_kwargs' must be a JSON object"):
        prepare_prompts(bad, None, opts, "d")


def test_native_tools_with_a_template_that_drops_them_is_refused():
    tok = build_tiny_tokenizer()  # plain ChatML: no tools in it
    ds = datasets.Dataset.from_list([{"messages": [{"role": "user", "content": "hi"}], "tools": json.dumps([WEATHER])}])
    with pytest.raises(
        DataError,
        match="d has a 'tools' column, but the model's chat template does not render "
        "tools.*--agent_template hermes, react_en or react_grpo",
    ):
        prepare_prompts(ds, PromptOptions().template(tok), PromptOptions(), "d")
    opts = PromptOptions(agent_template="hermes")
    [row] = rows(prepare_prompts(ds, opts.template(tok), opts, "d"))
    assert "get_weather" in opts.template(tok).render_prompt(row["messages"])
