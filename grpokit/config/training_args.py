"""`grpokit train`'s training options (the TrainingArguments slice of ``TrainConfig``): steps, batches, optimizer and
schedule, saving, logging, evaluation, the training forward and the distributed set-up."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from grpokit.config.fields import opt as _opt
from grpokit.protocol import MAX_N


@dataclass
class TrainingArguments:
    output_dir: str = _opt("output", "where logs, checkpoints, plots and the final model go")
    overwrite_output_dir: bool = _opt(
        False,
        "a fresh run may delete the checkpoints and logs an earlier run left "
        "in output_dir (otherwise it refuses to start)",
    )
    per_device_train_batch_size: int = _opt(8, "completions per micro-step per process", ge=1)
    gradient_accumulation_steps: int = _opt(1, "micro-steps per optimizer step", ge=1)
    steps_per_generation: int | None = _opt(None, "micro-steps per rollout (default gradient_accumulation_steps)", ge=1)
    generation_batch_size: int | None = _opt(
        None, "completions per rollout, all processes (alternative to steps_per_generation)", ge=1
    )
    learning_rate: float = _opt(1e-6, "peak learning rate", gt=0)
    lr_scheduler_type: str = _opt("linear", "transformers scheduler name: linear, cosine, constant, …")
    warmup_ratio: float = _opt(0.0, "fraction of steps for linear warm-up", ge=0, le=1)
    weight_decay: float = _opt(0.0, "AdamW weight decay", ge=0)
    adam_beta1: float = _opt(0.9, "AdamW beta1", ge=0, lt=1)
    adam_beta2: float = _opt(0.999, "AdamW beta2", ge=0, lt=1)
    max_grad_norm: float = _opt(1.0, "gradient clipping (0 disables)", ge=0)
    num_train_epochs: float = _opt(1.0, "passes over the training prompts (ignored when max_steps > 0)", gt=0)
    max_steps: int = _opt(
        -1,
        "optimizer steps; overrides num_train_epochs when > 0",
        ge=1,
        also=(-1,),
        why="-1: train --num_train_epochs instead",
    )
    optimizer: str = _opt(
        "adamw", "optimizer name from the optimizers registry (`adamw` takes torch's fused kernel where it can)"
    )
    callbacks: list[str] = _opt([], "callback names from the callbacks registry")
    logging_steps: int = _opt(1, "log every N optimizer steps", ge=1)
    save_steps: int = _opt(500, "checkpoint every N optimizer steps", ge=1)
    save_total_limit: int | None = _opt(
        None,
        "keep at most N checkpoints; unset, 0 or -1 keeps every one (as "
        "transformers' Trainer reads them); the newest is never deleted",
        ge=-1,
        why="unset, 0 or -1 keeps every checkpoint",
    )
    save_final_model: bool = _opt(True, "save the trained model to output_dir at the end")
    eval_steps: int | None = _opt(
        None,
        "evaluate on --val_dataset every N steps (greedy accuracy with the rewards, "
        "and pass@k with --num_generations_eval)",
        ge=1,
    )
    seed: int = _opt(42, "random seed", ge=0, le=2**32 - 1, why="the range numpy and torch seed from")
    log_completions: bool = _opt(
        False,
        "write completions.jsonl: each completion's prompt, text, group, rewards and "
        "advantage, and for the first --log_completions_max_rows rows of a step "
        "per-token data and image thumbnails (what `grpokit view` shows)",
    )
    log_completions_max_tokens: int = _opt(
        256,
        "per-token data (decoded piece, logprob, entropy, loss mask) for at "
        "most this many completion tokens of a completions.jsonl row (the "
        "rest is counted as `cut`); 0 = none",
        ge=0,
    )
    log_completions_max_rows: int = _opt(
        16,
        "rows of each step (on each process) that carry per-token data and up "
        "to 4 JPEG thumbnails of 128 px; their token values cost one no-grad "
        "forward of these rows",
        ge=0,
    )
    write_report: bool = _opt(
        True, "write output_dir/report.html at the end of the run (the trajectory viewer, `grpokit view`)"
    )
    resume_from_checkpoint: str | None = _opt(None, "checkpoint folder, or 'latest' for the newest in output_dir")
    report_to: list[str] = _opt(["none"], "trackers through accelerate: none, tensorboard, wandb, …")
    plots: bool = _opt(True, "write PNG plots of the main curves")
    use_cpu: bool = _opt(False, "train on CPU even when a GPU is present")
    deepspeed: str | None = _opt(None, "zero0-zero3, zero2_offload, zero3_offload or a DeepSpeed JSON file")
    fsdp: bool = _opt(
        False, "shard weights, gradients and optimizer state with PyTorch FSDP2 (one process too: nothing is split)"
    )
    # the training forward (trainers/packing.py)
    logps_chunk_size: int = _opt(
        1024,
        "compute the training logps in the output head's place, this many tokens' "
        "logits at a time, so the [batch, completion, vocab] logits never exist "
        "(same values and gradients); 0 = the plain path (full logits)",
        ge=0,
    )
    padding_free: bool = _opt(
        False,
        "train on each micro-batch's rows packed into one row without padding "
        "(position_ids restart per row; needs eager, sdpa, flex or flash attention)",
    )
    disable_tqdm: bool = _opt(
        False,
        "no progress bar: plain progress lines on stderr instead, as when stderr is "
        "not a terminal (first and last step, then a step 30 s after the last line)",
    )
    # ms-swift / transformers names
    optim: str | None = _opt(
        None,
        "transformers' optimizer name: adamw_torch, adamw_torch_fused (= --optimizer adamw) or sgd (= --optimizer sgd)",
    )
    adam_epsilon: float = _opt(1e-8, "AdamW epsilon", ge=0)
    warmup_steps: float = _opt(
        0,
        "linear warm-up steps (a value below 1: a fraction of the steps, as in "
        "transformers 5); overrides --warmup_ratio when > 0",
        ge=0,
    )
    lr_scheduler_kwargs: str | None = _opt(
        None,
        "JSON object of extra arguments for the learning-rate schedule, e.g. '{\"num_cycles\": 0.5}' for cosine",
        json_object=True,
    )
    logging_first_step: bool = _opt(True, "also log the first optimizer step when --logging_steps > 1")
    save_strategy: Literal["steps", "no"] = _opt(
        "steps", "steps: a checkpoint every --save_steps; no: none (the final model is still saved)"
    )
    eval_strategy: Literal["steps", "no"] | None = _opt(
        None, "no: never evaluate; steps: every --eval_steps (which needs validation data); unset: as --save_strategy"
    )
    per_device_eval_batch_size: int = _opt(64, "prompts per engine call when evaluating", ge=1)
    eval_on_start: bool = _opt(False, "evaluate once before the first step too (a fresh run with validation data)")
    eval_on_end: bool = _opt(
        False,
        "evaluate once after the last step too; the summary then says the held-out "
        "score before (--eval_on_start) and after",
    )
    num_generations_eval: int | None = _opt(
        None,
        "evaluation also samples this many completions K per validation "
        "prompt (at --temperature/--top_p/--top_k) and logs "
        "eval/<reward>/pass@k for k = 1, 2, 4, … and K, mean@K and their "
        "intervals (docs/options.md); unset: the greedy pass alone",
        ge=1,
        le=MAX_N,
    )
    eval_pass_threshold: float = _opt(
        1.0,
        "sampled evaluation: a sample passes (for pass@k) when its reward is at "
        "least this (1.0: a correct answer of an accuracy-type reward)",
    )
    dataloader_num_workers: int | None = _opt(
        None,
        "worker processes that read the next windows' prompt rows "
        "ahead of training (0 or unset: read in the training process)",
        ge=0,
    )
    dataloader_prefetch_factor: int | None = _opt(None, "windows each worker reads ahead (default 2)", ge=1)
    dataloader_multiprocessing_context: str | None = _opt(
        None, "how the workers start: fork, spawn or forkserver (default: the platform's)"
    )
    max_nonfinite_steps: int = _opt(
        3,
        "an optimizer step whose loss or grad norm is NaN/inf is skipped (weights "
        "unchanged, warned); after this many such steps in a row the run stops",
        ge=1,
    )
