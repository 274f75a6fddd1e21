"""`grpokit rollout`'s flags: the argparse parser, one group of options per function, in the order --help lists them.

``server/cli.py`` reads and checks what it parses (``options_from_argv``) and starts the server.
"""

from __future__ import annotations

import argparse

from grpokit.config.help import unknown_option_line
from grpokit.errors import ConfigError
from grpokit.server.media import DEFAULT_FORMATS


def rollout_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="grpokit rollout",
        allow_abbrev=False,  # `--por 8001` is a typo named below, not --port
        description="Serve rollouts (single- or multi-turn) to a trainer started with --vllm_mode server; "
        "receives new weights after each optimizer step. See docs/server_mode.md.",
    )
    p.add_argument("--model", required=True, help="local Hugging Face model folder to serve")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--engine",
        default=None,
        choices=["transformers", "vllm"],
        help="inference backend: transformers (any device) or vllm (needs vllm installed; "
        "docs/vllm.md); default vllm when it is installed, as swift rollout, else transformers",
    )
    p.add_argument("--torch_dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    _add_trajectory_options(p)
    p.add_argument("--external_plugins", nargs="*", default=[], help="python files imported before any lookup")
    _add_access_and_limits(p)
    _add_transport_options(p)
    _add_image_options(p)
    _add_vllm_options(p)

    def error(message: str) -> None:
        line = unknown_option_line(message, [s for a in p._actions for s in a.option_strings], "grpokit rollout")
        raise ConfigError(line or f"grpokit rollout: {message} (see `grpokit rollout --help`)")

    p.error = error
    return p


def _add_trajectory_options(p: argparse.ArgumentParser) -> None:
    """What the server rolls out (multi-turn schedulers, the chat template's switches) and the name it serves under."""
    p.add_argument("--multi_turn_scheduler", default=None, help="multi-turn scheduler name (multi_turns registry)")
    p.add_argument("--max_turns", type=int, default=None, help="max turns per trajectory (multi-turn only)")
    p.add_argument("--gym_env", default=None, help="environment name (envs registry) for gym_scheduler")
    p.add_argument(
        "--served_model_name",
        default=None,
        help="the name /v1/models lists (the OpenAI-compatible endpoint, docs/agents.md; any model= of "
        "a call is served alike); default: the model folder's name",
    )
    p.add_argument(
        "--completion_length_limit_scope",
        default=None,
        choices=["total", "per_round"],
        help="multi-turn: max_tokens bounds the whole trajectory (total) or each turn (per_round)",
    )
    p.add_argument(
        "--loss_scale",
        default=None,
        choices=["default", "last_round"],
        help="multi-turn: last_round trains on the last round only",
    )
    p.add_argument(
        "--use_gym_env",
        type=str.lower,
        default=None,
        choices=["true", "false"],
        help="multi-turn: the scheduler's rollout_infos['total_reward'] is the trainer's gym_reward "
        "(default: the scheduler decides; gym_scheduler gives one)",
    )
    p.add_argument(
        "--enable_thinking",
        type=str.lower,
        default=None,
        choices=["true", "false"],
        help="passed to the chat template as enable_thinking (Qwen3 and other hybrid-thinking templates) "
        "for the prompts this server renders; a trainer's own --enable_thinking travels with its "
        "prompts and wins; the trainer must render the same (checked at its start-up)",
    )


def _add_access_and_limits(p: argparse.ArgumentParser) -> None:
    """Who may call (the API key) and the bounds on what a call may ask: batch, body, prefill, weight sync."""
    p.add_argument(
        "--api_key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every request (default: env GRPOKIT_API_KEY)",
    )
    p.add_argument("--insecure", action="store_true", help="allow binding a non-loopback address without an API key")
    p.add_argument("--max_batch_requests", type=int, default=4096, help="most requests in one /infer/ call (more: 413)")
    p.add_argument(
        "--max_inflight_requests",
        type=int,
        default=0,
        help="most requests in flight over all calls (more: 429, the client retries); 0 = 4x the above",
    )
    p.add_argument("--max_body_mb", type=float, default=64.0, help="largest request body (more: 413)")
    p.add_argument("--max_batch_size", type=int, default=256, help="sequences per generate() call (vllm: max_num_seqs)")
    p.add_argument(
        "--fast_decode",
        type=str.lower,
        default="true",
        choices=["true", "false"],
        help="transformers engine: grpokit's decode loop for Llama/Qwen2/Qwen3 (false: HF generate)",
    )
    p.add_argument(
        "--max_prefill_mb",
        type=float,
        default=128.0,
        help="transformers engine: a batch is split so that one call's prefill attention (CPU: a float32 "
        "score per head per prompt-token pair) stays below this",
    )
    p.add_argument(
        "--max_weight_bucket_mb",
        type=float,
        default=1024.0,
        help="largest weight-sync bucket of several tensors the trainer may announce (more: 422)",
    )
    p.add_argument(
        "--max_sync_timeout_s",
        type=float,
        default=300.0,
        help="caps the timeout a trainer asks for the weight-sync rendezvous and each broadcast",
    )


def _add_transport_options(p: argparse.ArgumentParser) -> None:
    """Connections and what the guard lets through (docs/server_mode.md, "Security" and "Deadlines")."""
    p.add_argument(
        "--allowed_hosts",
        nargs="*",
        default=[],
        help="further names a request's Host (and Origin) may give, beside loopback names and the --host "
        "address (others: 421; '*': any, e.g. behind a proxy that checks them)",
    )
    p.add_argument(
        "--max_json_items",
        type=int,
        default=1_000_000,
        help="most JSON items (array elements and object members) in one body, counted before parsing (more: 413)",
    )
    p.add_argument(
        "--header_timeout_s",
        type=float,
        default=10.0,
        help="the request line and headers must arrive within this, from the connection (else 408)",
    )
    p.add_argument(
        "--body_timeout_s",
        type=float,
        default=60.0,
        help="a request's whole body must arrive within this, from its headers (else 408)",
    )
    p.add_argument("--body_idle_s", type=float, default=10.0, help="longest pause inside a request body (else 408)")
    p.add_argument("--keep_alive_s", type=float, default=5.0, help="an idle keep-alive connection is closed after this")
    p.add_argument(
        "--max_connections",
        type=int,
        default=0,
        help="most open connections (0: as many as fit below the file-descriptor limit); one more closes "
        "the one waiting longest without a complete request",
    )


def _add_image_options(p: argparse.ArgumentParser) -> None:
    """Images on requests (vision-language models; docs/server_mode.md, "Images")."""
    p.add_argument(
        "--media_root",
        nargs="*",
        default=[],
        help="directories under which a request may name images by path (default: none; images come as base64)",
    )
    p.add_argument("--max_images_per_request", type=int, default=16, help="most images on one request (more: 413)")
    p.add_argument("--max_image_mb", type=float, default=16.0, help="largest encoded image (more: 413)")
    p.add_argument(
        "--max_images_mb",
        type=float,
        default=256.0,
        help="encoded bytes of the distinct images of one /infer/ call (more: 413)",
    )
    p.add_argument(
        "--max_image_pixels",
        type=int,
        default=4096 * 4096,
        help="most pixels of one image, read from its header before decoding (more: 413)",
    )
    p.add_argument(
        "--max_images_pixels",
        type=int,
        default=64 * 1024 * 1024,
        help="decoded pixels of the distinct images of one /infer/ call, read from their headers before "
        "any is decoded (more: 413)",
    )
    p.add_argument(
        "--image_formats", nargs="+", default=list(DEFAULT_FORMATS), help="image formats accepted (others: 415)"
    )


def _add_vllm_options(p: argparse.ArgumentParser) -> None:
    """``swift rollout``'s vLLM options, under the same names."""
    flag = dict(type=str.lower, choices=["true", "false"])
    p.add_argument(
        "--vllm_max_model_len",
        type=int,
        default=None,
        help="longest prompt + max_tokens served (default: the model's); applies to both engines",
    )
    p.add_argument(
        "--vllm_gpu_memory_utilization",
        type=float,
        default=None,
        help="vllm: fraction of the accelerator's memory vLLM may take (default: the engine's)",
    )
    p.add_argument("--vllm_enable_prefix_caching", default="true", **flag, help="vllm: reuse cached prefixes")
    p.add_argument(
        "--vllm_enforce_eager",
        default="false",
        **flag,
        help="vllm: no CUDA graphs, no torch.compile of the model (a faster start, slower decoding)",
    )
    p.add_argument("--vllm_tensor_parallel_size", type=int, default=1, help="vllm: only 1 (not implemented yet)")
    p.add_argument(
        "--vllm_data_parallel_size",
        type=int,
        default=1,
        help="vllm: only 1 (not implemented yet; start one server per device)",
    )
    p.add_argument(
        "--vllm_enable_lora",
        default=None,
        **flag,
        help="accept adapter-only weight syncs (LoRA served unmerged, one version per sync); default: "
        "true with --engine transformers, false with vllm",
    )
    p.add_argument("--vllm_max_lora_rank", type=int, default=16, help="largest LoRA rank served unmerged")
    p.add_argument(
        "--vllm_max_loras",
        type=int,
        default=None,
        help="vllm with --vllm_enable_lora true: LoRA versions loaded at once (default 4: a trainer's "
        "--max_staleness up to 3); an update asking to keep more is refused",
    )
    p.add_argument(
        "--vllm_use_async_engine",
        default="false",
        **flag,
        help="accepted for swift rollout's multi-turn commands; no effect (trajectories always overlap)",
    )
