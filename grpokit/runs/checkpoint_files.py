"""A checkpoint folder read as data, never as code: a checkpoint shared on a hub or a team drive is input.

- Every entry is a folder or a regular file (``check_tree``): a symlink (it may point out of the folder), a FIFO (a
  read would wait forever), a socket or a device is refused before anything is opened.
- JSON files (``trainer_state.json``, ``args.json``) are read bounded in bytes and nesting (``read_json``), and
  every field of the trainer state is typed and ranged before use (``checked_state``).
- Tensor files are read only by loaders that cannot run code: ``torch.load(weights_only=True)`` (with the numpy
  types accelerate's RNG file holds allowed) and safetensors. Nothing here calls ``pickle.load`` or
  ``torch.load(weights_only=False)``.
- accelerate pickles the RNG states and, when it cannot load them, logs at info level and goes on: the resumed run
  would silently draw other random numbers than the uninterrupted one. ``rng_state`` reads this process's file
  first (one line naming it and the cause when it does not load) and ``check_rng_restored`` verifies after
  ``load_state`` that the states in effect are the file's.
"""

from __future__ import annotations

import errno
import json
import os
import pickle  # only for its exception type: nothing here unpickles
import random
import stat
import warnings
from pathlib import Path, PurePosixPath

from grpokit.errors import ConfigError

MAX_ENTRIES = 100_000  # files and folders in one checkpoint (a sharded model of a few hundred files is usual)
MAX_DEPTH = 16  # folder nesting inside a checkpoint
MAX_JSON_DEPTH = 32  # nesting of a JSON value (args.json's deepest option is a list of lists)
MAX_STEP = 10**12  # larger step or prompt counts are not a run's
RNG_FILE = "random_states_{index}.pkl"  # accelerate's name, one per process
_KINDS = {
    stat.S_IFLNK: "a symlink",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFSOCK: "a socket",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
}
_ADVICE = "resume from another checkpoint, or start afresh with --overwrite_output_dir true"


def first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]


def not_regular(path: Path, mode: int) -> ConfigError:
    kind = _KINDS.get(stat.S_IFMT(mode), "not a regular file")
    return ConfigError(f"{path} is {kind}, not a regular file: a checkpoint holds only files and folders; {_ADVICE}")


def check_tree(ckpt: Path) -> None:
    """Every entry under ``ckpt`` is a folder or a regular file (nothing is followed or opened), within bounds."""
    count, todo = 0, [(ckpt, 0)]
    while todo:
        folder, depth = todo.pop()
        try:
            entries = list(os.scandir(folder))
        except OSError as e:
            raise ConfigError(f"{folder}: cannot be listed ({e.strerror})") from e
        count += len(entries)
        if count > MAX_ENTRIES:
            raise ConfigError(f"{ckpt} holds more than {MAX_ENTRIES} entries: not a grpokit checkpoint; {_ADVICE}")
        for entry in entries:
            mode = entry.stat(follow_symlinks=False).st_mode
            if stat.S_ISDIR(mode):
                if depth + 1 > MAX_DEPTH:
                    raise ConfigError(f"{entry.path}: folders nested deeper than {MAX_DEPTH}; {_ADVICE}")
                todo.append((Path(entry.path), depth + 1))
            elif not stat.S_ISREG(mode):
                raise not_regular(Path(entry.path), mode)


def open_regular(path: Path):
    """``path`` opened for reading as a binary file object, only when it is a regular file: a symlink is not
    followed, and a FIFO is refused, not waited on. ConfigError naming the file otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:  # the last part is a symlink
            raise not_regular(path, stat.S_IFLNK) from e
        raise ConfigError(f"{path}: cannot be read ({e.strerror})") from e
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise not_regular(path, mode)
    return os.fdopen(fd, "rb")


def read_regular(path: Path, max_bytes: int) -> bytes:
    """The bytes of the regular file ``path`` (``open_regular``), at most ``max_bytes``."""
    with open_regular(path) as f:
        raw = f.read(max_bytes + 1)
    if len(raw) > max_bytes:
        raise ConfigError(f"{path} is larger than {max_bytes} bytes: not one grpokit wrote; {_ADVICE}")
    return raw


def read_json(path: Path, max_bytes: int) -> object:
    """``path`` parsed as JSON: a regular file, at most ``max_bytes``, UTF-8, nested at most ``MAX_JSON_DEPTH``."""
    return parse_json(read_regular(path, max_bytes), path)


def parse_json(raw: bytes, path: Path) -> object:
    """The bytes of ``path`` as JSON, UTF-8 and nested at most ``MAX_JSON_DEPTH``; ConfigError naming it."""
    try:
        value = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start}); {_ADVICE}") from e
    except RecursionError:
        value = None
        depth = MAX_JSON_DEPTH + 1
    except ValueError as e:
        raise ConfigError(f"{path} is not valid JSON ({first_line(e)}); the save that wrote it did not finish") from e
    else:
        depth = _depth(value)
    if depth > MAX_JSON_DEPTH:
        raise ConfigError(f"{path} nests deeper than {MAX_JSON_DEPTH} levels: not one grpokit wrote; {_ADVICE}")
    return value


def _depth(value: object, limit: int = MAX_JSON_DEPTH + 1) -> int:
    """Nesting of a parsed JSON value, counted up to ``limit`` (iterative: no recursion on hostile input)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        v, d = todo.pop()
        if isinstance(v, dict | list):
            deepest = max(deepest, d)
            if d >= limit:
                return d
            todo.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v))
    return deepest


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_STEP


