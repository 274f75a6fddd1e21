"""Each part is built once and handed on (issue 30): one chat template shared by the prompts, the engine, the
scheduler, the trainer and CHORD; one batch plan; engines and schedulers configured through their constructors, never by
an attribute set afterwards; registries that refuse a second object under a taken name unless told to override,
while ms-swift-style item assignment keeps replacing."""

from __future__ import annotations

import ast
import json
import logging
from pathlib import Path

import pytest
from support import flags

from grpokit.errors import PluginError
from grpokit.registry import Registry

PACKAGE = Path(__file__).resolve().parents[2] / "grpokit"
PARTS = ("engine", "scheduler")  # a name or attribute ending so holds an engine or a rollout scheduler


# -- no attribute set on an engine or a scheduler after it is built ------------------------------------------------
def _holds_part(node: ast.AST) -> bool:
    """``engine``, ``served_engine``, ``self.engine``, ``trainer.scheduler``, ``x.infer_engine``: not ``self``."""
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return name.endswith(PARTS) and "lr_" not in name  # an LR scheduler is not a rollout scheduler


def _part_assignments(tree: ast.Module) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, (ast.AugAssign, ast.AnnAssign))
            else []
        )
        for target in targets:
            if isinstance(target, ast.Attribute) and _holds_part(target.value):
                found.append((node.lineno, ast.unparse(target)))
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "setattr"
            and node.args
            and _holds_part(node.args[0])
        ):
            found.append((node.lineno, ast.unparse(node)))
    return found


def test_the_rule_finds_assignments_on_parts():
    tree = ast.parse(
        "engine.fast_decode = True\nself.engine.template = t\ntrainer.scheduler.x += 1\n"
        "setattr(served_engine, 'a', 1)\nself.engine = e\nlr_scheduler.last_epoch = 3\n"
    )
    assert [line for line, _ in _part_assignments(tree)] == [1, 2, 3, 4]


def test_no_attribute_is_set_on_an_engine_or_scheduler_after_it_is_built():
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {text}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for line, text in _part_assignments(ast.parse(path.read_text()))
    ]
    assert not found, "give the part a constructor argument instead:\n" + "\n".join(found)


# -- registries ---------------------------------------------------------------------------------------------------
class Builtin:
    pass


class Mine:
    pass


def _registry() -> Registry:
    registry = Registry("reward function", "--reward_funcs")
    registry.register("accuracy")(Builtin)
    return registry


def test_register_refuses_a_second_object_under_a_taken_name_in_one_line():
    registry = _registry()
    with pytest.raises(PluginError) as e:
        registry.register("accuracy")(Mine)
    message = str(e.value)
    assert "\n" not in message and "reward function registry" in message and "'accuracy'" in message
    assert "override=True" in message and f"{__name__}.Builtin" in message
    assert registry["accuracy"] is Builtin


def test_register_with_override_replaces_and_says_which_entry_wins(caplog):
    registry = _registry()
    with caplog.at_level(logging.WARNING, logger="grpokit.registry"):
        assert registry.register("accuracy", override=True)(Mine) is Mine
    assert registry["accuracy"] is Mine and "Mine replaces" in caplog.text and "Builtin" in caplog.text
    assert registry.override("accuracy", Builtin) is Builtin and registry["accuracy"] is Builtin
    assert registry.register("new_name", Mine) is Mine  # a free name, the direct form


def test_item_assignment_replaces_as_in_ms_swift_with_a_warning(caplog):
    registry = _registry()
    with caplog.at_level(logging.WARNING, logger="grpokit.registry"):
        registry["accuracy"] = Mine
    assert registry["accuracy"] is Mine
    assert "reward function 'accuracy' registered again" in caplog.text and "Mine replaces" in caplog.text


def test_the_same_definition_registered_again_is_not_a_second_object(caplog):
    registry = _registry()
    again = type("Builtin", (), {"__module__": Builtin.__module__, "__qualname__": Builtin.__qualname__})
    with caplog.at_level(logging.WARNING, logger="grpokit.registry"):
        registry.register("accuracy")(again)  # a module imported twice runs its decorators twice
        registry.register("accuracy")(again)
    assert registry["accuracy"] is again and caplog.text == ""
    with pytest.raises(PluginError):  # two different lambdas share a qualified name, not a definition
        registry.register("f")(lambda: 1)
        registry.register("f")(lambda: 2)


def test_a_ported_plugin_replaces_a_builtin_name_by_item_assignment(tmp_path, caplog):
    from grpokit.plugins.loader import load_plugins
    from grpokit.rewards import orms

    plugin = tmp_path / "swift_style_replace.py"
    plugin.write_text(
        "from grpokit.swift.rewards import ORM, orms\n\n"
        "class StrictAccuracy(ORM):\n"
        "    def __call__(self, completions, **kwargs):\n"
        "        return [0.0 for _ in completions]\n\n"
        "orms['accuracy'] = StrictAccuracy\n"
    )
    refusing = tmp_path / "register_replace.py"
    refusing.write_text(
        "from grpokit.rewards import orms\n\n@orms.register('accuracy')\n"
        "def accuracy(completions, **kwargs):\n    return [1.0 for _ in completions]\n"
    )
    builtin = orms["accuracy"]
    try:
        with caplog.at_level(logging.WARNING, logger="grpokit.registry"):
            load_plugins([str(plugin)])
        assert orms["accuracy"].__name__ == "StrictAccuracy" and "registered again" in caplog.text
        orms["accuracy"] = builtin
        with pytest.raises(
            PluginError,
            match=r"register_replace.py: import failed at line 3: .*'accuracy' is "
            r"already registered.*override=True",
        ):
            load_plugins([str(refusing)])
        assert orms["accuracy"] is builtin
    finally:
        dict.__setitem__(orms, "accuracy", builtin)


