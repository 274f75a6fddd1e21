"""A resume against the checkpoint's arguments: what changed, and whether the run would still train the same thing.

Every option changes what trains unless it is listed in ``HARMLESS`` (where the run writes, how often it logs or
saves, how it reads data or reaches a server). A resume with a changed option that is not harmless is refused,
with each change as ``--name old → new``; harmless changes are said in one warning line and recorded in the new
args.json. Options that only one side knows (a grpokit version that added or dropped one) are not compared.
"""

from __future__ import annotations

import json
from pathlib import Path

from grpokit.config.plan import world_size
from grpokit.errors import ConfigError
from grpokit.redaction import redacted
from grpokit.runs.checkpoint_files import read_json
from grpokit.runs.checkpoints import ARGS_FILE, check_window_processes, read_state, resolve_resume

MAX_ARGS_BYTES = 4 << 20  # an args.json is a few KiB; a file of MiBs is not a run's

HARMLESS = frozenset(
    {
        # where and how outputs are written
        "output_dir",
        "overwrite_output_dir",
        "resume_from_checkpoint",
        "logging_steps",
        "logging_first_step",
        "save_steps",
        "save_strategy",
        "save_total_limit",
        "save_final_model",
        "plots",
        "report_to",
        "disable_tqdm",
        "log_completions",
        "log_completions_max_tokens",
        "log_completions_max_rows",
        "write_report",
        # evaluation (it reads the validation rows, trains on nothing)
        "eval_steps",
        "eval_strategy",
        "eval_on_start",
        "eval_on_end",
        "per_device_eval_batch_size",
        "val_dataset",
        # how the rows are read, not which
        "dataloader_num_workers",
        "dataloader_prefetch_factor",
        "dataloader_multiprocessing_context",
        "dataset_num_proc",
        "load_from_cache_file",
        # where the rollout server is and how long to wait for it
        "vllm_server_host",
        "vllm_server_port",
        "vllm_server_base_url",
        "vllm_server_timeout",
        "vllm_server_api_key",
        # memory and speed settings with the same arithmetic
        "offload_model",
        "offload_optimizer",
        "weight_sync_bucket_mb",
        "code_exec_workers",
        "sleep_level",
        "vllm_gpu_memory_utilization",
        "vllm_max_num_seqs",
        "vllm_enable_prefix_caching",
        "vllm_enforce_eager",
        # plugin files may move; callbacks watch the run
        "external_plugins",
        "callbacks",
        # a longer or shorter run: the learning-rate schedule is recomputed for the new length (said in the warning)
        "max_steps",
        "num_train_epochs",
    }
)


def read_args(path: Path) -> dict | None:
    """A run's args.json, or None when there is none; a torn, foreign or oversized one (or one that is not a
    regular file) is a ConfigError."""
    if not path.exists() and not path.is_symlink():
        return None
    try:
        args = read_json(path, MAX_ARGS_BYTES)
    except ConfigError as e:
        raise ConfigError(f"{e}; restore it or delete it to resume without the check") from None
    if not isinstance(args, dict):
        raise ConfigError(f"{path}: not an object of options; restore it or delete it to resume without the check")
    return args


def normalised(flat: dict) -> dict:
    """Options as args.json holds them (JSON round trip: tuples become lists, paths strings; secrets redacted,
    grpokit/redaction.py: a run's folder is shared, its report mailed)."""
    return redacted(json.loads(json.dumps(flat, default=str)))


def changed_options(old: dict, new: dict) -> list[tuple[str, object, object]]:
    return [(k, old[k], new[k]) for k in sorted(old.keys() & new.keys()) if old[k] != new[k]]


def _show(v: object) -> str:
    text = json.dumps(v, default=str)
    return text if len(text) <= 80 else text[:77] + "..."


def check_resume_args(old: dict | None, new: dict, ckpt: Path) -> list[str]:
    """Refuse a resume whose options would train something else; return the harmless changes, shown."""
    if old is None:
        return []
    changes = changed_options(redacted(old), normalised(new))  # an older args.json may hold a secret
    refused = [f"--{k} {_show(a)} → {_show(b)}" for k, a, b in changes if k not in HARMLESS]
    if refused:
        raise ConfigError(
            f"--resume_from_checkpoint {ckpt}: these options differ from the checkpoint's run and "
            f"would train something else: {', '.join(refused)}; resume with the checkpoint's values "
            "(its args.json), or start a new run in another --output_dir"
        )
    return [f"--{k} {_show(a)} → {_show(b)}" for k, a, b in changes if k != "resume_from_checkpoint"]


def preflight_resume(output_dir: Path, resume: str | None, flat: dict) -> None:
    """Before any model loads: the checkpoint a resume would use exists and is whole, and its arguments match
    (RunOutputs.resume checks again, for trainers built without the pipeline)."""
    ckpt, _ = resolve_resume(Path(output_dir), resume)
    if ckpt is not None:
        check_window_processes(read_state(ckpt), world_size(), ckpt)
        check_resume_args(read_args(ckpt / ARGS_FILE) or read_args(Path(output_dir) / ARGS_FILE), flat, ckpt)
