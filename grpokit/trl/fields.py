"""Every field of TRL 1.16's ``GRPOConfig`` (its own and those of transformers' ``TrainingArguments``), decided:

- ``SAME``: a grpokit option of the same name and meaning; the value (TRL's default included) is passed on.
- ``RENAMED``: a grpokit option under another name (``mask_truncated_completions`` → ``--overlong_filter``).
- ``CONVERTED``: read by ``config.py`` into grpokit's options (``bf16``/``fp16`` → ``--torch_dtype``; the vLLM
  importance-sampling fields → ``--rollout_importance_sampling_mode``; ...).
- ``INERT``: fields that TRL's GRPO trainer does not read either (transformers documents them as informational,
  or they only steer a feature that is off): accepted with any value.
- ``REFUSED``: not implemented here; TRL's default is accepted (it means the feature is off), any other value
  stops with the reason and what to do instead.

``tests/unit/test_trl_fields.py`` reads the field list from the installed TRL 1.16 package and fails on any field
missing here.
"""

from __future__ import annotations

# TRL's GRPOConfig defaults where they differ from transformers' TrainingArguments (TRL 1.16 grpo_config.py and
# its base class) — the defaults a TRL user's script relies on
TRL_DEFAULTS: dict[str, object] = {
    "learning_rate": 1e-6,
    "logging_steps": 10,
    "gradient_checkpointing": True,
    "bf16": None,  # TRL: True unless fp16 is set
    "num_generations": 8,
    "max_completion_length": 512,
    "shuffle_dataset": True,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "repetition_penalty": 1.0,
    "use_vllm": False,
    "vllm_mode": "colocate",
    "vllm_server_host": "0.0.0.0",
    "vllm_server_port": 8000,
    "vllm_server_timeout": 240.0,
    "vllm_gpu_memory_utilization": 0.3,
    "vllm_tensor_parallel_size": 1,
    "beta": 0.0,
    "num_iterations": 1,
    "epsilon": 0.2,
    "sapo_temperature_neg": 1.05,
    "sapo_temperature_pos": 1.0,
    "vespo_k_pos": 2.0,
    "vespo_lambda_pos": 3.0,
    "vespo_k_neg": 3.0,
    "vespo_lambda_neg": 2.0,
    "importance_sampling_level": "token",
    "multi_objective_aggregation": "sum_then_normalize",
    "scale_rewards": "group",
    "loss_type": "dapo",
    "mask_truncated_completions": False,
    "sync_ref_model": False,
    "ref_model_mixup_alpha": 0.6,
    "ref_model_sync_steps": 512,
    "top_entropy_quantile": 1.0,
    "entropy_coef": 0.0,
    "use_adaptive_entropy": False,
    "entropy_coef_min": 0.0,
    "entropy_coef_max": 1.0,
    "entropy_coef_delta": 0.005,
    "entropy_target": 0.2,
    "vllm_importance_sampling_correction": True,
    "vllm_importance_sampling_mode": "sequence_mask",
    "vllm_importance_sampling_clip_max": 3.0,
    "use_bias_correction_kl": True,
    "log_completions": False,
    "pad_to_multiple_of": "auto",
    "vllm_group_port": 51216,
    "vllm_enable_sleep_mode": False,
    "trust_remote_code": False,
    "disable_dropout": False,
    "cast_lm_head_to_fp32": False,
    "use_transformers_continuous_batching": False,
    "use_transformers_paged": False,
}

SAME = frozenset(
    """adam_beta1 adam_beta2 adam_epsilon beta chat_template_kwargs dataloader_multiprocessing_context
    dataloader_num_workers dataloader_prefetch_factor delta disable_dropout disable_tqdm epsilon epsilon_high
    eval_on_start
    generation_batch_size gradient_accumulation_steps gradient_checkpointing gradient_checkpointing_kwargs
    importance_sampling_level learning_rate log_completions logging_first_step loss_type lr_scheduler_kwargs
    lr_scheduler_type max_completion_length max_grad_norm max_steps num_generations num_generations_eval
    num_iterations num_train_epochs optim output_dir per_device_eval_batch_size per_device_train_batch_size
    ref_model_mixup_alpha ref_model_sync_steps repetition_penalty reward_weights
    save_total_limit seed steps_per_generation sync_ref_model temperature top_entropy_quantile top_k top_p
    trust_remote_code use_cpu use_vllm vespo_k_neg vespo_k_pos vespo_lambda_neg vespo_lambda_pos
    vllm_gpu_memory_utilization vllm_mode vllm_server_timeout vllm_tensor_parallel_size warmup_steps
    weight_decay""".split()
)

