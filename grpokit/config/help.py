"""`grpokit train --help`: the options by topic, one screen each, and the "did you mean" line for a mistyped one.

``--help`` prints the topics and the options a first run sets; ``--help TOPIC`` (or ``grpokit options TOPIC``)
one topic's options with their defaults; ``--help-all`` every topic in turn. ``TOPICS`` names the options of each
topic; an option no topic names (a field added later) is listed under its dataclass's own topic, so every option
is always somewhere. Torch-free: it reads the dataclasses of ``args.py`` only.
"""

from __future__ import annotations

import dataclasses
import difflib
import shutil
import textwrap

from grpokit.config.args import ALL_GROUPS
from grpokit.config.fields import Kind, option_fields
from grpokit.config.names import REGISTRIES, help_suffix
from grpokit.errors import ConfigError

HELP_FLAGS = ("-h", "--help", "--help-all")
MAX_WIDTH = 100  # help lines wrap at the terminal's width, at most this

# topic -> (what it covers, its options in the order shown, separated by spaces). An option no topic names goes to
# its dataclass's topic (GROUP_TOPIC).
TOPICS: dict[str, tuple[str, str]] = {
    "model": (
        "the policy and reference models, dtype, attention, what trains",
        "model ref_model torch_dtype tuner_type attn_impl trust_remote_code gradient_checkpointing "
        "gradient_checkpointing_kwargs freeze_vit freeze_aligner",
    ),
    "lora": (
        "LoRA adapters, and freezing parameters under full fine-tuning",
        "lora_rank lora_alpha lora_dropout target_modules target_regex use_rslora use_dora freeze_parameters "
        "freeze_parameters_regex freeze_parameters_ratio trainable_parameters trainable_parameters_regex",
    ),
    "data": ("datasets, prompts, chat template", ""),
    "rollout": (
        "sampling: group size, lengths, temperature, stop words",
        "num_generations max_completion_length max_new_tokens temperature top_p top_k repetition_penalty "
        "stop_words fast_decode structured_outputs_regex structured_outputs_json",
    ),
    "vllm": (
        "generating with vLLM in the training process (colocate)",
        "use_vllm vllm_gpu_memory_utilization vllm_max_model_len vllm_tensor_parallel_size "
        "vllm_enable_prefix_caching vllm_enforce_eager vllm_max_num_seqs sleep_level offload_model "
        "offload_optimizer",
    ),
    "server": (
        "rollout servers (--vllm_mode server) and weight sync",
        "vllm_mode vllm_server_host vllm_server_port vllm_server_base_url vllm_server_timeout "
        "vllm_server_api_key vllm_server_pass_dataset weight_sync_bucket_mb check_weight_sync vllm_enable_lora "
        "vllm_max_lora_rank",
    ),
    "async": (
        "asynchronous training: rolling out ahead of the weights",
        "async_generate max_staleness partial_rollouts staleness_policy stream_groups",
    ),
    "multi-turn": (
        "multi-turn schedulers, environments and agents",
        "multi_turn_scheduler max_turns gym_env use_gym_env openenv_env agent verifiers_env agent_concurrency "
        "agent_timeout completion_length_limit_scope loss_scale",
    ),
    "algorithm": (
        "advantages, the policy loss, clipping, KL",
        "advantage_estimator scale_rewards loss_type importance_sampling_level beta epsilon epsilon_high "
        "delta tau_pos tau_neg vespo_k_pos vespo_lambda_pos vespo_k_neg vespo_lambda_neg real_tau "
        "kl_in_reward num_iterations",
    ),
    "filters": (
        "dynamic sampling, token filters, off-policy fixes, ref updates",
        "dynamic_sample max_resample_times overlong_filter top_entropy_quantile log_entropy "
        "rollout_importance_sampling_mode rollout_importance_sampling_threshold use_rollout_logprobs "
        "logps_support off_policy_sequence_mask_delta sync_ref_model ref_model_sync_steps "
        "ref_model_mixup_alpha",
    ),
    "chord": (
        "CHORD: an SFT term mixed into the loss",
        "chord_sft_dataset chord_sft_per_device_train_batch_size chord_enable_phi_function "
        "chord_mu_warmup_steps chord_mu_decay_steps chord_mu_peak chord_mu_valley",
    ),
    "reward": ("reward functions, reward models and their settings", ""),
    "training": (
        "batch sizes, optimizer, learning rate, how long",
        "per_device_train_batch_size gradient_accumulation_steps steps_per_generation generation_batch_size "
        "learning_rate lr_scheduler_type lr_scheduler_kwargs warmup_ratio warmup_steps weight_decay optimizer "
        "optim adam_beta1 adam_beta2 adam_epsilon max_grad_norm num_train_epochs max_steps seed "
        "max_nonfinite_steps",
    ),
    "hardware": (
        "devices, distributed training, memory and speed",
        "use_cpu deepspeed fsdp logps_chunk_size padding_free dataloader_num_workers "
        "dataloader_prefetch_factor dataloader_multiprocessing_context",
    ),
    "output": (
        "the run folder, logging, progress, checkpoints, resuming",
        "output_dir overwrite_output_dir logging_steps logging_first_step report_to plots disable_tqdm "
        "log_completions log_completions_max_tokens log_completions_max_rows write_report save_strategy "
        "save_steps save_total_limit save_final_model resume_from_checkpoint callbacks",
    ),
    "eval": (
        "evaluation on the held-out data during and around training",
        "eval_strategy eval_steps eval_on_start eval_on_end per_device_eval_batch_size num_generations_eval "
        "eval_pass_threshold",
    ),
    "teacher": (
        "on-policy distillation: teachers, their term in the advantage",
        "teacher_model teacher_model_server teacher_kl_coef teacher_tag_key",
    ),
}
# each dataclass's unnamed options go to this topic
GROUP_TOPIC = {
    "ModelArguments": "model",
    "DataArguments": "data",
    "RolloutArguments": "rollout",
    "AlgorithmArguments": "algorithm",
    "RewardArguments": "reward",
    "TrainingArguments": "training",
}
FIRST_RUN = (
    "model",
    "dataset",
    "reward_funcs",
    "tuner_type",
    "num_generations",
    "max_completion_length",
    "learning_rate",
    "max_steps",
)


