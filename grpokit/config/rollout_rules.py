"""The rules between the rollout options: server mode, multi-turn, vLLM colocate and asynchronous generation.

``validate`` runs ``check_rollout_modes`` between the data options and the rewards; each refusal is one line naming
the options that clash and what to use instead.
"""

from __future__ import annotations

from grpokit.config.args import TrainConfig
from grpokit.config.async_rules import async_option, check_partial_rollouts
from grpokit.errors import ConfigError


def check_rollout_modes(cfg: TrainConfig) -> None:
    """Server mode, multi-turn, vLLM colocate and async generation: combinations that cannot work."""
    r = cfg.rollout
    server = r.vllm_mode == "server"
    check_partial_rollouts(r, server)
    # server mode: the server runs the trajectories; the trainer's multi-turn options are checked against the
    # server's at start-up (grpokit.rollout.remote.check_server_rollout), as ms-swift takes them on either side
    used = [
        f
        for f, on in (
            ("--gym_env", r.gym_env),
            ("--openenv_env", r.openenv_env),
            ("--loss_scale", r.loss_scale != "default"),
            ("--max_turns", r.max_turns),
            ("--use_gym_env", r.use_gym_env is not None),
        )
        if on
    ]
    if not server and r.multi_turn_scheduler is None and used:
        raise ConfigError(
            f"{used[0]} acts on multi-turn rollouts; add --multi_turn_scheduler NAME (e.g. "
            "gym_scheduler, thinking_tips_scheduler)"
        )
    if r.openenv_env and server:
        raise ConfigError(
            f"--openenv_env {r.openenv_env}: in server mode the rollout server's scheduler makes the "
            "environments; name it in each row's env_config.env (module:Class) instead"
        )
    if r.vllm_server_pass_dataset and not server:
        raise ConfigError(
            "--vllm_server_pass_dataset true sends the rows' columns to a rollout server; it needs "
            "--vllm_mode server (in colocate mode the scheduler reads them anyway)"
        )
    if server and not (r.vllm_server_host or r.vllm_server_base_url):
        raise ConfigError(
            "--vllm_mode server needs --vllm_server_host H --vllm_server_port P (or --vllm_server_base_url URL)"
        )
    if r.vllm_server_host and len(r.vllm_server_port) not in (1, len(r.vllm_server_host)):
        raise ConfigError(
            f"{len(r.vllm_server_host)} --vllm_server_host value(s) but {len(r.vllm_server_port)} "
            "--vllm_server_port value(s); give one port, or one per host"
        )
    if r.async_generate and not (server or r.use_vllm):
        raise ConfigError(
            f"{async_option(r)} needs an engine with its own copy of the weights (--vllm_mode "
            "server, or --use_vllm true): the in-process transformers engine samples from the "
            "live training weights, which change while the next window would be generating"
        )
    if r.use_vllm and not server:
        _check_vllm_colocate(cfg)


def _check_vllm_colocate(cfg: TrainConfig) -> None:
    r = cfg.rollout
    if r.sleep_level == 2 and cfg.training.eval_steps:
        raise ConfigError(
            f"--sleep_level 2 with --eval_steps {cfg.training.eval_steps}: evaluation runs between "
            "an optimizer step and the weight sync, when sleep level 2 has dropped vLLM's weights; "
            "use --sleep_level 1"
        )
    if r.sleep_level and r.async_generate:
        raise ConfigError(
            f"--sleep_level {r.sleep_level} with {async_option(r)}: the engine cannot sleep "
            "while it generates the next window during training; use --sleep_level 0"
        )
    offload = [f"--{n} true" for n in ("offload_model", "offload_optimizer") if getattr(r, n)]
    if offload and r.async_generate:
        raise ConfigError(
            f"{offload[0]} with {async_option(r)}: the next window generates while this one "
            "trains, so the training model cannot wait in CPU memory; drop one of the two"
        )
    sharded = "--deepspeed" if cfg.training.deepspeed else "--fsdp" if cfg.training.fsdp else None
    if offload and sharded:
        instead = (
            "--deepspeed zero3_offload (DeepSpeed keeps the partitions and optimizer state in CPU memory)"
            if sharded == "--deepspeed"
            else "plain DDP (drop --fsdp), or --deepspeed zero3_offload"
        )
        raise ConfigError(
            f"{offload[0]} with {sharded} and vLLM colocate is not implemented (those engines "
            f"partition the weights and optimizer state themselves); drop it and use {instead}"
        )
