"""--fsdp (FSDP2, grpokit/distributed/sharding.py): 2 gloo processes on CPU give what one process gives.

The deterministic-completion plugin of test_distributed.py makes runs differ only by how the work is split, so
rewards, advantages, losses and parameters after 3 steps are compared with one process (and DDP) for full weights
with a reference model (beta > 0) and for LoRA (adapters disabled as the reference, and beta 0). The in-process
engine's whole copy, checkpoints (FSDP shards through torch.distributed.checkpoint), resume and the final model
are checked on the same runs.
"""

from __future__ import annotations

import json
import shutil
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from support import flags
from test_distributed import (
    PLUGIN,
    B,
    _args,
    _dumps,
    _log_rows,
    _max_diff,
    _one_process,
    _params,
    _torchrun,
    make_setup,
)

# a trainer that, before it saves the final model, dumps the engine's greedy tokens for one prompt and how far
# the engine's whole copy is from the gathered policy (a collective: every rank runs it)
ENGINE_CHECK = textwrap.dedent("""

    class EngineCheck(DeterministicTrainer):
        def _finish(self):
            from grpokit.protocol import RequestConfig, RolloutInferRequest

            own = dict(self.engine.model.named_parameters())
            diff = 0.0
            for name, p in self.policy.named_parameters():
                diff = max(diff, float((own[name].detach().cpu() - _whole(p)).abs().max()))
            request = RolloutInferRequest(messages=[{"role": "user", "content": "What is 2 + 3?"}])
            out = self.engine.infer([request], RequestConfig(max_tokens=8, temperature=0))
            self._dump({"kind": "engine", "diff": diff, "greedy": out[0].choices[0].token_ids})
            super()._finish()


    TrainerFactory.TRAINER_MAPPING["grpo"] = "dist_plugin.EngineCheck"
""")

# 3 optimizer steps, one rollout each; a checkpoint after step 2
STEPS = ("--max_steps", "3", "--learning_rate", "3e-3", "--save_steps", "2")
# no dropout: its draws differ between process layouts
LORA = flags("--tuner_type lora --lora_rank 4 --lora_alpha 8 --target_modules all-linear --lora_dropout 0")


@pytest.fixture(scope="session")
def sharded_setup(tmp_path_factory) -> SimpleNamespace:
    """The model, data and plugin of this file and test_sharded_zero3.py (the same for both), made once, so that
    the one-process runs both compare with are the same runs: ``_run`` makes each of them once (``one_process``:
    name → options; the multi-process runs differ by name and are made where they are asked for)."""
    shared = make_setup(tmp_path_factory.mktemp("sharded"), PLUGIN + ENGINE_CHECK)
    shared.one_process = {}
    return shared


@pytest.fixture(scope="module")
def setup(sharded_setup) -> SimpleNamespace:
    return sharded_setup