def topic_options() -> dict[str, list[str]]:
    """topic -> its options, every option of ``ALL_GROUPS`` in exactly one topic."""
    fields = option_fields(ALL_GROUPS)
    out = {topic: [n for n in names.split() if n in fields] for topic, (_, names) in TOPICS.items()}
    named = {n for names in out.values() for n in names}
    for group in ALL_GROUPS:
        for f in dataclasses.fields(group):
            if f.name not in named:
                out.setdefault(_group_topic(group), []).append(f.name)
    return out


def _group_topic(group: type) -> str:
    """The topic of a dataclass's unnamed options: its own, or one named after it (``TeacherArguments``:
    ``teacher``)."""
    return GROUP_TOPIC.get(group.__name__) or group.__name__.removesuffix("Arguments").lower()


def topic_summary(topic: str) -> str:
    return TOPICS[topic][0] if topic in TOPICS else f"the options of {topic}"


def default_of(field: dataclasses.Field):
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


def shown_default(field: dataclasses.Field) -> str | None:
    return shown_value(default_of(field))


def shown_value(value) -> str | None:
    """A value as a user would write it, or None where there is nothing to show (unset, an empty list)."""
    if value is None or value == []:
        return None
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return " ".join(map(str, value))
    return str(value)


def _value_word(kind: Kind) -> str:
    if kind.literal:
        word = "{" + ",".join(map(str, kind.literal)) + "}"
    else:
        word = {bool: "true|false", int: "INT", float: "FLOAT"}.get(kind.base, "TEXT")
    return f"{word} [...]" if kind.is_list else word


def _option_lines(name: str, field: dataclasses.Field, kind: Kind, width: int) -> list[str]:
    text = field.metadata.get("help", "")
    if name in REGISTRIES:
        text += help_suffix(name).replace("%%", "%")
    default = shown_default(field)
    if default is not None and "default" not in text.lower():
        text += f" (default: {default})"
    head = f"  --{name} {_value_word(kind)}"
    body = textwrap.wrap(text, width=width, initial_indent=" " * 6, subsequent_indent=" " * 6)
    return [head, *body]


