"""`grpokit train`'s data options (the DataArguments slice of ``TrainConfig``): datasets, splits, columns, system prompt
and ms-swift's dataset and template options."""

from __future__ import annotations

from dataclasses import dataclass

from grpokit.config.fields import opt as _opt


@dataclass
class DataArguments:
    dataset: list[str] = _opt(
        [],
        "training data: .jsonl/.json/.csv/.parquet files, builtin:<task>, or hub ids; "
        "append #N to sub-sample N rows (default: builtin:arithmetic)",
    )
    val_dataset: list[str] = _opt([], "held-out data, same forms as --dataset")
    system: str | None = _opt(
        None,
        "system prompt prepended to rows that have none; a value ending in .txt is "
        "a file holding the prompt (as in ms-swift); \\n in the text is a newline",
    )
    max_length: int | None = _opt(
        None,
        "max prompt length in tokens, as rendered by the chat template (ms-swift's "
        "meaning for GRPO); longer prompts follow --truncation_strategy. The "
        "completion is bounded by --max_completion_length on its own",
        ge=1,
    )
    split_dataset_ratio: float = _opt(
        0.0, "hold out this fraction of --dataset as validation when --val_dataset is not given", ge=0, lt=1
    )
    dataset_shuffle: bool = _opt(True, "shuffle the training prompts each epoch")
    # ms-swift's dataset and template options (grpokit/data, grpokit/template; docs/datasets.md)
    truncation_strategy: str | None = _opt(
        None,
        "prompts longer than --max_length: left (keep the last max_length tokens), right (keep the first), "
        "delete (drop the row, with a warning count) or raise (stop, naming the row); unset = left (ms-swift's "
        "GRPO default), or delete in server mode and with multi-turn rollouts, said at start-up",
    )
    columns: str | None = _opt(
        None,
        'rename dataset columns first: a JSON object {"src": "dst"} or a JSON '
        'file, e.g. \'{"question_text": "query"}\' (ms-swift\'s --columns)',
        json_object=True,
    )
    dataset_num_proc: int = _opt(1, "processes for dataset preprocessing (Dataset.map num_proc)", ge=1)
    load_from_cache_file: bool = _opt(False, "reuse datasets' cache of preprocessed rows (Dataset.map)")
    agent_template: str | None = _opt(
        None,
        "how a row's `tools` column reaches the prompt: unset = the chat "
        "template's own tools= rendering; hermes, react_en or react_grpo = tools "
        "written into the system message in that format",
    )
    enable_thinking: bool | None = _opt(
        None,
        "passed to the chat template as enable_thinking (Qwen3 and other "
        "hybrid-thinking templates); unset = the template's default",
    )
    chat_template_kwargs: str | None = _opt(
        None,
        "more keyword arguments for the chat template, as a JSON object "
        "(TRL's chat_template_kwargs), e.g. '{\"reasoning_effort\": "
        '"low"}\'',
        json_object=True,
    )
    max_row_bytes: int = _opt(
        8 << 20,
        "a .jsonl/.csv line (one row) longer than this many bytes is refused, "
        "naming the line, before it is parsed (default 8 MiB)",
        ge=1,
    )