RENAMED: dict[str, str] = {
    "mask_truncated_completions": "overlong_filter",
    "shuffle_dataset": "dataset_shuffle",
    "sapo_temperature_neg": "tau_neg",
    "sapo_temperature_pos": "tau_pos",
    "vllm_max_model_length": "vllm_max_model_len",
    "vllm_structured_outputs_regex": "structured_outputs_regex",
    "off_policy_mask_threshold": "off_policy_sequence_mask_delta",
}

# read by config.py (the comment says into what)
CONVERTED = frozenset(
    [
        "bf16",  # with fp16 and model_init_kwargs' dtype: --torch_dtype
        "fp16",
        "model_init_kwargs",  # dtype/torch_dtype → --torch_dtype, attn_implementation → --attn_impl
        "scale_rewards",  # True/False → group/none, as TRL reads them
        "logging_steps",  # a whole number of steps; TRL's fraction of the run is refused
        "save_steps",
        "eval_steps",
        "eval_strategy",  # no / steps; epoch is refused
        "save_strategy",  # no / steps; epoch and best are refused
        "report_to",  # a name or a list of names → --report_to
        "vllm_server_host",  # one host → --vllm_server_host (with vllm_mode='server')
        "vllm_server_port",
        "vllm_server_base_url",
        "vllm_enable_sleep_mode",  # True → --sleep_level 2, as TRL's vLLM sleeps at level 2
        "vllm_importance_sampling_correction",  # with use_vllm: --rollout_importance_sampling_mode
        "vllm_importance_sampling_mode",
        "vllm_importance_sampling_clip_max",  # the threshold C
        "vllm_importance_sampling_cap",  # TRL's older name for clip_max
        "use_bias_correction_kl",  # --kl_bias_correction (only acts when beta != 0)
        "deepspeed",  # a preset name or JSON file path
        "fsdp",  # True (grpokit's FSDP2); TRL's option strings are refused
        "max_tool_calling_iterations",  # the tools/environment_factory loop's turn limit (grpokit.trl.tools)
        "logging_strategy",  # steps; no/epoch refused
        "generation_kwargs",  # temperature/top_p/top_k/repetition_penalty/max_tokens override those fields, as in TRL
        "num_completions_to_print",  # TRL's console table, printed only with log_completions: refused there
        "log_unique_prompts",  # shapes only the wandb/trackio table: refused when one is reported to
        "log_multimodal",  # images in the wandb/trackio table: refused (False) when one is reported to
        "run_name",  # the trackers' run name: with report_to none it names nothing (as in TRL); else refused
        "project",
    ]
)

_INFO = "informational in transformers (the Trainer does not read it) and not read by TRL's GRPO trainer"
_HUB = "read only when pushing to the Hub, which is refused (push_to_hub)"
INERT: dict[str, str] = {
    "do_train": _INFO,
    "do_eval": _INFO,
    "do_predict": _INFO,
    "resume_from_checkpoint": _INFO + "; trainer.train(resume_from_checkpoint=...) resumes, as in TRL",
    "hub_token": _HUB,
    "hub_private_repo": _HUB,
    "hub_model_id": _HUB,
    "hub_strategy": _HUB,
    "hub_always_push": _HUB,
    "hub_revision": _HUB,
    "local_rank": "set by the launcher; grpokit reads the launcher's environment (LOCAL_RANK) itself",
    "pad_to_multiple_of": "batches are padded to their longest row ('auto' does so off Neuron devices)",
    "label_names": "GRPO trains on its own completions; there are no labels",
    "length_column_name": "used only by group_by_length sampling, which GRPO does not use",
    "vllm_group_port": "grpokit's rollout server syncs weights over its own HTTP transport, not a NCCL group",
}