# trainer_state.json's fields: name → (required, check, what it must be)
_FIELDS = {
    "global_step": (True, _count, "a step count"),
    "prompts_consumed": (True, _count, "a prompt count"),
    "max_steps": (False, _count, "a step count"),
    "prompts_per_draw": (False, lambda v: _count(v) and v > 0, "a positive count"),
    "window_processes": (False, lambda v: _count(v) and 0 < v <= 1 << 16, "a process count"),
    "chord_sft_consumed": (False, _count, "a row count"),
    "python_random": (False, lambda v: isinstance(v, str), "text"),
    "prompts_pending": (
        False,
        lambda v: isinstance(v, list) and len(v) <= 1 << 20 and all(_count(x) for x in v),
        "a list of stream positions",
    ),
    "files": (
        False,
        lambda v: isinstance(v, dict) and all(_safe_rel(k) and _count(n) for k, n in v.items()),
        "relative paths inside the checkpoint with their sizes",
    ),
}


def _safe_rel(rel: object) -> bool:
    """A path that stays inside the checkpoint: relative, no ``..``, no empty or ``.`` parts."""
    if not isinstance(rel, str) or not rel or "\\" in rel or "\0" in rel:
        return False
    parts = PurePosixPath(rel).parts
    return not PurePosixPath(rel).is_absolute() and all(p not in ("", ".", "..") for p in parts)


def checked_state(state: object, path: Path) -> dict:
    """A trainer state whose every known field has its type and range (fields a later grpokit adds pass)."""
    if not isinstance(state, dict):
        raise ConfigError(f"{path} holds a JSON {type(state).__name__}, not a grpokit trainer state; {_ADVICE}")
    for name, (required, ok, what) in _FIELDS.items():
        if name not in state:
            if required:
                raise ConfigError(f"{path} lacks {name}: not a grpokit trainer state; {_ADVICE}")
            continue
        if not ok(state[name]):
            shown = json.dumps(state[name])[:60]
            raise ConfigError(f"{path}: {name} is {shown}, not {what}: the file was altered; {_ADVICE}")
    pending = state.get("prompts_pending", [])
    if any(p >= state["prompts_consumed"] for p in pending):
        raise ConfigError(f"{path}: prompts_pending lists positions not yet drawn: the file was altered; {_ADVICE}")
    return state


def load_tensors(path: Path) -> object:
    """A torch file read with ``weights_only=True`` (accelerate's numpy types allowed, as its own loader allows
    them): tensors and plain values only; a file that needs anything else to load is refused, never run."""
    import torch  # not at the top: the run folder's checks stay torch-free until a checkpoint loads
    from accelerate.utils.other import TORCH_SAFE_GLOBALS

    with open_regular(path) as f, torch.serialization.safe_globals(TORCH_SAFE_GLOBALS), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the unpickler's note on a pickle protocol it did not expect
        try:
            return torch.load(f, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:  # torch's text advises weights_only=False: never here
            raise NotData(_refusal(str(e))) from e


class NotData(ValueError):
    """A torch or pickle file that holds more than tensors and plain values (it would run code to load)."""


def _refusal(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    why = next((line for line in lines if "GLOBAL" in line or "Unsupported" in line), "")
    why = why.replace("WeightsUnpickler error: ", "")
    return f"holds more than tensors and plain values, refused without running it{': ' + why if why else ''}"


def rng_path(state_dir: Path, process_index: int) -> Path:
    return state_dir / RNG_FILE.format(index=process_index)


def rng_state(state_dir: Path, process_index: int) -> dict:
    """This process's RNG states as accelerate saved them, read as data and checked; ConfigError naming the file
    and the cause when it is missing or does not load (accelerate would skip it without a word)."""
    import torch  # not at the top: as above

    path = rng_path(state_dir, process_index)
    if not path.exists():
        raise ConfigError(
            f"--resume_from_checkpoint: {path} is missing: the resumed run would draw other random numbers than "
            f"the run that saved it; {_ADVICE}"
        )
    try:
        states = load_tensors(path)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - the unpickler's and the zip reader's own types
        raise ConfigError(
            f"--resume_from_checkpoint: {path} (the RNG states) does not load ({first_line(e)}); {_ADVICE}"
        ) from e
    py, torch_state = (
        (states.get("random_state"), states.get("torch_manual_seed")) if isinstance(states, dict) else (None, None)
    )
    if (
        not (isinstance(py, tuple) and len(py) == 3 and isinstance(torch_state, torch.Tensor))
        or "numpy_random_seed" not in states
    ):
        raise ConfigError(
            f"--resume_from_checkpoint: {path} does not hold accelerate's RNG states (python, numpy, torch); {_ADVICE}"
        )
    return states


def check_rng_restored(states: dict, path: Path) -> None:
    """After ``load_state``: the RNG states in effect are the file's (accelerate skips a state it cannot set)."""
    import torch  # not at the top: as above

    if random.getstate() != states["random_state"] or not torch.equal(
        torch.get_rng_state(), states["torch_manual_seed"]
    ):
        raise ConfigError(
            f"--resume_from_checkpoint: {path} (the RNG states) loaded but could not be set (accelerate skipped "
            f"it): the resumed run would draw other random numbers; {_ADVICE}"
        )
