"""Porting = renaming imports: a plugin file written as ms-swift users write one (imports renamed, nothing else)
and reward functions in TRL's documented conventions (unmodified, registered through a plugin or named by import
path) each train 2 steps on the tiny model. Both sources live in this repository (third_party.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support import flags, tiny_run_on_rows
from third_party import swift_plugin, trl_reward_examples, trl_reward_modules

from grpokit.protocol import ChatCompletionResponseChoice, RolloutInferRequest
from grpokit.rewards import orms, rm_plugins
from grpokit.rollout.env import envs
from grpokit.rollout.multi_turn import multi_turns

pytestmark = pytest.mark.slow


@pytest.fixture
def swift_plugin_file(tmp_path):
    return swift_plugin(tmp_path / "swift_plugin_renamed.py")  # swift_style_plugin.py, imports renamed


# CustomEnv is `class CustomEnv(Env)` with nothing in it: reset/step stay abstract, so it cannot be built.
NOT_INSTANTIABLE = {"custom_env": "CustomEnv(Env) defines neither reset nor step (abstract)"}
# The plugin's reward functions, trained together in one run on rows that carry every column they read, with
# external_r1v_acc (a built-in under ms-swift's name) beside them.
PLUGIN_REWARDS = [
    "external_countdown",
    "external_code_format",
    "thinking_tips",
    "external_tooluse_format_reward",
    "external_tooluse_length_reward",
    "external_tooluse_correct_reward",
]
SWIFT_REWARDS = [*PLUGIN_REWARDS, "external_r1v_acc"]

TOOL_SOLUTION = '<tool_call>\n{"name": "calculator", "parameters": {"expression": "1+2"}}\n</tool_call>'


def _rows(n: int = 4) -> list[dict]:
    """Rows with the columns the plugin's rewards and its qwenlong judge read; no system message (the judge reads
    messages[0] as the problem)."""
    return [
        {
            "messages": [
                {
                    "role": "user",
                    "content": f"<text>Doc {k}.</text> What is {k} + 2? Format your "
                    "response as follows: <answer>N</answer>",
                }
            ],
            "target": k + 2,
            "nums": [k, 2],
            "solution": f"<answer>{k + 2}</answer>" if k % 2 else TOOL_SOLUTION,
            "verification_info": {"language": "python", "test_cases": [{"input": "", "output": str(k + 2)}]},
            "reward_model": {"ground_truth": str(k + 2)},
        }
        for k in range(n)
    ]


def _train(model_dir: Path, tmp_path: Path, plugin: Path | None, rows: list[dict], extra: list[str]) -> Path:
    mine = "--num_generations 2 --max_completion_length 12 --seed 0 --log_completions true"
    plugins = ["--external_plugins", str(plugin)] if plugin else []
    trainer, _, out = tiny_run_on_rows(model_dir, rows, tmp_path, mine, *plugins, *extra)
    assert trainer.state.global_step == 2
    return out


def _logs(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "logging.jsonl").read_text().splitlines()]


def test_swift_plugin_loads_and_registers_in_every_registry(swift_plugin_file):
    from grpokit.plugins.loader import load_plugins

    before = set(orms)
    load_plugins([str(swift_plugin_file)])
    registered = {"orms": set(orms), "rm": set(rm_plugins), "mt": set(multi_turns), "envs": set(envs)}
    assert set(PLUGIN_REWARDS) == registered["orms"] - before
    assert {"my_rmplugin", "qwenlong"} <= registered["rm"] and "calculator_in_reply" in registered["mt"]
    assert set(NOT_INSTANTIABLE) <= registered["envs"]
    with pytest.raises(TypeError, match="abstract"):
        envs["custom_env"]({})


def test_swift_plugin_reward_functions_train(swift_plugin_file, tiny_model_dir, tmp_path):
    out = _train(tiny_model_dir, tmp_path, swift_plugin_file, _rows(), ["--reward_funcs", *SWIFT_REWARDS])
    logs = _logs(out)
    assert [r["step"] for r in logs] == [1, 2]
    for name in SWIFT_REWARDS:  # every function scored every sample (trainer_state.global_step, request_id, ...)
        assert all(isinstance(r[f"rewards/{name}/mean"], float) for r in logs), name
    assert all(r["rewards/external_tooluse_correct_reward/mean"] <= 3.0 for r in logs)


def test_swift_plugin_reward_model_plugins_train(swift_plugin_file, tiny_model_dir, tiny_rm_dir, tmp_path):
    """my_rmplugin on a sequence classifier (template.encode + data_collator + to_device) and
    qwenlong, a judge on a causal LM (grpokit.swift's TransformersEngine, choice.message.content), in one run."""
    out = _train(
        tiny_model_dir,
        tmp_path,
        swift_plugin_file,
        _rows(),
        flags(
            "--reward_funcs external_countdown",
            {"--reward_model": tiny_rm_dir},
            str(tiny_model_dir),
            "--reward_model_plugin my_rmplugin qwenlong",
        ),
    )
    logs = _logs(out)
    rm_seq, rm_causal = f"rm_{tiny_rm_dir.name}", f"rm_{tiny_model_dir.name}"
    for r in logs:
        assert isinstance(r[f"rewards/{rm_seq}/mean"], float)
        assert r[f"rewards/{rm_causal}/mean"] in (0.0, 0.25, 0.5, 0.75, 1.0)  # [[YES]]/[[NO]] or 0


def test_swift_plugin_tool_call_scheduler_trains_and_steps(swift_plugin_file, tiny_model_dir, tmp_path):
    out = _train(
        tiny_model_dir,
        tmp_path,
        swift_plugin_file,
        _rows(),
        flags("--reward_funcs external_countdown --multi_turn_scheduler calculator_in_reply --max_turns 2"),
    )
    assert len(_logs(out)) == 2
    # its step() on grpokit's objects: choice.message.content, token_ids, self.tokenizer, messages[-1] edited
    from transformers import AutoTokenizer

    sched = multi_turns["calculator_in_reply"](
        None, max_turns=2, tokenizer=AutoTokenizer.from_pretrained(tiny_model_dir)
    )
    text = "Action: calculator\nAction Input: 2+3\n"
    choice = ChatCompletionResponseChoice(
        message={"role": "assistant", "content": text}, finish_reason="stop", token_ids=[5, 6]
    )
    req = RolloutInferRequest(messages=[{"role": "user", "content": "2+3?"}, {"role": "assistant", "content": text}])
    assert sched.check_finished(req, choice, 1) is False
    result = sched.step(req, choice, 1)
    assert req.messages[-1]["content"] == text + "Result: 5"
    assert result["response_loss_mask"][:2] == [1, 1] and set(result["response_loss_mask"][2:]) == {0}
    assert result["rollout_infos"] == {"tool_results": "Result: 5", "num_turns": 1}


def test_trl_documentation_reward_functions_train(tiny_model_dir, tmp_path):
    """The TRL-convention examples on TRL's standard format (a prompt string column)."""
    names = [
        "trl_ex1_token_length",
        "trl_ex1_1_char_length",
        "trl_ex3_reference",
        "trl_ex4_math",
        "trl_ex4_coding",
        "trl_ex5_async",
        "trl_ex6_logging",
    ]
    rows = [
        {
            "prompt": f"What is {k} + 1? Put it in \\boxed{{}}.",
            "ground_truth": str(k + 1),
            "task": "math" if k % 2 else "coding",
        }
        for k in range(4)
    ]
    plugin = trl_reward_examples(tmp_path / "trl_reward_examples.py")
    out = _train(tiny_model_dir, tmp_path, plugin, rows, ["--reward_funcs", *names])
    logs = _logs(out)
    for r in logs:
        assert r["rewards/trl_ex1_token_length/mean"] >= 1.0  # completion_ids by keyword: token counts
        assert r["rewards/trl_ex1_1_char_length/mean"] >= 1.0  # texts: character counts
        assert r["rewards/trl_ex5_async/mean"] > 0.0  # awaited; non-empty completions score 1
        assert r["rewards/trl_ex3_reference/mean"] == 0.0  # a random model writes no \boxed{answer}
        assert 0.0 <= r["accuracy"] <= 1.0  # log_metric("accuracy", ...) of Example 6
    comps = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert len(comps) == 8
    for c in comps:  # log_extra columns of Example 6 in the completions table
        assert c["golden_answer"] in {"1", "2", "3", "4"} and isinstance(c["extracted_answer"], str)
        # Example 4: each row is scored by exactly one of the two task functions (None = not scored)
        assert (c["trl_ex4_math"] is None) != (c["trl_ex4_coding"] is None)
        assert {c["trl_ex4_math"], c["trl_ex4_coding"]} - {None} <= {-1.0, 1.0}


def test_trl_conversational_example_reads_messages_from_a_conversational_dataset(tiny_model_dir, tmp_path):
    """TRL picks the format from the dataset: a prompt column of messages makes TRL-convention rewards read
    prompts and completions as message lists (Example 2: completion[0]["content"], which fails on a string),
    while an ms-swift-convention function (Example 1.1's signature is also ms-swift's) still counts characters."""
    names = ["trl_ex1_token_length", "trl_ex1_1_char_length", "trl_ex2_format", "trl_ex5_async"]
    rows = [
        {
            "prompt": [
                {"role": "system", "content": "Think, then answer."},
                {"role": "user", "content": f"What is {k} + 1?"},
            ]
        }
        for k in range(4)
    ]
    plugin = trl_reward_examples(tmp_path / "trl_reward_examples.py")
    out = _train(tiny_model_dir, tmp_path, plugin, rows, ["--reward_funcs", *names])
    for r in _logs(out):
        assert r["rewards/trl_ex2_format/mean"] == 0.0  # message lists read; a random model writes no <think>
        assert r["rewards/trl_ex1_token_length/mean"] >= 1.0
        assert r["rewards/trl_ex1_1_char_length/mean"] > 1.0  # texts (a message list would count 1)
        assert r["rewards/trl_ex5_async/mean"] == 1.0  # a non-empty message list scores 1


def test_trl_examples_by_import_path_train_with_no_registration_at_all(tiny_model_dir, tmp_path):
    """TRL's CLI form, ``--reward_funcs module.function``: each documentation example is a module of its own, as
    written, with no grpokit line in it; functions named this way are called TRL's way (Example 2 included, whose
    signature alone would read as ms-swift's), and the format follows the dataset (here conversational)."""
    paths = trl_reward_modules(Path.cwd())  # the current directory is searched first
    names = [paths[n] for n in ("trl_ex1_token_length", "trl_ex2_format", "trl_ex5_async")]
    rows = [{"prompt": [{"role": "user", "content": f"What is {k} + 1?"}]} for k in range(4)]
    out = _train(tiny_model_dir, tmp_path, None, rows, ["--reward_funcs", *names])
    for r in _logs(out):
        assert r[f"rewards/{paths['trl_ex2_format']}/mean"] == 0.0  # message lists read; no <think> written
        assert r[f"rewards/{paths['trl_ex1_token_length']}/mean"] >= 1.0  # completion_ids by keyword
        assert r[f"rewards/{paths['trl_ex5_async']}/mean"] == 1.0  # awaited; a non-empty message list scores 1


def test_an_import_path_that_names_no_function_stops_the_run_in_one_line(tmp_path):
    from grpokit.errors import ConfigError
    from grpokit.rewards import build_reward_funcs

    (Path.cwd() / "my_trl_rewards.py").write_text("class Scorer:\n    pass\n\nTHRESHOLD = 0.5\n")
    with pytest.raises(ConfigError, match=r"unknown reward function \(and no module 'no_such_module'.*registered: "):
        build_reward_funcs(["no_such_module.reward"])
    with pytest.raises(ConfigError, match=r"my_trl_rewards.Scorer is a class; an import path must name a reward"):
        build_reward_funcs(["my_trl_rewards.Scorer"])
    with pytest.raises(ConfigError, match=r"my_trl_rewards.missing is nothing"):
        build_reward_funcs(["my_trl_rewards.missing"])
    with pytest.raises(ConfigError, match=r"my_trl_rewards.THRESHOLD is float"):
        build_reward_funcs(["my_trl_rewards.THRESHOLD"])


def test_a_reward_that_fits_no_convention_stops_the_run_before_training(tiny_model_dir, tmp_path):
    from grpokit.errors import ConfigError

    plugin = tmp_path / "bad_rewards.py"
    plugin.write_text(
        "from grpokit.rewards import orms\n\n"
        "def scores_nothing(prompts, /, completions):\n    return [0.0] * len(completions)\n\n"
        "orms['scores_nothing'] = scores_nothing\n"
    )
    with pytest.raises(
        ConfigError,
        match=r"--reward_funcs scores_nothing: scores_nothing is called with keywords "
        r"\(TRL convention\), but prompts is positional-only",
    ):
        _train(tiny_model_dir, tmp_path, plugin, _rows(), ["--reward_funcs", "scores_nothing"])
    assert not (tmp_path / "out" / "logging.jsonl").exists()  # no step ran


def test_swift_thinking_tips_reward_with_the_round_per_output_scheduler(swift_plugin_file, tiny_model_dir, tmp_path):
    """The plugin's thinking_tips reads trajectory_inputs[request_id][-1] (the last round); with
    thinking_tips_scheduler every round is its own sample, and all rounds of a request get the same reward."""
    out = _train(
        tiny_model_dir,
        tmp_path,
        swift_plugin_file,
        _rows(),
        flags("--reward_funcs thinking_tips --multi_turn_scheduler thinking_tips_scheduler --max_turns 2"),
    )
    assert len(_logs(out)) == 2
    comps = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert comps and all(c["thinking_tips"] in (0.0, 1.0) for c in comps)
