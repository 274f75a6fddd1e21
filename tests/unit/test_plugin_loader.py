"""`--external_plugins` loading, `TrainerFactory` paths, and the pieces of examples/plugin/plugin.py."""

from __future__ import annotations

import asyncio
import importlib
import logging
import sys
import textwrap
from pathlib import Path

import pytest

from grpokit.algorithms import (
    ADVANTAGE_ESTIMATORS,
    IS_LEVELS,
    LOSS_NORMALIZERS,
    POLICY_LOSSES,
    ROLLOUT_IS_MODES,
    SCALE_MODES,
)
from grpokit.errors import ConfigError, PluginError
from grpokit.plugins.loader import load_plugins, load_plugins_once
from grpokit.rewards import orms, prms, rm_plugins
from grpokit.rollout.env import envs
from grpokit.rollout.multi_turn import multi_turns
from grpokit.trainers.callbacks import callbacks_map
from grpokit.trainers.factory import TrainerFactory
from grpokit.trainers.optimizers import optimizers_map

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "plugin" / "plugin.py"
REGISTRIES = (
    orms,
    prms,
    rm_plugins,
    multi_turns,
    envs,
    callbacks_map,
    optimizers_map,
    TrainerFactory.TRAINER_MAPPING,
    ADVANTAGE_ESTIMATORS,
    SCALE_MODES,
    POLICY_LOSSES,
    LOSS_NORMALIZERS,
    IS_LEVELS,
    ROLLOUT_IS_MODES,
)


@pytest.fixture
def isolated(tmp_path):
    """Undo what loading plugins does: registry entries, TRAINER_MAPPING, sys.path, the plugin modules."""
    saved = [dict(r) for r in REGISTRIES]
    path, modules = list(sys.path), set(sys.modules)
    yield tmp_path
    for registry, before in zip(REGISTRIES, saved, strict=True):
        dict.clear(registry)
        dict.update(registry, before)  # plain dict methods: no "registered again" warnings while restoring
    sys.path[:] = path
    for name in set(sys.modules) - modules:
        origin = str(getattr(sys.modules[name], "__file__", None) or "")
        if origin.startswith((str(tmp_path), str(EXAMPLE.parent))):
            del sys.modules[name]


