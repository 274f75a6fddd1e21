"""TRL's ``GRPOConfig``: TRL 1.16's fields with TRL's defaults and meanings, turned into grpokit's options.

``fields.py`` decides each field (passed on, renamed, converted, inert, or refused with the reason). grpokit's own
options are accepted beside them (``GRPOConfig(..., save_final_model=False)``); a name in neither stops with one
line. The values are then checked by the same gate as ``grpokit train``'s flags (``config/checked.py``).

Where TRL's defaults differ from ``grpokit train``'s (docs/porting.md lists them): beta 0.0, loss_type dapo,
num_train_epochs 3, logging_steps 10, gradient_checkpointing on, bf16 unless fp16 (the dtype), logging_first_step
off, full fine-tuning unless ``peft_config`` is given, and with vLLM the importance-sampling correction on.
"""

from __future__ import annotations

import difflib
import functools
import json
from typing import Any

from grpokit.config.args import ALL_GROUPS
from grpokit.errors import ConfigError
from grpokit.trl.fields import REFUSED, RENAMED, SAME, TRL_DEFAULTS, decided

DEFAULT_OUTPUT_DIR = "trainer_output"  # transformers' default output_dir
_NEEDS_VALUE = {"max_completion_length", "num_generations", "learning_rate"}  # TRL's None here has no grpokit form


@functools.cache
def grpokit_options() -> frozenset[str]:
    return frozenset(f for group in ALL_GROUPS for f in group.__dataclass_fields__)


@functools.cache
def trl_defaults() -> dict[str, Any]:
    """Every field's default: TRL's GRPOConfig's own, else transformers' TrainingArguments'."""
    import dataclasses

    from transformers import TrainingArguments  # not at the top: a heavy import, needed once a config is made

    out = {}
    for f in dataclasses.fields(TrainingArguments):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    out.update(TRL_DEFAULTS)
    for name in decided():
        out.setdefault(name, None)
    return out


