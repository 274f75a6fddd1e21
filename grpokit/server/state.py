"""What a rollout server holds: its options, engine, scheduler, weight receiver and request counters."""

from __future__ import annotations

from pathlib import Path

import torch

from grpokit.config.args import RolloutArguments
from grpokit.errors import ConfigError
from grpokit.modeling import load_causal_lm, load_tokenizer, torch_dtype
from grpokit.plugins.loader import load_plugins
from grpokit.rollout.multi_turn import build_scheduler as build_multi_turn
from grpokit.rollout.scheduler import RolloutScheduler
from grpokit.server.engine import ServedTransformersEngine
from grpokit.server.options import ServerOptions
from grpokit.server.vllm_served import ServedVllmEngine
from grpokit.server.weight_sync import WeightReceiver
from grpokit.template.encode import ChatTemplate
from grpokit.template.processor import is_vlm_folder, load_processor, make_template


class ServerState:
    """The live objects behind the HTTP endpoints."""

    def __init__(self, options: ServerOptions, engine, scheduler) -> None:
        self.options = options
        self.engine = engine
        self.scheduler = scheduler
        self.receiver = WeightReceiver(max_timeout_s=options.max_sync_timeout_s)
        self.image_limits = options.image_limits()
        self.inflight = 0  # requests inside /infer/ now (the event loop is the only writer)
        self.weight_version = 0  # number of completed weight updates

    @property
    def multimodal(self) -> bool:
        """The served model takes images (its template is the processor's)."""
        return bool(getattr(getattr(self.engine, "template", None), "multimodal", False))

    def engine_info(self) -> dict:
        o = self.options
        info = {
            "engine_type": self.engine.engine_type,
            "model": o.model,
            "enable_multi_turn": bool(o.multi_turn_scheduler),
            "multi_turn_scheduler": o.multi_turn_scheduler,
            "max_turns": getattr(self.scheduler, "max_turns", None) if o.multi_turn_scheduler else None,
            "use_gym_env": bool(o.gym_env),
            "uses_env_reward": bool(getattr(self.scheduler, "uses_env_reward", False)),
            "gym_env": o.gym_env,
            "enable_thinking": o.enable_thinking,
            "completion_length_limit_scope": getattr(self.scheduler, "completion_length_limit_scope", None),
            "loss_scale": getattr(self.scheduler, "loss_scale", None),
            "max_batch_requests": o.max_batch_requests,
            "max_body_mb": o.max_body_mb,
            "max_inflight_requests": o.max_inflight_requests,
            "max_weight_bucket_mb": o.max_weight_bucket_mb,
            "max_sync_timeout_s": o.max_sync_timeout_s,
            "weight_version": self.weight_version,
            "partial_rollouts": hasattr(self.engine, "pause_for_update"),  # an update can pause and resume sampling
            "communicator": self.receiver.is_open,
            "inflight_requests": self.inflight,  # load now; tests wait on it to act while a batch is served
            "multimodal": self.multimodal,
            "max_images_per_request": o.max_images_per_request,
            "max_image_mb": o.max_image_mb,
            "media_root": bool(o.media_root),
        }
        if hasattr(self.engine, "info"):
            info.update(self.engine.info())
        return info


def build_served_engine(
    engine: str,
    model_path: str,
    torch_dtype_name: str,
    max_batch_size: int = 256,
    fast_decode: bool = True,
    max_model_len: int | None = None,
    vllm: dict | None = None,
    max_prefill_mb: float = 128.0,
    vllm_lora: tuple[int, int] | None = None,
):
    """Load ``model_path`` and wrap it in the engine named ``engine`` (``fast_decode``, ``max_prefill_mb``:
    transformers only; ``vllm``: further ``VllmSettings`` fields; ``vllm_lora``: vLLM's LoRA rank and versions)."""
    if engine == "vllm":  # vLLM in this process; weights from the sync group are loaded into it in place
        return ServedVllmEngine.build(
            model_path, torch_dtype_name, max_batch_size, max_model_len, vllm or {}, lora=vllm_lora
        )
    if engine != "transformers":
        raise ConfigError(f"--engine {engine}: unknown engine; use transformers or vllm")
    tokenizer = load_tokenizer(model_path)
    dtype = torch_dtype(torch_dtype_name, for_training_weights=False)
    vlm = is_vlm_folder(model_path)
    model = load_served_vlm(model_path, dtype) if vlm else load_causal_lm(model_path, dtype)
    if torch.cuda.is_available():
        model = model.to("cuda")
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    # a vision-language model: its processor is the template, loaded as the trainer loads it (same prompt ids)
    template = make_template(load_processor(model_path, tokenizer)) if vlm else ChatTemplate(tokenizer)
    return ServedTransformersEngine(
        model,
        template,
        max_batch_size=max_batch_size,
        max_model_len=max_model_len,
        max_prefill_mb=max_prefill_mb,
        fast_decode=fast_decode,
    )


def load_served_vlm(model_path: str, dtype):
    """A vision-language model as the trainer loads one (``AutoModelForImageTextToText``), so that its parameter
    names are the trainer's and weight sync maps one to one."""
    from transformers import AutoModelForImageTextToText  # not at the top: text-only servers never need it

    try:
        return AutoModelForImageTextToText.from_pretrained(model_path, dtype=dtype)
    except (OSError, ValueError, ImportError) as e:
        raise ConfigError(
            f"--model {model_path}: cannot load as a vision-language model ({str(e).splitlines()[0]})"
        ) from e


def build_scheduler(options: ServerOptions, engine):
    """The server's scheduler: ``RolloutScheduler`` (single turn) or the named multi-turn one."""
    if not options.multi_turn_scheduler:
        return RolloutScheduler(engine)
    extra = {
        k: getattr(options, k)
        for k in ("completion_length_limit_scope", "loss_scale")
        if getattr(options, k) is not None
    }
    args = RolloutArguments(
        multi_turn_scheduler=options.multi_turn_scheduler, max_turns=options.max_turns, gym_env=options.gym_env, **extra
    )
    # use_gym_env: explicit, as in swift rollout: total_reward is (not) the reward
    return build_multi_turn(
        args, engine.tokenizer, infer_engine=engine, template=engine.template, uses_env_reward=options.use_gym_env
    )


def build_state(options: ServerOptions) -> ServerState:
    """Plugins first (they may register schedulers and environments), then the engine and the scheduler."""
    if not Path(options.model).is_dir():
        raise ConfigError(
            f"--model {options.model}: no such folder (grpokit rollout serves a local Hugging Face model folder)"
        )
    load_plugins(options.external_plugins)
    engine = build_served_engine(
        options.engine,
        options.model,
        options.torch_dtype,
        options.max_batch_size,
        options.fast_decode,
        options.vllm_max_model_len,
        options.vllm_settings(),
        options.max_prefill_mb,
        options.vllm_lora(),
    )
    engine.template.chat_template_kwargs.update(options.chat_template_kwargs())  # --enable_thinking
    if options.vllm_enable_lora and hasattr(engine, "serve_adapters"):  # adapter-only weight syncs accepted
        engine.serve_adapters(options.vllm_max_lora_rank)
    return ServerState(options, engine, build_scheduler(options, engine))