# -- a built set-up: one template, one plan, parts wired at construction -------------------------------------------
def test_a_built_set_up_shares_one_template_and_one_plan(tiny_model_dir, tmp_path, monkeypatch):
    import grpokit.pipeline.train as pipeline
    import grpokit.trainers.grpo_trainer as grpo_trainer
    from grpokit.config.parse import parse_train_args
    from grpokit.template.prompts import PromptOptions
    from grpokit.trainers.factory import TrainerFactory

    class SetUpOnly(grpo_trainer.GRPOTrainer):
        def train(self):  # the set-up is what this test reads
            return self.state

    data = tmp_path / "data.jsonl"
    data.write_text(
        "".join(
            json.dumps({"messages": [{"role": "user", "content": f"{a} + 1?"}], "solution": str(a + 1)}) + "\n"
            for a in range(4)
        )
    )
    expert = tmp_path / "expert.jsonl"
    expert.write_text(data.read_text())
    cfg = parse_train_args(
        flags(
            {"--model": tiny_model_dir, "--dataset": data, "--output_dir": tmp_path / "out"},
            {"--chord_sft_dataset": expert},
            "--max_steps 1 --num_generations 2 --per_device_train_batch_size 2 --max_completion_length 8 --beta 0",
            "--torch_dtype float32 --multi_turn_scheduler tool_call_scheduler --max_turns 2 --reward_funcs format",
            "--fast_decode false --chord_sft_per_device_train_batch_size 1 --chord_mu_peak 0.5",
            "--chord_mu_valley 0.5 --disable_tqdm true --plots false --save_final_model false",
        )
    )
    calls = {"template": 0, "plan": 0}
    made, plan = PromptOptions.template, pipeline.batch_plan

    def count(key, fn):
        def wrapped(*args, **kwargs):
            calls[key] += 1
            return fn(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(PromptOptions, "template", count("template", made))
    monkeypatch.setattr(pipeline, "batch_plan", count("plan", plan))
    monkeypatch.setattr(grpo_trainer, "batch_plan", count("plan", plan))
    monkeypatch.setitem(TrainerFactory.TRAINER_MAPPING, "grpo", SetUpOnly)
    trainer = pipeline.run_train(cfg)
    assert calls == {"template": 1, "plan": 1}
    template = trainer.template
    assert trainer.engine.template is template and trainer._producer.template is template
    assert trainer._chord.template is template  # CHORD's expert rows were prepared with it too (one build)
    assert trainer.scheduler.infer_engine is trainer.engine and trainer.scheduler.chat_template() is template
    assert trainer.scheduler._template is template  # given at construction, not rebuilt from the tokenizer
    assert trainer.engine.infer_on_loop_thread is True and trainer.engine.fast_decode is False


# -- schedulers get everything at construction ---------------------------------------------------------------------
class _Engine:
    tokenizer = None
    template = None


def test_a_scheduler_is_built_with_its_engine_template_and_gym_choice(monkeypatch):
    from grpokit.config.args import RolloutArguments
    from grpokit.errors import ConfigError
    from grpokit.rollout.multi_turn import MultiTurnScheduler, build_scheduler, multi_turns

    class SwiftStyle(MultiTurnScheduler):  # ms-swift's constructor: everything passed on
        def __init__(self, infer_engine=None, max_turns=None, *args, **kwargs):
            super().__init__(infer_engine, max_turns, *args, **kwargs)

    class Drops(MultiTurnScheduler):  # keeps its own signature and forgets the rest
        def __init__(self, infer_engine=None, max_turns=None, **kwargs):
            super().__init__(None, max_turns)

    monkeypatch.setitem(multi_turns, "swift_style", SwiftStyle)
    monkeypatch.setitem(multi_turns, "drops", Drops)
    engine, template = _Engine(), object()
    built = build_scheduler(
        RolloutArguments(multi_turn_scheduler="swift_style", use_gym_env=True),
        None,
        infer_engine=engine,
        template=template,
        uses_env_reward=True,
    )
    assert built.infer_engine is engine and built._template is template and built.uses_env_reward is True
    assert SwiftStyle.uses_env_reward is False  # the choice is the instance's, not the class's
    with pytest.raises(ConfigError, match=r"--use_gym_env true: the scheduler 'drops' \(Drops\) did not take it"):
        build_scheduler(RolloutArguments(multi_turn_scheduler="drops"), None, infer_engine=engine, uses_env_reward=True)
    with pytest.raises(ConfigError, match="Drops dropped its infer_engine argument"):
        build_scheduler(RolloutArguments(multi_turn_scheduler="drops"), None, infer_engine=engine)


def test_the_trainer_refuses_a_scheduler_without_an_engine_and_builds_a_recipe_around_its_own():
    from types import SimpleNamespace

    from grpokit.errors import ConfigError
    from grpokit.rollout.scheduler import RolloutScheduler
    from grpokit.trainers.training_setup import setup_rollout

    cfg = SimpleNamespace(
        rollout=SimpleNamespace(fast_decode=True, async_generate=False), training=SimpleNamespace(deepspeed=None)
    )
    accelerator = SimpleNamespace(distributed_type=SimpleNamespace(value="NO"), state=None)
    engine = _Engine()
    engine.engine_type, engine.model = "test", None
    with pytest.raises(ConfigError, match="the scheduler RolloutScheduler has no engine: build it with infer_engine"):
        setup_rollout(engine, RolloutScheduler(), None, None, cfg, accelerator)
    _, scheduler = setup_rollout(engine, lambda e: RolloutScheduler(e, max_turns=2), None, None, cfg, accelerator)
    assert scheduler.infer_engine is engine and scheduler.max_turns == 2
