"""Options: flags, YAML (flags win), the built-in demo defaults, validation messages, the batch plan, --help."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest

from grpokit.config.names import BUILTIN_NAMES, REGISTRIES, registered_names
from grpokit.config.parse import parse_train_args
from grpokit.config.plan import batch_plan
from grpokit.errors import ConfigError


def test_no_model_and_no_dataset_is_the_demo():
    cfg = parse_train_args([])
    assert cfg.model.model is None  # → the built-in SmolLM2 demo model
    assert cfg.data.dataset == ["builtin:arithmetic"] and cfg.data.val_dataset == ["builtin:arithmetic:test"]
    assert cfg.model.tuner_type == "lora" and cfg.reward.reward_funcs == ["accuracy"]
    # a demo option can still be overridden by a flag
    assert parse_train_args(["--max_steps", "3"]).training.max_steps == 3


def test_yaml_gives_defaults_and_flags_win(tmp_path):
    cfg_file = tmp_path / "run.yaml"
    cfg_file.write_text(
        "dataset: [builtin:countdown]\nnum_generations: 4\nlearning_rate: 3.0e-6\nper_device_train_batch_size: 8\n"
    )
    cfg = parse_train_args(["--config", str(cfg_file), "--num_generations", "2"])
    assert cfg.data.dataset == ["builtin:countdown"]
    assert cfg.rollout.num_generations == 2  # the flag
    assert cfg.training.learning_rate == 3e-6  # the file
    assert cfg.model.tuner_type == "lora"  # the default, as in ms-swift (a dataset was given: not the demo)


def test_yaml_unknown_key_names_it_and_suggests(tmp_path):
    cfg_file = tmp_path / "bad.yaml"
    cfg_file.write_text("num_generation: 4\n")
    with pytest.raises(ConfigError, match="num_generation.*did you mean num_generations"):
        parse_train_args(["--config", str(cfg_file)])


def test_unknown_flag_suggests_the_close_one():
    with pytest.raises(ConfigError, match="--lerning_rate; did you mean --learning_rate"):
        parse_train_args(["--dataset", "builtin:arithmetic", "--lerning_rate", "1e-5"])


def test_indivisible_generation_batch_says_which_numbers_work():
    with pytest.raises(ConfigError) as e:
        parse_train_args(
            ["--dataset", "builtin:arithmetic", "--per_device_train_batch_size", "12", "--num_generations", "8"]
        )
    msg = str(e.value)
    assert "generation batch 12" in msg and "num_generations 8" in msg and "8 or 16" in msg


def test_batch_plan_counts():
    cfg = parse_train_args(
        [
            "--dataset",
            "builtin:arithmetic",
            "--per_device_train_batch_size",
            "4",
            "--num_generations",
            "4",
            "--gradient_accumulation_steps",
            "2",
            "--steps_per_generation",
            "4",
            "--num_iterations",
            "2",
        ]
    )
    plan = batch_plan(cfg, world=2)
    assert plan.generation_batch_size == 4 * 4 * 2
    assert plan.prompts_per_rollout == 8
    assert plan.micro_steps_per_window == 8 and plan.optimizer_steps_per_window == 4
    text = plan.describe()
    assert "8 prompts × 4 generations = 32 completions per rollout over 2 processes" in text


def test_steps_per_generation_must_fill_whole_optimizer_steps():
    with pytest.raises(ConfigError, match="multiple of gradient_accumulation_steps 2"):
        parse_train_args(
            [
                "--dataset",
                "builtin:arithmetic",
                "--gradient_accumulation_steps",
                "2",
                "--steps_per_generation",
                "3",
                "--num_generations",
                "4",
                "--per_device_train_batch_size",
                "4",
            ]
        )


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--temperature", "0"], "--temperature 0"),
        (["--num_generations", "1", "--per_device_train_batch_size", "4"], "--num_generations 1"),
        (["--reward_weights", "1", "2"], "--reward_weights has 2"),
        (["--gym_env", "guess_number"], "--multi_turn_scheduler"),
        (["--vllm_mode", "server"], "--vllm_server_host"),
        (["--resume_from_checkpoint", "/nope"], "/nope"),
    ],
)
def test_bad_values_are_named(flags, needle):
    with pytest.raises(ConfigError, match=needle.replace("-", r"\-")):
        parse_train_args(["--dataset", "builtin:arithmetic", *flags])


def test_help_answers_before_torch_is_imported():
    code = (
        "import sys; from grpokit.cli.main import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print('torch' in sys.modules)"
    )
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip().splitlines()[-1] == "False"
    assert "train" in out.stdout and "rollout" in out.stdout and "infer" in out.stdout
    assert time.perf_counter() - t0 < 30


def _train_help(*extra: str) -> tuple[str, bool]:
    """`grpokit train [extra] --help-all` in a fresh interpreter: the text, and whether torch got imported."""
    code = (
        "import sys; from grpokit.cli.main import main\n"
        f"try:\n    main(['train', *{list(extra)!r}, '--help-all'])\nexcept SystemExit:\n    pass\n"
        "print('torch imported:', 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    text = " ".join(out.stdout.split())  # the help wraps lines
    return text, "torch imported: True" in text


def test_train_help_lists_the_ms_swift_flags_and_builtin_names_without_torch():
    text, torch_imported = _train_help()
    for flag in (
        "--num_generations",
        "--reward_funcs",
        "--multi_turn_scheduler",
        "--steps_per_generation",
        "--loss_type",
        "--vllm_mode",
        "--external_plugins",
        "--resume_from_checkpoint",
    ):
        assert flag in text, flag
    assert not torch_imported
    for option, names in BUILTIN_NAMES.items():
        assert f"registered: {', '.join(names)} (a plugin may add more)" in text, option


def test_train_help_with_a_plugin_lists_its_names(algo_plugin):
    text, _ = _train_help("--external_plugins", str(algo_plugin))
    assert "registered: grpo, bnpo, dr_grpo, dapo, cispo, sapo, luspo, vespo, real, gk_pg" in text
    assert "registered: grpo, rloo, reinforce_plus_plus, gk_above_mean" in text


def test_builtin_names_for_help_are_what_grpokit_registers():
    """BUILTIN_NAMES is the torch-free copy that --help shows; a loss/estimator added to grpokit/algorithms must be
    added there too."""
    import grpokit.algorithms as alg

    for option, attrs in REGISTRIES.items():
        registries = [getattr(alg, attr) for attr in attrs]
        own = {
            n
            for n in registered_names(option)
            if all(getattr(r[n], "__module__", "").startswith("grpokit.") for r in registries)
        }
        assert own == set(BUILTIN_NAMES[option]), (
            f"grpokit registers {sorted(own)} for --{option}: update BUILTIN_NAMES in grpokit/config/names.py"
        )


# ------------------------------------------------------------------------------------------------------------
# registry names: checked after --external_plugins load
# ------------------------------------------------------------------------------------------------------------
ALGO_PLUGIN = """
from grpokit.algorithms import ADVANTAGE_ESTIMATORS, LOSS_NORMALIZERS, POLICY_LOSSES, Centered, TokenLoss
from grpokit.algorithms.losses import token_mean

