"""``--offload_model`` / ``--offload_optimizer`` (ms-swift's names): while an engine with its own copy of the
weights (vLLM colocate) generates, the training model's weights and buffers (and the reference model's) and the
optimizer state wait in CPU memory, so the engine has the accelerator to itself; they come back before the window's
logps and training steps.

Every tensor returns to the device it came from (an Adam ``step`` counter kept on the CPU stays there). Moves are
copies (``Tensor.to(device, copy=True)``): the tensor no longer shares storage with the one it replaces, across
devices as ``to`` always does, and on one device too, which lets a CPU-only test watch the moves happen.

Where nothing can be gained the options are accepted with one warning line at start-up, as ms-swift's options that
do not apply: the in-process transformers engine samples with the training model itself, a rollout server
generates in another process, and a model trained on the CPU is in CPU memory already. With ``--deepspeed`` or
``--fsdp`` the weights and optimizer state are partitioned by those engines; moving them is not implemented
(config/validate.py refuses the combination with vLLM colocate).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch

logger = logging.getLogger(__name__)

# engines whose generation does not use an in-process copy of the weights that offloading makes room for
_NO_EFFECT = {
    "transformers": "the in-process transformers engine samples with the training model itself (or, "
    "sharded, with a gathered copy of its weights on the training device)",
    "server": "server mode generates on the rollout server, in another process",
}


class Offloader:
    """Moves the given models' parameters and buffers (``offload_model``) and the optimizer's state tensors
    (``offload_optimizer``) to ``offload_device`` inside ``offloaded()`` and back to where each came from on
    exit. ``moves`` counts tensors moved (both ways), for logs and tests."""

    def __init__(
        self,
        models: list,
        optimizer,
        *,
        offload_model: bool,
        offload_optimizer: bool,
        offload_device: str | torch.device = "cpu",
    ) -> None:
        self.models = [m for m in models if m is not None] if offload_model else []
        self.optimizer = optimizer if offload_optimizer else None
        self.offload_device = torch.device(offload_device)
        self.moves = 0

    @contextmanager
    def offloaded(self) -> Iterator[None]:
        homes: list[tuple] = []  # filled as tensors move, so a failure half-way still brings back what moved
        try:
            self._offload(homes)
            yield
        finally:
            self._reload(homes)

    @torch.no_grad()
    def _offload(self, homes: list[tuple]) -> None:
        """Move everything out, adding (setter, tensor now, home device) to ``homes`` for the way back."""
        for model in self.models:
            for t in [*model.parameters(), *model.buffers()]:
                home, moved, setter = t.device, self._move(t.data, self.offload_device), _set_data(t)
                setter(moved)
                homes.append((setter, moved, home))
        if self.optimizer is not None:
            for state in self.optimizer.state.values():
                for key, value in list(state.items()):
                    if isinstance(value, torch.Tensor):
                        state[key] = moved = self._move(value, self.offload_device)
                        homes.append((_set_item(state, key), moved, value.device))
        _free_cache()

    @torch.no_grad()
    def _reload(self, homes: list[tuple]) -> None:
        for setter, tensor, home in homes:
            setter(self._move(tensor, home))

    def _move(self, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        self.moves += 1
        return tensor.to(device, copy=True)


def _set_data(t: torch.Tensor):
    def setter(value: torch.Tensor) -> None:
        t.data = value  # the Parameter object stays: optimizer, hooks and tied weights still point at it

    return setter


def _set_item(state: dict, key):
    def setter(value: torch.Tensor) -> None:
        state[key] = value

    return setter


def _free_cache() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # hand the freed blocks back, so the engine can use them


def make_offloader(
    rollout_args, engine, models: list, optimizer, device: torch.device, main_process: bool = True
) -> Offloader | None:
    """The Offloader for this run, or None when neither option is on or (one warning line, from the main process)
    they have no effect."""
    on = [f"--{n}" for n in ("offload_model", "offload_optimizer") if getattr(rollout_args, n)]
    if not on:
        return None
    kind = getattr(engine, "engine_type", "")
    why = _NO_EFFECT.get(kind)
    if why is None and torch.device(device).type == "cpu":
        why = "training runs on the CPU, so the weights and optimizer state are in CPU memory already"
    if why is not None:
        if main_process:
            logger.warning("%s %s no effect here: %s", " and ".join(on), "has" if len(on) == 1 else "have", why)
        return None
    return Offloader(
        models, optimizer, offload_model=rollout_args.offload_model, offload_optimizer=rollout_args.offload_optimizer
    )


def offload_context(offloader: Offloader | None):
    """``offloader.offloaded()``, or a context that does nothing without one."""
    return offloader.offloaded() if offloader is not None else nullcontext()
