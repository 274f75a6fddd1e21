"""The pause a weight update sets so that a running generation hands it the engine's lock and continues after
it on the new weights (partial rollouts): shared by the served transformers engine (engines/partial/served.py) and the
vLLM engines (vllm_steps.py)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from contextvars import ContextVar

# Set around a call that must run to its end while the pause holds (the weight-sync check's probe, which runs on
# the new weights before the paused rows continue): the pause does not stop it.
PROBING: ContextVar[bool] = ContextVar("grpokit_probing", default=False)


class PauseGate:
    """What a weight update and a pausable engine (with ``lock``) share: the update sets the pause before it takes
    the lock; the generation, seeing it, hands the lock over (``_wait_for_update``) and takes it back once the
    update has cleared the pause. Counts the resumed rows in ``partial_resumes``."""

    def _init_partial(self) -> None:
        self._pause = threading.Event()
        self._resumed = threading.Condition()
        self._pausable = True  # False while a call that cannot resume runs (it runs to its end)
        self.partial_resumes = 0

    def _sampled_version(self, resumed: bool = False) -> int | None:
        """The weight version the tokens sampled now are tagged with (``resumed``: after a weight update paused
        the call); an engine serving several versions says which one the call samples."""
        return self.policy_version

    def pause_for_update(self) -> None:
        self._pause.set()

    def resume_after_update(self) -> None:
        with self._resumed:
            self._pause.clear()
            self._resumed.notify_all()

    def _wait_for_update(self) -> None:
        """Give the lock to the waiting update, and take it back once the update is done."""
        self.lock.release()
        try:
            with self._resumed:
                while self._pause.is_set():
                    self._resumed.wait(timeout=1.0)
        finally:
            self.lock.acquire()


@contextlib.contextmanager
def paused(engine) -> Iterator[None]:
    """Hold a pausable engine's running generation at its next token for the block (the block takes the lock as
    it needs; the rows continue after it); a plain engine is left as it is, so the block waits for its batch."""
    pausable = hasattr(engine, "pause_for_update")
    if pausable:
        engine.pause_for_update()
    try:
        yield
    finally:
        if pausable:
            engine.resume_after_update()
