"""Load the policy (+ LoRA), the reference model and the tokenizer from local Hugging Face folders, and check the
folder before anything heavy loads: a hub id is answered at once (no retries against an unreachable hub), the
tokenizer must cover the model's vocabulary, and prompt + completion must fit in the model's context."""

from __future__ import annotations

import contextlib
import json
import logging
import re
from pathlib import Path

import torch

from grpokit.config.args import ModelArguments
from grpokit.config.validate import json_object
from grpokit.data.hub import hub_unreachable_reason
from grpokit.errors import ConfigError
from grpokit.modeling import load_causal_lm, load_tokenizer, load_trained, torch_dtype
from grpokit.pipeline.default_model import ensure_default_model
from grpokit.pipeline.vlm_parts import freeze_vlm_parts, load_vlm, vlm_targets
from grpokit.template.processor import is_vlm_folder, load_processor

logger = logging.getLogger(__name__)
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def check_model_source(path: str, option: str = "--model") -> None:
    """ConfigError at once when ``path`` is no local folder. grpokit loads local folders only; for what looks
    like a hub id the message says whether the hub answers (one short probe, ``data/hub.py``), instead of the
    ~50 s of retries that transformers spends on an unreachable hub."""
    if Path(path).expanduser().is_dir():
        return
    if Path(path).expanduser().exists():
        raise ConfigError(
            f"{option} {path}: is a file, not a model folder (config.json, weights and tokenizer files in one folder)"
        )
    if _HUB_ID.fullmatch(path) and not path.startswith((".", "/", "~")):
        import os

        offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0")
        reason = "offline mode is on (HF_HUB_OFFLINE)" if offline else hub_unreachable_reason()
        hint = (
            f"the hub cannot be reached ({reason})"
            if reason
            else f"download it first: huggingface-cli download {path} --local-dir models/{path.rsplit('/', 1)[-1]}"
        )
        raise ConfigError(
            f"{option} {path}: no such local folder; grpokit loads local Hugging Face folders, and "
            f"{hint}; then pass the folder"
        )
    raise ConfigError(f"{option} {path}: no such folder")


def check_tokenizer_covers(model, tokenizer, path: str) -> None:
    """ConfigError when the tokenizer makes ids that the model's embedding has no row for (a tokenizer from
    another model): they would fail later as an IndexError inside the forward."""
    text_tok = getattr(tokenizer, "tokenizer", tokenizer)  # a processor holds its tokenizer
    rows = model.get_input_embeddings().num_embeddings
    if len(text_tok) > rows:
        raise ConfigError(
            f"--model {path}: the tokenizer has {len(text_tok)} tokens but the model's embedding only "
            f"{rows} rows, so ids from {rows} up have no embedding; use the tokenizer that came with "
            "this model"
        )


def context_length(model) -> int | None:
    """The model's context in tokens (``max_position_embeddings``, a VLM's text config's), or None."""
    config = model.config
    for c in (config, getattr(config, "text_config", None)):
        n = getattr(c, "max_position_embeddings", None) if c is not None else None
        if isinstance(n, int) and n > 0:
            return n
    return None


def bound_prompt_length(model, data, max_completion_length: int, path: str, log=print) -> int | None:
    """Prompt + completion checked against the model's context before training. ``--max_completion_length`` must
    leave room for a prompt; ``--max_length`` + it must fit. Unset ``--max_length`` bounds prompts to the room the
    context leaves (so no row, however long, reaches the model whole; it is cut or dropped as --truncation_strategy
    says). Returns the prompt bound: ``data.max_length``, or that room when it is unset (``data`` is not changed:
    args.json keeps what the user gave, so a resume compares like with like); None without either."""
    ctx = context_length(model)
    if ctx is None:
        return data.max_length
    if max_completion_length >= ctx:
        raise ConfigError(
            f"--max_completion_length {max_completion_length}: the model {path} has a context of {ctx} "
            "tokens (max_position_embeddings), which must hold the prompt too; lower it below "
            f"{ctx}"
        )
    room = ctx - max_completion_length
    if data.max_length is not None and data.max_length > room:
        raise ConfigError(
            f"--max_length {data.max_length} + --max_completion_length {max_completion_length} = "
            f"{data.max_length + max_completion_length} tokens, past the model's context of {ctx} "
            f"(max_position_embeddings of {path}); lower --max_length to at most {room}"
        )
    if data.max_length is not None:
        return data.max_length
    log(
        f"prompts are bounded to {room} tokens (the model's context {ctx} minus --max_completion_length "
        f"{max_completion_length}); set --max_length to choose, --truncation_strategy for how",
        flush=True,
    )
    return room


def resolve_model_path(margs: ModelArguments, log=print) -> str:
    if margs.model is not None:
        return margs.model
    return str(ensure_default_model(log=log))


