"""Turn ``--dataset`` specs into one ``datasets.Dataset`` of prompt rows.

Spec forms (any may end with ``#N`` to keep N rows drawn by a seeded shuffle):

- a local file ``.jsonl`` / ``.json`` / ``.csv`` / ``.parquet``, or a folder written by ``Dataset.save_to_disk``;
- ``builtin:<task>`` (train split) or ``builtin:<task>:test`` (held-out split), generated in code;
- a hub id ``org/name`` or ``org/name:subset`` (train split), through ``datasets.load_dataset``.

Rows are then normalised (see ``normalize_rows``) so that every row holds ``messages``; other columns travel on
to the reward functions by name.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import datasets
from datasets import Dataset

from grpokit.data.builtin import BUILTIN_TASKS, builtin_rows
from grpokit.data.hub import load_hub_dataset
from grpokit.data.images import check_images
from grpokit.errors import ConfigError, DataError

__all__ = ["BUILTIN_TASKS", "load_dataset_spec", "load_train_val", "normalize_rows", "concat_datasets"]

logger = logging.getLogger(__name__)

BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
PROMPT_COLUMNS = ("messages", "prompt", "query")
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+(:[\w.-]+)?")


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def _split_count(spec: str, option: str) -> tuple[str, int | None]:
    """``'data.jsonl#500'`` → ``('data.jsonl', 500)``; a spec without ``#`` → ``(spec, None)``."""
    if "#" not in spec or Path(spec).expanduser().exists():
        return spec, None
    base, _, count = spec.rpartition("#")
    if not count.isdigit() or int(count) == 0:
        raise DataError(f"{option} {spec!r}: the part after '#' must be a positive row count, e.g. {base}#500")
    return base, int(count)


def _has_no_rows(path: Path, builder: str) -> bool:
    """Cheap check for an empty file: blank, ``[]``, a CSV with only its header line, a 0-row parquet."""
    if builder == "parquet":
        import pyarrow.parquet

        return pyarrow.parquet.ParquetFile(path).metadata.num_rows == 0
    if path.stat().st_size > 1 << 16:
        return False
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    if builder == "csv":
        return len(lines) <= 1
    return not lines or "".join(lines).replace(" ", "") in ("[]", "{}")


def _load_file(path: Path, spec: str, option: str) -> Dataset:
    if path.is_dir():
        if (path / "state.json").exists() or (path / "dataset_info.json").exists():
            loaded = datasets.load_from_disk(str(path))
            if isinstance(loaded, datasets.DatasetDict):
                if "train" not in loaded:
                    raise DataError(f"{option} {spec!r}: saved DatasetDict has no 'train' split ({list(loaded)})")
                loaded = loaded["train"]
            return loaded
        raise DataError(
            f"{option} {spec!r} is a folder but not one written by Dataset.save_to_disk; "
            f"pass the data file inside it ({', '.join(BUILDERS)})"
        )
    builder = BUILDERS.get(path.suffix.lower())
    if builder is None:
        raise DataError(
            f"{option} {spec!r}: unsupported file type {path.suffix or '(none)'!r}; "
            f"use one of {', '.join(BUILDERS)}, builtin:<task> or a hub id org/name"
        )
    try:
        empty = _has_no_rows(path, builder)
    except Exception:  # unreadable: let the loader below report the real cause
        empty = False
    if empty:
        raise DataError(f"{option} {spec!r}: the file has no rows; fill it or pick another dataset")
    try:
        return datasets.load_dataset(builder, data_files=str(path), split="train")
    except Exception as exc:  # pyarrow / json errors carry the real cause; keep it on one line
        raise DataError(f"{option} {spec!r}: could not read the {builder} file ({_one_line(exc)})") from exc


def _load_source(base: str, spec: str, seed: int, option: str) -> Dataset:
    if base.startswith("builtin:"):
        name, _, split = base[len("builtin:") :].partition(":")
        return Dataset.from_list(builtin_rows(name, split or "train", seed))
    path = Path(base).expanduser()
    if path.exists():
        return _load_file(path, spec, option)
    looks_local = base.startswith((".", "/", "~")) or path.suffix.lower() in BUILDERS
    if not looks_local and _HUB_ID.fullmatch(base):
        repo, _, subset = base.partition(":")
        return load_hub_dataset(repo, subset or None)
    raise DataError(
        f"{option} {spec!r}: file not found; pass an existing .jsonl/.json/.csv/.parquet file, "
        f"builtin:<task> ({', '.join(sorted(BUILTIN_TASKS))}) or a hub id org/name"
    )


def load_dataset_spec(spec: str, *, seed: int = 42, option: str = "--dataset") -> Dataset:
    """Load one spec as raw rows (not yet normalised), sub-sampled to ``#N`` rows if asked.

    ``option`` is the flag named in error messages (``--dataset`` or ``--val_dataset``).
    """
    base, count = _split_count(spec.strip(), option)
    ds = _load_source(base, spec, seed, option)
    if len(ds) == 0:
        raise DataError(f"{option} {spec!r} has no rows; check the file or pick another dataset")
    if count is not None:
        if count > len(ds):
            logger.warning("%s %r asks for %d rows but has only %d; using all of them", option, spec, count, len(ds))
        else:
            ds = ds.shuffle(seed=seed).select(range(count))
    return ds


