"""Everything a run leaves in output_dir: args.json, logging.jsonl, completions.jsonl, trackers, checkpoints
(save, rotate, resume, clear an earlier run's), the final model, plots and the end-of-run summary."""

from __future__ import annotations

import json
import logging
import random
import shutil
from pathlib import Path

from grpokit.config.plan import checkpoint_dirs, earlier_run_checkpoints
from grpokit.errors import ConfigError
from grpokit.trainers.distributed import full_state_dict
from grpokit.trainers.outputs import JsonlLog, plot_curves, progress_bar, summary_text

logger = logging.getLogger(__name__)
STATE_FILE = "trainer_state.json"


class RunOutputs:
    """Owns output_dir. Writes happen on the main process; the collectives (checkpoints) run on every process."""

    def __init__(self, accelerator, args, flat_config: dict, tokenizer) -> None:
        self.accelerator, self.args, self.tokenizer = accelerator, args, tokenizer
        self.output_dir = Path(args.output_dir)
        main = accelerator.is_main_process
        if main:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            (self.output_dir / "args.json").write_text(json.dumps(flat_config, indent=2, default=str))
        self._log = JsonlLog(self.output_dir / "logging.jsonl", enabled=main)
        self._completions = JsonlLog(self.output_dir / "completions.jsonl", enabled=main and args.log_completions)
        if [r for r in args.report_to if r != "none"]:
            accelerator.init_trackers("grpokit", config={k: str(v) for k, v in flat_config.items()})

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

    def progress(self, total: int, initial: int):
        return progress_bar(main=self.accelerator.is_main_process, disable_tqdm=self.args.disable_tqdm,
                            total=total, initial=initial)

    def close(self) -> None:
        self._log.close()
        self._completions.close()

    # -- checkpoints -----------------------------------------------------------------------------------------
    def save_checkpoint(self, model, *, step: int, prompts_consumed: int, max_steps: int,
                        extra: dict | None = None) -> Path:
        """accelerate's state (optimizer, schedule, RNGs), the model as ``save_pretrained`` writes it, the
        tokenizer, and the loop's position (with ``extra`` positions, e.g. CHORD's SFT rows); then the oldest
        checkpoints beyond --save_total_limit go."""
        ckpt = self.output_dir / f"checkpoint-{step}"
        acc = self.accelerator
        acc.wait_for_everyone()
        acc.save_state(str(ckpt / "state"))
        state_dict = full_state_dict(acc, model)  # a collective when weights are sharded
        if acc.is_main_process:
            acc.unwrap_model(model).save_pretrained(ckpt, state_dict=state_dict, safe_serialization=True)
            self.tokenizer.save_pretrained(ckpt)
            loop = {"global_step": step, "prompts_consumed": prompts_consumed, "max_steps": max_steps,
                    "python_random": repr(random.getstate()[1][:3]), **(extra or {})}
            (ckpt / STATE_FILE).write_text(json.dumps(loop, indent=2))
            self._rotate_checkpoints()
        acc.wait_for_everyone()
        return ckpt

    def _rotate_checkpoints(self) -> None:
        limit = self.args.save_total_limit
        if not limit:
            return
        for old in checkpoint_dirs(self.output_dir)[:-limit]:
            shutil.rmtree(old, ignore_errors=True)

    def _clear_earlier_run(self) -> None:
        """A fresh run starts with an output_dir of its own: an earlier run's checkpoints are deleted when
        --overwrite_output_dir allows it (refused otherwise), and its log rows dropped so they cannot mix into
        this run's logs and plots."""
        earlier = earlier_run_checkpoints(self.output_dir, self.args.overwrite_output_dir)
        if self.accelerator.is_main_process:
            for old in earlier:
                shutil.rmtree(old, ignore_errors=True)
            self._log.truncate_after(0)
            self._completions.truncate_after(0)
        self.accelerator.wait_for_everyone()

    def resume(self) -> dict | None:
        """With --resume_from_checkpoint: load accelerate's state, drop log rows after the checkpoint, and return
        the loop's position (``global_step``, ``prompts_consumed``). Without it: clear an earlier run, None."""
        path = self.args.resume_from_checkpoint
        if path == "latest":
            ckpts = [c for c in checkpoint_dirs(self.output_dir) if (c / STATE_FILE).is_file()]
            if not ckpts:
                logger.warning("--resume_from_checkpoint latest: no checkpoint in %s; starting fresh", self.output_dir)
            path = str(ckpts[-1]) if ckpts else None
        if not path:
            self._clear_earlier_run()
            return None
        ckpt = Path(path)
        if not (ckpt / STATE_FILE).is_file():
            raise ConfigError(f"--resume_from_checkpoint {path}: not a grpokit checkpoint (no {STATE_FILE})")
        self.accelerator.load_state(str(ckpt / "state"))
        loop = json.loads((ckpt / STATE_FILE).read_text())
        self._log.truncate_after(loop["global_step"])
        self._completions.truncate_after(loop["global_step"])
        logger.info("resumed from %s at step %d", ckpt, loop["global_step"])
        return loop

    # -- the end ---------------------------------------------------------------------------------------------
    def finish(self, model, final_ckpt: Path) -> None:
        """The final model (--save_final_model), plots, and the summary printed at the end."""
        acc = self.accelerator
        extra = {"logs": str(self.output_dir / "logging.jsonl"), "last checkpoint": str(final_ckpt)}
        state_dict = full_state_dict(acc, model) if self.args.save_final_model else None
        if not acc.is_main_process:
            return
        if self.args.save_final_model:
            final = self.output_dir / "final_model"
            acc.unwrap_model(model).save_pretrained(final, state_dict=state_dict, safe_serialization=True)
            self.tokenizer.save_pretrained(final)
            extra["final model"] = str(final)
        rows = [r for r in self._log.rows() if "loss" in r]
        if self.args.plots:
            plots = plot_curves(rows, self.output_dir)
            if plots:
                extra["plots"] = ", ".join(p.name for p in plots)
        if self.args.log_completions:
            extra["completions"] = str(self.output_dir / "completions.jsonl")
        print(summary_text(rows, self.output_dir, extra), flush=True)