REFUSED: dict[str, str] = {
    "log_level": "transformers' loggers keep the level the process set",
    "log_level_replica": "transformers' loggers keep the level the process set",
    "log_on_each_node": "grpokit logs on rank 0 only",
    "logging_nan_inf_filter": "grpokit logs every value as it is (a non-finite step is skipped and counted)",
    "skip_memory_metrics": "memory metrics are not collected",
    "ds3_gather_for_generation": "grpokit gathers ZeRO-3 weights for generation in any case",
    "dataloader_pin_memory": "grpokit's prompt stream is not a torch DataLoader",
    "dataloader_drop_last": "grpokit's prompt stream draws whole rollouts",
    "dataloader_persistent_workers": "grpokit's prompt stream has no worker processes",
    "dataloader_in_order": "grpokit's prompt stream is in order on every rank",
    "remove_unused_columns": "every dataset column reaches the rewards, as with TRL's default (False)",
    "vllm_model_impl": "the rollout engine uses vLLM's own model implementation",
    "push_to_hub": "push the saved model yourself (huggingface-cli upload)",
    "log_completions_hub_repo": "completions are written to completions.jsonl in output_dir; upload that file",
    "use_liger_kernel": "grpokit computes logps in chunks in the output head's place (logps_chunk_size)",
    "liger_kernel_config": "grpokit computes logps in chunks in the output head's place (logps_chunk_size)",
    "torch_compile": "not implemented",
    "torch_compile_backend": "not implemented",
    "torch_compile_mode": "not implemented",
    "tf32": "set torch.backends.cuda.matmul.allow_tf32 in your script",
    "bf16_full_eval": "evaluation runs in the training dtype (bf16/fp16)",
    "fp16_full_eval": "evaluation runs in the training dtype (bf16/fp16)",
    "use_cache": "the KV cache is the rollout engine's; training forwards do not use one",
    "cache_implementation": "the rollout engine keeps its own KV cache",
    "activation_checkpointing": "use gradient_checkpointing",
    "activation_checkpointing_kwargs": "use gradient_checkpointing_kwargs",
    "auto_find_batch_size": "GRPO needs whole groups in a batch (TRL refuses it too)",
    "average_tokens_across_devices": "the loss types normalise across ranks by their own rule (loss_type)",
    "label_smoothing_factor": "GRPO has no labels to smooth",
    "neftune_noise_alpha": "not implemented",
    "torch_empty_cache_steps": "not implemented",
    "optim_args": "not implemented; pick an optimizer by optim",
    "optim_target_modules": "not implemented",
    "accelerator_config": "not implemented; grpokit sets accelerate up itself",
    "parallelism_config": "context and sequence parallelism are not implemented (TRL's GRPO refuses them too)",
    "fsdp_config": "use fsdp=True (grpokit's FSDP2 wraps each decoder layer)",
    "ddp_backend": "not implemented; torchrun's default backend is used",
    "ddp_find_unused_parameters": "not implemented",
    "ddp_bucket_cap_mb": "not implemented",
    "ddp_broadcast_buffers": "not implemented",
    "ddp_static_graph": "not implemented",
    "ddp_timeout": "not implemented",
    "debug": "not implemented",
    "full_determinism": "not implemented; seed makes runs repeatable on one machine",
    "data_seed": "the prompt order follows seed",
    "train_sampling_strategy": "prompts are drawn shuffled (shuffle_dataset) or in order",
    "ignore_data_skip": "a resume continues from the checkpoint's prompt position",
    "restore_callback_states_from_checkpoint": "not implemented",
    "enable_jit_checkpoint": "not implemented",
    "save_only_model": "checkpoints always hold the optimizer state (a resume needs it)",
    "save_on_each_node": "checkpoints are written by rank 0",
    "load_best_model_at_end": "not implemented",
    "metric_for_best_model": "not implemented",
    "greater_is_better": "not implemented",
    "eval_delay": "not implemented",
    "eval_accumulation_steps": "evaluation scores completions as they come",
    "eval_do_concat_batches": "evaluation has no prediction batches to concatenate",
    "eval_use_gather_object": "not implemented",
    "prediction_loss_only": "evaluation scores completions with the rewards",
    "include_for_metrics": "evaluation scores completions with the rewards",
    "batch_eval_metrics": "evaluation scores completions with the rewards",
    "include_num_input_tokens_seen": "not implemented",
    "trackio_space_id": "not implemented",
    "trackio_bucket_id": "not implemented",
    "trackio_static_space_id": "not implemented",
    "router_aux_loss_coef": "mixture-of-experts auxiliary losses are not implemented",
    "cast_lm_head_to_fp32": "not implemented",
    "min_p": "not implemented in grpokit's samplers",
    "multi_objective_aggregation": "only sum_then_normalize (TRL's default) is implemented",
    "entropy_coef": "an entropy bonus is not implemented",
    "use_adaptive_entropy": "adaptive entropy control is not implemented",
    "entropy_coef_min": "adaptive entropy control is not implemented",
    "entropy_coef_max": "adaptive entropy control is not implemented",
    "entropy_coef_delta": "adaptive entropy control is not implemented",
    "entropy_target": "adaptive entropy control is not implemented",
    "vllm_importance_sampling_clip_min": "a lower bound is not implemented (the upper, clip_max, is)",
    "use_transformers_continuous_batching": "grpokit's transformers engine batches its own way",
    "transformers_continuous_batching_config": "grpokit's transformers engine batches its own way",
    "use_transformers_paged": "grpokit's transformers engine batches its own way",
}


def decided() -> set[str]:
    """Every field name decided here."""
    return set(SAME) | set(RENAMED) | set(CONVERTED) | set(INERT) | set(REFUSED)
