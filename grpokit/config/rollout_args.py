"""`grpokit train`'s rollout options (the RolloutArguments slice of ``TrainConfig``): sampling, the engine (in process,
vLLM colocate, a rollout server), multi-turn schedulers, structured outputs and asynchronous generation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from grpokit.config.fields import opt as _opt
from grpokit.protocol import (
    MAX_N,
    MAX_REPETITION_PENALTY,
    MAX_TEMPERATURE,
    MAX_TOKENS,
    MAX_TOP_K,
    MIN_REPETITION_PENALTY,
    MIN_TEMPERATURE,
)


@dataclass
class RolloutArguments:
    num_generations: int = _opt(
        8,
        "completions sampled per prompt (the group size G)",
        ge=2,
        le=MAX_N,
        why="GRPO compares the completions of one prompt",
    )
    max_completion_length: int = _opt(
        512,
        "max new tokens per completion (per trajectory with --completion_length_limit_scope total)",
        ge=1,
        le=MAX_TOKENS,
    )
    max_new_tokens: int | None = _opt(
        None, "ms-swift's older name for --max_completion_length (overrides it when given)", ge=1, le=MAX_TOKENS
    )
    temperature: float = _opt(
        1.0,
        "sampling temperature; training logits are divided by it too",
        ge=MIN_TEMPERATURE,
        le=MAX_TEMPERATURE,
        why="0, greedy, gives every completion of a group the same reward: no learning signal",
    )
    top_p: float = _opt(1.0, "nucleus sampling", gt=0, le=1)
    top_k: int = _opt(-1, "top-k sampling; -1 disables", ge=-1, le=MAX_TOP_K, why="-1 or 0 disables top-k")
    repetition_penalty: float = _opt(
        1.0, "repetition penalty (1 = none)", ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY
    )
    stop_words: list[str] = _opt([], "extra stop strings")
    fast_decode: bool = _opt(
        True,
        "transformers engine: sample Llama/Qwen2/Qwen3 models with grpokit's own decode "
        "loop (same distribution as HF generate, 2x faster on small models); false, or "
        "any other model, uses HF generate",
    )
    use_vllm: bool = _opt(False, "generate with vLLM (colocate: in process; server: through grpokit rollout)")
    vllm_mode: Literal["colocate", "server"] = _opt("colocate", "where rollouts run")
    vllm_server_host: list[str] = _opt([], "rollout server host(s) for --vllm_mode server")
    vllm_server_port: list[int] = _opt([8000], "rollout server port(s), one per host", ge=1, le=65535)
    vllm_server_base_url: list[str] = _opt([], "rollout server base URL(s), instead of host/port")
    vllm_server_timeout: float = _opt(240.0, "seconds to wait for a rollout server (start-up and each call)", gt=0)
    vllm_server_api_key: str | None = _opt(None, "API key for the rollout server (or GRPOKIT_API_KEY)")
    vllm_gpu_memory_utilization: float = _opt(
        0.3,
        "colocate: fraction of the GPU's memory vLLM reserves next to training (weights + KV cache; on a CPU "
        "the fraction of RAM, unless VLLM_CPU_KVCACHE_SPACE sets the KV cache in GiB)",
        gt=0,
        le=1,
    )
    vllm_max_model_len: int | None = _opt(None, "vLLM max model length", ge=1)
    vllm_tensor_parallel_size: int = _opt(1, "vLLM tensor parallel size (colocate)", ge=1)
    vllm_enable_prefix_caching: bool = _opt(True, "vLLM prefix caching")
    vllm_enforce_eager: bool = _opt(False, "vLLM: no CUDA graphs")
    vllm_max_num_seqs: int = _opt(256, "vLLM colocate: most sequences in one engine step", ge=1)
    sleep_level: int = _opt(0, "vLLM colocate: 0 keep, 1 offload weights, 2 drop weights while training", ge=0, le=2)
    # ms-swift's offload while vLLM colocate generates (distributed/offload.py); no effect with other engines
    offload_model: bool = _opt(
        False,
        "vLLM colocate: move the training (and reference) model's weights to CPU "
        "memory while vLLM generates, back before training",
    )
    offload_optimizer: bool = _opt(
        False, "vLLM colocate: move the optimizer state to CPU memory while vLLM generates, back before training"
    )
    vllm_enable_lora: bool = _opt(
        True,
        "--tuner_type lora: each weight sync sends only the LoRA adapter (and the base once); merged weights where "
        "the adapter cannot be served unmerged",
    )
    vllm_max_lora_rank: int = _opt(16, "largest LoRA rank the engine serves unmerged (above it: merged sync)", ge=1)
    weight_sync_bucket_mb: int = _opt(256, "server mode: max size of one flattened weight bucket", ge=1)
    check_weight_sync: bool = _opt(
        True,
        "after every weight sync (server mode, vLLM colocate) check that the engine holds the trainer's "
        "weights: float64 checksums of every tensor on both sides and a 4-token greedy logprob probe; a "
        "mismatch stops the run naming the bucket or tensor. Costs one more read of every weight on each "
        "side and one short generation per sync (docs/PERFORMANCE.md)",
    )
    async_generate: bool = _opt(
        False,
        "generate the next window while training on this one (one window "
        "off-policy: --max_staleness of one window's optimizer steps)",
    )
    max_staleness: int | None = _opt(
        None,
        "asynchronous training (TRL's name): windows are rolled out ahead by a background producer, and no "
        "trained token is more than this many optimizer steps older than the weights that train it; 0 is "
        "synchronous. Default: one window with --async_generate true, else 0 (docs/server_mode.md)",
        ge=0,
    )
    partial_rollouts: bool = _opt(
        False,
        "--max_staleness (server mode, or vLLM colocate): a weight update pauses the running generation, "
        "which continues on the new weights (finished tokens and logprobs kept, each token tagged by version)",
    )
    staleness_policy: Literal["wait", "drop"] = _opt(
        "wait",
        "--max_staleness: wait (the producer waits, so no window is ever too old) or drop (the producer "
        "runs one window further ahead; a window too old when its turn comes is dropped and its prompts "
        "rolled out again)",
    )
    stream_groups: bool = _opt(
        False,
        "--max_staleness: the buffer holds groups, each taken to train as soon as its num_generations "
        "completions are scored, from one producer per rollout server (docs/server_mode.md)",
    )
    multi_turn_scheduler: str | None = _opt(None, "multi-turn scheduler name from the multi_turns registry")
    max_turns: int | None = _opt(None, "max turns per trajectory", ge=1)
    gym_env: str | None = _opt(None, "environment name from the envs registry (gym_scheduler)")
    openenv_env: str | None = _opt(
        None,
        "OpenEnvScheduler: the OpenEnv environment to run in process, as "
        "module:Class (or a factory returning one); a row's env_config.env wins",
    )
    agent: str | None = _opt(
        None,
        "agent name from the agents registry (an external plugin): each episode runs "
        "its async agent(client, row) against the trainer's OpenAI-compatible endpoint "
        "(docs/agents.md)",
    )
    verifiers_env: str | None = _opt(
        None,
        "a verifiers (0.4) environment to train on, with its own tasks, "
        "harness and reward functions, served through the same endpoint as "
        "--agent: module:attr (an Env or a function returning one), a module "
        "with load_environment(), or a taskset id; --agent_concurrency and "
        "--agent_timeout bound its episodes (docs/agents_envs.md)",
    )
    agent_concurrency: int = _opt(64, "--agent: episodes run at once", ge=1, le=4096)
    agent_timeout: float = _opt(
        600.0,
        "--agent: seconds one episode may take; past it the episode ends as a "
        "counted timeout (reward 0, nothing trained)",
        gt=0,
    )
    completion_length_limit_scope: Literal["total", "per_round"] = _opt(
        "per_round", "total: max_completion_length bounds the whole trajectory; per_round: each turn"
    )
    loss_scale: Literal["default", "last_round"] = _opt(
        "default", "last_round: only the last round trains (thinking_tips_scheduler)"
    )
    # server mode (docs/server_mode.md): the multi-turn options above may be given to the trainer too; they are
    # checked against the rollout server's own at start-up (it runs the trajectories)
    vllm_server_pass_dataset: bool = _opt(
        False,
        "server mode: send each row's extra columns to the rollout server "
        "as data_dict (its scheduler or environment reads them); also on "
        "with --multi_turn_scheduler, as in ms-swift",
    )
    use_gym_env: bool | None = _opt(
        None,
        "the multi-turn scheduler's rollout_infos['total_reward'] is a reward "
        "(gym_reward); default: on when the scheduler (or the server's) says so",
    )
    structured_outputs_regex: str | None = _opt(None, "constrain completions to this regex")
    structured_outputs_json: str | None = _opt(
        None, "constrain completions to JSON valid against this schema (JSON text or a .json file)", json_object=True
    )
