"""Turn ``--dataset`` specs into one ``datasets.Dataset`` of prompt rows.

Spec forms (any may end with ``#N`` to keep N rows drawn by a seeded shuffle, repeating rows past the size):

- a local file ``.jsonl`` / ``.json`` / ``.csv`` / ``.parquet``, or a folder written by ``Dataset.save_to_disk``;
- ``builtin:<task>`` (train split) or ``builtin:<task>:test`` (held-out split), generated in code;
- a hub id ``org/name`` or ``org/name:subset`` (train split), through ``datasets.load_dataset``.

Columns are renamed by ``--columns`` (``grpokit.data.columns``), then rows are normalised (``grpokit.data.rows``)
so that every row holds ``messages``; other columns travel on to the reward functions by name.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

import datasets
from datasets import Dataset

from grpokit.data.builtin import BUILTIN_TASKS, builtin_rows
from grpokit.data.columns import rename_columns
from grpokit.data.files import MAX_ROW_BYTES, json_problem, one_line, scan_text_file
from grpokit.data.hub import load_hub_dataset
from grpokit.data.images import check_images
from grpokit.data.rows import normalize_rows
from grpokit.errors import ConfigError, DataError

__all__ = ["BUILTIN_TASKS", "RowOptions", "concat_datasets", "load_dataset_spec", "load_rows", "load_train_val",
           "normalize_rows", "resolve_system"]

logger = logging.getLogger(__name__)

BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+(:[\w.-]+)?")


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


def _load_file(path: Path, spec: str, option: str, max_row_bytes: int = MAX_ROW_BYTES) -> Dataset:
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
    if builder in ("json", "csv"):  # each line bounded, UTF-8 and (JSON Lines) parsed, before the loader reads it
        scan_text_file(path, builder, f"{option} {spec!r}", max_row_bytes)
    try:
        return datasets.load_dataset(builder, data_files=str(path), split="train")
    except Exception as exc:  # pyarrow / json errors carry the real cause; keep it on one line
        where = json_problem(path, spec) if builder == "json" else None
        cause = where or one_line(exc)
        raise DataError(f"{option} {spec!r}: could not read the {builder} file ({cause})") from exc


def _load_source(base: str, spec: str, seed: int, option: str, max_row_bytes: int = MAX_ROW_BYTES) -> Dataset:
    if base.startswith("builtin:"):
        name, _, split = base[len("builtin:") :].partition(":")
        return Dataset.from_list(builtin_rows(name, split or "train", seed))
    path = Path(base).expanduser()
    if path.exists():
        return _load_file(path, spec, option, max_row_bytes)
    looks_local = base.startswith((".", "/", "~")) or path.suffix.lower() in BUILDERS
    if not looks_local and _HUB_ID.fullmatch(base):
        repo, _, subset = base.partition(":")
        return load_hub_dataset(repo, subset or None)
    raise DataError(
        f"{option} {spec!r}: file not found; pass an existing .jsonl/.json/.csv/.parquet file, "
        f"builtin:<task> ({', '.join(sorted(BUILTIN_TASKS))}) or a hub id org/name"
    )


def _sample(ds: Dataset, count: int, seed: int) -> Dataset:
    """``#N`` as ms-swift draws it: N rows of a seeded shuffle; past the dataset's size, every row
    ``N // len`` times and then ``N % len`` rows of the shuffle."""
    order = ds.shuffle(seed=seed)
    if count <= len(ds):
        return order.select(range(count))
    repeats, rest = divmod(count, len(ds))
    return datasets.concatenate_datasets([ds] * repeats + ([order.select(range(rest))] if rest else []))