def _run(setup, name: str, nproc: int, *extra: str) -> Path:
    run = setup.root / name
    args = _args(setup.model, setup.data, run / "out", setup.plugin, B * 2 // nproc, *STEPS, *extra)
    if nproc == 1:
        made = setup.__dict__.setdefault("one_process", {})  # name → options (a setup of another file has none yet)
        if name in made:  # made for the other file (or an earlier test) with the same options
            assert made[name] == args, f"one-process run {name} asked for with other options"
            return run
        _one_process(args, run / "dump")
        made[name] = args
    else:
        _torchrun(args, run / "dump")
    return run


def _check_same(one: Path, two: Path) -> None:
    """Rewards and advantages (global) and the mean of the ranks' losses match one process to 1e-5."""
    (r1,), (a, b) = _dumps(one / "dump", 1), _dumps(two / "dump", 2)
    win1, win_a, win_b = ([x for x in rows if x["kind"] == "window"] for rows in (r1, a, b))
    assert len(win1) == len(win_a) == len(win_b) == 3
    for w, x, y in zip(win1, win_a, win_b, strict=True):
        assert x["rewards"] == pytest.approx(w["rewards"], rel=1e-5)
        assert x["advantages"] + y["advantages"] == pytest.approx(w["advantages"], rel=1e-5, abs=1e-7)
    loss1 = [x["loss"] for x in r1 if x["kind"] == "micro"]
    loss2 = [
        (x["loss"] + y["loss"]) / 2
        for x, y in zip(*([x for x in r if x["kind"] == "micro"] for r in (a, b)), strict=True)
    ]
    assert len(loss1) == 3 and loss2 == pytest.approx(loss1, rel=1e-5, abs=1e-7)


@pytest.fixture(scope="module")
def full_runs(setup) -> SimpleNamespace:
    kl = ("--beta", "0.04")
    return SimpleNamespace(
        one=_run(setup, "full1", 1, *kl),
        ddp=_run(setup, "full_ddp", 2, *kl),
        fsdp=_run(setup, "full_fsdp", 2, *kl, "--fsdp", "true", "--save_final_model", "true"),
    )


@pytest.mark.slow
def test_fsdp_full_weights_with_kl_match_one_process_and_ddp(full_runs):
    _check_same(full_runs.one, full_runs.fsdp)
    _check_same(full_runs.one, full_runs.ddp)
    p1, pd, pf = (_params(run / "dump") for run in (full_runs.one, full_runs.ddp, full_runs.fsdp))
    assert _max_diff(pf, _params(full_runs.fsdp / "dump", 1)) == 0.0  # both ranks gathered the same weights
    assert _max_diff(p1, pf) < 1e-4 and _max_diff(pd, pf) < 1e-4
    kl = [r["kl"] for r in _log_rows(full_runs.fsdp / "out") if "kl" in r]
    assert len(kl) == 3 and kl[-1] > 0  # the sharded reference model took part


@pytest.mark.slow
def test_fsdp_engine_copy_final_model_and_shards(setup, full_runs):
    from transformers import AutoModelForCausalLM

    engine = [[x for x in r if x["kind"] == "engine"] for r in _dumps(full_runs.fsdp / "dump", 2)]
    assert [e[0]["diff"] for e in engine] == [0.0, 0.0]  # each rank's whole copy equals the trained shards
    final = full_runs.fsdp / "out" / "final_model"
    assert json.loads((final / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
    model = AutoModelForCausalLM.from_pretrained(final)
    params = _params(full_runs.fsdp / "dump")
    assert _max_diff({n: p.detach() for n, p in model.named_parameters()}, params) == 0.0
    # the engine's greedy tokens equal the saved model's own greedy generate on the same prompt
    from transformers import AutoTokenizer

    from grpokit.template.encode import ChatTemplate

    template = ChatTemplate(AutoTokenizer.from_pretrained(final))
    prompt = template.encode_prompts([[{"role": "user", "content": "What is 2 + 3?"}]])[0]
    out = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=8,
        do_sample=False,
        eos_token_id=template.eos_token_id,
        pad_token_id=template.pad_token_id,
    )
    ids = out[0, len(prompt) :].tolist()
    assert engine[0][0]["greedy"] == engine[1][0]["greedy"] == ids[: len(engine[0][0]["greedy"])]
    shards = full_runs.fsdp / "out" / "checkpoint-2" / "state" / "fsdp_sharded"
    assert (shards / ".metadata").is_file() and len(list(shards.glob("*.distcp"))) == 2  # one file per rank


@pytest.mark.slow
def test_fsdp_checkpoint_resumes_in_two_processes(setup, full_runs):
    resumed = setup.root / "full_fsdp_resumed"
    shutil.copytree(full_runs.fsdp / "out", resumed / "out")
    ckpt = resumed / "out" / "checkpoint-2"
    _torchrun(
        _args(
            setup.model,
            setup.data,
            resumed / "out",
            setup.plugin,
            B,
            *STEPS,
            *flags("--beta 0.04 --fsdp true", {"--resume_from_checkpoint": ckpt}),
        ),
        resumed / "dump",
    )
    windows = [x for x in _dumps(resumed / "dump", 2)[0] if x["kind"] == "window"]
    assert [w["step"] for w in windows] == [2]  # only the last rollout ran again
    assert [r["step"] for r in _log_rows(resumed / "out") if "loss" in r] == [1, 2, 3]
    # model and optimizer shards (AdamW moments included) came back: the last step lands on the same weights
    assert _max_diff(_params(resumed / "dump"), _params(full_runs.fsdp / "dump")) < 1e-6


@pytest.mark.slow
def test_fsdp_full_weights_without_kl_match_one_process(setup):
    """beta 0: no reference model to shard."""
    one = _run(setup, "full1_b0", 1, "--beta", "0")
    fsdp = _run(setup, "full_fsdp_b0", 2, "--beta", "0", "--fsdp", "true")
    _check_same(one, fsdp)
    assert _max_diff(_params(one / "dump"), _params(fsdp / "dump")) < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("beta", ["0.04"])  # β 0 (no reference) is the full-weight test's
def test_fsdp_lora_matches_one_process(setup, beta):
    one = _run(setup, f"lora1_{beta}", 1, *LORA, "--beta", beta)
    fsdp = _run(setup, f"lora_fsdp_{beta}", 2, *LORA, "--beta", beta, "--fsdp", "true")
    _check_same(one, fsdp)
    p1, pf = _params(one / "dump"), _params(fsdp / "dump")
    assert _max_diff(p1, pf) < 1e-4
    lora_b = [p for n, p in p1.items() if "lora_B" in n]
    assert lora_b and max(float(p.abs().max()) for p in lora_b) > 1e-3  # B starts at 0: the adapters trained
    engine = [x for x in _dumps(fsdp / "dump", 2)[0] if x["kind"] == "engine"]
    assert engine[0]["diff"] == 0.0  # the engine's copy carries the trained adapters


@pytest.mark.slow
def test_fsdp_dapo_with_gradient_accumulation_matches_one_process(setup):
    """dapo divides by the global token count of the optimizer step; 2 micro-steps per step (S = A = 2), so the
    ranks' micro-batches group rows differently from one process but each step's gradient is the same."""
    extra = ("--loss_type", "dapo", "--gradient_accumulation_steps", "2", "--beta", "0")
    one, fsdp = _run(setup, "dapo1", 1, *extra), _run(setup, "dapo_fsdp", 2, *extra, "--fsdp", "true")
    (m1,), (r0, r1) = (
        ([x for x in r if x["kind"] == "micro"] for r in _dumps(run / "dump", k)) for run, k in ((one, 1), (fsdp, 2))
    )
    assert len(m1) == len(r0) == len(r1) == 6  # 3 optimizer steps × 2 micro-steps
    for step in range(3):
        a = sum(x["loss"] for x in m1[2 * step : 2 * step + 2])
        b = sum(
            (x["loss"] + y["loss"]) / 2
            for x, y in zip(r0[2 * step : 2 * step + 2], r1[2 * step : 2 * step + 2], strict=True)
        )
        assert b == pytest.approx(a, rel=1e-5, abs=1e-7)
    assert _max_diff(_params(one / "dump"), _params(fsdp / "dump")) < 1e-4
    assert _max_diff(_params(one / "dump"), setup.initial) > 1e-3  # and the weights moved far more than that
