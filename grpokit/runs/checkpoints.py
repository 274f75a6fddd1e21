"""Checkpoint folders on disk: written whole or not at all, found, checked, set aside, rotated.

A checkpoint is written into ``checkpoint-N.tmp`` and renamed to ``checkpoint-N`` when complete. Its
``trainer_state.json`` is written last, atomically, and lists every file of the checkpoint with its size, so a
folder whose state file is missing, torn, or names a file that is missing or has another size is not a
checkpoint: ``--resume_from_checkpoint latest`` skips it and says so. Folders that must never be picked again
(checkpoints newer than the one a run resumed from, unusable ones a fresh start replaces) are renamed to
``checkpoint-N.<why>``, never deleted: the name is no longer ``checkpoint-<digits>``, so nothing lists them.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

from grpokit.config.plan import checkpoint_dirs
from grpokit.errors import ConfigError
from grpokit.runs.checkpoint_files import check_tree, checked_state, parse_json, read_regular
from grpokit.runs.pickle_scan import unreadable_parts
from grpokit.runs.run_dir import atomic_write_text, fsync_dir

logger = logging.getLogger(__name__)
STATE_FILE = "trainer_state.json"
ARGS_FILE = "args.json"
TMP_SUFFIX = ".tmp"
ABANDONED, UNUSABLE = "abandoned", "unusable"  # the reasons a folder is set aside (its name's suffix)
SET_ASIDE = (ABANDONED, UNUSABLE)
MAX_STATE_BYTES = 1 << 20  # a trainer_state.json is a few hundred bytes; a huge one is not ours


def checkpoint_step(path: Path) -> int:
    return int(path.name.split("-")[-1])


def temporary_dir(ckpt: Path) -> Path:
    """Where ``ckpt`` is written before it is renamed into place (emptied first: a crashed save's leftovers)."""
    tmp = ckpt.with_name(ckpt.name + TMP_SUFFIX)
    if tmp.exists():
        shutil.rmtree(tmp)
    return tmp


def file_sizes(folder: Path) -> dict[str, int]:
    """Every file under ``folder`` (relative path → size), fsynced so that they reach the disk before the state
    file that names them."""
    sizes = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file() and p.name != STATE_FILE:
            with p.open("rb") as f:
                os.fsync(f.fileno())
            sizes[p.relative_to(folder).as_posix()] = p.stat().st_size
    return sizes


def finish_checkpoint(tmp: Path, ckpt: Path, loop: dict) -> None:
    """Seal ``tmp``: the state file (with the file list) written last and atomically, then the rename into place.
    A checkpoint already at ``ckpt`` (the same step saved again) is replaced only once the new one is whole."""
    for sub in [p for p in tmp.rglob("*") if p.is_dir()]:
        fsync_dir(sub)
    state = {**loop, "files": file_sizes(tmp)}
    atomic_write_text(tmp / STATE_FILE, json.dumps(state, indent=2))
    old = None
    if ckpt.exists():
        old = ckpt.with_name(ckpt.name + ".replaced")
        if old.exists():
            shutil.rmtree(old)
        os.replace(ckpt, old)
    os.replace(tmp, ckpt)
    fsync_dir(ckpt.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def read_state(ckpt: Path) -> dict:
    """The checkpoint's trainer_state.json, read as data and every field checked; ConfigError saying what is
    wrong with it otherwise."""
    path = ckpt / STATE_FILE
    if not path.exists() and not path.is_symlink():
        raise ConfigError(f"{ckpt}: not a complete grpokit checkpoint (no {STATE_FILE})")
    raw = read_regular(path, MAX_STATE_BYTES)
    if not raw.strip():
        raise ConfigError(f"{path} is empty (the save that wrote it did not finish)")
    return checked_state(parse_json(raw, path), path)


def check_checkpoint(ckpt: Path) -> dict:
    """``read_state`` plus the folder as data (folders and regular files only, nothing followed) and the files
    the state lists (present, with the sizes written). Older checkpoints without a file list need their
    accelerate state folder."""
    if not ckpt.is_dir():
        raise ConfigError(f"{ckpt}: not a folder")
    check_tree(ckpt)
    state = read_state(ckpt)
    files = state.get("files")
    if files is not None:
        for rel, size in files.items():
            p = ckpt / rel
            if not p.is_file():
                raise ConfigError(f"{ckpt}: {rel} is missing")
            if p.stat().st_size != size:
                raise ConfigError(f"{ckpt}: {rel} has {p.stat().st_size} bytes, {size} were written")
    elif not (ckpt / "state").is_dir():
        raise ConfigError(f"{ckpt}: no state folder (optimizer, schedule, RNGs)")
    return state


def check_window_processes(state: dict, num_processes: int, ckpt: Path) -> None:
    """A checkpoint taken inside a window holds one window file per process: it resumes with as many."""
    saved_by = state.get("window_processes")
    if saved_by is not None and saved_by != num_processes:
        raise ConfigError(
            f"--resume_from_checkpoint {ckpt}: taken inside a rollout window by {saved_by} "
            f"process(es), each holding its share of the window, and resumed with {num_processes}; "
            f"resume it with {saved_by}, or from a checkpoint at a window boundary"
        )


def latest_checkpoint(output_dir: Path) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest usable checkpoint in ``output_dir`` and the newer ones skipped, each with the reason."""
    skipped = []
    for ckpt in reversed(checkpoint_dirs(output_dir)):
        try:
            check_checkpoint(ckpt)
        except ConfigError as e:
            skipped.append((ckpt, str(e).removeprefix(f"{ckpt}: ")))
            continue
        return ckpt, skipped
    return None, skipped


def resolve_resume(output_dir: Path, resume: str | None) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The checkpoint --resume_from_checkpoint names (``latest``: the newest usable one in ``output_dir``), and
    the unusable ones ``latest`` skipped. A named checkpoint that is not usable is a ConfigError saying why."""
    if not resume:
        return None, []
    if resume == "latest":
        return latest_checkpoint(Path(output_dir))
    ckpt = Path(resume)
    try:
        check_checkpoint(ckpt)
    except ConfigError as e:
        raise ConfigError(
            f"--resume_from_checkpoint {resume}: {str(e).removeprefix(f'{ckpt}: ')}; pass a complete "
            "checkpoint-N folder or 'latest'"
        ) from None
    return ckpt, []


def skipped_line(skipped: list[tuple[Path, str]]) -> str:
    return "--resume_from_checkpoint latest: skipped " + "; ".join(f"{p.name} ({why})" for p, why in skipped)


def set_aside(ckpt: Path, why: str) -> Path:
    """Rename ``ckpt`` to ``checkpoint-N.<why>`` (``.<why>-2``, ... when taken) so that no listing picks it."""
    target = ckpt.with_name(f"{ckpt.name}.{why}")
    k = 2
    while target.exists():
        target = ckpt.with_name(f"{ckpt.name}.{why}-{k}")
        k += 1
    os.replace(ckpt, target)
    return target


def set_aside_dirs(output_dir: Path) -> list[Path]:
    """The folders ``set_aside`` renamed (``checkpoint-N.abandoned``, ``.unusable``, with their ``-k`` copies)."""
    return [
        p
        for p in Path(output_dir).glob("checkpoint-*.*")
        if p.is_dir() and p.name.split(".", 1)[1].split("-")[0] in SET_ASIDE
    ]


def set_aside_newer(output_dir: Path, step: int) -> list[Path]:
    """A resume from an older checkpoint abandons the newer ones: renamed aside, kept for the user to look at."""
    moved = [set_aside(c, ABANDONED) for c in checkpoint_dirs(output_dir) if checkpoint_step(c) > step]
    if moved:
        logger.warning(
            "resuming at step %d: moved the newer checkpoints aside (%s); `latest` will not pick them",
            step,
            ", ".join(p.name for p in moved),
        )
    return moved


def remove_leftovers(output_dir: Path) -> None:
    """Half-written ``checkpoint-N.tmp`` folders of a save that never finished (the lock says no run writes)."""
    for tmp in Path(output_dir).glob(f"checkpoint-*{TMP_SUFFIX}"):
        shutil.rmtree(tmp, ignore_errors=True)


def rotate(output_dir: Path, limit: int | None, keep: Path) -> list[Path]:
    """--save_total_limit N > 0: the oldest checkpoints beyond N go, never ``keep`` (the one just written).
    None, 0 or a negative N keep every checkpoint (as transformers' Trainer reads it)."""
    if limit is None or limit <= 0:
        return []
    removed = [old for old in checkpoint_dirs(output_dir)[:-limit] if old != keep]
    for old in removed:
        shutil.rmtree(old, ignore_errors=True)
    return removed


def load_error(ckpt: Path, exc: BaseException) -> ConfigError:
    """One line for a checkpoint that failed to load: every file that does not read as data (up to three), else
    the cause. Each file is named with its own reader's complaint, so the line never blames a file that reads."""
    bad = unreadable_parts(ckpt)
    if bad:
        parts = "; ".join(f"{path} is unreadable ({why})" for path, why in bad)
        return ConfigError(
            f"--resume_from_checkpoint {ckpt}: {parts}; resume from an earlier checkpoint, or start afresh with "
            "--overwrite_output_dir true"
        )
    cause = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
    return ConfigError(
        f"--resume_from_checkpoint {ckpt}: loading it failed ({type(exc).__name__}: {cause}); resume "
        "from an earlier checkpoint, or start afresh with --overwrite_output_dir true"
    )