def topic_text(topic: str, width: int | None = None) -> str:
    """One topic's options, each with its value, help and default."""
    width = width or min(MAX_WIDTH, shutil.get_terminal_size().columns)
    fields = option_fields(ALL_GROUPS)
    lines = textwrap.wrap(f"{topic}: {topic_summary(topic)}", width=width)
    for name in topic_options()[topic]:
        field, kind = fields[name]
        lines += _option_lines(name, field, kind, width)
    return "\n".join(lines)


def overview_text(prog: str, width: int | None = None) -> str:
    """`grpokit train --help`: usage, the topics, the options a first run sets."""
    width = width or min(MAX_WIDTH, shutil.get_terminal_size().columns)
    counts = {t: len(names) for t, names in topic_options().items()}
    lines = [f"usage: {prog} [--config FILE] [--OPTION VALUE ...]", ""]
    lines += textwrap.wrap(
        "GRPO-family training. With neither --model nor --dataset: the built-in demo.",
        width=width,
    )
    lines += [
        "",
        *textwrap.wrap(
            f"Options by topic: `{prog} --help TOPIC` (or `grpokit options TOPIC`); all of them: --help-all.",
            width=width,
        ),
    ]
    lines += [f"  {t:<11}{topic_summary(t)} ({n})" for t, n in counts.items()]
    lines += ["", "The options a first run sets:", "  --config FILE", "      a YAML file of options; flags override it"]
    fields = option_fields(ALL_GROUPS)
    for name in FIRST_RUN:
        field, kind = fields[name]
        lines += _option_lines(name, field, kind, width)
    lines += textwrap.wrap(
        "Each option also takes its dashed spelling (--learning-rate); a true/false option --X also takes --no_X. "
        "ms-swift's other names are accepted too, with a line saying what they do here (docs/porting.md).",
        width=width,
    )
    return "\n".join(lines)


def help_text(argv: list[str], prog: str) -> str:
    """What ``-h``/``--help [TOPIC]``/``--help-all`` in ``argv`` asks for."""
    if "--help-all" in argv:
        return "\n\n".join([overview_text(prog), *(topic_text(t) for t in topic_options())])
    for i, arg in enumerate(argv):
        if arg in ("-h", "--help") and i + 1 < len(argv) and not argv[i + 1].startswith("-"):
            return topic_help(argv[i + 1])
    return overview_text(prog)


def topic_help(topic: str) -> str:
    topics = topic_options()
    if topic not in topics:
        raise ConfigError(f"--help {topic}: no such topic; use one of {', '.join(topics)} (or --help-all)")
    return topic_text(topic)


def did_you_mean(name: str, flags: list[str]) -> str:
    """``; did you mean --learning_rate?`` for a mistyped ``--learning_rat``: each option once, in its underscore
    spelling (argparse knows ``--learning-rate`` too), the closest one."""
    typed = "--" + name[2:].replace("-", "_")
    names = sorted({"--" + f[2:].replace("-", "_") for f in flags if f.startswith("--")})
    longer = [n for n in names if n.startswith(typed)]  # what argparse's prefix matching would have taken
    close = difflib.get_close_matches(typed, longer or names, n=1, cutoff=0 if longer else 0.6)
    return f"; did you mean {close[0]}?" if close else ""


def unknown_option_line(message: str, flags: list[str], command: str) -> str | None:
    """argparse's ``unrecognized arguments: --limt 3`` as ``unknown option --limt; did you mean --limit?``."""
    prefix = "unrecognized arguments: "
    if not message.startswith(prefix):
        return None
    words = message[len(prefix) :].split()
    options = [w.split("=", 1)[0] for w in words if w.startswith("--")]
    if not options:
        return f"unexpected value(s) {' '.join(words)}: every value follows a --flag (see `{command} --help`)"
    hint = did_you_mean(options[0], flags) or f"; see `{command} --help`"
    return f"unknown option {options[0]}{hint}"
