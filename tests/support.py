"""Builders the test files share instead of copying: command lines of `grpokit train`, the blocks of options many
runs repeat (quiet output, colocated vLLM, a rollout server to train against), datasets and reward plugins written
to disk, and a run's logged rows. Importable as ``support`` from every test folder (tests/ is on ``sys.path``
because tests/conftest.py lives there)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

# a run that writes only its logs: no final model, no plots, no progress bar
QUIET = {"--save_final_model": "false", "--plots": "false", "--disable_tqdm": "true"}
# vLLM in the trainer's process on the CPU, sized for the tiny models
VLLM_COLOCATE = {
    "--use_vllm": "true",
    "--vllm_mode": "colocate",
    "--vllm_enforce_eager": "true",
    "--vllm_max_model_len": "512",
    "--vllm_gpu_memory_utilization": "0.3",
}


def flags(*parts) -> list[str]:
    """A command line from ``parts``, in order: a dict gives option, value pairs; a string that starts with ``--``
    and holds white space gives its words (``"--max_steps 2 --beta 0"``); anything else (a path, a number, a
    string with spaces that is one value) is one argument. A later option wins where the parser sees it twice."""
    out: list[str] = []
    for part in parts:
        if isinstance(part, dict):
            out += [str(x) for pair in part.items() for x in pair]
        elif isinstance(part, str) and part.startswith("--") and part.split() != [part]:
            out += part.split()
        else:
            out.append(str(part))
    return out


def server_flags(port: int, timeout: int | None = None) -> dict:
    """Options that send a run's rollouts to a `grpokit rollout` server on 127.0.0.1:``port``."""
    found = {"--vllm_mode": "server", "--vllm_server_host": "127.0.0.1", "--vllm_server_port": str(port)}
    return found if timeout is None else {**found, "--vllm_server_timeout": str(timeout)}


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    """``rows`` as JSON lines at ``path``."""
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_plugin(path: Path, source: str) -> Path:
    """A plugin module (``--external_plugins``) with ``source``, dedented, at ``path``."""
    path.write_text(textwrap.dedent(source))
    return path


def logged_rows(out: Path) -> list[dict]:
    """Every row of a run's logging.jsonl."""
    return [json.loads(line) for line in (out / "logging.jsonl").read_text().splitlines()]


def logged_steps(out: Path) -> list[dict]:
    """The optimizer steps' rows of a run's logging.jsonl (those with a loss)."""
    return [r for r in logged_rows(out) if "loss" in r]
