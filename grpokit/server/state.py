"""What a rollout server holds: its options, engine, scheduler, weight receiver and request counters."""

from __future__ import annotations

from dataclasses import dataclass, field

from grpokit.errors import ConfigError


@dataclass
class ServerOptions:
    """``grpokit rollout`` options (see ``grpokit.server.cli``)."""

    model: str
    host: str = "127.0.0.1"
    port: int = 8000
    engine: str = "transformers"
    multi_turn_scheduler: str | None = None
    max_turns: int | None = None
    gym_env: str | None = None
    completion_length_limit_scope: str | None = None  # multi-turn only; None: the scheduler's default
    loss_scale: str | None = None  # multi-turn only; None: the scheduler's default
    external_plugins: list[str] = field(default_factory=list)
    api_key: str | None = None
    insecure: bool = False
    max_batch_requests: int = 4096
    max_inflight_requests: int = 0  # 0: 4 x max_batch_requests
    max_body_mb: float = 64.0
    torch_dtype: str = "auto"
    max_batch_size: int = 256
    fast_decode: bool = True  # transformers engine: grpokit's decode loop where the model allows it

    def __post_init__(self) -> None:
        if self.engine not in ("transformers", "vllm"):
            raise ConfigError(f"--engine {self.engine}: unknown engine; use transformers or vllm")
        if self.max_batch_requests < 1:
            raise ConfigError(f"--max_batch_requests {self.max_batch_requests}: must be at least 1")
        if self.max_inflight_requests < 0:
            raise ConfigError(f"--max_inflight_requests {self.max_inflight_requests}: must be 0 (auto) or more")
        if self.max_inflight_requests == 0:
            self.max_inflight_requests = 4 * self.max_batch_requests
        if self.max_body_mb <= 0:
            raise ConfigError(f"--max_body_mb {self.max_body_mb}: must be positive")
        if self.max_turns is not None and not self.multi_turn_scheduler:
            raise ConfigError(f"--max_turns {self.max_turns} needs --multi_turn_scheduler NAME (a single-turn server "
                              "always stops after one turn)")
        if self.gym_env and not self.multi_turn_scheduler:
            raise ConfigError(f"--gym_env {self.gym_env} needs --multi_turn_scheduler gym_scheduler")
        for flag in ("completion_length_limit_scope", "loss_scale"):
            if getattr(self, flag) is not None and not self.multi_turn_scheduler:
                raise ConfigError(f"--{flag} {getattr(self, flag)} needs --multi_turn_scheduler NAME (it shapes "
                                  "multi-turn trajectories)")

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * 1024 * 1024)


class ServerState:
    """The live objects behind the HTTP endpoints."""

    def __init__(self, options: ServerOptions, engine, scheduler) -> None:
        from grpokit.server.weight_sync import WeightReceiver

        self.options = options
        self.engine = engine
        self.scheduler = scheduler
        self.receiver = WeightReceiver()
        self.inflight = 0  # requests inside /infer/ now (the event loop is the only writer)
        self.weight_version = 0  # number of completed weight updates

    def engine_info(self) -> dict:
        o = self.options
        info = {
            "engine_type": self.engine.engine_type,
            "model": o.model,
            "enable_multi_turn": bool(o.multi_turn_scheduler),
            "multi_turn_scheduler": o.multi_turn_scheduler,
            "max_turns": o.max_turns,
            "use_gym_env": bool(o.gym_env),
            "uses_env_reward": bool(getattr(self.scheduler, "uses_env_reward", False)),
            "gym_env": o.gym_env,
            "completion_length_limit_scope": getattr(self.scheduler, "completion_length_limit_scope", None),
            "loss_scale": getattr(self.scheduler, "loss_scale", None),
            "max_batch_requests": o.max_batch_requests,
            "weight_version": self.weight_version,
            "communicator": self.receiver.is_open,
            "inflight_requests": self.inflight,  # load now; tests wait on it to act while a batch is served
        }
        if hasattr(self.engine, "info"):
            info.update(self.engine.info())
        return info


def build_scheduler(options: ServerOptions, engine):
    """The server's scheduler: ``RolloutScheduler`` (single turn) or the named multi-turn one."""
    from grpokit.rollout.scheduler import RolloutScheduler

    if not options.multi_turn_scheduler:
        return RolloutScheduler(engine)
    from grpokit.config.args import RolloutArguments
    from grpokit.rollout.multi_turn import build_scheduler as build_multi_turn

    extra = {k: getattr(options, k) for k in ("completion_length_limit_scope", "loss_scale")
             if getattr(options, k) is not None}
    args = RolloutArguments(multi_turn_scheduler=options.multi_turn_scheduler, max_turns=options.max_turns,
                            gym_env=options.gym_env, **extra)
    scheduler = build_multi_turn(args, engine.tokenizer)
    if getattr(scheduler, "infer_engine", None) is None:
        scheduler.infer_engine = engine
    return scheduler


def build_state(options: ServerOptions) -> ServerState:
    """Plugins first (they may register schedulers and environments), then the engine and the scheduler."""
    from pathlib import Path

    from grpokit.plugins.loader import load_plugins
    from grpokit.server.engine import build_served_engine

    if not Path(options.model).is_dir():
        raise ConfigError(f"--model {options.model}: no such folder (grpokit rollout serves a local Hugging Face "
                          "model folder)")
    load_plugins(options.external_plugins)
    engine = build_served_engine(options.engine, options.model, options.torch_dtype, options.max_batch_size,
                                 options.fast_decode)
    return ServerState(options, engine, build_scheduler(options, engine))
