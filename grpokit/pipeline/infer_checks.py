"""`grpokit infer` and `grpokit eval` check everything they are given before any work: each number in its range,
the reward names in their registry (after the plugins load), the output path writable (a probe file written
beside it), the dataset read (a bad row named, with its cause), all before the model loads and generation
starts. The results are written whole or not at all: into the probe file, then renamed over ``--output``."""

from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path

from grpokit.errors import ConfigError
from grpokit.rewards.build import reward_entry


def check_numbers(args) -> None:
    """The options the sampling settings do not cover (those are checked by ``evaluate.eval_settings``)."""
    if args.limit < 0:
        raise ConfigError(f"--limit {args.limit}: must be 0 (every prompt) or a positive number of prompts, e.g. 100")
    if args.threads < 0:
        raise ConfigError(f"--threads {args.threads}: must be 0 (torch's default) or a positive thread count")
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max_new_tokens {args.max_new_tokens}: must be at least 1, e.g. 256")


def check_reward_names(names: list[str]) -> None:
    """Every --reward_funcs name is registered (after --external_plugins loaded): one line naming it otherwise."""
    for name in names:
        reward_entry(name)


class OutputFile:
    """``--output`` checked at the start (its folder created, a probe file written there) and written at the
    end through that file, renamed into place, so a failed run leaves no half-written results."""

    def __init__(self, path: str | None) -> None:
        self.path = None if path is None else Path(path)
        self._tmp: Path | None = None
        if self.path is not None:
            self._probe()

    def _probe(self) -> None:
        path = self.path
        if path.is_dir():
            raise ConfigError(f"--output {path}: is a folder; give a file path, e.g. {path / 'results.jsonl'}")
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with tmp.open("wb") as f:
                f.write(b"\0")
            if path.exists() and not os.access(path, os.W_OK):
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        except OSError as e:
            with contextlib.suppress(OSError):
                tmp.unlink()
            where = e.filename or path
            raise ConfigError(
                f"--output {path}: cannot write {where} ({e.strerror or e}); choose a writable path"
            ) from None
        self._tmp = tmp

    def write(self, lines: list[str]) -> None:
        if self._tmp is None:
            return
        with self._tmp.open("w", encoding="utf-8") as f:
            f.writelines(lines)
        os.replace(self._tmp, self.path)
        self._tmp = None

    def discard(self) -> None:
        """The probe file of a run that ended before writing."""
        if self._tmp is not None:
            with contextlib.suppress(OSError):
                self._tmp.unlink()
            self._tmp = None