def _write(folder: Path, name: str, code: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(textwrap.dedent(code))
    return path


# ------------------------------------------------------------------------------------------------------------
# the loader
# ------------------------------------------------------------------------------------------------------------
def test_plugin_becomes_a_top_level_module_with_its_folder_on_sys_path(isolated):
    path = _write(isolated / "plugs", "gk_first_plugin.py", "VALUE = 3\n")
    assert load_plugins([str(path)]) == ["gk_first_plugin"]
    assert sys.path[0] == str(path.parent)
    module = importlib.import_module("gk_first_plugin")  # a string path "gk_first_plugin.X" resolves
    assert module.VALUE == 3 and Path(module.__file__) == path


def test_helper_next_to_the_plugin_imports_as_a_sibling(isolated):
    _write(isolated / "plugs", "gk_helpers.py", "def double(x):\n    return 2 * x\n")
    path = _write(isolated / "plugs", "gk_uses_helper.py", "from gk_helpers import double\nRESULT = double(21)\n")
    load_plugins([str(path)])
    assert sys.modules["gk_uses_helper"].RESULT == 42


def test_files_load_in_order_and_a_later_one_sees_earlier_registrations(isolated):
    a = _write(
        isolated / "a",
        "gk_plugin_a.py",
        """
        from grpokit.rewards import orms
        orms["gk_first"] = lambda completions, **kw: [1.0] * len(completions)
    """,
    )
    b = _write(
        isolated / "b",
        "gk_plugin_b.py",
        """
        from grpokit.rewards import orms
        first = orms["gk_first"]          # KeyError if a.py had not run before
        orms["gk_doubled"] = lambda completions, **kw: [2 * s for s in first(completions)]
    """,
    )
    assert load_plugins([str(a), str(b)]) == ["gk_plugin_a", "gk_plugin_b"]
    assert orms["gk_doubled"](["x", "y"]) == [2.0, 2.0]


def test_registering_an_existing_name_warns_which_one_wins(isolated, caplog):
    builtin = orms["accuracy"]
    path = _write(
        isolated / "p",
        "gk_override.py",
        """
        from grpokit.rewards import ORM, orms
        class StrictAccuracy(ORM):
            def __call__(self, completions, solution, **kwargs):
                return [float(c.strip() == s) for c, s in zip(completions, solution)]
        orms["accuracy"] = StrictAccuracy
    """,
    )
    with caplog.at_level(logging.WARNING, logger="grpokit.registry"):
        load_plugins([str(path)])
    assert orms["accuracy"].__name__ == "StrictAccuracy"  # the plugin wins: it registered last
    expected = (
        f"reward function 'accuracy' registered again: gk_override.StrictAccuracy replaces "
        f"{builtin.__module__}.{builtin.__qualname__}"
    )
    assert expected in caplog.messages


def test_loading_the_same_file_again_reruns_it(isolated):
    _write(isolated / "p", "gk_counter.py", "runs = 0\n")
    path = _write(isolated / "p", "gk_bump.py", "import gk_counter\ngk_counter.runs += 1\n")
    load_plugins([str(path)])
    load_plugins([str(path)])
    assert sys.modules["gk_counter"].runs == 2


def test_load_once_skips_a_file_already_imported_but_not_one_whose_module_was_removed(isolated):
    _write(isolated / "p", "gk_counter2.py", "runs = 0\n")
    path = _write(isolated / "p", "gk_bump2.py", "import gk_counter2\ngk_counter2.runs += 1\n")
    assert load_plugins_once([str(path)]) == ["gk_bump2"]
    assert load_plugins_once([str(path)]) == ["gk_bump2"]
    assert sys.modules["gk_counter2"].runs == 1
    del sys.modules["gk_bump2"]  # what a test fixture does to undo a load
    load_plugins_once([str(path)])
    assert sys.modules["gk_counter2"].runs == 2


def test_missing_file_and_non_python_file(isolated):
    with pytest.raises(PluginError, match=r"^--external_plugins /no/such/plugin\.py: file not found$"):
        load_plugins(["/no/such/plugin.py"])
    txt = _write(isolated, "gk_notes.txt", "hello\n")
    with pytest.raises(PluginError, match=r"not a Python file; pass a \.py file"):
        load_plugins([str(txt)])


def test_plugin_raising_on_import_names_file_line_and_first_line_of_error(isolated):
    path = _write(isolated / "p", "gk_broken.py", "x = 1\nraise RuntimeError('no API key\\nsecond line')\n")
    with pytest.raises(PluginError) as info:
        load_plugins([str(path)])
    assert str(info.value) == f"--external_plugins {path}: import failed at line 2: RuntimeError: no API key"
    assert "gk_broken" not in sys.modules  # a half-imported module does not linger


def test_syntax_error_names_the_line(isolated):
    path = _write(isolated / "p", "gk_typo.py", "a = 1\nb = 2\ndef f(:\n    pass\n")
    with pytest.raises(PluginError, match=r"import failed at line 3: SyntaxError: "):
        load_plugins([str(path)])


def test_a_plugin_may_not_replace_an_imported_library_module(isolated):
    import json

    path = _write(isolated / "p", "json.py", "BROKEN = True\n")
    with pytest.raises(PluginError, match=r"a module named 'json' is already imported from .*rename the plugin"):
        load_plugins([str(path)])
    assert sys.modules["json"] is json


def test_a_plugin_of_the_same_name_from_another_folder_replaces_the_earlier_one(isolated, caplog):
    first = _write(isolated / "one", "gk_same.py", "WHICH = 1\n")
    second = _write(isolated / "two", "gk_same.py", "WHICH = 2\n")
    load_plugins([str(first)])
    with caplog.at_level(logging.WARNING, logger="grpokit.plugins.loader"):
        load_plugins([str(second)])
    assert sys.modules["gk_same"].WHICH == 2
    assert any("replaces the one loaded from" in m for m in caplog.messages)


# ------------------------------------------------------------------------------------------------------------
# TrainerFactory
# ------------------------------------------------------------------------------------------------------------
def test_trainer_mapping_string_path_resolves_to_the_plugin_class(isolated):
    path = _write(
        isolated / "p",
        "gk_trainer_plugin.py",
        """
        from grpokit.trainers.factory import TrainerFactory
        from grpokit.trainers.grpo_trainer import GRPOTrainer
        class MyTrainer(GRPOTrainer):
            pass
        TrainerFactory.TRAINER_MAPPING["grpo"] = "gk_trainer_plugin.MyTrainer"
    """,
    )
    load_plugins([str(path)])
    assert TrainerFactory.get_trainer_cls("grpo") is sys.modules["gk_trainer_plugin"].MyTrainer


@pytest.mark.parametrize(
    "value, needle",
    [
        ("MyTrainer", "give an importable 'module.Class' path"),
        (
            "gk_not_loaded_plugin.MyTrainer",
            "No module named 'gk_not_loaded_plugin' (load the file that defines it with --external_plugins)",
        ),
        ("grpokit.trainers.factory.NoSuchTrainer", "has no attribute 'NoSuchTrainer'"),
        ("grpokit.errors.GrpokitError.__doc__", "cannot be imported"),
        ("grpokit.registry.logger", "is a Logger, not a class"),
    ],
)
def test_bad_trainer_mapping_is_a_one_line_config_error(isolated, value, needle):
    TrainerFactory.TRAINER_MAPPING["grpo"] = value
    with pytest.raises(ConfigError) as info:
        TrainerFactory.get_trainer_cls("grpo")
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_trainer_module_failing_on_import_is_a_config_error(isolated):
    _write(isolated / "p", "gk_bad_trainer_mod.py", "raise ImportError('needs flash_attn\\nmore')\n")
    sys.path.insert(0, str(isolated / "p"))
    TrainerFactory.TRAINER_MAPPING["grpo"] = "gk_bad_trainer_mod.T"
    with pytest.raises(ConfigError, match=r"importing gk_bad_trainer_mod failed: ImportError: needs flash_attn$"):
        TrainerFactory.get_trainer_cls("grpo")
    with pytest.raises(ConfigError, match=r"trainer 'dpo' is not registered; known: grpo"):
        TrainerFactory.get_trainer_cls("dpo")


# ------------------------------------------------------------------------------------------------------------
# examples/plugin/plugin.py
# ------------------------------------------------------------------------------------------------------------
@pytest.fixture
def example(isolated):
    load_plugins([str(EXAMPLE)])
    return sys.modules["plugin"]


def test_example_plugin_registers_every_extension(example):
    from grpokit.trainers.grpo_trainer import GRPOTrainer

    assert orms["countdown"] is example.CountdownORM and orms["countdown_judge"] is example.CountdownJudge
    assert multi_turns["countdown_retry"] is example.CountdownRetryScheduler
    assert envs["countdown"] is example.CountdownEnv
    assert optimizers_map["lion"] is example.build_lion
    assert callbacks_map["reward_summary"] is example.RewardSummary
    assert TrainerFactory.TRAINER_MAPPING["grpo"] == "plugin.CountdownTrainer"
    assert issubclass(TrainerFactory.get_trainer_cls("grpo"), GRPOTrainer)


# nums [4, 2, 3], target 18
REPLIES = [
    "<answer>(4 + 2) * 3</answer>",  # 6 * 3 = 18, each number once                 → correct
    "I think <answer>4 + 2 + 3</answer>",  # = 9: right numbers, wrong value        → 0; judge 1 - 9/18 = 0.5
    "no tag at all",  # no answer                                                    → 0; judge 0
    "<answer>4 * 2 * 3 = 24</answer>",  # "= 24" is allowed; 24 ≠ 18               → 0; judge 1 - 6/18 = 2/3
    "<answer>4 * 4 + 2</answer>",  # 4 twice, 3 unused                              → 0; judge 0
    "<answer>4 ** 2 + 2</answer>",  # power is not allowed                          → 0; judge 0
    "<answer>1</answer> then <answer>3 * (4 + 2)</answer>",  # the LAST tag counts  → correct
]


def test_countdown_reward_scores_and_metrics(example):
    reward = example.CountdownORM()
    scores = reward(REPLIES, target=[18] * 7, nums=[[4, 2, 3]] * 7)
    assert scores == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    # answer tags in 6 of 7 replies; right numbers in replies 0, 1, 3, 6 → 4 of 7
    assert reward.last_metrics == pytest.approx({"has_answer": 6 / 7, "uses_numbers": 4 / 7})


def test_countdown_check_is_exact(example):
    check = sys.modules["countdown_check"].check
    assert check("<answer>(7 / 2) * 2 + 1</answer>", [7, 2, 2, 1], 8).correct  # 3.5 * 2 + 1 exactly
    assert not check("<answer>7 / 2</answer>", [7, 2], 3).correct  # 7/2 is not 3 (no integer division)
    assert check("<answer>(5 - 5) / 0</answer>", [5, 5, 0], 1).reason.endswith("divides by zero")
    assert check("<answer>-3 + 5</answer>", [3, 5], 2).value is None  # unary minus is not an operation here
    assert check("<answer>4+2+3</answer>", ["4", "2", "3"], "9").correct  # string columns from CSV are fine


def test_judge_gives_partial_credit_with_all_samples_in_flight(example):
    judge = example.CountdownJudge()
    scores = asyncio.run(judge(REPLIES, target=[18] * 7, nums=[[4, 2, 3]] * 7))
    assert scores == pytest.approx([1.0, 0.5, 0.0, 2 / 3, 0.0, 0.0, 1.0])
    assert judge.last_metrics == {"max_in_flight": 7.0}  # every sample awaited concurrently
    limited = example.CountdownJudge(max_concurrency=2)
    asyncio.run(limited(REPLIES, target=[18] * 7, nums=[[4, 2, 3]] * 7))
    assert limited.last_metrics == {"max_in_flight": 2.0}


def test_lion_matches_a_hand_computed_step(example):
    import torch

    p = torch.nn.Parameter(torch.tensor([1.0, -2.0, 0.5]))
    opt = example.Lion([p], lr=0.1)
    p.grad = torch.tensor([0.3, -0.1, 0.0])
    opt.step()
    # m = 0: update sign(0.1 g) = [1, -1, 0] → p = [0.9, -1.9, 0.5]; m ← 0.01 g = [0.003, -0.001, 0]
    assert torch.allclose(p.detach(), torch.tensor([0.9, -1.9, 0.5]))
    p.grad = torch.tensor([-0.3, -0.1, 0.0])
    opt.step()
    # 0.9 m + 0.1 g = [0.0027 - 0.03, -0.0009 - 0.01, 0] → sign [-1, -1, 0] → p = [1.0, -1.8, 0.5]
    assert torch.allclose(p.detach(), torch.tensor([1.0, -1.8, 0.5]))
    assert opt.steps_taken == 2
    q = torch.nn.Parameter(torch.tensor([2.0]))
    decayed = example.Lion([q], lr=0.1, weight_decay=0.5)
    q.grad = torch.tensor([-1.0])
    decayed.step()
    # decoupled decay first: 2 · (1 - 0.1 · 0.5) = 1.9, then + 0.1 (sign of -g) → 2.0
    assert torch.allclose(q.detach(), torch.tensor([2.0]))
    with pytest.raises(ValueError, match="Lion: need lr > 0"):
        example.Lion([q], lr=0.0)


def test_retry_scheduler_feeds_back_the_verdict_until_right(example):
    from test_multi_turn import ScriptedEngine, request, run_one, tiny_tokenizer

    tok = tiny_tokenizer()
    tries = iter(["<answer>4 + 2 + 3</answer>", "<answer>(4 + 2) * 3</answer>"])
    engine = ScriptedEngine(tok, lambda r: next(tries))
    scheduler = multi_turns["countdown_retry"](engine, max_turns=3, tokenizer=tok)
    out = run_one(scheduler, request("Make 18 from 4, 2, 3.", nums=[4, 2, 3], target=18), max_tokens=64)
    roles = [m["role"] for m in out.messages]
    assert roles == ["user", "assistant", "user", "assistant"]  # right on the second try: stops before turn 3
    assert out.messages[2]["content"].startswith("Not yet: 4 + 2 + 3 = 9, not 18.")
    assert out.rollout_infos["num_turns"] == 2 and out.rollout_infos["countdown_retries"] == 1
    assert out.response_loss_mask == [[1] * len(ids) for ids in out.response_token_ids]  # feedback is not here

    engine = ScriptedEngine(tok, lambda r: "no idea")
    out = run_one(
        multi_turns["countdown_retry"](engine, max_turns=2, tokenizer=tok),
        request("Make 18.", nums=[4, 2, 3], target=18),
        max_tokens=64,
    )
    assert out.rollout_infos["num_turns"] == 2 and "there is no <answer>" in out.messages[2]["content"]


def test_retry_scheduler_without_the_columns_names_them(example):
    from test_multi_turn import ScriptedEngine, request, run_one, tiny_tokenizer

    from grpokit.errors import RolloutError

    tok = tiny_tokenizer()
    scheduler = multi_turns["countdown_retry"](ScriptedEngine(tok, lambda r: "x"), max_turns=2, tokenizer=tok)
    with pytest.raises(RolloutError, match="countdown_retry needs the dataset columns nums and target.*solution"):
        run_one(scheduler, request("hi", solution="1"), max_tokens=8)


def test_countdown_env_rewards_the_right_equation(example):
    from grpokit.protocol import RolloutInferRequest

    env = envs["countdown"]({})
    req = RolloutInferRequest(
        messages=[{"role": "user", "content": "Make 18."}], data_dict={"nums": [4, 2, 3], "target": 18}
    )
    assert asyncio.run(env.reset(req)) == ("", {"nums": [4, 2, 3], "target": 18})
    obs, reward, done, _ = asyncio.run(env.step([{"role": "assistant", "content": "<answer>4 + 2 + 3</answer>"}]))
    assert (reward, done) == (0.0, False) and obs == "Not yet: 4 + 2 + 3 = 9, not 18. Try again."
    obs, reward, done, info = asyncio.run(env.step([{"role": "assistant", "content": "<answer>3*(4+2)</answer>"}]))
    assert (obs, reward, done, info) == ("Correct!", 1.0, True, {"equation": "3*(4+2)"})


def test_reward_summary_callback_writes_the_curve(example, tmp_path):
    import json
    from types import SimpleNamespace

    cb = callbacks_map["reward_summary"]()
    trainer = SimpleNamespace(accelerator=SimpleNamespace(is_main_process=True), output_dir=tmp_path)
    cb.on_train_begin(trainer)
    cb.on_log(trainer, {"step": 1, "reward": 0.25, "rewards/countdown/mean": 0.25, "loss": 0.1})
    cb.on_log(trainer, {"step": 2, "reward": 0.75, "rewards/countdown/mean": 0.75, "loss": 0.2})
    cb.on_train_end(trainer)
    summary = json.loads((tmp_path / "reward_summary.json").read_text())
    assert summary == {
        "best_step": 2,
        "best_reward": 0.75,
        "curve": [
            {"step": 1, "reward": 0.25, "rewards/countdown/mean": 0.25},
            {"step": 2, "reward": 0.75, "rewards/countdown/mean": 0.75},
        ],
    }


# ------------------------------------------------------------------------------------------------------------
# docs/plugins.md: every example compiles; the module-level ones run and register what they say
# ------------------------------------------------------------------------------------------------------------
DOCS = Path(__file__).resolve().parents[2] / "docs" / "plugins.md"


def _doc_blocks() -> list[str]:
    import re

    return re.findall(r"```python\n(.*?)```", DOCS.read_text(), re.S)


def test_docs_examples_compile_and_register(isolated):
    import inspect

    blocks = _doc_blocks()
    assert len(blocks) >= 20
    ran = 0
    for i, block in enumerate(blocks):
        code = compile(block, f"docs/plugins.md[python block {i}]", "exec")
        if block.lstrip().startswith(("import", "from")):  # a whole plugin file: run it
            exec(code, {"__name__": f"docs_example_{i}"})
            ran += 1
    assert ran >= 10
    for registry, name in [
        (orms, "brevity"),
        (orms, "mentions_target"),
        (orms, "http_judge"),
        (prms, "addition_steps"),
        (rm_plugins, "length_penalized"),
        (multi_turns, "ask_to_shorten"),
        (envs, "echo"),
        (optimizers_map, "sgd_nesterov"),
        (callbacks_map, "stop_at_reward"),
        (POLICY_LOSSES, "vanilla_pg"),
        (LOSS_NORMALIZERS, "vanilla_pg"),
        (ADVANTAGE_ESTIMATORS, "above_mean"),
    ]:
        assert name in registry, name
    assert TrainerFactory.TRAINER_MAPPING["grpo"].endswith(".MyTrainer")
    # two of them by hand: Brevity(max_words=50): 10 words → 1; 75 → 2 - 1.5 = 0.5; 120 → 0
    brevity = orms["brevity"]()
    assert brevity(["w " * 10, "w " * 75, "w " * 120]) == [1.0, 0.5, 0.0]
    assert brevity.last_metrics == {"mean_words": (10 + 75 + 120) / 3}
    # AdditionSteps takes the weakest step: 2+2=4 right, 3+3=7 wrong → min = 0; no steps → not scored
    steps = prms["addition_steps"]()
    assert steps(["Step 1: 2 + 2 = 4\nStep 2: 3 + 3 = 7", "Step 1: 1 + 1 = 2", "no steps"]) == [0.0, 1.0, None]
    assert inspect.iscoroutinefunction(orms["http_judge"].__call__)
    assert orms["mentions_target"](["it is 24", "no"], target=[24, 24]) == [1.0, 0.0]
