"""Everything a run leaves in output_dir: args.json, logging.jsonl, completions.jsonl, trackers, checkpoints
(save, rotate, resume, clear an earlier run's), the final model, plots and the end-of-run summary. The folder
rules (atomic checkpoints, which checkpoint `latest` is, setting aside) are in checkpoints.py; probing, locking
and OS errors in run_dir.py."""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
from pathlib import Path
from typing import Protocol

from grpokit.config.moot import installed_trackers
from grpokit.config.plan import earlier_run_checkpoints
from grpokit.distributed.processes import full_state_dict
from grpokit.errors import GrpokitError
from grpokit.redaction import remember_secrets
from grpokit.runs.checkpoint_files import check_rng_restored, rng_path, rng_state
from grpokit.runs.checkpoints import (
    ARGS_FILE,
    TMP_SUFFIX,
    UNUSABLE,
    check_checkpoint,
    check_window_processes,
    finish_checkpoint,
    load_error,
    remove_leftovers,
    resolve_resume,
    rotate,
    set_aside,
    set_aside_dirs,
    set_aside_newer,
    skipped_line,
    temporary_dir,
)
from grpokit.runs.outputs import JsonlLog, plot_curves, summary_text
from grpokit.runs.pickle_scan import check_pickles
from grpokit.runs.progress import Phases, progress_bar
from grpokit.runs.run_args import check_resume_args, normalised, read_args
from grpokit.runs.run_dir import atomic_write_text, output_errors
from grpokit.viewer import write_report

logger = logging.getLogger(__name__)


class UnfinishedWindow(Protocol):
    """What a checkpoint saves of the window in training (trainers/state.py's ``WindowProgress``)."""

    unfinished: bool

    def save(self, folder: Path, rank: int, step_metrics: dict) -> None: ...