def _prompt_messages(row: dict, source: str, index: int) -> list[dict]:
    """The prompt of one row as a list of messages (from messages, prompt or query)."""
    for column in PROMPT_COLUMNS:
        value = row.get(column)
        if value is None:
            continue
        if isinstance(value, str):
            return [{"role": "user", "content": value}]
        if isinstance(value, list) and all(isinstance(m, dict) and "role" in m for m in value):
            return [dict(m) for m in value]
        raise DataError(
            f"{source}: row {index}: column {column!r} must be a string or a list of {{role, content}} messages, "
            f"got {type(value).__name__}"
        )
    raise DataError(f"{source}: row {index} has an empty prompt; fill one of {', '.join(PROMPT_COLUMNS)}")


def normalize_rows(ds: Dataset, system: str | None, *, source: str = "dataset") -> Dataset:
    """Give every row a ``messages`` prompt; copy ``answer`` to ``solution``; add the system prompt.

    - ``messages`` is used as is; otherwise ``prompt`` or ``query`` is (a string becomes one user message, a
      list of messages is taken as the messages) and that column is dropped (it now lives in ``messages``).
    - a trailing assistant message is a reference answer, not part of the prompt: it is removed and becomes
      ``solution`` when the row has neither ``solution`` nor ``answer``.
    - a row's own ``system`` column, else the ``system`` argument, is prepended when the row has no system
      message; the ``system`` column is then dropped.
    - ``answer`` is copied to ``solution`` when ``solution`` is absent (it wins over a trailing assistant reply).
    All other columns are kept.
    """
    columns = list(ds.column_names)
    prompt_column = next((c for c in PROMPT_COLUMNS if c in columns), None)
    if prompt_column is None:
        raise DataError(
            f"{source}: no prompt column (columns: {', '.join(columns) or 'none'}); add one of: messages "
            "(list of {role, content}), query (str) or prompt (str or list of messages)"
        )
    if len(ds) == 0:
        raise DataError(f"{source} has no rows; check the file or pick another dataset")
    has_solution = "solution" in columns
    has_system_column = "system" in columns
    has_answer = "answer" in columns and not has_solution
    drop = [c for c in (prompt_column, "system") if c in columns and c != "messages"]

    def convert(row: dict, index: int) -> dict:
        messages = _prompt_messages({prompt_column: row[prompt_column]}, source, index)
        out: dict = {} if has_solution else {"solution": row["answer"] if has_answer else None}
        if messages and messages[-1].get("role") == "assistant":
            reference = messages.pop()
            if not has_solution and out["solution"] is None:
                out["solution"] = reference.get("content")
        if not messages:
            raise DataError(f"{source}: row {index} has no prompt message before the assistant reply")
        default_system = row.get("system") if has_system_column else None
        default_system = default_system or system
        if default_system and messages[0].get("role") != "system":
            messages.insert(0, {"role": "system", "content": default_system})
        out["messages"] = messages
        return out

    ds = ds.map(convert, with_indices=True, remove_columns=drop, desc=f"normalising {source}")
    if not has_solution and all(value is None for value in ds["solution"]):
        ds = ds.remove_columns("solution")  # no answer and no reference reply anywhere: add no empty column
    return ds


def concat_datasets(parts: list[tuple[str, Dataset]]) -> Dataset:
    """Concatenate normalised datasets; a column missing from one part is filled with None there."""
    if len(parts) == 1:
        return parts[0][1]
    order: list[str] = []
    features: dict = {}
    owner: dict[str, str] = {}
    for source, ds in parts:
        for name, feature in ds.features.items():
            if name not in features:
                order.append(name)
                features[name], owner[name] = feature, source
    aligned = []
    for source, ds in parts:
        for name in order:
            if name not in ds.column_names:
                ds = ds.add_column(name, [None] * len(ds), feature=features[name])
        ds = ds.select_columns(order)
        for name in order:
            if ds.features[name] != features[name]:
                try:
                    ds = ds.cast_column(name, features[name])
                except Exception as exc:
                    raise DataError(
                        f"column {name!r} is {ds.features[name]} in {source} but {features[name]} in "
                        f"{owner[name]}; make the types agree or load them separately ({_one_line(exc)})"
                    ) from exc
        aligned.append(ds)
    return datasets.concatenate_datasets(aligned)


def _load_many(specs: list[str], system: str | None, seed: int, option: str) -> Dataset:
    parts = []
    for spec in specs:
        source = f"{option} {spec!r}"
        raw = load_dataset_spec(spec, seed=seed, option=option)
        parts.append((source, check_images(normalize_rows(raw, system, source=source), source)))  # data/images.py
    return concat_datasets(parts)


def load_train_val(
    dataset: list[str],
    val_dataset: list[str],
    *,
    system: str | None,
    seed: int,
    split_dataset_ratio: float = 0.0,
) -> tuple[Dataset, Dataset | None]:
    """Load, normalise and concatenate ``--dataset`` and ``--val_dataset``.

    Without ``--val_dataset``, ``split_dataset_ratio`` > 0 holds out that fraction of the training rows (seeded).
    """
    if not dataset:
        raise ConfigError("--dataset is empty; pass a file, builtin:arithmetic or a hub id org/name")
    if not 0.0 <= split_dataset_ratio < 1.0:
        raise ConfigError(f"--split_dataset_ratio {split_dataset_ratio}: must be in [0, 1), e.g. 0.05")
    train = _load_many(dataset, system, seed, "--dataset")
    if val_dataset:
        return train, _load_many(val_dataset, system, seed, "--val_dataset")
    if split_dataset_ratio == 0.0:
        return train, None
    n_val = max(1, round(len(train) * split_dataset_ratio))
    if n_val >= len(train):
        raise DataError(
            f"--split_dataset_ratio {split_dataset_ratio} leaves no training rows out of {len(train)}; "
            "lower it or pass --val_dataset"
        )
    split = train.train_test_split(test_size=n_val, seed=seed)
    return split["train"], split["test"]
