"""The prompt options of a run (tools, chat-template keyword arguments, ``--max_length``) and the dataset pass that
applies them once a tokenizer is loaded.

``PromptOptions.from_args`` reads them off ``DataArguments`` and checks them (no model needed);
``PromptOptions.template`` builds the ``ChatTemplate`` that renders prompts with them, the same for the trainer
and its engine; ``prepare_prompts`` puts each row's tools and chat-template kwargs into its prompt (they travel
with it: ``grpokit.template.encode``) and applies ``--max_length`` with ``--truncation_strategy`` delete (drop the
row) or raise (stop); left/right cut the prompt ids when they are encoded (``ChatTemplate``). An image row's
length is counted after the processor expanded its images; left/right must not cut through image tokens (checked
here, per row).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field

from datasets import Dataset

from grpokit.config.checks import option_check
from grpokit.data.columns import parse_columns
from grpokit.data.loading import resolve_system
from grpokit.errors import ConfigError, DataError
from grpokit.template.agent import add_tools, check_agent_template, parse_tools
from grpokit.template.encode import TRUNCATION_STRATEGIES, ChatTemplate, attach
from grpokit.template.processor import ProcessorTemplate
from grpokit.template.prompt_bounds import lengths_over_bound

logger = logging.getLogger(__name__)


def parse_json_object(value: str | dict | None, option: str) -> dict:
    """A JSON object given as text (or already a dict, from a YAML config); ConfigError naming ``option``."""
    if value is None or isinstance(value, dict):
        return dict(value or {})
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"--{option} {value!r}: not valid JSON ({exc.msg}); pass an object, e.g. '{{\"enable_thinking\": false}}'"
        ) from None
    if not isinstance(parsed, dict):
        raise ConfigError(f'--{option} {value!r}: must be a JSON object {{"name": value, ...}}')
    return parsed


@dataclass(frozen=True)
class PromptOptions:
    agent_template: str | None = None
    chat_template_kwargs: dict = field(default_factory=dict)
    max_length: int | None = None
    truncation_strategy: str = "left"
    num_proc: int = 1
    load_from_cache_file: bool = False

    @classmethod
    def from_args(cls, data, rollout=None) -> PromptOptions:
        """From ``DataArguments`` (read by attribute name), checked; ConfigError naming the option and the fix.
        ``rollout`` (``RolloutArguments``) decides the default --truncation_strategy (``default_truncation``)."""
        kwargs = parse_json_object(data.chat_template_kwargs, "chat_template_kwargs")
        if data.enable_thinking is not None:
            kwargs["enable_thinking"] = data.enable_thinking
        check_agent_template(data.agent_template)
        strategy = data.truncation_strategy or default_truncation(rollout)
        if strategy == "split":
            raise ConfigError(
                "--truncation_strategy split: ms-swift allows it for pre-training only; for GRPO use "
                "left, right, delete or raise"
            )
        if strategy not in TRUNCATION_STRATEGIES:
            raise ConfigError(
                f"--truncation_strategy {strategy}: unknown; use one of {', '.join(TRUNCATION_STRATEGIES)}"
            )
        if data.max_length is not None and data.max_length < 1:
            raise ConfigError(f"--max_length {data.max_length}: must be a positive token count, or unset for no limit")
        if data.dataset_num_proc < 1:
            raise ConfigError(f"--dataset_num_proc {data.dataset_num_proc}: must be ≥ 1")
        return cls(
            data.agent_template, kwargs, data.max_length, strategy, data.dataset_num_proc, data.load_from_cache_file
        )

    @property
    def truncates_ids(self) -> bool:
        """True when over-long prompts are cut at encoding time (left/right), not handled in the dataset."""
        return self.max_length is not None and self.truncation_strategy in ("left", "right")

    def template(self, tokenizer, system: str | None = None) -> ChatTemplate:
        """The chat template with these options; for a multimodal model's processor, the processor template."""
        if hasattr(tokenizer, "image_processor"):  # template/processor.py
            return ProcessorTemplate(
                tokenizer,
                system,
                chat_template_kwargs=self.chat_template_kwargs,
                max_length=self.max_length,
                truncation_strategy=self.truncation_strategy,
            )
        return ChatTemplate(
            tokenizer,
            system,
            chat_template_kwargs=self.chat_template_kwargs,
            max_length=self.max_length,
            truncation_strategy=self.truncation_strategy,
        )


