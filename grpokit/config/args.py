"""Every option of `grpokit train`, grouped by concern, with ms-swift/TRL names.

Each dataclass is one slice of the configuration; a component receives only the slice it needs. Help text is the
field metadata, so `grpokit train --help` documents every flag. Nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Literal

from grpokit.config.fields import opt as _opt
from grpokit.config.reward_args import RewardArguments  # one slice, kept in its own module
from grpokit.config.teacher_args import TeacherArguments  # one slice, kept in its own module
from grpokit.protocol import (
    MAX_N,
    MAX_REPETITION_PENALTY,
    MAX_TEMPERATURE,
    MAX_TOKENS,
    MAX_TOP_K,
    MIN_REPETITION_PENALTY,
    MIN_TEMPERATURE,
)

# --attn_impl's names (transformers' attn_implementation, and ms-swift's flash_attn for flash_attention_2)
ATTN_IMPLS = ("sdpa", "eager", "flash_attn", "flash_attention_2", "flash_attention_3", "flex_attention")


@dataclass
class ModelArguments:
    model: str | None = _opt(None, "policy model: a local folder in Hugging Face format (default: the built-in "
                                   "SmolLM2-135M-Instruct demo model, converted once and cached)")
    ref_model: str | None = _opt(None, "reference model for the KL term (default: a frozen copy of --model; with "
                                       "LoRA the base model with adapters disabled)")
    torch_dtype: Literal["auto", "float32", "bfloat16", "float16"] = _opt(
        "auto", "weights/compute dtype; auto = bfloat16 where the device supports it well, else float32")
    tuner_type: Literal["full", "lora"] = _opt("lora", "LoRA adapters (peft; --lora_rank, --lora_alpha, "
                                                       "--target_modules), as in ms-swift, or full fine-tuning")
    lora_rank: int = _opt(8, "LoRA rank r", ge=1)
    lora_alpha: int = _opt(32, "LoRA alpha", ge=1)
    lora_dropout: float = _opt(0.05, "LoRA dropout", ge=0, lt=1)
    target_modules: list[str] = _opt(["all-linear"], "LoRA target modules (peft names, or all-linear)")
    gradient_checkpointing: bool = _opt(False, "recompute activations in backward to save memory")
    trust_remote_code: bool = _opt(False, "allow custom model code from the model folder")
    disable_dropout: bool = _opt(False, "every dropout of the policy and reference at p = 0 (TRL's disable_dropout)")
    # ms-swift names (issue 19)
    attn_impl: str | None = _opt(None, "attention implementation: sdpa, eager, flash_attn (= flash_attention_2, "
                                       "CUDA only), flash_attention_3, flex_attention; default: transformers' choice",
                                       choices=ATTN_IMPLS)
    gradient_checkpointing_kwargs: str | None = _opt(
        None, "JSON object passed to gradient_checkpointing_enable (default {\"use_reentrant\": false})",
        json_object=True)
    target_regex: str | None = _opt(None, "LoRA targets as one regex over module names (instead of --target_modules)")
    use_rslora: bool = _opt(False, "rank-stabilised LoRA scaling alpha/sqrt(r) (peft use_rslora)")
    use_dora: bool = _opt(False, "weight-decomposed LoRA (peft use_dora)")
    freeze_parameters: list[str] = _opt([], "full fine-tuning: freeze the parameters whose names start with these "
                                            "prefixes")
    freeze_parameters_regex: str | None = _opt(None, "full fine-tuning: freeze the parameters whose names this regex "
                                                     "matches (re.search)")
    freeze_parameters_ratio: float = _opt(0.0, "full fine-tuning: freeze this fraction of the parameters, counted "
                                               "from the bottom layers (embeddings first)", ge=0, le=1)
    trainable_parameters: list[str] = _opt([], "full fine-tuning: train these name prefixes again after the freezing")
    trainable_parameters_regex: str | None = _opt(None, "full fine-tuning: train the parameters this regex matches "
                                                        "again after the freezing")
    # vision-language models (docs/multimodal.md): which parts train, ms-swift's names and defaults
    freeze_vit: bool = _opt(True, "vision-language models: keep the vision tower frozen (false: train it, with "
                                  "LoRA adapters on its linear layers under --tuner_type lora)")
    freeze_aligner: bool = _opt(True, "vision-language models: keep the aligner (the projector from vision to "
                                      "language) frozen (false: train it, with LoRA adapters under lora)")


@dataclass
class DataArguments:
    dataset: list[str] = _opt([], "training data: .jsonl/.json/.csv/.parquet files, builtin:<task>, or hub ids; "
                                  "append #N to sub-sample N rows (default: builtin:arithmetic)")
    val_dataset: list[str] = _opt([], "held-out data, same forms as --dataset")
    system: str | None = _opt(None, "system prompt prepended to rows that have none; a value ending in .txt is "
                                    "a file holding the prompt (as in ms-swift); \\n in the text is a newline")
    max_length: int | None = _opt(None, "max prompt length in tokens, as rendered by the chat template (ms-swift's "
                                        "meaning for GRPO); longer prompts follow --truncation_strategy. The "
                                        "completion is bounded by --max_completion_length on its own", ge=1)
    split_dataset_ratio: float = _opt(0.0, "hold out this fraction of --dataset as validation when --val_dataset "
                                           "is not given", ge=0, lt=1)
    dataset_shuffle: bool = _opt(True, "shuffle the training prompts each epoch")
    # issue 19: ms-swift's dataset and template options (grpokit/data, grpokit/template; docs/datasets.md)
    truncation_strategy: str | None = _opt(
        None, "prompts longer than --max_length: left (keep the last max_length tokens), right (keep the first), "
              "delete (drop the row, with a warning count) or raise (stop, naming the row); unset = left (ms-swift's "
              "GRPO default), or delete in server mode and with multi-turn rollouts, said at start-up")
    columns: str | None = _opt(None, "rename dataset columns first: a JSON object {\"src\": \"dst\"} or a JSON "
                                     "file, e.g. '{\"question_text\": \"query\"}' (ms-swift's --columns)",
                                     json_object=True)
    dataset_num_proc: int = _opt(1, "processes for dataset preprocessing (Dataset.map num_proc)", ge=1)
    load_from_cache_file: bool = _opt(False, "reuse datasets' cache of preprocessed rows (Dataset.map)")
    agent_template: str | None = _opt(None, "how a row's `tools` column reaches the prompt: unset = the chat "
                                            "template's own tools= rendering; hermes, react_en or react_grpo = tools "
                                            "written into the system message in that format")
    enable_thinking: bool | None = _opt(None, "passed to the chat template as enable_thinking (Qwen3 and other "
                                              "hybrid-thinking templates); unset = the template's default")
    chat_template_kwargs: str | None = _opt(None, "more keyword arguments for the chat template, as a JSON object "
                                                  "(TRL's chat_template_kwargs), e.g. '{\"reasoning_effort\": "
                                                  "\"low\"}'", json_object=True)
    max_row_bytes: int = _opt(8 << 20, "a .jsonl/.csv line (one row) longer than this many bytes is refused, "
                                       "naming the line, before it is parsed (default 8 MiB)", ge=1)


@dataclass
class RolloutArguments:
    num_generations: int = _opt(8, "completions sampled per prompt (the group size G)",
                                ge=2, le=MAX_N, why="GRPO compares the completions of one prompt")
    max_completion_length: int = _opt(512, "max new tokens per completion (per trajectory with "
                                           "--completion_length_limit_scope total)", ge=1, le=MAX_TOKENS)
    max_new_tokens: int | None = _opt(None, "ms-swift's older name for --max_completion_length (overrides it when "
                                            "given)", ge=1, le=MAX_TOKENS)
    temperature: float = _opt(1.0, "sampling temperature; training logits are divided by it too",
                              ge=MIN_TEMPERATURE, le=MAX_TEMPERATURE,
                              why="0, greedy, gives every completion of a group the same reward: no learning signal")
    top_p: float = _opt(1.0, "nucleus sampling", gt=0, le=1)
    top_k: int = _opt(-1, "top-k sampling; -1 disables", ge=-1, le=MAX_TOP_K, why="-1 or 0 disables top-k")
    repetition_penalty: float = _opt(1.0, "repetition penalty (1 = none)",
                                     ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)
    stop_words: list[str] = _opt([], "extra stop strings")
    fast_decode: bool = _opt(True, "transformers engine: sample Llama/Qwen2/Qwen3 models with grpokit's own decode "
                                   "loop (same distribution as HF generate, 2x faster on small models); false, or "
                                   "any other model, uses HF generate")
    use_vllm: bool = _opt(False, "generate with vLLM (colocate: in process; server: through grpokit rollout)")
    vllm_mode: Literal["colocate", "server"] = _opt("colocate", "where rollouts run")
    vllm_server_host: list[str] = _opt([], "rollout server host(s) for --vllm_mode server")
    vllm_server_port: list[int] = _opt([8000], "rollout server port(s), one per host", ge=1, le=65535)
    vllm_server_base_url: list[str] = _opt([], "rollout server base URL(s), instead of host/port")
    vllm_server_timeout: float = _opt(240.0, "seconds to wait for a rollout server (start-up and each call)", gt=0)
    vllm_server_api_key: str | None = _opt(None, "API key for the rollout server (or GRPOKIT_API_KEY)")
    vllm_gpu_memory_utilization: float = _opt(
        0.3, "colocate: fraction of the GPU's memory vLLM reserves next to training (weights + KV cache; on a CPU "
             "the fraction of RAM, unless VLLM_CPU_KVCACHE_SPACE sets the KV cache in GiB)", gt=0, le=1)
    vllm_max_model_len: int | None = _opt(None, "vLLM max model length", ge=1)
    vllm_tensor_parallel_size: int = _opt(1, "vLLM tensor parallel size (colocate)", ge=1)
    vllm_enable_prefix_caching: bool = _opt(True, "vLLM prefix caching")
    vllm_enforce_eager: bool = _opt(False, "vLLM: no CUDA graphs")
    vllm_max_num_seqs: int = _opt(256, "vLLM colocate: most sequences in one engine step", ge=1)
    sleep_level: int = _opt(0, "vLLM colocate: 0 keep, 1 offload weights, 2 drop weights while training", ge=0, le=2)
    # ms-swift's offload while vLLM colocate generates (trainers/offload.py); no effect with other engines
    offload_model: bool = _opt(False, "vLLM colocate: move the training (and reference) model's weights to CPU "
                                      "memory while vLLM generates, back before training")
    offload_optimizer: bool = _opt(False, "vLLM colocate: move the optimizer state to CPU memory while vLLM "
                                          "generates, back before training")
    vllm_enable_lora: bool = _opt(True, "--tuner_type lora: each weight sync sends only the LoRA adapter (and the "
                                        "base once); merged weights where the adapter cannot be served unmerged")
    vllm_max_lora_rank: int = _opt(16, "largest LoRA rank the engine serves unmerged (above it: merged sync)", ge=1)
    weight_sync_bucket_mb: int = _opt(256, "server mode: max size of one flattened weight bucket", ge=1)
    check_weight_sync: bool = _opt(
        True, "after every weight sync (server mode, vLLM colocate) check that the engine holds the trainer's "
              "weights: float64 checksums of every tensor on both sides and a 4-token greedy logprob probe; a "
              "mismatch stops the run naming the bucket or tensor. Costs one more read of every weight on each "
              "side and one short generation per sync (docs/PERFORMANCE.md)")
    async_generate: bool = _opt(False, "generate the next window while training on this one (one window "
                                       "off-policy: --max_staleness of one window's optimizer steps)")
    max_staleness: int | None = _opt(
        None, "asynchronous training (TRL's name): windows are rolled out ahead by a background producer, and no "
              "trained token is more than this many optimizer steps older than the weights that train it; 0 is "
              "synchronous. Default: one window with --async_generate true, else 0 (docs/server_mode.md)", ge=0)
    partial_rollouts: bool = _opt(
        False, "--max_staleness (server mode, or vLLM colocate): a weight update pauses the running generation, "
               "which continues on the new weights (finished tokens and logprobs kept, each token tagged by version)")
    staleness_policy: Literal["wait", "drop"] = _opt(
        "wait", "--max_staleness: wait (the producer waits, so no window is ever too old) or drop (the producer "
                "runs one window further ahead; a window too old when its turn comes is dropped and its prompts "
                "rolled out again)")
    stream_groups: bool = _opt(
        False, "--max_staleness: the buffer holds groups, each taken to train as soon as its num_generations "
               "completions are scored, from one producer per rollout server (docs/server_mode.md)")
    multi_turn_scheduler: str | None = _opt(None, "multi-turn scheduler name from the multi_turns registry")
    max_turns: int | None = _opt(None, "max turns per trajectory", ge=1)
    gym_env: str | None = _opt(None, "environment name from the envs registry (gym_scheduler)")
    openenv_env: str | None = _opt(None, "OpenEnvScheduler: the OpenEnv environment to run in process, as "
                                         "module:Class (or a factory returning one); a row's env_config.env wins")
    agent: str | None = _opt(None, "agent name from the agents registry (an external plugin): each episode runs "
                                   "its async agent(client, row) against the trainer's OpenAI-compatible endpoint "
                                   "(docs/agents.md)")
    verifiers_env: str | None = _opt(None, "a verifiers (0.4) environment to train on, with its own tasks, "
                                           "harness and reward functions, served through the same endpoint as "
                                           "--agent: module:attr (an Env or a function returning one), a module "
                                           "with load_environment(), or a taskset id; --agent_concurrency and "
                                           "--agent_timeout bound its episodes (docs/agents_envs.md)")
    agent_concurrency: int = _opt(64, "--agent: episodes run at once", ge=1, le=4096)
    agent_timeout: float = _opt(600.0, "--agent: seconds one episode may take; past it the episode ends as a "
                                       "counted timeout (reward 0, nothing trained)", gt=0)
    completion_length_limit_scope: Literal["total", "per_round"] = _opt(
        "per_round", "total: max_completion_length bounds the whole trajectory; per_round: each turn")
    loss_scale: Literal["default", "last_round"] = _opt("default", "last_round: only the last round trains "
                                                                   "(thinking_tips_scheduler)")
    # server mode (docs/server_mode.md): the multi-turn options above may be given to the trainer too; they are
    # checked against the rollout server's own at start-up (it runs the trajectories)
    vllm_server_pass_dataset: bool = _opt(False, "server mode: send each row's extra columns to the rollout server "
                                                 "as data_dict (its scheduler or environment reads them); also on "
                                                 "with --multi_turn_scheduler, as in ms-swift")
    use_gym_env: bool | None = _opt(None, "the multi-turn scheduler's rollout_infos['total_reward'] is a reward "
                                          "(gym_reward); default: on when the scheduler (or the server's) says so")
    structured_outputs_regex: str | None = _opt(None, "constrain completions to this regex")
    structured_outputs_json: str | None = _opt(None, "constrain completions to JSON valid against this schema "
                                                     "(JSON text or a .json file)", json_object=True)


@dataclass
class AlgorithmArguments:
    # names from registries that plugins may extend: checked after --external_plugins load (config/names.py)
    advantage_estimator: str = _opt("grpo", "advantage estimator (ADVANTAGE_ESTIMATORS)")
    scale_rewards: str | None = _opt(None, "advantage scaling (SCALE_MODES; default by estimator: grpo→group, "
                                           "rloo→none, reinforce_plus_plus→batch, any other→group)")
    loss_type: str = _opt("grpo", "loss and its normalisation (POLICY_LOSSES and LOSS_NORMALIZERS)")
    importance_sampling_level: str = _opt(
        "token", "importance sampling level (IS_LEVELS): token = GRPO, sequence = GSPO, sequence_token = GSPO-token")
    beta: float = _opt(0.04, "KL coefficient (k3 estimator); 0 skips the reference model", ge=0)
    epsilon: float = _opt(0.2, "PPO clip range (lower)", ge=0)
    epsilon_high: float | None = _opt(None, "upper clip range (clip-higher, DAPO); default = epsilon; cispo: "
                                            "the cap on the IS weight", ge=0)
    delta: float | None = _opt(None, "two-sided clip: upper bound on the ratio for negative advantages", gt=1)
    tau_pos: float = _opt(1.0, "sapo temperature for positive advantages", gt=0)
    tau_neg: float = _opt(1.05, "sapo temperature for negative advantages", gt=0)
    vespo_k_pos: float = _opt(2.0, "vespo: power k of the Gamma kernel W^k·e^(λ(1−W)) for advantages >= 0", ge=0)
    vespo_lambda_pos: float = _opt(3.0, "vespo: decay λ of the Gamma kernel for advantages >= 0", gt=0)
    vespo_k_neg: float = _opt(3.0, "vespo: power k of the Gamma kernel for negative advantages", ge=0)
    vespo_lambda_neg: float = _opt(2.0, "vespo: decay λ of the Gamma kernel for negative advantages", gt=0)
    real_tau: float = _opt(0.5, "real: temperature τ of REAL's in-group classification loss (logits s/τ)", gt=0)
    kl_in_reward: bool | None = _opt(None, "subtract β·KL from the reward instead of adding it to the loss; unset: "
                                           "true with rloo and reinforce_plus_plus, false otherwise (ms-swift's rule)")
    num_iterations: int = _opt(1, "updates per rollout (μ)", ge=1)
    dynamic_sample: bool = _opt(False, "DAPO dynamic sampling: resample groups whose rewards are all equal")
    max_resample_times: int = _opt(3, "dynamic sampling: max extra rollout rounds per window", ge=0)
    overlong_filter: bool = _opt(False, "truncated completions contribute no loss")
    top_entropy_quantile: float = _opt(1.0, "train only the top-q highest-entropy tokens (global quantile)", gt=0, le=1)
    log_entropy: bool = _opt(False, "log token entropy")
    kl_bias_correction: bool = _opt(False, "--beta: each token's KL times its importance ratio, the unbiased "
                                           "reverse-KL gradient off-policy (DeepSeek-V3.2; TRL's "
                                           "use_bias_correction_kl)")
    rollout_importance_sampling_mode: str | None = _opt(
        None, "correct the rollout-vs-training mismatch with the engine's logprobs (ROLLOUT_IS_MODES)")
    rollout_importance_sampling_threshold: float = _opt(2.0, "rollout IS threshold C", ge=1)
    use_rollout_logprobs: bool = _opt(
        False, "slime's --use-rollout-logprobs (verl's bypass mode): the engine's logprobs of the sampled tokens are "
               "the old policy's in the clipped ratio, so no forward recomputes them. They equal the trainer's up to "
               "the sampler's numerics (the mismatch/* metrics show how far); every trained token needs one")
    logps_support: Literal["sampler", "full"] = _opt(
        "sampler", "the support of the training logps (old, current, reference) when sampling truncates (top_k, "
                   "top_p < 1, special tokens an engine never emits): sampler renormalises each token's probability "
                   "over the tokens the sampler kept, rebuilt from the logits by the sampler's rule, so the policy "
                   "ratio compares the distributions that were sampled from (costs a top-k or a vocabulary sort "
                   "per token); full uses the whole vocabulary (cheaper, but with top_p < 1 every ratio to the "
                   "engine's logprobs is scaled by the kept mass)")
    sync_ref_model: bool = _opt(False, "mix the policy into the reference model every ref_model_sync_steps")
    ref_model_sync_steps: int = _opt(512, "steps between reference-model syncs", ge=1)
    ref_model_mixup_alpha: float = _opt(0.6, "ref ← α·policy + (1−α)·ref", ge=0, le=1)
    # CHORD: SFT on expert replies mixed into the GRPO loss (algorithms/chord.py, trainers/chord_sft.py)
    chord_sft_dataset: list[str] = _opt([], "CHORD: expert data, same forms and columns as --dataset; each row's "
                                            "reference reply (final assistant message, or solution/answer/"
                                            "response/output/completion) is the SFT target")
    chord_sft_per_device_train_batch_size: int | None = _opt(None, "CHORD: SFT rows per micro-step per process "
                                                                   "(required with --chord_sft_dataset)", ge=1)
    chord_enable_phi_function: bool = _opt(False, "CHORD-phi: weight each expert token's loss by p·(1−p)")
    chord_mu_warmup_steps: int | None = _opt(None, "CHORD: steps for mu to rise linearly from 0 to "
                                                   "--chord_mu_peak (unset: 0)", ge=0)
    chord_mu_decay_steps: int | None = _opt(None, "CHORD: steps for mu's cosine decay from peak to valley "
                                                  "(unset: 0)", ge=0)
    chord_mu_peak: float | None = _opt(None, "CHORD: mu's peak; loss = (1−mu)·GRPO + mu·SFT (required with "
                                             "--chord_sft_dataset)", ge=0, le=1)
    chord_mu_valley: float | None = _opt(None, "CHORD: mu's final value after the decay (required with "
                                               "--chord_sft_dataset; equal to the peak: a constant mu)", ge=0, le=1)
    off_policy_sequence_mask_delta: float | None = _opt(
        None, "DeepSeek-V3.2: a sequence with a negative advantage whose mean log π_old − log π_θ per token exceeds "
              "this gets no policy loss (π_old: the engine's logprobs, else the old logps)", ge=0, why="unset: no mask")


@dataclass
class TrainingArguments:
    output_dir: str = _opt("output", "where logs, checkpoints, plots and the final model go")
    overwrite_output_dir: bool = _opt(False, "a fresh run may delete the checkpoints and logs an earlier run left "
                                             "in output_dir (otherwise it refuses to start)")
    per_device_train_batch_size: int = _opt(8, "completions per micro-step per process", ge=1)
    gradient_accumulation_steps: int = _opt(1, "micro-steps per optimizer step", ge=1)
    steps_per_generation: int | None = _opt(None, "micro-steps per rollout (default gradient_accumulation_steps)", ge=1)
    generation_batch_size: int | None = _opt(None, "completions per rollout, all processes (alternative to "
                                                   "steps_per_generation)", ge=1)
    learning_rate: float = _opt(1e-6, "peak learning rate", gt=0)
    lr_scheduler_type: str = _opt("linear", "transformers scheduler name: linear, cosine, constant, …")
    warmup_ratio: float = _opt(0.0, "fraction of steps for linear warm-up", ge=0, le=1)
    weight_decay: float = _opt(0.0, "AdamW weight decay", ge=0)
    adam_beta1: float = _opt(0.9, "AdamW beta1", ge=0, lt=1)
    adam_beta2: float = _opt(0.999, "AdamW beta2", ge=0, lt=1)
    max_grad_norm: float = _opt(1.0, "gradient clipping (0 disables)", ge=0)
    num_train_epochs: float = _opt(1.0, "passes over the training prompts (ignored when max_steps > 0)", gt=0)
    max_steps: int = _opt(-1, "optimizer steps; overrides num_train_epochs when > 0",
                          ge=1, also=(-1,), why="-1: train --num_train_epochs instead")
    optimizer: str = _opt("adamw", "optimizer name from the optimizers registry (`adamw` takes torch's fused "
                                   "kernel where it can)")
    callbacks: list[str] = _opt([], "callback names from the callbacks registry")
    logging_steps: int = _opt(1, "log every N optimizer steps", ge=1)
    save_steps: int = _opt(500, "checkpoint every N optimizer steps", ge=1)
    save_total_limit: int | None = _opt(None, "keep at most N checkpoints; unset, 0 or -1 keeps every one (as "
                                        "transformers' Trainer reads them); the newest is never deleted", ge=-1,
                                        why="unset, 0 or -1 keeps every checkpoint")
    save_final_model: bool = _opt(True, "save the trained model to output_dir at the end")
    eval_steps: int | None = _opt(None, "evaluate on --val_dataset every N steps (greedy accuracy with the rewards, "
                                        "and pass@k with --num_generations_eval)", ge=1)
    seed: int = _opt(42, "random seed", ge=0, le=2**32 - 1, why="the range numpy and torch seed from")
    log_completions: bool = _opt(False, "write completions.jsonl: each completion's prompt, text, group, rewards and "
                                        "advantage, and for the first --log_completions_max_rows rows of a step "
                                        "per-token data and image thumbnails (what `grpokit view` shows)")
    log_completions_max_tokens: int = _opt(256, "per-token data (decoded piece, logprob, entropy, loss mask) for at "
                                                "most this many completion tokens of a completions.jsonl row (the "
                                                "rest is counted as `cut`); 0 = none", ge=0)
    log_completions_max_rows: int = _opt(16, "rows of each step (on each process) that carry per-token data and up "
                                             "to 4 JPEG thumbnails of 128 px; their token values cost one no-grad "
                                             "forward of these rows", ge=0)
    write_report: bool = _opt(True, "write output_dir/report.html at the end of the run (the trajectory viewer, "
                                    "`grpokit view`)")
    resume_from_checkpoint: str | None = _opt(None, "checkpoint folder, or 'latest' for the newest in output_dir")
    report_to: list[str] = _opt(["none"], "trackers through accelerate: none, tensorboard, wandb, …")
    plots: bool = _opt(True, "write PNG plots of the main curves")
    use_cpu: bool = _opt(False, "train on CPU even when a GPU is present")
    deepspeed: str | None = _opt(None, "zero0-zero3, zero2_offload, zero3_offload or a DeepSpeed JSON file")
    fsdp: bool = _opt(False, "shard weights, gradients and optimizer state with PyTorch FSDP2 (one process "
                             "too: nothing is split)")
    # the training forward (trainers/packing.py)
    logps_chunk_size: int = _opt(1024, "compute the training logps in the output head's place, this many tokens' "
                                       "logits at a time, so the [batch, completion, vocab] logits never exist "
                                       "(same values and gradients); 0 = the plain path (full logits)", ge=0)
    padding_free: bool = _opt(False, "train on each micro-batch's rows packed into one row without padding "
                                     "(position_ids restart per row; needs eager, sdpa, flex or flash attention)")
    disable_tqdm: bool = _opt(False, "no progress bar: plain progress lines on stderr instead, as when stderr is "
                                     "not a terminal (first and last step, then a step 30 s after the last line)")
    # ms-swift / transformers names (issue 19)
    optim: str | None = _opt(None, "transformers' optimizer name: adamw_torch, adamw_torch_fused (= --optimizer "
                                   "adamw) or sgd (= --optimizer sgd)")
    adam_epsilon: float = _opt(1e-8, "AdamW epsilon", ge=0)
    warmup_steps: float = _opt(0, "linear warm-up steps (a value below 1: a fraction of the steps, as in "
                                   "transformers 5); overrides --warmup_ratio when > 0", ge=0)
    lr_scheduler_kwargs: str | None = _opt(None, "JSON object of extra arguments for the learning-rate schedule, "
                                                 "e.g. '{\"num_cycles\": 0.5}' for cosine", json_object=True)
    logging_first_step: bool = _opt(True, "also log the first optimizer step when --logging_steps > 1")
    save_strategy: Literal["steps", "no"] = _opt("steps", "steps: a checkpoint every --save_steps; no: none "
                                                          "(the final model is still saved)")
    eval_strategy: Literal["steps", "no"] | None = _opt(None, "no: never evaluate; steps: every --eval_steps (which "
                                                              "needs validation data); unset: as --save_strategy")
    per_device_eval_batch_size: int = _opt(64, "prompts per engine call when evaluating", ge=1)
    eval_on_start: bool = _opt(False, "evaluate once before the first step too (a fresh run with validation data)")
    eval_on_end: bool = _opt(False, "evaluate once after the last step too; the summary then says the held-out "
                                    "score before (--eval_on_start) and after")
    num_generations_eval: int | None = _opt(None, "evaluation also samples this many completions K per validation "
                                                  "prompt (at --temperature/--top_p/--top_k) and logs "
                                                  "eval/<reward>/pass@k for k = 1, 2, 4, … and K, mean@K and their "
                                                  "intervals (docs/options.md); unset: the greedy pass alone",
                                            ge=1, le=MAX_N)
    eval_pass_threshold: float = _opt(1.0, "sampled evaluation: a sample passes (for pass@k) when its reward is at "
                                           "least this (1.0: a correct answer of an accuracy-type reward)")
    dataloader_num_workers: int | None = _opt(None, "worker processes that read the next windows' prompt rows "
                                                    "ahead of training (0 or unset: read in the training process)",
                                                    ge=0)
    dataloader_prefetch_factor: int | None = _opt(None, "windows each worker reads ahead (default 2)", ge=1)
    dataloader_multiprocessing_context: str | None = _opt(None, "how the workers start: fork, spawn or forkserver "
                                                                "(default: the platform's)")
    max_nonfinite_steps: int = _opt(3, "an optimizer step whose loss or grad norm is NaN/inf is skipped (weights "
                                       "unchanged, warned); after this many such steps in a row the run stops",
                                       ge=1)


ALL_GROUPS = (ModelArguments, DataArguments, RolloutArguments, AlgorithmArguments, RewardArguments,
              TrainingArguments, TeacherArguments)


@dataclass
class TrainConfig:
    """The parsed configuration: one attribute per concern."""

    model: ModelArguments
    data: DataArguments
    rollout: RolloutArguments
    algorithm: AlgorithmArguments
    reward: RewardArguments
    training: TrainingArguments
    teacher: TeacherArguments = field(default_factory=TeacherArguments)  # on-policy distillation
    # ms-swift options given that grpokit warns about or refuses (config/swift_options.py): name -> value
    swift_options: dict = field(default_factory=dict)

    def flat(self) -> dict:
        """All options in one dict (args.json; reward constructors pick their kwargs from it by name)."""
        out: dict = {}
        for part in (self.model, self.data, self.rollout, self.algorithm, self.reward, self.training, self.teacher):
            out.update(asdict(part))
        return out