class GRPOConfig:
    """``GRPOConfig(output_dir=..., **fields)`` as in TRL; read and set fields as attributes. ``flags()`` gives the
    grpokit options (TRL's defaults included) for a run."""

    def __init__(self, output_dir: str | None = None, **fields: Any) -> None:
        known = decided() | grpokit_options()
        for name in fields:
            if name not in known:
                close = difflib.get_close_matches(name, sorted(known), n=1)
                hint = f"; did you mean {close[0]}?" if close else ""
                raise ConfigError(
                    f"GRPOConfig({name}=...): no such field in TRL's GRPOConfig or grpokit's options{hint}"
                )
        self.__dict__.update(trl_defaults())
        self.__dict__.update(fields)
        self.extra = {k: v for k, v in fields.items() if k not in decided()}  # grpokit's own options
        self.output_dir = output_dir or DEFAULT_OUTPUT_DIR
        # TRL's __post_init__: bf16 unless fp16; scale_rewards True/False; the deprecated IS cap
        if self.bf16 is None:
            self.bf16 = not self.fp16
        self.scale_rewards = {True: "group", False: "none"}.get(self.scale_rewards, self.scale_rewards)
        if self.vllm_importance_sampling_cap is not None:
            self.vllm_importance_sampling_clip_max = self.vllm_importance_sampling_cap
        if self.auto_find_batch_size:
            why = REFUSED["auto_find_batch_size"]
            raise ConfigError(f"GRPOConfig(auto_find_batch_size=True): not supported; {why}")

    def __repr__(self) -> str:
        return f"GRPOConfig(output_dir={self.output_dir!r}, ...)"

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "extra"}

    def reward_model_dtype(self) -> str:
        """TRL loads reward models with model_init_kwargs: its dtype, else float32."""
        kwargs = self.model_init_kwargs
        kwargs = json.loads(kwargs) if isinstance(kwargs, str) else dict(kwargs or {})
        dtype = kwargs.get("dtype") or kwargs.get("torch_dtype")
        return str(dtype).removeprefix("torch.") if dtype else "float32"

    def flags(self, lora: bool = False) -> list[str]:
        """grpokit's command-line options for these fields. ``lora``: a peft_config is given (TRL trains the full
        model unless one is)."""
        out: list[str] = []
        defaults = trl_defaults()
        for name in sorted(decided()):
            value = getattr(self, name)
            if name in SAME or name in RENAMED:
                option = RENAMED.get(name, name)
                if value is None:
                    if name in _NEEDS_VALUE:
                        raise ConfigError(f"GRPOConfig({name}=None): give a number")
                    continue
                out += _flag(option, value)
            elif name in REFUSED and not _same(value, defaults[name]):
                raise ConfigError(f"GRPOConfig({name}={value!r}): not supported by grpokit; {REFUSED[name]}")
        out += self._converted()
        if "tuner_type" not in self.extra:  # TRL: full fine-tuning unless peft_config wraps the model
            out += ["--tuner_type", "lora" if lora else "full"]
        for name, value in self.extra.items():
            if value is not None:
                out += _flag(name, value)
        return out

    def _converted(self) -> list[str]:  # long on purpose: one entry per converted field, in fields.py's order
        out = _dtype_flags(self.model_init_kwargs, self.bf16, self.fp16, self.extra)
        out += ["--scale_rewards", str(self.scale_rewards)]
        for name in ("logging_steps", "save_steps", "eval_steps"):
            value = getattr(self, name)
            if value is not None:
                out += [f"--{name}", str(_whole_steps(name, value))]
        for name, allowed in (
            ("eval_strategy", ("no", "steps")),
            ("save_strategy", ("no", "steps")),
            ("logging_strategy", ("steps",)),
        ):
            value = str(getattr(getattr(self, name), "value", getattr(self, name)))
            if value not in allowed:
                raise ConfigError(
                    f"GRPOConfig({name}={value!r}): not supported by grpokit; use "
                    f"{' or '.join(repr(a) for a in allowed)}"
                )
            if name != "logging_strategy":
                out += [f"--{name}", value]
        reports = [self.report_to] if isinstance(self.report_to, str) else list(self.report_to or ["none"])
        out += ["--report_to", *reports]
        tracking = reports not in (["none"], [])
        tables = bool({"wandb", "trackio", "all"} & set(reports))  # where TRL logs its completions table
        for name, off, why in (
            (
                "num_completions_to_print",
                not self.log_completions,
                "a console table of completions is not printed; log_completions writes them to completions.jsonl",
            ),
            ("log_unique_prompts", not tables, "completions tables are not sent to trackers"),
            ("log_multimodal", not tables, "completions tables are not sent to trackers"),
        ):
            if not off and not _same(getattr(self, name), trl_defaults()[name]):
                raise ConfigError(f"GRPOConfig({name}={getattr(self, name)!r}): not supported by grpokit; {why}")
        for name in ("run_name", "project"):
            if tracking and not _same(getattr(self, name), trl_defaults()[name]):
                raise ConfigError(
                    f"GRPOConfig({name}=...): naming the tracker's run is not supported by grpokit; "
                    "set the tracker's own variable (WANDB_NAME, WANDB_PROJECT, ...)"
                )
        if self.vllm_mode == "server":
            if self.vllm_server_base_url:
                out += ["--vllm_server_base_url", str(self.vllm_server_base_url)]
            else:
                out += [
                    "--vllm_server_host",
                    str(self.vllm_server_host),
                    "--vllm_server_port",
                    str(self.vllm_server_port),
                ]
        if self.vllm_enable_sleep_mode:
            out += ["--sleep_level", "2"]  # TRL's vLLM sleeps at level 2 between generations
        out += self._importance_sampling()
        if isinstance(self.deepspeed, dict):
            raise ConfigError(
                "GRPOConfig(deepspeed={...}): give a DeepSpeed JSON file path or a preset name "
                "(zero0 ... zero3_offload)"
            )
        if self.deepspeed:
            out += ["--deepspeed", str(self.deepspeed)]
        if self.fsdp is True:
            out += ["--fsdp", "true"]
        elif self.fsdp not in (None, False, "", []):
            raise ConfigError(
                f"GRPOConfig(fsdp={self.fsdp!r}): grpokit's FSDP2 takes fsdp=True (each decoder "
                "layer wrapped, full sharding); TRL's option strings are not supported"
            )
        if self.beta != 0 and self.use_bias_correction_kl:
            out += ["--kl_bias_correction", "true"]
        return out + _generation_flags(self.generation_kwargs)

    def _importance_sampling(self) -> list[str]:
        """TRL corrects vLLM's sampling mismatch by default (vllm_importance_sampling_correction); only with vLLM."""
        if not (self.use_vllm and self.vllm_importance_sampling_correction):
            return []
        if self.vllm_importance_sampling_clip_max is None:
            raise ConfigError(
                "GRPOConfig(vllm_importance_sampling_clip_max=None): a bound below is not implemented; "
                "give the upper bound C (TRL's default 3.0) or vllm_importance_sampling_correction=False"
            )
        return [
            "--rollout_importance_sampling_mode",
            str(self.vllm_importance_sampling_mode),
            "--rollout_importance_sampling_threshold",
            str(self.vllm_importance_sampling_clip_max),
        ]


