"""ms-swift's option names that grpokit does not implement as options of its own: each is either *warned* (accepted;
one line at start-up says it has no effect here and why) or *refused* (an error with the reason, unless its value
is one at which grpokit already behaves as ms-swift does). Every other name ms-swift's GRPO path takes is a field of
``TrainConfig`` with ms-swift's meaning; ``DEVIATIONS`` lists the defaults that differ, with the reason.

``tests/unit/test_swift_options.py`` walks ms-swift's full option list (``tests/data/ms-swift-options.tsv``) and
checks that each name is in exactly one of: the fields of ``TrainConfig``, ``WARNED``, ``REFUSED``.
``scripts/gen_porting_options.py`` renders these tables into docs/porting.md. Torch-free: ``--help`` builds on it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from grpokit.errors import ConfigError

WARNED: dict[str, str] = {}  # name -> why it has no effect here


@dataclass(frozen=True)
class Refusal:
    reason: str
    accepted: str  # the value(s), "|" between, at which grpokit already behaves as ms-swift does


REFUSED: dict[str, Refusal] = {}


def _warn(reason: str, names: str) -> None:
    for name in names.split():
        WARNED[name] = reason


def _refuse(reason: str, names: str) -> None:
    """``names``: ``name=accepted_value`` words; the value is the one that means what grpokit does anyway."""
    for word in names.split():
        name, _, accepted = word.partition("=")
        REFUSED[name] = Refusal(reason, accepted)


# ---- warned: no effect on what GRPO trains here ------------------------------------------------------------------
_warn(
    "a setting of ms-swift's deployment server; on `grpokit train` it has no effect (the rollout server is "
    "`grpokit rollout`, with its own --host/--port)",
    "host port api_key ssl_keyfile ssl_certfile owned_by served_model_name verbose log_interval log_level "
    "max_logprobs context_manager",
)
_warn(
    "a setting of `swift infer`/`swift eval`; training has no effect from it",
    "infer_backend result_path write_batch_size metric max_batch_size val_dataset_sample reranker_use_activation "
    "stream logprobs top_logprobs eval_use_evalscope eval_dataset eval_dataset_args eval_limit "
    "eval_generation_config extra_eval_args",
)
_warn(
    "a SwanLab tracker setting; grpokit's trackers go through accelerate (--report_to), without these settings",
    "swanlab_token swanlab_project swanlab_workspace swanlab_exp_name swanlab_notification_method "
    "swanlab_webhook_url swanlab_secret swanlab_sender_email swanlab_receiver_email swanlab_smtp_server "
    "swanlab_smtp_port swanlab_email_language swanlab_mode",
)
_warn(
    "an option of DPO/KTO/CPO/SimPO/ORPO/RM/GKD training (swift rlhf's other --rlhf_type values), not of GRPO",
    "label_smoothing rpo_alpha ld_alpha discopop_tau loss_weights cpo_alpha simpo_gamma desirable_weight "
    "undesirable_weight center_rewards_coefficient sft_alpha lmbda seq_kd gkd_logits_topk "
    "ref_adapters",
)
_warn(
    "an option of supervised training (SFT loss, metrics or sampler), which GRPO does not use",
    "enable_dft_loss enable_channel_loss acc_strategy group_by_length train_dataloader_shuffle mrl_dims "
    "eval_metric label_smoothing_factor label_names length_column_name remove_unused_columns "
    "prediction_loss_only eval_do_concat_batches eval_use_gather_object eval_accumulation_steps include_for_metrics "
    "batch_eval_metrics sortish_sampler predict_with_generate generation_max_length generation_num_beams "
    "generation_config is_binary_loss_scale model_name model_author",
)
_warn(
    "an option of a tuner other than LoRA (--tuner_type); grpokit's tuners are full and lora",
    "lora_ga_batch_size lora_ga_iters lora_ga_max_length lora_ga_direction lora_ga_scale lora_ga_stable_gamma "
    "fourier_n_frequency fourier_scaling boft_block_size boft_block_num boft_n_butterfly_factor boft_dropout "
    "vera_rank vera_projection_prng_key vera_dropout vera_d_initial adapter_act adapter_length adalora_target_r "
    "adalora_init_r adalora_tinit adalora_tfinal adalora_deltaT adalora_beta1 adalora_beta2 "
    "adalora_orth_reg_weight llamapro_num_new_blocks llamapro_num_groups reft_layer_key reft_layers reft_rank "
    "reft_intervention_type reft_args",
)
_warn(
    "acts only with --use_galore / --lisa_activated_layers, which grpokit refuses",
    "galore_target_modules galore_rank galore_update_proj_gap galore_scale galore_proj_type "
    "galore_optim_per_parameter galore_with_embedding galore_quantization galore_proj_quant galore_proj_bits "
    "galore_proj_group_size galore_cos_threshold galore_gamma_proj galore_queue_size lisa_step_interval "
    "optim_target_modules",
)
_warn(
    "a setting of an algorithm grpokit does not have: RLSD (--advantage_reweight), "
    "SDAR (--sdar_loss_coef) or --loss_type fipo; those are refused, so this one has "
    "nothing to act on",
    "rlsd_lambda rlsd_reweight_clip_range "
    "rlsd_lambda_warmup_steps rlsd_lambda_decay_steps rlsd_negative_only sdar_gate_beta fipo_decay_rate "
    "fipo_clip_range fipo_clip_high_only fipo_safety_threshold",
)
_warn(
    "acts only with --packing, --streaming or --interleave_prob, which grpokit refuses",
    "packing_length packing_num_proc packing_strategy lazy_tokenize stopping_strategy shuffle_buffer_size",
)
_warn(
    "a GPU kernel or memory setting (speed and memory only, the same training); grpokit does not apply it",
    "use_liger_kernel liger_kernel_config tf32 torch_compile_backend torch_compile_mode torch_empty_cache_steps "
    "use_flash_ckpt experts_impl vllm_enable_expert_parallel vllm_disable_custom_all_reduce vllm_use_async_engine "
    "vllm_disable_cascade_attn vllm_mm_processor_cache_gb enable_npu_model_patch "
    "ds3_gather_for_generation zero_hpz_partition_size use_cache use_logits_to_keep max_memory "
    "dataloader_pin_memory skip_memory_metrics bf16_full_eval fp16_full_eval",
)
_warn(
    "a distributed-training setting that accelerate chooses itself here (torchrun/accelerate launch set the "
    "process group)",
    "ddp_timeout ddp_backend ddp_find_unused_parameters ddp_bucket_cap_mb ddp_broadcast_buffers ddp_static_graph "
    "local_rank log_on_each_node log_level_replica save_on_each_node",
)
_warn(
    "a model-hub setting; grpokit loads local folders and never uploads",
    "use_hf hub_token model_revision reward_model_revision ref_model_revision hub_private_repo hub_model_id "
    "hub_strategy hub_always_push hub_revision local_repo_path download_mode",
)
_warn(
    "a tracker-naming setting that grpokit does not pass to the trackers (runs are named by --output_dir)",
    "run_name project trackio_space_id trackio_bucket_id trackio_static_space_id logging_dir",
)
_warn(
    "chosen from the model folder here: grpokit reads the architecture from config.json and uses the tokenizer's "
    "own chat template",
    "model_type ref_model_type reward_model_type template template_backend reward_template",
)
_warn(
    "grpokit always writes checkpoints as safetensors in transformers' default shards, into --output_dir as "
    "given (no version subfolder, no symlink)",
    "safe_serialization max_shard_size add_version create_checkpoint_symlink enable_jit_checkpoint",
)
_warn(
    "mixed precision follows --torch_dtype (bfloat16/float16 → autocast over float32 master weights for full "
    "fine-tuning)",
    "bf16 fp16",
)
_warn(
    "an image setting grpokit does not apply: images go through the model's own image processor settings (its "
    "preprocessor_config.json), --gradient_checkpointing covers the whole model, there are no bounding-box "
    "rewards, and vLLM takes every image of a row (its own limit: 999 per prompt; docs/multimodal.md)",
    "max_pixels norm_bbox vit_gradient_checkpointing vllm_limit_mm_per_prompt",
)
_warn(
    "a setting of ms-swift's argument loader; grpokit's --config YAML and flags need none",
    "load_args load_data_args ignore_args_error check_model custom_register_path do_train do_eval do_predict debug",
)
_warn(
    "grpokit logs every metric at each --logging_steps step without these filters or counters",
    "logging_nan_inf_filter include_num_input_tokens_seen wandb_log_unique_prompts log_rollout_offpolicy_metrics",
)
_warn(
    "the padding side is internal here: prompts are padded on the left for generation and the training rows are "
    "built without padding between prompt and completion",
    "padding_side",
)
_warn(
    "the weight sync to vLLM / the rollout server always sends flattened buckets of --weight_sync_bucket_mb (the "
    "adapter alone, or the merged weights, with LoRA), which bounds the memory these options bound in ms-swift",
    "move_model_batches enable_flattened_weight_sync vllm_server_group_port",
)
_warn(
    "grpokit's prompt reader keeps its workers for the whole run and the windows wrap around epochs, so there is "
    "no last partial batch and no worker restart",
    "dataloader_persistent_workers dataloader_drop_last dataloader_in_order",
)
_warn(
    "replaced by grpokit's own options: prompts are shuffled by --dataset_shuffle with --seed; evaluation rows "
    "are not shuffled",
    "data_seed val_dataset_shuffle train_sampling_strategy",
)
_warn(
    "the loss normalisation is chosen by --loss_type, which already averages over all processes' tokens where "
    "the loss type asks for it",
    "average_tokens_across_devices",
)
_warn("rows with problems fail with an error naming the row in grpokit; there is no lenient mode to switch", "strict")
_warn(
    "ms-swift's reasoning parser for its server's chat API; grpokit's engines return the raw completion, which "
    "the rewards see",
    "vllm_reasoning_parser",
)
_warn(
    "evaluation here keeps no best checkpoint, so there is no metric to choose one by",
    "metric_for_best_model greater_is_better",
)
_warn(
    "grpokit's checkpoints hold no callback state to restore; callbacks are rebuilt from --callbacks",
    "restore_callback_states_from_checkpoint",
)

# ---- refused: would change training if ignored -------------------------------------------------------------------
_NOT_GRPO = "not GRPO"
_NOT_YET = "not implemented in grpokit"
_refuse(
    "grpokit train is GRPO (ms-swift's swift rlhf --rlhf_type grpo); other RLHF types are " + _NOT_GRPO,
    "rlhf_type=grpo",
)
_refuse(
    _NOT_GRPO + ": a pretraining/SFT data feature (packed or streamed datasets) that GRPO prompts do not use",
    "packing=False streaming=False interleave_prob=None cached_dataset=list cached_val_dataset=list",
)
_refuse(
    _NOT_YET + ": GaLore, LISA and other optimizer schemes (use --optimizer or an optimizer plugin)",
    "use_galore=False lisa_activated_layers=0 optim_args=None lorap_lr_ratio=None",
)
_refuse(
    _NOT_YET + ": only peft LoRA adapters on the policy (no adapters to load, no swift LoRA, no extra "
    "trainable modules)",
    "tuner_backend=peft adapters=list use_swift_lora=False modules_to_save=list lora_bias=none lora_dtype=None "
    "init_weights=true target_parameters=None reward_adapters=list",
)
_refuse(_NOT_YET + ": learning rates per module (vision tower, aligner)", "vit_lr=None aligner_lr=None")
_refuse(
    _NOT_YET + ": freezing a vision-language model's language model (train only the vision tower or aligner)",
    "freeze_llm=False",
)
_refuse(
    _NOT_YET + ": a model change at load time (new tokens, RoPE scaling, init, device map, extra kwargs, task heads)",
    "new_special_tokens=list rope_scaling=None init_strategy=None device_map=None "
    "model_kwargs=None task_type=None num_labels=None problem_type=None max_model_len=None",
)
_refuse(
    _NOT_YET + ": sequence, pipeline, data or tensor parallelism beyond --vllm_tensor_parallel_size, and "
    "accelerate/parallelism configs (see docs/distributed.md)",
    "sequence_parallel_size=1 vllm_pipeline_parallel_size=1 vllm_data_parallel_size=1 deepspeed_autotp_size=None "
    "accelerator_config=None parallelism_config=None fsdp_config=None activation_checkpointing=None "
    "activation_checkpointing_kwargs=None",
)
_refuse(
    _NOT_YET + ": vLLM quantisation, speculative decoding and raw engine kwargs",
    "vllm_quantization=None vllm_speculative_config=None vllm_engine_kwargs=None",
)
_refuse(
    _NOT_YET + ": sampling beyond temperature/top_p/top_k/repetition_penalty (min_p, beam search)",
    "min_p=0.0 num_beams=1",
)
_refuse(
    _NOT_YET + ": the RLSD and SDAR (self-distillation) extensions of GRPO",
    "advantage_reweight=None sdar_loss_coef=0.0",
)
_refuse(
    _NOT_YET + ": evaluation beyond greedy and sampled (pass@k) scores every --eval_steps (delays, best "
    "model, early stop)",
    "eval_delay=0 load_best_model_at_end=False early_stop_interval=None max_epochs=None",
)
_refuse(
    _NOT_YET + ": MoE router loss, NEFTune noise, torch.compile, batch-size search, full determinism",
    "router_aux_loss_coef=0.0 neftune_noise_alpha=None torch_compile=False auto_find_batch_size=False "
    "full_determinism=False",
)
_refuse(
    _NOT_YET + ": checkpoints always hold the optimizer state, and resuming restores it with the prompt "
    "position (no weights-only checkpoint or resume, no restart of the data)",
    "resume_only_model=False ignore_data_skip=False save_only_model=False",
)
_refuse(
    _NOT_YET + ": prompts are always rendered with the tokenizer's chat template, without an answer prefix",
    "use_chat_template=True|None response_prefix=None",
)
_refuse(
    _NOT_YET + ": ms-swift's dataset registry (grpokit reads files, builtin:<task> and hub ids)",
    "custom_dataset_info=list",
)
_refuse(
    _NOT_YET + ": ms-swift's column aliases always apply (rename columns with --columns instead)",
    "disable_auto_column_mapping=False",
)
_refuse(_NOT_YET + ": uploading to a model hub", "push_to_hub=False")
_refuse(
    _NOT_YET + ": ms-swift's thinking-history template switches (the chat template's own rendering is used)",
    "preserve_thinking=None add_non_thinking_prefix=True disable_ignore_empty_think=False",
)
_refuse(
    "grpokit logs every --logging_steps steps (logging_strategy steps) and has no 'no'/'epoch' modes",
    "logging_strategy=steps",
)

# ---- implemented, with a default that differs from ms-swift's ------------------------------------------------------
DEVIATIONS: dict[str, str] = {
    "vllm_gpu_memory_utilization": "0.3: colocate mode shares the GPU with training (ms-swift's 0.9 leaves "
    "training no room unless sleep_level is set)",
    "vllm_enable_prefix_caching": "True (ms-swift: None = vLLM's own default, which is on)",
    "vllm_enable_lora": "True: with --tuner_type lora a sync sends the adapter alone where the engine serves it",
    "vllm_mode": "colocate (ms-swift: None, resolved to colocate unless a server host is given)",
    "beta": "0.04 (ms-swift: None, resolved to 0.04 for GRPO)",
    "loss_scale": "default (ms-swift: None, resolved to its default loss scale)",
    "loss_type": "grpo (ms-swift: None, resolved per algorithm to grpo)",
    "temperature": "1.0: ms-swift's 0.9 is its shared RLHF default; GRPO's PPO ratio assumes the sampling "
    "distribution is the trained one (TRL's default is 1.0)",
    "torch_dtype": "auto: bfloat16 where the device supports it well, else float32 (ms-swift: the model's dtype)",
    "per_device_train_batch_size": "8 (ms-swift: 1), so that a default run holds whole groups of 8 generations",
    "num_generations_eval": "None: evaluation is the greedy pass alone; given K, the greedy pass and K samples per "
    "prompt, reported as pass@k, mean@K and greedy (ms-swift: None samples "
    "--num_generations per prompt and reports their mean rewards)",
    "gradient_accumulation_steps": "1 (ms-swift: None, resolved to 1 for GRPO)",
    "gradient_checkpointing": "False: the small models grpokit is tuned for run faster without it (ms-swift: True)",
    "logging_steps": "1 (ms-swift: 5): GRPO steps are few and slow, every step is worth a log row",
    "weight_decay": "0.0 (ms-swift: 0.1), TRL's GRPO default",
    "adam_beta2": "0.999 (ms-swift: 0.95), torch's and TRL's default",
    "lr_scheduler_type": "linear (ms-swift: cosine), TRL's default",
    "report_to": "none (ms-swift: tensorboard): logging.jsonl has every metric; a tracker not installed is a warning",
    "optim": "None = --optimizer decides (its adamw is the fused kernel of ms-swift's default adamw_torch_fused)",
    "optimizer": "adamw (ms-swift: None = --optim, whose default adamw_torch_fused is the same kernel)",
    "output_dir": "output (ms-swift: None, resolved to output/<model>/v<N>-<time>)",
    "learning_rate": "1e-6 (ms-swift: None, resolved to 1e-4 for LoRA and 1e-5 for full; GRPO usually wants less)",
    "fsdp": "False, a switch (ms-swift: None or an FSDP option string)",
    "num_train_epochs": "1.0 (ms-swift: 3.0): one pass over the prompts is the usual GRPO run",
    "disable_tqdm": "False (ms-swift: None, resolved to False)",
    "dataloader_num_workers": "None = rows read in the training process (ms-swift: None = 1 worker on Linux): rows "
    "are read from a dataset already in memory, where a worker process costs more than "
    "it saves",
    "per_device_eval_batch_size": "64 (ms-swift: 1): evaluation is one greedy completion per prompt (and "
    "--num_generations_eval samples), and one engine call per 64 prompts keeps it fast",
    "eval_steps": "None = no evaluation (ms-swift: None = every --save_steps when a validation set exists); set it "
    "to evaluate; without validation data it is one start-up warning and no evaluation, as in ms-swift",
}

# deviations that do not change a run: ms-swift resolves its unset value to grpokit's default, or (workers) only
# the speed differs
SAME_ONCE_RESOLVED = {
    "beta",
    "disable_tqdm",
    "fsdp",
    "gradient_accumulation_steps",
    "loss_scale",
    "loss_type",
    "optim",
    "optimizer",
    "vllm_mode",
    "vllm_enable_prefix_caching",
    "dataloader_num_workers",
}


def swift_value_matches(value, accepted: str) -> bool:
    """Whether a value given for an ms-swift option (flag words, or a YAML value) equals ``accepted`` as ms-swift's
    option table writes it (``False``, ``None``, ``list`` for an empty list, ``'std'``, ``0.0``, ``steps``)."""
    if "|" in accepted:
        return any(swift_value_matches(value, one) for one in accepted.split("|"))
    if isinstance(value, list):
        if accepted == "list":
            return not value
        if not value:  # a bare `--flag` means true
            value = True
        elif len(value) == 1:
            value = value[0]
        else:
            return False
    text = str(value).strip().strip("'\"").lower()
    want = accepted.strip("'\"").lower()
    if want in ("none", "list"):
        return text in ("none", "null", "") or value is None
    if want in ("true", "false"):
        return text in ({"true", "1", "yes"} if want == "true" else {"false", "0", "no"})
    try:
        return float(text) == float(want)
    except ValueError:
        return text == want


def check_swift_options(given: dict, rank0: bool | None = None, log=None) -> list[str]:
    """Refuse the refused options given at another value, then warn once (rank 0) about each warned option given.
    ``given``: option name -> value as parsed. Returns the warning lines."""
    for name, value in given.items():
        refusal = REFUSED.get(name)
        if refusal and not swift_value_matches(value, refusal.accepted):
            raise ConfigError(
                f"--{name} {_show(value)}: {refusal.reason}; remove the option ({_as_grpokit(name, refusal)})"
            )
    lines = [
        f"--{name} {_show(value)}: no effect in grpokit: {WARNED[name]}"
        for name, value in given.items()
        if name in WARNED
    ]
    if (is_rank0() if rank0 is None else rank0) and log is not None:
        for line in lines:
            log(line)
    return lines


def _as_grpokit(name: str, refusal: Refusal) -> str:
    accepted = refusal.accepted.split("|")[0].strip("'")
    if accepted in ("None", "list"):
        return "grpokit behaves as ms-swift does without it"
    return f"grpokit behaves as --{name} {accepted.lower() if accepted in ('True', 'False') else accepted}"


def is_rank0() -> bool:
    """Start-up warnings print once per run: on the first process (torchrun/accelerate set RANK)."""
    return os.environ.get("RANK", "0") == "0"


def _show(value) -> str:
    if isinstance(value, list):
        return " ".join(map(str, value)) if value else "true"  # a bare flag
    return str(value).lower() if isinstance(value, bool) else str(value)  # a YAML boolean as a flag writes it