class RunOutputs:
    """Owns output_dir. Writes happen on the main process; the collectives (checkpoints) run on every process."""

    def __init__(self, accelerator, args, flat_config: dict, tokenizer) -> None:
        self.accelerator, self.args, self.tokenizer = accelerator, args, tokenizer
        self.output_dir = Path(args.output_dir)
        self.saved_step: int | None = None  # the step of the last checkpoint this run saved or resumed from
        main = accelerator.is_main_process
        if main:
            with output_errors(self.output_dir, "creating"):
                self.output_dir.mkdir(parents=True, exist_ok=True)
        # args.json is written once resume() has compared the checkpoint's arguments with these
        remember_secrets(flat_config)  # the log filter redacts them too
        self._flat = normalised(flat_config)
        self._args_text = json.dumps(self._flat, indent=2)
        self._log = JsonlLog(self.output_dir / "logging.jsonl", enabled=main)
        self._completions = JsonlLog(self.output_dir / "completions.jsonl", enabled=main and args.log_completions)
        if installed_trackers(args.report_to):
            accelerator.init_trackers("grpokit", config={k: str(v) for k, v in self._flat.items()})

    # -- logs ------------------------------------------------------------------------------------------------
    def log(self, logs: dict) -> None:
        """One optimizer step's row: logging.jsonl and the trackers (main process only)."""
        if self.accelerator.is_main_process:
            self._log.write(logs)
            self.accelerator.log({k: v for k, v in logs.items() if k != "step"}, step=logs["step"])

    def log_eval(self, logs: dict) -> None:
        if self.accelerator.is_main_process:
            self._log.write(logs)

    def write_completions(self, rows: list[dict]) -> None:
        for row in rows:
            self._completions.write(row)

    def progress(self, total: int, initial: int, phases: Phases | None = None):
        return progress_bar(
            main=self.accelerator.is_main_process,
            disable_tqdm=self.args.disable_tqdm,
            total=total,
            initial=initial,
            phases=phases,
        )

    def close(self) -> None:
        self._log.close()
        self._completions.close()

    # -- checkpoints -----------------------------------------------------------------------------------------
    def save_checkpoint(
        self,
        model,
        *,
        step: int,
        prompts_consumed: int,
        max_steps: int,
        extra: dict | None = None,
        window: UnfinishedWindow | None = None,
        step_metrics: dict | None = None,
    ) -> Path:
        """accelerate's state (optimizer, schedule, RNGs), the model as ``save_pretrained`` writes it, the
        tokenizer, args.json, the rest of an unfinished ``window`` (each process its share, with the
        ``step_metrics`` not logged yet) and the loop's position (with ``extra`` positions, e.g. CHORD's SFT
        rows), all into ``checkpoint-N.tmp``, which becomes ``checkpoint-N`` once complete (checkpoints.py);
        then the oldest checkpoints beyond --save_total_limit go."""
        ckpt = self.output_dir / f"checkpoint-{step}"
        acc = self.accelerator
        main = acc.is_main_process
        acc.wait_for_everyone()
        tmp = ckpt.with_name(ckpt.name + TMP_SUFFIX)
        try:
            with output_errors(tmp, "writing the checkpoint"):
                if main:
                    temporary_dir(ckpt)
                acc.wait_for_everyone()
                acc.save_state(str(tmp / "state"))
                state_dict = full_state_dict(acc, model)  # a collective when weights are sharded
                if window is not None:
                    window.save(tmp, acc.process_index, step_metrics or {})
                if main:
                    acc.unwrap_model(model).save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
                    self.tokenizer.save_pretrained(tmp)
                    (tmp / ARGS_FILE).write_text(self._args_text)
                acc.wait_for_everyone()  # every process's files are in before the state file seals them
                if main:
                    loop = {
                        "global_step": step,
                        "prompts_consumed": prompts_consumed,
                        "max_steps": max_steps,
                        "python_random": repr(random.getstate()[1][:3]),
                        **(extra or {}),
                    }
                    if window is not None and window.unfinished:  # one window file per process
                        loop["window_processes"] = acc.num_processes
                    finish_checkpoint(tmp, ckpt, loop)
                    rotate(self.output_dir, self.args.save_total_limit, keep=ckpt)
        except BaseException:
            if main:  # a save that failed (a full disk) leaves the earlier checkpoints as they were, and its space
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        acc.wait_for_everyone()
        self.saved_step = step
        return ckpt

    def _clear_earlier_run(self) -> None:
        """A fresh run starts with an output_dir of its own: an earlier run's checkpoints are deleted when
        --overwrite_output_dir allows it (refused otherwise), and its log rows dropped so they cannot mix into
        this run's logs and plots."""
        earlier = earlier_run_checkpoints(self.output_dir, self.args.overwrite_output_dir)
        if self.accelerator.is_main_process:
            for old in earlier + (set_aside_dirs(self.output_dir) if self.args.overwrite_output_dir else []):
                shutil.rmtree(old, ignore_errors=True)
            self._log.truncate_after(0)
            self._completions.truncate_after(0)
        self.accelerator.wait_for_everyone()

    def _start_fresh(self) -> None:
        self._clear_earlier_run()
        self._write_args()

    def resume(self) -> dict | None:
        """With --resume_from_checkpoint: check the checkpoint and its arguments against this run's, load
        accelerate's state, set newer checkpoints aside, drop log rows after the checkpoint (and a torn last
        line), and return the loop's position (``global_step``, ``prompts_consumed``, ``checkpoint``). Without
        it, or with ``latest`` and no usable checkpoint: start fresh, None."""
        acc, main = self.accelerator, self.accelerator.is_main_process
        if main:
            remove_leftovers(self.output_dir)
        ckpt, skipped = resolve_resume(self.output_dir, self.args.resume_from_checkpoint)
        acc.wait_for_everyone()  # every process chose before the main one renames anything
        if skipped and main:
            logger.warning(skipped_line(skipped))
        if ckpt is None:
            if self.args.resume_from_checkpoint == "latest":
                logger.warning(
                    "--resume_from_checkpoint latest: no usable checkpoint in %s; starting fresh", self.output_dir
                )
                if main:  # set aside, not deleted: this run's rotation and a later `latest` never pick them
                    for bad, _ in skipped:
                        set_aside(bad, UNUSABLE)
                acc.wait_for_everyone()
            self._start_fresh()
            return None
        loop = check_checkpoint(ckpt)
        check_window_processes(loop, acc.num_processes, ckpt)
        changes = check_resume_args(
            read_args(ckpt / ARGS_FILE) or read_args(self.output_dir / ARGS_FILE), self._flat, ckpt
        )
        if changes and main:
            logger.warning(
                "--resume_from_checkpoint %s: options changed that do not change what trains: %s; "
                "args.json records the new values",
                ckpt,
                ", ".join(changes),
            )
        check_pickles(ckpt)  # DeepSpeed and torch.distributed.checkpoint unpickle: only allowed names (pickle_scan.py)
        rng = rng_state(ckpt / "state", acc.process_index)  # read as data first: accelerate would skip it silently
        try:
            acc.load_state(str(ckpt / "state"))
        except GrpokitError:
            raise
        except Exception as e:  # torch, safetensors and the unpickler each raise their own type
            raise load_error(ckpt, e) from e
        check_rng_restored(rng, rng_path(ckpt / "state", acc.process_index))
        step = self.saved_step = loop["global_step"]
        if main:
            if ckpt.parent.resolve() == self.output_dir.resolve():
                set_aside_newer(self.output_dir, step)
            torn = self._log.truncate_after(step) + self._completions.truncate_after(step)
            if torn:
                logger.warning("resume: dropped %d torn last line(s) of logging.jsonl/completions.jsonl", torn)
        self._write_args()
        if main:
            logger.info("resumed from %s at step %d", ckpt, step)
        return {**loop, "checkpoint": str(ckpt)}

    def _write_args(self) -> None:
        if self.accelerator.is_main_process:
            path = self.output_dir / ARGS_FILE
            with output_errors(path, "writing"):
                atomic_write_text(path, self._args_text)
        self.accelerator.wait_for_everyone()

    # -- the end ---------------------------------------------------------------------------------------------
    def finish(self, model, final_ckpt: Path) -> None:
        """The final model (--save_final_model), plots, report.html (--write_report), and the summary printed at
        the end."""
        acc = self.accelerator
        extra = {"logs": str(self.output_dir / "logging.jsonl"), "last checkpoint": str(final_ckpt)}
        state_dict = full_state_dict(acc, model) if self.args.save_final_model else None
        if not acc.is_main_process:
            return
        if self.args.save_final_model:
            final = self.output_dir / "final_model"
            tmp = final.with_name(final.name + TMP_SUFFIX)
            try:
                with output_errors(tmp, "writing the final model"):
                    shutil.rmtree(tmp, ignore_errors=True)
                    acc.unwrap_model(model).save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
                    self.tokenizer.save_pretrained(tmp)
                    if final.exists():
                        shutil.rmtree(final)
                    os.replace(tmp, final)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            extra["final model"] = str(final)
        rows = [r for r in self._log.rows() if "loss" in r]
        if self.args.plots:
            plots = plot_curves(rows, self.output_dir)
            if plots:
                extra["plots"] = ", ".join(p.name for p in plots)
        if self.args.log_completions:
            extra["completions"] = str(self.output_dir / "completions.jsonl")
        if self.args.write_report:  # the trajectory viewer; `grpokit view OUTPUT_DIR` rebuilds it
            extra["report"] = str(write_report(self.output_dir))
        evals = [r for r in self._log.rows() if "loss" not in r and any(k.startswith("eval/") for k in r)]
        print(summary_text(rows, self.output_dir, extra, evals), flush=True)