def load_dataset_spec(spec: str, *, seed: int = 42, option: str = "--dataset",
                      max_row_bytes: int = MAX_ROW_BYTES) -> Dataset:
    """Load one spec as raw rows (not yet normalised), sub-sampled to ``#N`` rows if asked.

    ``option`` is the flag named in error messages (``--dataset`` or ``--val_dataset``); ``max_row_bytes``
    bounds each line of a local text file (``--max_row_bytes``, ``grpokit.data.files``).
    """
    base, count = _split_count(spec.strip(), option)
    ds = _load_source(base, spec, seed, option, max_row_bytes)
    if len(ds) == 0:
        raise DataError(f"{option} {spec!r} has no rows; check the file or pick another dataset")
    if count is not None:
        if count > len(ds):
            logger.warning("%s %r asks for %d rows but has only %d; the rows repeat (as in ms-swift)", option,
                           spec, count, len(ds))
        ds = _sample(ds, count, seed)
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
                        f"{owner[name]}; make the types agree or load them separately ({one_line(exc)})"
                    ) from exc
        aligned.append(ds)
    return datasets.concatenate_datasets(aligned)


@dataclass(frozen=True)
class RowOptions:
    """How raw rows become prompts: ``--system`` (already read from its file), ``--columns``, and the
    ``Dataset.map`` settings ``--dataset_num_proc`` / ``--load_from_cache_file``, and ``--max_row_bytes``."""

    system: str | None = None
    columns: dict[str, str] = field(default_factory=dict)
    num_proc: int = 1
    load_from_cache_file: bool = False
    max_row_bytes: int = MAX_ROW_BYTES


def resolve_system(value: str | None) -> str | None:
    """``--system`` as ms-swift reads it: a value ending in ``.txt`` is a file whose text is the system prompt
    (it must exist); any other value is the prompt itself, with ``\\n`` read as a newline."""
    if value is None:
        return None
    if value.endswith(".txt"):
        path = Path(value).expanduser()
        if not path.is_file():
            raise ConfigError(f"--system {value}: a value ending in .txt is read as a file, and there is no such "
                              "file; fix the path, or pass the prompt text itself")
        return path.read_text(encoding="utf-8")
    return value.replace("\\n", "\n")


def _load_many(specs: list[str], opts: RowOptions, seed: int, option: str, used: set[str]) -> Dataset:
    parts = []
    for spec in specs:
        source = f"{option} {spec!r}"
        raw = load_dataset_spec(spec, seed=seed, option=option, max_row_bytes=opts.max_row_bytes)
        raw, matched = rename_columns(raw, opts.columns, source)
        used.update(matched)
        rows = normalize_rows(raw, opts.system, source=source, num_proc=opts.num_proc,
                              load_from_cache_file=opts.load_from_cache_file)
        parts.append((source, check_images(rows, source)))  # data/images.py
    return concat_datasets(parts)


def load_rows(specs: list[str], options: RowOptions, *, seed: int, option: str) -> Dataset:
    """``specs`` loaded, normalised and concatenated as ``load_train_val`` does ``--dataset``, for another data
    option (``option`` names it in errors, e.g. ``--chord_sft_dataset``); ``options.system`` is used as given. A
    ``--columns`` name this data lacks is no error here (it is checked against ``--dataset``)."""
    return _load_many(specs, options, seed, option, set())


def load_train_val(
    dataset: list[str],
    val_dataset: list[str],
    *,
    system: str | None,
    seed: int,
    split_dataset_ratio: float = 0.0,
    options: RowOptions | None = None,
) -> tuple[Dataset, Dataset | None]:
    """Load, normalise and concatenate ``--dataset`` and ``--val_dataset``.

    Without ``--val_dataset``, ``split_dataset_ratio`` > 0 holds out that fraction of the training rows (seeded).
    ``options`` carries ``--columns`` and the map settings; its ``system`` is replaced by ``system``.
    """
    if not dataset:
        raise ConfigError("--dataset is empty; pass a file, builtin:arithmetic or a hub id org/name")
    if not 0.0 <= split_dataset_ratio < 1.0:
        raise ConfigError(f"--split_dataset_ratio {split_dataset_ratio}: must be in [0, 1), e.g. 0.05")
    opts = replace(options or RowOptions(), system=system)
    used: set[str] = set()
    train = _load_many(dataset, opts, seed, "--dataset", used)
    val = _load_many(val_dataset, opts, seed, "--val_dataset", used) if val_dataset else None
    unused = sorted(set(opts.columns) - used)
    if unused:
        raise ConfigError(f"--columns names {', '.join(map(repr, unused))}, which no dataset has (matched "
                          "ignoring case); fix the name or drop it from --columns")
    if val is not None:
        return train, val
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
