"""ms-swift's option names (issue 19): each one implemented, warned about or refused, with a reason; the
warned ones change nothing but print one line; the refused ones stop with an error naming them."""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import logging
from pathlib import Path

import pytest

from grpokit.config.args import ALL_GROUPS
from grpokit.config.parse import parse_train_args
from grpokit.config.swift_options import DEVIATIONS, REFUSED, SAME_ONCE_RESOLVED, WARNED, swift_value_matches
from grpokit.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
TSV = ROOT / "tests" / "data" / "ms-swift-options.tsv"


def _generator():
    spec = importlib.util.spec_from_file_location("gen_porting_options", ROOT / "scripts" / "gen_porting_options.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SWIFT = _generator().ms_swift_options(TSV)  # name -> (ms-swift default, declaring class)
FIELDS = {f.name: f for g in ALL_GROUPS for f in dataclasses.fields(g)}


def test_every_ms_swift_option_is_implemented_warned_or_refused_exactly_once():
    assert len(SWIFT) == 469
    problems = []
    for name in SWIFT:
        homes = [kind for kind, table in (("field", FIELDS), ("warned", WARNED), ("refused", REFUSED)) if name in table]
        if len(homes) != 1:
            problems.append(f"{name}: {homes or 'nowhere'}")
    assert problems == []
    assert set(WARNED) | set(REFUSED) | set(DEVIATIONS) <= set(SWIFT)  # no stray names in the tables
    assert SAME_ONCE_RESOLVED <= set(DEVIATIONS)
    assert all(reason.strip() for reason in WARNED.values()) and all(r.reason for r in REFUSED.values())


def _swift_default(text: str):
    """ms-swift's default as its table writes it, as a Python value (None where it resolves at run time)."""
    text = text.removeprefix("lambda: ")
    if text in ("list", "<factory>"):
        return []
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def _ours(f: dataclasses.Field):
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


@pytest.mark.parametrize("name", sorted(n for n in SWIFT if n in FIELDS))
def test_implemented_options_have_ms_swift_default_or_a_recorded_deviation(name):
    theirs, ours = _swift_default(SWIFT[name][0]), _ours(FIELDS[name])
    same = theirs == ours or (theirs is None and ours == [])  # ms-swift's unset list is grpokit's empty list
    # DEVIATIONS may also explain the same written default that resolves differently (None = ... at run time)
    assert same or name in DEVIATIONS, f"{name}: ms-swift {theirs!r}, grpokit {ours!r}: record it in DEVIATIONS"


BASE = ["--model", "m/m", "--dataset", "d.jsonl"]


def _groups(cfg):
    return [cfg.model, cfg.data, cfg.rollout, cfg.algorithm, cfg.reward, cfg.training]


@pytest.mark.parametrize(
    "flag",
    [
        ["--use_liger_kernel", "true"],
        ["--swanlab_project", "p"],
        ["--lora_ga_iters", "3"],
        ["--ddp_backend", "gloo"],
    ],
)
def test_a_warned_option_prints_one_line_and_changes_nothing(flag, caplog):
    plain = parse_train_args(BASE)
    with caplog.at_level(logging.WARNING):
        cfg = parse_train_args(BASE + flag)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith(f"{flag[0]} ") and "no effect in grpokit" in lines[0]
    assert WARNED[flag[0][2:]] in lines[0]
    assert _groups(cfg) == _groups(plain)


def test_warned_option_on_another_rank_is_silent(caplog, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    with caplog.at_level(logging.WARNING):
        parse_train_args(BASE + ["--use_liger_kernel", "true"])
    assert not [r for r in caplog.records if "no effect" in r.getMessage()]


@pytest.mark.parametrize(
    "flag",
    [
        ["--packing", "true"],
        ["--rlhf_type", "dpo"],
        ["--use_galore"],
        ["--sequence_parallel_size", "2"],
        ["--advantage_reweight", "x"],
        ["--sdar_loss_coef", "0.1"],
        ["--min_p", "0.1"],
        ["--num_beams", "4"],
        ["--save_only_model", "true"],
    ],
)
def test_a_refused_option_stops_with_its_name_and_reason(flag):
    with pytest.raises(ConfigError) as e:
        parse_train_args(BASE + flag)
    msg = str(e.value)
    assert msg.startswith(f"{flag[0]} ") and REFUSED[flag[0][2:]].reason in msg and "\n" not in msg


@pytest.mark.parametrize(
    "flag",
    [
        ["--packing", "false"],
        ["--rlhf_type", "grpo"],
        ["--num_beams", "1"],
        ["--freeze_parameters_ratio", "0"],
        ["--tuner_backend", "peft"],
    ],
)
def test_a_refused_option_at_grpokits_behaviour_is_accepted_silently(flag, caplog):
    with caplog.at_level(logging.WARNING):
        cfg = parse_train_args(BASE + flag)
    assert caplog.records == [] and _groups(cfg) == _groups(parse_train_args(BASE))


def test_ms_swift_options_from_a_yaml_config(tmp_path, caplog):
    (tmp_path / "c.yaml").write_text("model: m/m\ndataset: [d.jsonl]\nuse_liger_kernel: false\nstreaming: false\n")
    with caplog.at_level(logging.WARNING):
        parse_train_args(["--config", str(tmp_path / "c.yaml")])
    assert [r.getMessage().split(":")[0] for r in caplog.records] == ["--use_liger_kernel false"]
    (tmp_path / "c.yaml").write_text("model: m/m\ndataset: [d.jsonl]\nstreaming: true\n")
    with pytest.raises(ConfigError, match="--streaming true: not GRPO"):
        parse_train_args(["--config", str(tmp_path / "c.yaml")])


def test_unknown_names_stay_errors():
    with pytest.raises(ConfigError, match="unknown option --no_such_swift_option"):
        parse_train_args(BASE + ["--no_such_swift_option", "1"])


@pytest.mark.parametrize(
    "value,accepted,same",
    [
        ([], "False", False),
        ([], "True", True),
        (["false"], "False", True),
        (["0.0"], "0", True),
        ([], "list", True),
        (["a"], "list", False),
        (["None"], "None", True),
        (None, "None", True),
        (["'std'"], "'std'", True),
        (["steps"], "steps", True),
        (["1", "2"], "1", False),
        (False, "False", True),
    ],
)
def test_swift_value_matches(value, accepted, same):
    assert swift_value_matches(value, accepted) is same


def test_ms_swift_spellings_of_grpokit_options():
    cfg = parse_train_args(
        BASE + ["--max_new_tokens", "77", "--optim", "adamw_torch_fused", "--eval_strategy", "no", "--eval_steps", "5"]
    )
    assert cfg.rollout.max_completion_length == 77 and cfg.training.optimizer == "adamw"
    assert cfg.training.eval_steps is None  # eval_strategy no: never evaluate
    cfg = parse_train_args(BASE + ["--save_strategy", "no", "--eval_steps", "5"])
    assert cfg.training.eval_steps is None  # unset eval_strategy follows save_strategy
    cfg = parse_train_args(
        BASE
        + ["--save_strategy", "no", "--eval_strategy", "steps", "--eval_steps", "5", "--split_dataset_ratio", "0.1"]
    )
    assert cfg.training.eval_steps == 5


@pytest.mark.parametrize(
    "flag,match",
    [
        (["--optim", "adafactor"], "--optim adafactor: not implemented in grpokit"),
        (
            ["--attn_impl", "flash_attn", "--use_cpu", "true"],
            "--attn_impl flash_attn: flash attention needs a CUDA GPU",
        ),
        (["--attn_impl", "fast"], "--attn_impl fast: unknown"),
        (["--lr_scheduler_kwargs", "{num_cycles: 1}"], "--lr_scheduler_kwargs .*not valid JSON"),
        (["--gradient_checkpointing_kwargs", "[1]"], "--gradient_checkpointing_kwargs .*expected a JSON object"),
        (["--dataloader_prefetch_factor", "4"], "--dataloader_prefetch_factor 4: acts only with"),
        (["--per_device_eval_batch_size", "0"], "--per_device_eval_batch_size 0: must be ≥ 1"),
        (["--save_strategy", "epoch"], "save_strategy"),
        (["--dataloader_multiprocessing_context", "fork"], "acts only with --dataloader_num_workers > 0"),
        (["--dataloader_num_workers", "1", "--dataloader_multiprocessing_context", "threads"], "not a start method"),
        (["--vllm_max_num_seqs", "0"], "--vllm_max_num_seqs 0: must be ≥ 1"),
        (["--tuner_type", "lora", "--freeze_parameters", "x"], "--freeze_parameters acts with --tuner_type full"),
        (["--freeze_parameters_ratio", "1.5"], "must be in \\[0, 1\\]"),
        (["--tuner_type", "full", "--freeze_parameters_regex", "("], "not a valid regex"),
    ],
)
def test_bad_values_of_implemented_options(flag, match):
    with pytest.raises(ConfigError, match=match):
        parse_train_args(BASE + flag)


def test_gradient_checkpointing_kwargs_without_checkpointing_warns(caplog):
    with caplog.at_level(logging.WARNING):
        parse_train_args(BASE + ["--gradient_checkpointing_kwargs", '{"use_reentrant": true}'])
    assert [r.getMessage() for r in caplog.records] == [
        "--gradient_checkpointing_kwargs: no effect without --gradient_checkpointing true (ms-swift's default is "
        "true, grpokit's false)"
    ]


def test_attn_impl_maps_to_transformers_names():
    from grpokit.modeling import attn_implementation

    assert attn_implementation("flash_attn") == "flash_attention_2"
    assert attn_implementation("sdpa") == "sdpa" and attn_implementation(None) is None


def test_porting_doc_options_block_is_up_to_date():
    gen = _generator()
    doc = (ROOT / "docs" / "porting.md").read_text()
    assert gen.updated_doc(doc, gen.render(TSV)) == doc, "run: python scripts/gen_porting_options.py"


def test_vllm_max_num_seqs_reaches_the_colocate_engine():
    from grpokit.engines.vllm_engine import VllmEngine

    built = []

    class Capture(VllmEngine):
        def __init__(self, model_path, settings, **kwargs):  # template, infer_on_loop_thread: the run's
            built.append(settings)

    cfg = parse_train_args(BASE + ["--vllm_max_num_seqs", "12"])
    Capture.from_rollout_args(cfg.rollout, "m")
    assert built[0].max_num_seqs == 12


def _three_layer_model():
    import torch

    model = torch.nn.Module()
    model.embed = torch.nn.Linear(2, 5, bias=False)  # 10 parameters
    model.layer = torch.nn.Linear(5, 2, bias=False)  # 10
    model.head = torch.nn.Linear(4, 5, bias=False)  # 20
    return model


def _trainable(model) -> list[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad]


@pytest.mark.parametrize(
    "flags,trainable",
    [
        (["--freeze_parameters_ratio", "0.5"], ["head.weight"]),  # 40 × 0.5 = 20: embed (10) and layer (10)
        (["--freeze_parameters_ratio", "0.4"], ["layer.weight", "head.weight"]),  # 16: only embed fits
        (["--freeze_parameters", "embed", "head"], ["layer.weight"]),
        (["--freeze_parameters_regex", "^(embed|layer)"], ["head.weight"]),
        (["--freeze_parameters_ratio", "1", "--trainable_parameters", "layer"], ["layer.weight"]),
        (["--freeze_parameters_ratio", "1", "--trainable_parameters_regex", "^he"], ["head.weight"]),
    ],
)
def test_freezing_parameters_as_ms_swift_does(flags, trainable):
    from grpokit.pipeline.models import freeze_parameters

    model = _three_layer_model()
    freeze_parameters(model, parse_train_args(BASE + ["--tuner_type", "full", *flags]).model)
    assert _trainable(model) == trainable


@pytest.mark.parametrize(
    "flags,match",
    [
        (["--freeze_parameters", "model.nope"], "--freeze_parameters model.nope: no parameter of the model"),
        (["--trainable_parameters_regex", "zzz"], "--trainable_parameters_regex zzz: no parameter"),
    ],
)
def test_freezing_a_name_the_model_lacks_is_an_error(flags, match):
    from grpokit.pipeline.models import freeze_parameters

    with pytest.raises(ConfigError, match=match):
        freeze_parameters(_three_layer_model(), parse_train_args(BASE + ["--tuner_type", "full", *flags]).model)


def test_porting_worked_example_parses(tmp_path):
    """docs/porting.md's translated ms-swift script: every option it uses is grpokit's, and the command parses and
    validates."""
    import shlex

    doc = (ROOT / "docs" / "porting.md").read_text()
    script = doc.split("### Worked example", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    argv = shlex.split(script.replace("\\\n", " "))
    assert argv[:2] == ["grpokit", "train"]
    argv = argv[2:]
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    argv[argv.index("--model") + 1] = str(tmp_path / "model")
    argv += ["--output_dir", str(tmp_path / "out")]
    if "--system" in argv:  # ms-swift's scripts name a prompt file, read from the working directory (empty here)
        Path(argv[argv.index("--system") + 1]).write_text("You are a helpful assistant.")
    known = {f"--{n}" for n in FIELDS}
    assert [a for a in argv if a.startswith("--") and a not in known] == []
    cfg = parse_train_args(argv)
    assert cfg.training.per_device_eval_batch_size == 4 and cfg.training.dataloader_num_workers == 4


@pytest.mark.parametrize(
    "flags,warmup",
    [
        ([], 0),
        (["--warmup_ratio", "0.1"], 10),
        (["--warmup_steps", "7"], 7),
        (["--warmup_steps", "0.25"], 25),
        (["--warmup_steps", "3", "--warmup_ratio", "0.5"], 3),
    ],
)
def test_warmup_steps_as_transformers_5_reads_them(flags, warmup):
    from grpokit.trainers.training_setup import num_warmup_steps

    assert num_warmup_steps(parse_train_args(BASE + flags).training, max_steps=100) == warmup


@pytest.mark.parametrize(
    "flags,kl_in_reward",
    [
        ([], False),
        (["--advantage_estimator", "rloo"], True),
        (["--advantage_estimator", "reinforce_plus_plus"], True),
        (["--advantage_estimator", "rloo", "--kl_in_reward", "false"], False),
        (["--kl_in_reward", "true"], True),
    ],
)
def test_kl_in_reward_unset_follows_the_estimator_as_in_ms_swift(flags, kl_in_reward):
    assert parse_train_args(BASE + flags).algorithm.kl_in_reward is kl_in_reward
