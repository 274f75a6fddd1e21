"""--offload_model / --offload_optimizer with vLLM colocate: while vLLM generates a window, the trainer's weights
and optimizer state are copies away from their training storage; training goes on, and after every weight sync
vLLM's greedy output equals the trainer model's.

On this CPU the training model is in CPU memory already, so make_offloader warns and offloads nothing; the test
installs the Offloader that make_offloader builds on a GPU (the same class, same arguments), whose moves are
copies and therefore visible as storage changes on one device too."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from support import VLLM_COLOCATE, flags

from grpokit.config.parse import parse_train_args

sys.path.insert(0, str(Path(__file__).parent))
from test_vllm_train import _args, _logged_steps, compare  # noqa: E402

pytestmark = pytest.mark.vllm


def _storage(model, optimizer) -> list[torch.Tensor]:
    """Views of the trainer's weight and optimizer-state storage (holding them keeps that memory from being
    reused, so a data pointer seen later in it means the same storage)."""
    return [
        t.detach()
        for t in [
            *model.parameters(),
            *(v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.numel() > 1),
        ]
    ]


def test_colocate_with_offload_trains_in_step_and_generates_without_the_training_storage(
    tiny128, tmp_path, monkeypatch
):
    from grpokit.distributed import offload
    from grpokit.engines.vllm_engine import VllmEngine
    from grpokit.pipeline.train import run_train
    from grpokit.trainers import trainer_setup

    made: list[offload.Offloader] = []

    def gpu_offloader(rollout_args, engine, models, optimizer, device, main_process):
        assert engine.engine_type == "vllm" and device.type == "cpu"
        made.append(
            offload.Offloader(
                models,
                optimizer,
                offload_model=rollout_args.offload_model,
                offload_optimizer=rollout_args.offload_optimizer,
            )
        )
        return made[-1]

    monkeypatch.setattr(trainer_setup, "make_offloader", gpu_offloader)
    checks: list[dict] = []
    training_storage: list[list[torch.Tensor]] = []  # after each sync: the trainer's tensors (kept alive)
    overlaps: list[int] = []  # during each rollout: how many of them are still in that storage
    comparing = [False]
    sync, infer = VllmEngine.sync_weights, VllmEngine.infer

    def checked_sync(self, model):
        sync(self, model)
        training_storage.append(_storage(model, made[0].optimizer))
        comparing[0] = True
        try:
            checks.append(compare(self, model, self.tokenizer))
        finally:
            comparing[0] = False

    def watched_infer(self, requests, config):
        if not comparing[0] and training_storage:
            now = {t.data_ptr() for t in _storage(made[0].models[0], made[0].optimizer)}
            overlaps.append(len(now & {t.data_ptr() for t in training_storage[-1]}))
        return infer(self, requests, config)

    monkeypatch.setattr(VllmEngine, "sync_weights", checked_sync)
    monkeypatch.setattr(VllmEngine, "infer", watched_infer)
    out = tmp_path / "offload"
    cfg = parse_train_args(
        _args(
            tiny128,
            out,
            *flags(VLLM_COLOCATE, "--offload_model true --offload_optimizer true --sleep_level 1"),
        )
    )
    trainer = run_train(cfg)
    try:
        assert len(made) == 1 and made[0].optimizer is not None and made[0].models
        assert len(checks) == 3 and all(c["greedy_equal"] for c in checks)
        assert overlaps and all(n == 0 for n in overlaps)  # nothing generated next to the training storage
        assert made[0].moves > 0
        assert [r["step"] for r in _logged_steps(out)] == [1, 2, 3]
    finally:
        trainer.engine.close()