def _dtype_flags(model_init_kwargs: Any, bf16: bool, fp16: bool, extra: dict) -> list[str]:
    """The dtype: model_init_kwargs' dtype, else bf16/fp16 (grpokit keeps float32 master weights under both, as
    TRL's mixed precision does), else float32 (TRL's default load dtype); attn_implementation and
    trust_remote_code from model_init_kwargs."""
    kwargs = json.loads(model_init_kwargs) if isinstance(model_init_kwargs, str) else dict(model_init_kwargs or {})
    out = []
    dtype = kwargs.pop("dtype", None) or kwargs.pop("torch_dtype", None)
    if "torch_dtype" not in extra:
        mixed = "float16" if fp16 else "bfloat16" if bf16 else "float32"
        out += ["--torch_dtype", str(dtype).removeprefix("torch.") if dtype else mixed]
    if "attn_implementation" in kwargs:
        out += ["--attn_impl", str(kwargs.pop("attn_implementation"))]
    if "trust_remote_code" in kwargs:
        out += ["--trust_remote_code", "true" if kwargs.pop("trust_remote_code") else "false"]
    if kwargs:
        raise ConfigError(
            f"GRPOConfig(model_init_kwargs={{{next(iter(kwargs))!r}: ...}}): not supported by grpokit; "
            "it takes dtype, torch_dtype, attn_implementation and trust_remote_code"
        )
    return out


_SAMPLING = ("temperature", "top_p", "top_k", "repetition_penalty")


def _generation_flags(kwargs: Any) -> list[str]:
    """TRL's generation_kwargs override the sampling fields of the same name; other keys are refused by name."""
    kwargs = json.loads(kwargs) if isinstance(kwargs, str) else dict(kwargs or {})
    out = []
    for key, value in kwargs.items():
        if key not in _SAMPLING:
            raise ConfigError(
                f"GRPOConfig(generation_kwargs={{{key!r}: ...}}): not supported by grpokit; it takes "
                f"{', '.join(_SAMPLING)}"
            )
        out += _flag(key, value)
    return out


def _whole_steps(name: str, value: Any) -> int:
    if isinstance(value, float) and value < 1:
        raise ConfigError(
            f"GRPOConfig({name}={value}): a fraction of the run is not supported by grpokit; give a "
            "whole number of steps"
        )
    if isinstance(value, float) and not value.is_integer():
        raise ConfigError(f"GRPOConfig({name}={value}): give a whole number of steps")
    return int(value)


def _same(value: Any, default: Any) -> bool:
    return value == default or (value is None and default in (None, "", [], {}))


def _flag(option: str, value: Any) -> list[str]:
    return [f"--{option}", *_values(value)]


def _values(value: Any) -> list[str]:
    if isinstance(value, bool):
        return ["true" if value else "false"]
    if isinstance(value, (list, tuple)):
        return [v for item in value for v in _values(item)]
    if isinstance(value, dict):
        return [json.dumps(value)]
    return [str(getattr(value, "value", value))]  # transformers' enums (IntervalStrategy.STEPS) by their value
