"""How a run stops between optimizer steps: on a signal, or on an error, each time with the last step saved.

SIGTERM and Ctrl-C during training: finish the optimizer step, save, stop with a line saying how to resume.

``StopRequest.install()`` replaces the SIGTERM and SIGINT handlers for the length of ``train()``. The first of
either only records the request; the loop asks ``requested`` after each optimizer step (all processes agree, so
that every rank saves the same step), saves a checkpoint and raises ``RunStopped``, which the CLI turns into one
line and exit status 143 (SIGTERM) or 130 (SIGINT). A second SIGINT raises KeyboardInterrupt at once, as Ctrl-C
does without grpokit. Handlers can only be set on the main thread; elsewhere (a trainer driven from a worker
thread) the request never comes and the default behaviour stays.

An error that ends a run between optimizer steps saves the steps done first, as SIGTERM does.

The loop's work at a step boundary (drawing and rolling out the next window, building it, the weight sync) is
marked ``at_step_boundary``. When it raises (a rollout server gone, a reward that fails, an engine error) after an
optimizer step that no checkpoint holds, the run saves a checkpoint at that step before it ends: the windows
drawn and not yet in the loop's hands are handed back to the prompt stream first, so the checkpoint lists them
as pending and a resume trains them (exactly once). Then the error goes on with one more sentence saying where
the checkpoint is and how to continue. A second fault while saving leaves the first error as it was, and says
that nothing was saved.

Only with one process: with several, the ranks that did not fail are elsewhere in the loop, and a save (a
collective) would wait for them forever; the error then ends the run as before (resume from the last checkpoint).
Errors inside a micro-step (the loss, backward, the optimizer) are not covered: gradients are half accumulated
there, so the step is not one a checkpoint can hold.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator

from grpokit.errors import GrpokitError

logger = logging.getLogger(__name__)

EXIT_CODES = {signal.SIGTERM: 128 + signal.SIGTERM, signal.SIGINT: 128 + signal.SIGINT}
_stopping = threading.Event()  # a stop was requested: later SIGTERMs (a launcher repeats it) change nothing


class RunStopped(GrpokitError):
    """The run stopped on a signal after saving a checkpoint; ``exit_code`` is 128 + the signal number."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@contextlib.contextmanager
def stop_outside_the_loop() -> Iterator[None]:
    """SIGTERM while the run loads or finishes (outside ``train()``'s loop, which handles it itself): there is no
    step to finish, so it stops at once, as RunStopped (one line, exit 143) rather than a silent -15."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handle(signum: int, frame) -> None:
        if _stopping.is_set():  # the loop saved and is on its way out; a repeated SIGTERM must not cut that short
            return
        _stopping.set()
        raise RunStopped(
            "SIGTERM: stopped outside the training loop; nothing was saved since the last checkpoint "
            "(continue from it with --resume_from_checkpoint latest)",
            EXIT_CODES[signal.SIGTERM],
        )

    _stopping.clear()
    previous = signal.signal(signal.SIGTERM, handle)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        _stopping.clear()


class StopRequest:
    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def install(self) -> StopRequest:
        if threading.current_thread() is not threading.main_thread():
            return self
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        if self.signum == signal.SIGINT and signum == signal.SIGINT:  # the second Ctrl-C: stop now
            raise KeyboardInterrupt
        if self.signum is None:
            self.signum = signum
            _stopping.set()
            name = signal.Signals(signum).name
            again = "; press Ctrl-C again to stop at once without saving" if signum == signal.SIGINT else ""
            if os.environ.get("RANK", "0") == "0":  # every process of a launch gets it; one says so
                print(
                    f"grpokit: {name}: finishing the current optimizer step, then saving a checkpoint{again}",
                    file=sys.stderr,
                    flush=True,
                )

    def agreed(self, accelerator) -> int | None:
        """The signal any process received (a collective with several processes: all of them stop together)."""
        if accelerator.num_processes == 1:
            return self.signum
        import torch

        mine = torch.tensor([float(self.signum or 0)], device=accelerator.device)
        return int(accelerator.reduce(mine, reduction="max").item()) or None

    def stopped(self, signum: int, step: int, ckpt) -> RunStopped:
        name = signal.Signals(signum).name
        return RunStopped(
            f"{name}: stopped after step {step}; checkpoint saved in {ckpt}; continue with the same "
            "command and --resume_from_checkpoint latest",
            EXIT_CODES.get(signum, 128 + signum),
        )


def at_step_boundary(method):
    """A method of the loop's work between optimizer steps (the next window, the weight sync): an error in it
    saves a checkpoint of the last optimizer step (when none holds it yet) before it ends the run; its success
    means the windows drawn so far are in the loop's hands (``PromptStream.settle``)."""

    @functools.wraps(method)
    def run(trainer, *args, **kwargs):
        with saved_on_error(trainer):
            out = method(trainer, *args, **kwargs)
        trainer._producer.prompts.settle()
        return out

    return run


@contextlib.contextmanager
def saved_on_error(trainer) -> Iterator[None]:
    """An error inside saves a checkpoint of the last optimizer step first (see the module's docstring)."""
    try:
        yield
    except Exception as e:
        if isinstance(e, RunStopped) or trainer.accelerator.num_processes > 1:
            raise
        step = trainer.state.global_step
        if step == 0 or trainer._outputs.saved_step == step:
            raise
        ckpt = _save(trainer, e)
        if ckpt is None:
            raise
        note = f"the run stopped after step {step}; checkpoint saved in {ckpt}: fix the cause, then continue with "
        note += "the same command and --resume_from_checkpoint latest"
        if isinstance(e, GrpokitError):  # the same error (its type kept for callers), its line one sentence longer
            e.args = (f"{e}; {note}",)
            raise
        print(f"grpokit: {type(e).__name__} ended the run; {note}", file=sys.stderr, flush=True)
        raise


def _save(trainer, error: BaseException):
    """The checkpoint at this step with every window drawn and not in the loop's hands pending; None (and a line)
    when the save itself fails."""
    stream = trainer._producer.prompts
    stream.requeue(stream.unsettled)
    try:
        return trainer._save_checkpoint()
    except Exception as save_error:  # noqa: BLE001 - the first error is the one to report; this one is said
        logger.error(
            "after %s, saving a checkpoint at step %d failed too (%s); nothing was saved since the last checkpoint",
            type(error).__name__,
            trainer.state.global_step,
            str(save_error).splitlines()[0][:200] if str(save_error) else type(save_error).__name__,
        )
        return None
