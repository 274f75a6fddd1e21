"""An error that ends a run between optimizer steps saves the steps done first, as SIGTERM does (signals.py).

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
import sys
from collections.abc import Iterator

from grpokit.errors import GrpokitError
from grpokit.trainers.signals import RunStopped

logger = logging.getLogger(__name__)


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