def default_truncation(rollout) -> str:
    """ms-swift's GRPO default ``left``; ``delete`` where prompt ids cannot be cut the same everywhere: in server
    mode (the rollout server renders the prompts) and with multi-turn rollouts (later turns are longer prompts)."""
    if rollout is not None and (rollout.vllm_mode == "server" or rollout.multi_turn_scheduler):
        return "delete"
    return "left"


def _row_kwargs(value, run_kwargs: dict, where: str) -> dict:
    """The run's chat-template kwargs under a row's own (ms-swift's ``chat_template_kwargs`` column)."""
    if value in (None, "", {}):
        return run_kwargs
    try:
        row = parse_json_object(value, "chat_template_kwargs")
    except ConfigError:
        raise DataError(f"{where}: column 'chat_template_kwargs' must be a JSON object, got {value!r:.80}") from None
    return {**run_kwargs, **{k: v for k, v in row.items() if v is not None}}


def _carry(ds: Dataset, opts: PromptOptions, source: str) -> Dataset:
    """Each row's tools (by --agent_template) and chat-template kwargs into its prompt."""
    has_tools, has_kwargs = "tools" in ds.column_names, "chat_template_kwargs" in ds.column_names

    def convert(row: dict, index: int) -> dict:
        where = f"{source}: row {index}"
        tools = parse_tools(row["tools"], where) if has_tools and row["tools"] not in (None, "", []) else []
        messages = add_tools(row["messages"], tools, opts.agent_template)
        kwargs = _row_kwargs(row["chat_template_kwargs"] if has_kwargs else None, opts.chat_template_kwargs, where)
        return {"messages": attach(messages, kwargs=kwargs)}

    return ds.map(
        convert,
        with_indices=True,
        desc=f"tools and template options into the prompts of {source}",
        num_proc=opts.num_proc if opts.num_proc > 1 else None,
        load_from_cache_file=opts.load_from_cache_file,
    )


def _prompt_lengths(ds: Dataset, template: ChatTemplate, opts: PromptOptions, source: str) -> list[int]:
    """Each row's prompt length in tokens; image rows through the processor (image tokens counted), whose
    left/right cut must not pass through image tokens (DataError naming the row)."""
    messages = ds["messages"]
    if not (getattr(template, "multimodal", False) and "images" in ds.column_names):
        lengths: list[int] = []
        for start in range(0, len(messages), 256):  # one tokenizer call per chunk
            lengths += template.prompt_lengths(messages[start : start + 256])
        return lengths
    lengths = []
    for i, (msgs, images) in enumerate(zip(messages, ds["images"], strict=True)):
        if not images:
            lengths += template.prompt_lengths([msgs])
            continue
        ids, _ = template.expand(msgs, images)
        lengths.append(len(ids))
        if template.cut_crosses_images(ids):
            raise DataError(
                f"{source}: row {i} has a {len(ids)}-token prompt (images expanded), over --max_length "
                f"{opts.max_length}, and a --truncation_strategy {opts.truncation_strategy} cut would pass "
                "through its image tokens; use --truncation_strategy delete, or raise --max_length"
            )
    return lengths


