"""``grpokit rollout``'s options as one checked value; torch-free, so that parsing (and --help) loads nothing."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from grpokit.errors import ConfigError
from grpokit.server.hosts import HostPolicy
from grpokit.server.media import DEFAULT_FORMATS, KNOWN_FORMATS, ImageLimits
from grpokit.wire.bodies import MAX_SYNC_TIMEOUT_S

logger = logging.getLogger(__name__)
DEFAULT_MAX_LORAS = 4  # LoRA versions a vLLM server loads at once: enough for a trainer's --max_staleness 3


@dataclass(frozen=True)
class TransportLimits:
    """Deadlines and the connection cap of the HTTP transport (server/transport.py)."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    body_idle_s: float = 10.0
    keep_alive_s: float = 5.0
    max_connections: int = 512


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
    use_gym_env: bool | None = None  # multi-turn only; None: the scheduler says whether it gives an env reward
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
    max_prefill_mb: float = 128.0  # transformers engine: attention memory of one generate call's prefill
    max_weight_bucket_mb: float = 1024.0  # largest weight-sync bucket holding several tensors
    max_sync_timeout_s: float = 300.0  # caps the timeout_s of /init_communicator/ (rendezvous, each broadcast)
    # the transport (server/transport.py) and the guard (server/guard.py, hosts.py, json_bounds.py)
    allowed_hosts: list[str] = field(default_factory=list)  # Host names beside loopback and the bound address
    max_json_items: int = 1_000_000  # JSON items (array elements, object members) of one body
    header_timeout_s: float = 10.0  # request line + headers, from the connection (or the end of keep-alive idle)
    body_timeout_s: float = 60.0  # the whole body, from the end of the headers
    body_idle_s: float = 10.0  # longest pause inside a body
    keep_alive_s: float = 5.0  # idle keep-alive connection
    max_connections: int = 0  # 0: as many as fit below the file-descriptor limit
    # images on requests (server/media.py): where paths may point, and the bounds of what a request may send
    media_root: list[str] = field(default_factory=list)
    max_images_per_request: int = 16
    max_image_mb: float = 16.0
    max_images_mb: float = 256.0
    max_image_pixels: int = 4096 * 4096
    max_images_pixels: int = 64 * 1024 * 1024  # decoded pixels of one call's distinct images (from their headers)
    image_formats: list[str] = field(default_factory=lambda: list(DEFAULT_FORMATS))
    # swift rollout's vLLM options, same names; max_model_len also bounds the transformers engine's context
    vllm_max_model_len: int | None = None
    vllm_gpu_memory_utilization: float | None = None  # None: the vLLM engine's default
    vllm_enable_prefix_caching: bool = True
    vllm_enforce_eager: bool = False  # no CUDA graphs and no torch.compile of the model
    vllm_tensor_parallel_size: int = 1
    vllm_data_parallel_size: int = 1
    vllm_enable_lora: bool | None = None  # adapter-only syncs accepted (engines/adapter_store.py); None: transformers
    vllm_max_lora_rank: int = 16
    vllm_max_loras: int | None = None  # vllm with LoRA: versions loaded at once (None: 4, for --max_staleness <= 3)
    vllm_use_async_engine: bool = False
    # swift rollout's template option: the default enable_thinking of the server's chat template (prompts that carry
    # the trainer's chat-template kwargs keep theirs); None: the template's own default
    enable_thinking: bool | None = None
    served_model_name: str | None = None  # what /v1/models lists; None: the model folder's name

    def __post_init__(self) -> None:
        if self.engine not in ("transformers", "vllm"):
            raise ConfigError(f"--engine {self.engine}: unknown engine; use transformers or vllm")
        self._check_limits()
        self._check_transport()
        self._check_image_options()
        self._check_vllm_options()
        if self.max_batch_requests < 1:
            raise ConfigError(f"--max_batch_requests {self.max_batch_requests}: must be at least 1")
        if self.max_inflight_requests < 0:
            raise ConfigError(f"--max_inflight_requests {self.max_inflight_requests}: must be 0 (auto) or more")
        if self.max_inflight_requests == 0:
            self.max_inflight_requests = 4 * self.max_batch_requests
        if self.max_body_mb <= 0:
            raise ConfigError(f"--max_body_mb {self.max_body_mb}: must be positive")
        if self.max_turns is not None and not self.multi_turn_scheduler:
            raise ConfigError(
                f"--max_turns {self.max_turns} needs --multi_turn_scheduler NAME (a single-turn server "
                "always stops after one turn)"
            )
        if self.gym_env and not self.multi_turn_scheduler:
            raise ConfigError(f"--gym_env {self.gym_env} needs --multi_turn_scheduler gym_scheduler")
        for flag in ("completion_length_limit_scope", "loss_scale", "use_gym_env"):
            if getattr(self, flag) is not None and not self.multi_turn_scheduler:
                raise ConfigError(
                    f"--{flag} {getattr(self, flag)} needs --multi_turn_scheduler NAME (it shapes "
                    "multi-turn trajectories)"
                )

    def _check_limits(self) -> None:
        if self.max_prefill_mb <= 0:
            raise ConfigError(f"--max_prefill_mb {self.max_prefill_mb}: must be positive")
        if self.max_weight_bucket_mb <= 0:
            raise ConfigError(f"--max_weight_bucket_mb {self.max_weight_bucket_mb}: must be positive")
        if not 0 < self.max_sync_timeout_s <= MAX_SYNC_TIMEOUT_S:
            raise ConfigError(f"--max_sync_timeout_s {self.max_sync_timeout_s}: must be in (0, {MAX_SYNC_TIMEOUT_S:g}]")
        if self.vllm_max_model_len is not None and self.vllm_max_model_len < 2:
            raise ConfigError(f"--vllm_max_model_len {self.vllm_max_model_len}: must be at least 2")

    def _check_transport(self) -> None:
        for flag in ("header_timeout_s", "body_timeout_s", "body_idle_s", "keep_alive_s"):
            if not 0 < getattr(self, flag) <= 3600:
                raise ConfigError(f"--{flag} {getattr(self, flag)}: must be in (0, 3600] seconds")
        if self.max_json_items < 1:
            raise ConfigError(f"--max_json_items {self.max_json_items}: must be at least 1")
        if self.max_connections < 0:
            raise ConfigError(
                f"--max_connections {self.max_connections}: must be 0 (as many as the file-descriptor "
                "limit allows) or more"
            )
        HostPolicy.for_bind(self.host, self.allowed_hosts)  # ConfigError naming a malformed --allowed_hosts value

    def transport_limits(self, max_connections: int) -> TransportLimits:
        """The transport's deadlines, with ``max_connections`` already fitted to the fd limit."""
        return TransportLimits(
            header_timeout_s=self.header_timeout_s,
            body_timeout_s=self.body_timeout_s,
            body_idle_s=self.body_idle_s,
            keep_alive_s=self.keep_alive_s,
            max_connections=max_connections,
        )

    def _check_image_options(self) -> None:
        for flag in (
            "max_images_per_request",
            "max_image_mb",
            "max_images_mb",
            "max_image_pixels",
            "max_images_pixels",
        ):
            if getattr(self, flag) <= 0:
                raise ConfigError(f"--{flag} {getattr(self, flag)}: must be positive")
        self.image_formats = [f.upper() for f in self.image_formats]
        unknown = [f for f in self.image_formats if f not in KNOWN_FORMATS]
        if unknown or not self.image_formats:
            raise ConfigError(
                f"--image_formats {' '.join(self.image_formats)}: give one or more of {' '.join(KNOWN_FORMATS)}"
            )
        for root in self.media_root:
            if not Path(root).is_dir():
                raise ConfigError(
                    f"--media_root {root}: no such directory; give a directory whose images requests may name by path"
                )

    def image_limits(self) -> ImageLimits:
        """The bounds on request images (paths resolved now, so a symlink swapped later cannot widen them)."""
        mb = 1024 * 1024
        return ImageLimits(
            max_images_per_request=self.max_images_per_request,
            max_image_bytes=int(self.max_image_mb * mb),
            max_call_image_bytes=int(self.max_images_mb * mb),
            max_image_pixels=self.max_image_pixels,
            max_call_pixels=self.max_images_pixels,
            formats=tuple(self.image_formats),
            media_roots=tuple(Path(r).resolve() for r in self.media_root),
        )

    def _check_vllm_options(self) -> None:
        """Every vLLM option is honoured or refused, never ignored."""
        later = "is not implemented yet in grpokit rollout"
        one_each = (
            "start one grpokit rollout per device and give the trainer all of them (--vllm_server_host/"
            "--vllm_server_port); it splits each batch across the servers"
        )
        if self.vllm_tensor_parallel_size != 1:
            raise ConfigError(
                f"--vllm_tensor_parallel_size {self.vllm_tensor_parallel_size}: tensor parallelism "
                f"{later} (vLLM runs in the server's process on one device); use 1"
            )
        if self.vllm_data_parallel_size != 1:
            raise ConfigError(
                f"--vllm_data_parallel_size {self.vllm_data_parallel_size}: data parallelism inside "
                f"one server {later}; {one_each}"
            )
        if self.vllm_enable_lora is None:
            self.vllm_enable_lora = self.engine == "transformers"
        if self.vllm_max_lora_rank < 1:
            raise ConfigError(f"--vllm_max_lora_rank {self.vllm_max_lora_rank}: must be at least 1")
        if self.vllm_max_loras is not None and not (self.engine == "vllm" and self.vllm_enable_lora):
            raise ConfigError(
                f"--vllm_max_loras {self.vllm_max_loras} applies to --engine vllm --vllm_enable_lora true only "
                "(the transformers engine keeps the versions the trainer asks for)"
            )
        if self.engine == "vllm" and self.vllm_enable_lora:
            self.vllm_max_loras = DEFAULT_MAX_LORAS if self.vllm_max_loras is None else self.vllm_max_loras
            if self.vllm_max_loras < 1:
                raise ConfigError(f"--vllm_max_loras {self.vllm_max_loras}: must be at least 1")
        if self.vllm_use_async_engine:  # swift rollout needs it for multi-turn; here trajectories always overlap
            logger.warning(
                "--vllm_use_async_engine true: no effect in grpokit rollout; its trajectories always run "
                "concurrently, each turn batched with the others' (what vLLM's async engine gives swift "
                "rollout)"
            )
        if self.vllm_gpu_memory_utilization is not None and not 0 < self.vllm_gpu_memory_utilization <= 1:
            raise ConfigError(f"--vllm_gpu_memory_utilization {self.vllm_gpu_memory_utilization}: must be in (0, 1]")
        if self.engine == "vllm" and self.max_prefill_mb != 128.0:
            raise ConfigError(
                f"--max_prefill_mb {self.max_prefill_mb} applies to --engine transformers only (vLLM "
                "schedules its own prefill)"
            )
        if self.engine != "vllm":
            used = [
                flag
                for flag, on in (
                    ("--vllm_gpu_memory_utilization", self.vllm_gpu_memory_utilization is not None),
                    ("--vllm_enable_prefix_caching false", not self.vllm_enable_prefix_caching),
                    ("--vllm_enforce_eager true", self.vllm_enforce_eager),
                )
                if on
            ]
            if used:
                raise ConfigError(f"{used[0]} applies to --engine vllm only; this server uses --engine {self.engine}")

    def vllm_settings(self) -> dict:
        """``VllmSettings`` fields set by the options (others keep the engine's defaults)."""
        extra = {"enable_prefix_caching": self.vllm_enable_prefix_caching, "enforce_eager": self.vllm_enforce_eager}
        if self.vllm_gpu_memory_utilization is not None:
            extra["gpu_memory_utilization"] = self.vllm_gpu_memory_utilization
        return extra

    def vllm_lora(self) -> tuple[int, int] | None:
        """(max rank, max versions loaded) vLLM starts with; None: without LoRA."""
        if self.engine != "vllm" or not self.vllm_enable_lora:
            return None
        return self.vllm_max_lora_rank, self.vllm_max_loras

    def chat_template_kwargs(self) -> dict:
        """The server's chat-template kwargs (under those a prompt carries from the trainer)."""
        return {} if self.enable_thinking is None else {"enable_thinking": self.enable_thinking}

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * 1024 * 1024)