@contextlib.contextmanager
def seeded_weights(seed: int):
    """Weights made inside (LoRA adapters, any newly initialised part) come from ``seed`` on every rank and in every
    run, and the process's random state is left as it was: the process is seeded once, by the trainer's set-up
    (seed + rank, so that ranks sample different completions; trainers/training_setup.py)."""
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def load_policy(margs: ModelArguments, beta: float, log=print, peft_config=None):
    """Returns (policy, tokenizer, ref_model or None). LoRA policies need no ref copy: the base is the ref.
    ``peft_config``: a peft ``LoraConfig`` to apply as given, instead of one made from the --lora_* options."""
    path = resolve_model_path(margs, log=log)
    check_model_source(path)
    if margs.ref_model and beta != 0:
        check_model_source(margs.ref_model, "--ref_model")
    tokenizer = load_tokenizer(path, margs.trust_remote_code)
    lora = margs.tuner_type == "lora"
    vlm = is_vlm_folder(path)
    load = load_vlm if vlm else load_causal_lm
    model = load(
        path, torch_dtype(margs.torch_dtype, for_training_weights=not lora), margs.trust_remote_code, margs.attn_impl
    )
    check_tokenizer_covers(model, tokenizer, path)
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    if margs.gradient_checkpointing:
        gc_kwargs = json_object("gradient_checkpointing_kwargs", margs.gradient_checkpointing_kwargs)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=gc_kwargs or {"use_reentrant": False})
        model.config.use_cache = False
        if lora:
            model.enable_input_require_grads()
    if vlm:  # the processor is the template (template/processor.py); LoRA or full, the chosen parts train
        tokenizer = load_processor(path, tokenizer)
        freeze_vlm_parts(model, margs)
    if lora:
        model = apply_lora(model, margs, vlm_targets(model, margs) if vlm else None, peft_config)
    else:
        freeze_parameters(model, margs)
    ref = None
    if beta != 0 and not lora:
        ref = load(
            margs.ref_model or path,
            torch_dtype(margs.torch_dtype, for_training_weights=False),
            margs.trust_remote_code,
            margs.attn_impl,
        )
        ref.requires_grad_(False).eval()
    if margs.disable_dropout:
        disable_dropout(model, ref)
    return model, tokenizer, ref


def disable_dropout(*models) -> None:
    """--disable_dropout: every ``torch.nn.Dropout`` (LoRA's too) at p = 0, as TRL's disable_dropout_in_model."""
    for model in models:
        for module in model.modules() if model is not None else ():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0


def apply_lora(model, margs: ModelArguments, vlm_linear: list[str] | None = None, peft_config=None):
    from peft import LoraConfig, get_peft_model

    if peft_config is not None:  # the caller's own LoraConfig (TRL's peft_config), applied as given
        try:
            return get_peft_model(model, peft_config)
        except ValueError as e:
            raise ConfigError(f"peft_config: {str(e).splitlines()[0]}") from e
    targets = margs.target_modules
    if vlm_linear is not None and targets == ["all-linear"]:  # a VLM: all-linear of the parts that train
        targets = vlm_linear
    # one entry with regex characters is a peft regex (full match on module names), e.g. top layers only:
    # '.*\.layers\.(2[0-9])\..*proj'; otherwise names are module-name suffixes, or all-linear
    if margs.target_regex:  # ms-swift's name for that regex
        target, option = margs.target_regex, f"--target_regex {margs.target_regex}"
    elif len(targets) == 1 and (targets[0] == "all-linear" or any(c in targets[0] for c in ".*[(|\\")):
        target, option = targets[0], f"--target_modules {targets[0]}"
    else:
        target, option = targets, f"--target_modules {' '.join(targets)}"
    config = LoraConfig(
        r=margs.lora_rank,
        lora_alpha=margs.lora_alpha,
        lora_dropout=margs.lora_dropout,
        target_modules=target,
        use_rslora=margs.use_rslora,
        use_dora=margs.use_dora,
        task_type="CAUSAL_LM",
    )
    try:
        return get_peft_model(model, config)
    except ValueError as e:
        raise ConfigError(f"{option}: {str(e).splitlines()[0]}") from e


def freeze_parameters(model, margs: ModelArguments) -> None:
    """ms-swift's freezing for full fine-tuning, in its order: the bottom ``freeze_parameters_ratio`` of the
    parameters (by count, in module order), then the ``freeze_parameters`` prefixes and the regex; last the
    ``trainable_parameters`` prefixes and regex train again. A prefix or regex that names no parameter is an error."""
    named = list(model.named_parameters())
    if margs.freeze_parameters_ratio > 0:
        budget, seen = int(sum(p.numel() for _, p in named) * margs.freeze_parameters_ratio), 0
        for _, p in named:
            seen += p.numel()
            if seen > budget:
                break
            p.requires_grad_(False)
    for option, prefixes, regex, trainable in (
        ("freeze_parameters", margs.freeze_parameters, margs.freeze_parameters_regex, False),
        ("trainable_parameters", margs.trainable_parameters, margs.trainable_parameters_regex, True),
    ):
        for prefix in prefixes:
            _set_trainable([p for n, p in named if n.startswith(prefix)], trainable, f"--{option} {prefix}")
        if regex is not None:
            pattern = re.compile(regex)
            _set_trainable([p for n, p in named if pattern.search(n)], trainable, f"--{option}_regex {regex}")


def _set_trainable(params: list, trainable: bool, option: str) -> None:
    if not params:
        raise ConfigError(
            f"{option}: no parameter of the model has such a name; parameter names look like "
            "model.layers.0.mlp.up_proj.weight"
        )
    for p in params:
        p.requires_grad_(trainable)


def load_for_inference(path: str, torch_dtype_name: str = "auto"):
    """A trained folder: a full model, or a LoRA adapter folder (adapter_config.json) on its base."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"--model {path}: no such folder")
    model = load_trained(path, torch_dtype(torch_dtype_name, for_training_weights=False))
    adapter = (p / "adapter_config.json").is_file() and not (p / "tokenizer_config.json").is_file()
    tok_path = json.loads((p / "adapter_config.json").read_text())["base_model_name_or_path"] if adapter else str(p)
    return model, load_tokenizer(tok_path)