def _apply_max_length(ds: Dataset, template: ChatTemplate, opts: PromptOptions, source: str) -> Dataset:
    """--max_length by --truncation_strategy. Text rows are tokenized only when a cheap bound says they may be
    over it (prompt_bounds.py); image rows are expanded through the processor."""
    limit = opts.max_length
    if getattr(template, "multimodal", False) and "images" in ds.column_names:
        lengths = dict(enumerate(_prompt_lengths(ds, template, opts, source)))
    else:
        lengths = lengths_over_bound(ds, template, limit)
    over = [i for i, n in sorted(lengths.items()) if n > limit]
    if not over:
        return ds
    if opts.truncation_strategy == "raise":
        i = over[0]
        raise DataError(
            f"{source}: row {i} has a {lengths[i]}-token prompt, over --max_length {limit} "
            f"({len(over)} of {len(ds)} rows are); raise --max_length, or use --truncation_strategy "
            "delete / left / right"
        )
    if opts.truncation_strategy == "delete":
        if len(over) == len(ds):
            raise DataError(
                f"{source}: every prompt is longer than --max_length {limit} (the shortest has "
                f"{min(lengths.values())} tokens); raise --max_length"
            )
        logger.warning(
            "%s: dropped %d of %d rows whose prompt is longer than --max_length %d tokens "
            "(--truncation_strategy delete)",
            source,
            len(over),
            len(ds),
            limit,
        )
        keep = set(over)
        return ds.select([i for i in range(len(ds)) if i not in keep])
    logger.warning(
        "%s: %d of %d prompts are longer than --max_length %d tokens and will be cut on the %s "
        "(--truncation_strategy %s)",
        source,
        len(over),
        len(ds),
        limit,
        opts.truncation_strategy,
        opts.truncation_strategy,
    )
    return ds


_PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "grpokit_probe_tool",
        "description": "probe",
        "parameters": {"type": "object", "properties": {}},
    },
}


def _check_renders_tools(template: ChatTemplate, source: str) -> None:
    """The chat template must show the tools it is given; many (plain ChatML, Llama 2, …) drop them silently."""
    probe = attach([{"role": "user", "content": "hi"}], tools=[_PROBE_TOOL])
    if "grpokit_probe_tool" not in template.render_prompt(probe):
        raise DataError(
            f"{source} has a 'tools' column, but the model's chat template does not render tools (its "
            "tools= argument); pass --agent_template hermes, react_en or react_grpo to write them into the "
            "system message, or drop the column"
        )


def prepare_prompts(ds: Dataset, template: ChatTemplate, opts: PromptOptions, source: str) -> Dataset:
    """Tools and chat-template kwargs into the prompts (they travel with them, ``grpokit.template.encode``), then
    ``--max_length``; ``template`` renders the prompts as the engine will."""
    if opts.chat_template_kwargs or {"tools", "chat_template_kwargs"} & set(ds.column_names):
        ds = _carry(ds, opts, source)
    if (
        opts.agent_template is None
        and template is not None
        and "tools" in ds.column_names
        and any(t not in (None, "", []) for t in ds["tools"])
    ):
        _check_renders_tools(template, source)
    if opts.max_length is not None:
        ds = _apply_max_length(ds, template, opts, source)
    return ds


def check_data_options(data, rollout) -> PromptOptions:
    """Every check of ``DataArguments`` that needs no model (the option gate runs it once: ``_gate_data``)."""
    resolve_system(data.system)
    parse_columns(data.columns)
    opts = PromptOptions.from_args(data, rollout)
    server, multi_turn = rollout.vllm_mode == "server", bool(rollout.multi_turn_scheduler)
    where = "in server mode (the rollout server renders the prompts)" if server else "with multi-turn rollouts"
    if opts.truncates_ids and (server or multi_turn):
        raise ConfigError(
            f"--max_length {opts.max_length} --truncation_strategy {opts.truncation_strategy} is not "
            f"implemented {where}; use --truncation_strategy delete (drop longer prompts) or raise"
        )
    if opts.max_length is not None and data.truncation_strategy is None and (server or multi_turn):
        logger.warning(
            "--max_length %d: prompts longer than it are dropped (--truncation_strategy delete) %s, "
            "where ms-swift's default left cannot cut them the same everywhere",
            opts.max_length,
            where,
        )
    return opts


@option_check("data")
def _gate_data(cfg) -> None:
    """The data options in the option gate (``grpokit.config.checks``): config imports no template code."""
    check_data_options(cfg.data, cfg.rollout)
