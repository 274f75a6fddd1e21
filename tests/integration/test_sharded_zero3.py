"""--deepspeed zero3 (DeepSpeed ZeRO-3 driven directly, grpokit/distributed/zero.py): 2 gloo processes on CPU give
what one process gives, with the checks of test_sharded_fsdp.py (3 steps, full weights with a reference model,
LoRA, the engine's whole copy, the final model, a checkpoint resumed in 2 processes)."""

from __future__ import annotations

import importlib.util
import json
import shutil
from types import SimpleNamespace

import pytest
from support import flags
from test_distributed import B, _args, _dumps, _log_rows, _max_diff, _params, _torchrun
from test_sharded_fsdp import LORA, STEPS, _check_same, _run, sharded_setup  # noqa: F401 (a fixture)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("deepspeed") is None,
        reason="needs the deepspeed extra (pip install 'grpokit[deepspeed]')",
    ),
]
ZERO3 = ("--deepspeed", "zero3")


@pytest.fixture(scope="module")
def setup(sharded_setup) -> SimpleNamespace:  # noqa: F811 (the fixture imported above, asked for by name)
    """test_sharded_fsdp.py's set-up: the one-process runs of the same options are made once for both files."""
    return sharded_setup


@pytest.fixture(scope="module")
def full_runs(setup) -> SimpleNamespace:
    kl = ("--beta", "0.04")
    return SimpleNamespace(
        one=_run(setup, "full1", 1, *kl), zero3=_run(setup, "full_zero3", 2, *kl, *ZERO3, "--save_final_model", "true")
    )


def test_zero3_full_weights_with_kl_match_one_process(full_runs):
    _check_same(full_runs.one, full_runs.zero3)
    p1, pz = _params(full_runs.one / "dump"), _params(full_runs.zero3 / "dump")
    assert _max_diff(pz, _params(full_runs.zero3 / "dump", 1)) == 0.0
    assert _max_diff(p1, pz) < 1e-4
    kl = [r["kl"] for r in _log_rows(full_runs.zero3 / "out") if "kl" in r]
    assert len(kl) == 3 and kl[-1] > 0  # the ZeRO-3 reference engine took part
    engine = [[x for x in r if x["kind"] == "engine"] for r in _dumps(full_runs.zero3 / "dump", 2)]
    assert [e[0]["diff"] for e in engine] == [0.0, 0.0]  # each rank's whole copy equals the trained partitions
    assert engine[0][0]["greedy"] == engine[1][0]["greedy"]


def test_zero3_final_model_and_resume(setup, full_runs):
    from transformers import AutoModelForCausalLM

    final = full_runs.zero3 / "out" / "final_model"
    assert json.loads((final / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
    model = AutoModelForCausalLM.from_pretrained(final)
    params = _params(full_runs.zero3 / "dump")
    assert _max_diff({n: p.detach() for n, p in model.named_parameters()}, params) == 0.0
    assert (full_runs.zero3 / "out" / "checkpoint-2" / "state" / "deepspeed" / "state").is_dir()
    resumed = setup.root / "full_zero3_resumed"
    shutil.copytree(full_runs.zero3 / "out", resumed / "out")
    ckpt = resumed / "out" / "checkpoint-2"
    _torchrun(
        _args(
            setup.model,
            setup.data,
            resumed / "out",
            setup.plugin,
            B,
            *STEPS,
            *flags("--beta 0.04", ZERO3, {"--resume_from_checkpoint": ckpt}),
        ),
        resumed / "dump",
    )
    windows = [x for x in _dumps(resumed / "dump", 2)[0] if x["kind"] == "window"]
    assert [w["step"] for w in windows] == [2]
    assert _max_diff(_params(resumed / "dump"), params) < 1e-6  # partitions and AdamW moments came back


def test_zero3_full_weights_without_kl_match_one_process(setup):
    """beta 0: no reference model (DDP at β 0 against one process: test_distributed.py)."""
    one, zero3 = _run(setup, "full1_b0", 1, "--beta", "0"), _run(setup, "full_zero3_b0", 2, "--beta", "0", *ZERO3)
    _check_same(one, zero3)
    assert _max_diff(_params(one / "dump"), _params(zero3 / "dump")) < 1e-4
    assert not any("kl" in r for r in _log_rows(zero3 / "out"))


@pytest.mark.parametrize("beta", ["0.04"])  # β 0 (no reference) is the full-weight test's
def test_zero3_lora_matches_one_process(setup, beta):
    one = _run(setup, f"lora1_{beta}", 1, *LORA, "--beta", beta)
    zero3 = _run(setup, f"lora_zero3_{beta}", 2, *LORA, "--beta", beta, *ZERO3)
    _check_same(one, zero3)
    assert _max_diff(_params(one / "dump"), _params(zero3 / "dump")) < 1e-4
    engine = [x for x in _dumps(zero3 / "dump", 2)[0] if x["kind"] == "engine"]
    assert engine[0]["diff"] == 0.0


def test_zero3_offload_matches_one_process(setup, full_runs):
    """zero3_offload: parameters and optimizer state live on the CPU (grpokit's torch AdamW steps them there)."""
    offload = _run(setup, "full_zero3_offload", 2, "--beta", "0.04", "--deepspeed", "zero3_offload")
    _check_same(full_runs.one, offload)
    assert _max_diff(_params(full_runs.one / "dump"), _params(offload / "dump")) < 1e-4


def test_zero3_matches_ddp_in_bf16(setup):
    """--torch_dtype bfloat16 (float32 weights and bf16 autocast, what auto gives on a CPU with AVX512-BF16),
    β 0.04, lr 1e-4: ZeRO-3 computes what DDP computes (measured: losses and KL equal to the last bit, grad norms
    2e-6 apart, weights 7.5e-9). DeepSpeed's own bf16 mode, now refused (test_zero_group.py), drifted: grad norm
    1.2e-5 apart at step 1 and 1.3e-3 at step 2, KL 1.7-5% apart at steps 2-3; these tolerances catch that."""
    bf16 = ("--torch_dtype", "bfloat16", "--beta", "0.04", "--learning_rate", "1e-4")
    ddp, zero3 = _run(setup, "bf16_ddp", 2, *bf16), _run(setup, "bf16_zero3", 2, *bf16, *ZERO3)
    for rank_ddp, rank_zero3 in zip(_dumps(ddp / "dump", 2), _dumps(zero3 / "dump", 2), strict=True):
        (micro_d, step_d), (micro_z, step_z) = (
            [[x for x in rows if x["kind"] == kind] for kind in ("micro", "step")] for rows in (rank_ddp, rank_zero3)
        )
        assert len(micro_d) == len(micro_z) == len(step_d) == len(step_z) == 3
        kl_d, kl_z = [x["kl"] for x in micro_d], [x["kl"] for x in micro_z]
        assert kl_d[-1] > 1e-5 and kl_z == pytest.approx(kl_d, rel=1e-4, abs=1e-9)
        assert [x["loss"] for x in micro_z] == pytest.approx([x["loss"] for x in micro_d], rel=1e-4, abs=1e-10)
        norm_d, norm_z = [x["grad_norm"] for x in step_d], [x["grad_norm"] for x in step_z]
        assert norm_z == pytest.approx(norm_d, rel=1e-5)
    pd, pz = _params(ddp / "dump"), _params(zero3 / "dump")
    assert _max_diff(pd, pz) < 1e-6 and _max_diff(pd, setup.initial) > 1e-4  # and lr 1e-4 moved the weights