POLICY_LOSSES["gk_pg"] = lambda ratio, logps, adv, cfg: TokenLoss(loss=-ratio * adv, clipped={})
LOSS_NORMALIZERS["gk_pg"] = token_mean
POLICY_LOSSES["gk_half"] = POLICY_LOSSES["gk_pg"]          # no normaliser
ADVANTAGE_ESTIMATORS["gk_above_mean"] = lambda ctx: Centered(
    (ctx.rewards - ctx.reward_stats.mean[ctx.groups.index]).clamp(min=0.0), ctx.rewards)
"""


@pytest.fixture
def algo_plugin(tmp_path):
    """A plugin file that registers a loss and an estimator; the registries are restored afterwards."""
    import grpokit.algorithms as alg

    registries = [getattr(alg, attr) for attrs in REGISTRIES.values() for attr in attrs]
    saved = [dict(r) for r in registries]
    path = tmp_path / "gk_algo_plugin.py"
    path.write_text(ALGO_PLUGIN)
    yield path
    for registry, before in zip(registries, saved, strict=True):
        dict.clear(registry)
        dict.update(registry, before)
    sys.modules.pop("gk_algo_plugin", None)


ARITH = ["--dataset", "builtin:arithmetic"]


def _set_up(argv: list[str]):
    """What `grpokit train` runs before any model loads: parse (fields, resolve, validate), then the pipeline's
    one plugin load and the checks of the names plugins may register (grpokit/pipeline/train.py run_train)."""
    from grpokit.config.validate import check_registry_names
    from grpokit.plugins.loader import load_plugins_once

    cfg = parse_train_args(argv)
    load_plugins_once(cfg.reward.external_plugins)
    check_registry_names(cfg)
    return cfg


def test_plugin_names_are_accepted_once_the_plugin_loads(algo_plugin):
    with pytest.raises(ConfigError, match=r"^--loss_type 'gk_pg': unknown loss type; registered: "):
        _set_up([*ARITH, "--loss_type", "gk_pg"])  # not registered before the plugin loads
    cfg = _set_up(
        [
            *ARITH,
            "--external_plugins",
            str(algo_plugin),
            "--loss_type",
            "gk_pg",
            "--advantage_estimator",
            "gk_above_mean",
        ]
    )
    assert (cfg.algorithm.loss_type, cfg.algorithm.advantage_estimator) == ("gk_pg", "gk_above_mean")


@pytest.mark.parametrize("option", list(REGISTRIES))
def test_unknown_name_lists_the_registered_ones_with_the_plugins(algo_plugin, option):
    import grpokit.algorithms as alg

    with pytest.raises(ConfigError) as e:
        _set_up([*ARITH, "--external_plugins", str(algo_plugin), f"--{option}", "nope"])
    registry = getattr(alg, REGISTRIES[option][0])
    assert str(e.value) == f"--{option} 'nope': unknown {registry.kind}; registered: {', '.join(sorted(registry))}"
    if option in ("loss_type", "advantage_estimator"):
        assert "gk_" in str(e.value)


def test_loss_without_normaliser_names_the_missing_half(algo_plugin):
    with pytest.raises(ConfigError, match=r"'gk_half' is registered in POLICY_LOSSES but not in LOSS_NORMALIZERS"):
        _set_up([*ARITH, "--external_plugins", str(algo_plugin), "--loss_type", "gk_half"])


def test_the_pipeline_imports_a_plugin_once_and_parsing_not_at_all(tmp_path):
    from grpokit.plugins.loader import load_plugins_once

    (tmp_path / "gk_count_runs.py").write_text(
        "import builtins\nbuiltins.gk_runs = getattr(builtins, 'gk_runs', 0) + 1\n"
    )
    import builtins

    try:
        cfg = parse_train_args([*ARITH, "--external_plugins", str(tmp_path / "gk_count_runs.py")])
        assert not hasattr(builtins, "gk_runs")  # parsing and validation load nothing
        assert load_plugins_once(cfg.reward.external_plugins) == ["gk_count_runs"]  # what run_train calls
        assert load_plugins_once(cfg.reward.external_plugins) == ["gk_count_runs"]  # asked again: not re-run
        assert builtins.gk_runs == 1
    finally:
        sys.modules.pop("gk_count_runs", None)
        builtins.__dict__.pop("gk_runs", None)


def test_fresh_run_refuses_an_output_dir_with_an_earlier_runs_checkpoints(tmp_path):
    from grpokit.config.plan import earlier_run_checkpoints

    assert earlier_run_checkpoints(tmp_path, overwrite=False) == []
    for n in (2, 4, 6, 8):
        (tmp_path / f"checkpoint-{n}").mkdir()
    with pytest.raises(
        ConfigError, match=r"checkpoint-2, checkpoint-4, checkpoint-6, …\).*--overwrite_output_dir true"
    ):
        earlier_run_checkpoints(tmp_path, overwrite=False)
    assert len(earlier_run_checkpoints(tmp_path, overwrite=True)) == 4


# ------------------------------------------------------------------------------------------------------------
# vLLM colocate: the memory default and the error that names our option (tests/vllm starts the real engine)
# ------------------------------------------------------------------------------------------------------------
GPU_STARTUP = (
    "Free memory on device cuda:0 (20.1/79.1 GiB) on startup is less than desired GPU memory utilization "
    "(0.9, 71.2 GiB). Decrease GPU memory utilization or reduce GPU memory used by other processes."
)
GPU_KV = (
    "No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when initializing the engine."
)


def test_colocate_memory_default_leaves_room_for_training():
    cfg = parse_train_args([*ARITH, "--use_vllm", "true"])
    assert cfg.rollout.vllm_gpu_memory_utilization == 0.3  # TRL's default for vLLM next to training


@pytest.mark.parametrize(
    "device, text, needles",
    [
        (
            "cuda",
            GPU_STARTUP,
            [
                "--vllm_gpu_memory_utilization 0.9: vLLM could not start with this memory fraction"
                " (Free memory on device cuda:0 (20.1/79.1 GiB) on startup is less than desired GPU memory "
                "utilization (0.9, 71.2 GiB)); lower it (e.g. --vllm_gpu_memory_utilization 0.45) or "
                "free memory that other processes hold"
            ],
        ),
        ("cuda", GPU_KV, ["(No available memory for the cache blocks); raise it, or lower --vllm_max_model_len"]),
        ("cpu", GPU_KV, ["raise it, or lower --vllm_max_model_len; on a CPU", "VLLM_CPU_KVCACHE_SPACE=<GiB>"]),
    ],
)
def test_vllm_memory_errors_name_our_option_value_and_fix(device, text, needles):
    import torch

    from grpokit.engines.vllm_settings import VllmSettings, start_error

    settings = VllmSettings(gpu_memory_utilization=0.9, memory_option="--vllm_gpu_memory_utilization")
    message = str(start_error(ValueError(text), "/m", settings, torch.device(device)))
    assert message.startswith("--vllm_gpu_memory_utilization 0.9: ")
    for needle in needles:
        assert needle in message, message
    assert ("VLLM_CPU_KVCACHE_SPACE" in message) == (device == "cpu")
    assert "`gpu_memory_utilization`" not in message


def test_other_vllm_start_errors_name_the_model():
    import torch

    from grpokit.engines.vllm_settings import VllmSettings, start_error

    error = start_error(ValueError("head size 16 is not supported\nmore"), "/m", VllmSettings(), torch.device("cpu"))
    assert str(error) == "vLLM cannot serve /m: ValueError: head size 16 is not supported"


@pytest.mark.parametrize("value, space, warned", [(0.5, "2", True), (0.3, "2", False), (0.5, "", False)])
def test_a_changed_fraction_that_kvcache_space_overrides_on_cpu_is_reported(monkeypatch, caplog, value, space, warned):
    import torch

    from grpokit.engines.vllm_settings import VllmSettings, warn_if_memory_ignored

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", space)
    settings = VllmSettings(
        gpu_memory_utilization=value, memory_option="--vllm_gpu_memory_utilization", memory_default=0.3
    )
    with caplog.at_level("WARNING", logger="grpokit.engines.vllm_engine"):
        warn_if_memory_ignored(settings, torch.device("cpu"))
    expected = (
        f"--vllm_gpu_memory_utilization {value} has no effect: on a CPU, VLLM_CPU_KVCACHE_SPACE={space} "
        "sets vLLM's KV cache (GiB) instead"
    )
    assert (expected in caplog.messages) == warned


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--temperature", "200"], "--temperature 200"),  # above the bound every engine enforces on a request
        (["--top_k", "-5"], "--top_k -5"),
        (["--repetition_penalty", "0.001"], "--repetition_penalty 0.001"),
        (["--max_completion_length", str(1 << 21)], f"--max_completion_length {1 << 21}"),
        (["--async_generate", "true"], "--async_generate true needs an engine with its own copy"),
        (["--use_vllm", "true", "--sleep_level", "1", "--async_generate", "true"], "the engine cannot sleep"),
        (
            ["--use_vllm", "true", "--sleep_level", "2", "--eval_steps", "5", "--split_dataset_ratio", "0.1"],
            "--sleep_level 2 with --eval_steps 5",
        ),
        (
            ["--use_vllm", "true", "--offload_model", "true", "--deepspeed", "zero3"],
            "drop it and use --deepspeed zero3_",
        ),
    ],
)
def test_sampling_and_engine_options_fail_before_any_model_loads(tiny_model_dir, math_jsonl, flags, needle):
    """Checks that once ran at the first rollout or after the model loaded now run in grpokit.config.validate."""
    with pytest.raises(ConfigError, match=re.escape(needle)):
        parse_train_args(["--model", str(tiny_model_dir), "--dataset", str(math_jsonl), *flags])
