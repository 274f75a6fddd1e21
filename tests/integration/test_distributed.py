"""Many processes: `torchrun --nproc_per_node 2` (gloo, CPU) gives what one process gives on the same global batch.

A plugin swaps in a GRPOTrainer whose completions are fixed token ids derived from (prompt position, sample
number), so runs differ only by how the work is split over processes. Each rank dumps its rewards, advantages,
losses, loss denominators and final parameters. The 1-process references run inside pytest; the 2-process runs
are torchrun's ranks with its environment, forked from the test zygote (``_torchrun``).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from cli_process import run_grpokit_ranks
from support import flags, run_inputs

from grpokit.errors import ConfigError

PLUGIN = textwrap.dedent('''
    """Deterministic completions and per-rank dumps, for tests/integration/test_distributed.py."""
    import json
    import os

    import torch

    from grpokit.rewards import ORM, orms
    from grpokit.protocol import ChatCompletionResponse, ChatCompletionResponseChoice, RolloutOutput
    from grpokit.trainers.factory import TrainerFactory
    from grpokit.trainers.grpo_trainer import GRPOTrainer


    class TokenReward(ORM):
        """A varied, deterministic score of the completion's token ids; the same score for a whole group when
        the answer is 2, 6 or 10 (no learning signal: dynamic sampling replaces such groups)."""
        def __call__(self, completions, completion_ids, solution, **kwargs):
            return [0.5 if int(sol) % 4 == 2 else float(sum(ids) % 11) / 11
                    for ids, sol in zip(completion_ids, solution, strict=True)]


    orms["token_reward"] = TokenReward


    def _whole(p):
        """A parameter as a whole CPU tensor: FSDP2 and ZeRO-3 shards gathered (a collective)."""
        from grpokit.engines.weights import whole_weight

        with whole_weight(p) as w:
            return w.cpu().clone()


    class DeterministicTrainer(GRPOTrainer):
        def _generate_completions(self, requests):
            seen, outputs = {}, []
            for r in requests:
                p = int(r.prompt_id)  # the prompt's position in the stream: the same in every process layout
                k = seen[p] = seen.get(p, -1) + 1  # sample number within the group
                n = 2 + p % 7 + k  # lengths differ between groups, hence between ranks
                ids = [100 + (31 * p + 7 * k + 3 * j) % 300 for j in range(n)] + [self.template.eos_token_id]
                text = self.tokenizer.decode(ids, skip_special_tokens=True)
                choice = ChatCompletionResponseChoice(message={"role": "assistant", "content": text},
                                                      finish_reason="stop", token_ids=ids)
                outputs.append(RolloutOutput(
                    response=ChatCompletionResponse(choices=[choice]),
                    messages=[*r.messages, {"role": "assistant", "content": text}],
                    response_token_ids=[ids], response_loss_mask=[[1] * len(ids)],
                    request_id=r.request_id, prompt_id=r.prompt_id, prompt_messages=r.messages))
            return outputs

        def _prepare_inputs(self, prompts, rollout=None):
            window = super()._prepare_inputs(prompts, rollout)
            self._dump({"kind": "window", "step": self.state.global_step, "rewards": window.rewards.tolist(),
                        "advantages": window.batch.advantages.tolist()})
            return window

        def _compute_loss_and_metrics(self, model, inputs):
            loss, metrics = super()._compute_loss_and_metrics(model, inputs)
            self._dump({"kind": "micro", "step": self.state.global_step + 1, "loss": float(loss.detach()),
                        "num_items": inputs.num_items, "tokens": float(inputs.completion_mask.sum()),
                        "kl": float(metrics["kl"]) if "kl" in metrics else None})  # unrounded, unlike the log
            return loss, metrics

        def _optimizer_step(self, loss):
            metrics = super()._optimizer_step(loss)  # grad_norm on the synchronising micro-step
            if self.accelerator.sync_gradients:
                norm = metrics.get("grad_norm")
                self._dump({"kind": "step", "step": self.state.global_step + 1,
                            "grad_norm": None if norm is None else float(norm)})
            return metrics

        def _finish(self):  # the final weights, before the process group ends
            params = {n: _whole(p) for n, p in self.accelerator.unwrap_model(self.model).named_parameters()}
            torch.save(params, os.path.join(os.environ["GRPOKIT_TEST_DUMP"],
                                            f"params_rank{self.accelerator.process_index}.pt"))
            super()._finish()

        def _dump(self, row):
            path = os.path.join(os.environ["GRPOKIT_TEST_DUMP"], f"rank{self.accelerator.process_index}.jsonl")
            with open(path, "a") as f:
                f.write(json.dumps(row) + "\\n")


    TrainerFactory.TRAINER_MAPPING["grpo"] = "dist_plugin.DeterministicTrainer"
''')

B = 8  # completions per process and micro-step in the 2-process runs (2 prompts × 4 generations)


# ----------------------------------------------------------------------------------------------------------
# launching
# ----------------------------------------------------------------------------------------------------------


def _torchrun(args: list[str], dump: Path, timeout: int = 240) -> subprocess.CompletedProcess:
    """`grpokit train` as `torchrun --nproc_per_node 2` runs it: 2 gloo ranks on 127.0.0.1 with torchrun's
    environment, forked from the test zygote (cli_process.py: no launcher, no interpreter start-up or imports a
    rank); the ranks' outputs one after the other, as the launcher would print them."""
    dump.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "GRPOKIT_TEST_DUMP": str(dump),
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    proc = run_grpokit_ranks(["train", *args], 2, env=env, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    # every 2-process run of the suite (DDP, FSDP2, ZeRO) also checks the clean exit of test_clean_exit.py: no
    # "terminate called" abort from a lingering gloo thread after the run printed its summary
    assert "terminate called" not in proc.stderr, proc.stderr[-3000:]
    return proc


def _one_process(args: list[str], dump: Path) -> None:
    """The 1-process reference, run here (saves a Python start-up); the plugin's trainer is unregistered after."""
    from grpokit.config.parse import parse_train_args
    from grpokit.pipeline.train import run_train
    from grpokit.trainers.factory import TrainerFactory

    dump.mkdir(parents=True, exist_ok=True)
    saved, threads = dict(TrainerFactory.TRAINER_MAPPING), torch.get_num_threads()
    old_dump = os.environ.get("GRPOKIT_TEST_DUMP")
    os.environ["GRPOKIT_TEST_DUMP"] = str(dump)
    torch.set_num_threads(1)
    try:
        run_train(parse_train_args(args))
    finally:
        TrainerFactory.TRAINER_MAPPING.clear()
        TrainerFactory.TRAINER_MAPPING.update(saved)
        sys.modules.pop("dist_plugin", None)  # its registration is undone: the next run must import it again
        torch.set_num_threads(threads)
        if old_dump is None:
            os.environ.pop("GRPOKIT_TEST_DUMP", None)
        else:
            os.environ["GRPOKIT_TEST_DUMP"] = old_dump


def _args(model: Path, data: Path, out: Path, plugin: Path, batch: int, *extra: str) -> list[str]:
    return flags(
        {"--model": model, "--dataset": data, "--output_dir": out, "--external_plugins": plugin},
        {"--per_device_train_batch_size": batch},
        "--tuner_type full --reward_funcs token_reward --num_generations 4 --max_completion_length 16",
        "--torch_dtype float32 --use_cpu true --logging_steps 1 --seed 0 --disable_tqdm true",
        "--dataset_shuffle false --plots false --save_final_model false",
        *extra,
    )


def _dumps(dump: Path, nproc: int) -> list[list[dict]]:
    return [[json.loads(line) for line in (dump / f"rank{r}.jsonl").read_text().splitlines()] for r in range(nproc)]


def _params(dump: Path, rank: int = 0) -> dict[str, torch.Tensor]:
    return torch.load(dump / f"params_rank{rank}.pt")


def _log_rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "logging.jsonl").read_text().splitlines()]


def _close(a: float, b: float, rel: float = 1e-5, abs_: float = 1e-7) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=abs_)


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def make_setup(root: Path, plugin_text: str = PLUGIN) -> SimpleNamespace:
    """The tiny model (and its initial weights), a 16-row dataset and the plugin file, under root."""
    from grpokit.testing import build_tiny_model

    found = run_inputs(root, build_tiny_model(root / "model"), plugin_text, "dist_plugin.py")
    from transformers import AutoModelForCausalLM

    found.initial = {n: p.detach() for n, p in AutoModelForCausalLM.from_pretrained(found.model).named_parameters()}
    return found


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> SimpleNamespace:
    return make_setup(tmp_path_factory.mktemp("dist"))


# grpo with KL (beta 0.04, a reference model) and 2 iterations per rollout: step 1 is on-policy, step 2 reuses
# the window off-policy (ratio ≠ 1, clipping possible), so both halves of the loss are exercised.
GRPO = ("--max_steps", "4", "--num_iterations", "2", "--beta", "0.04", "--learning_rate", "3e-3", "--save_steps", "2")


@pytest.fixture(scope="module")
def grpo_runs(setup) -> SimpleNamespace:
    one, two = setup.root / "grpo1", setup.root / "grpo2"
    _one_process(_args(setup.model, setup.data, one / "out", setup.plugin, 2 * B, *GRPO), one / "dump")
    _torchrun(_args(setup.model, setup.data, two / "out", setup.plugin, B, *GRPO), two / "dump")
    return SimpleNamespace(one=one, two=two)


# ----------------------------------------------------------------------------------------------------------
# the acceptance tests (each launches torchrun)
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_two_processes_match_one_process(setup, grpo_runs):
    (one,), (r0, r1) = _dumps(grpo_runs.one / "dump", 1), _dumps(grpo_runs.two / "dump", 2)
    win1, win2 = ([x for x in rows if x["kind"] == "window"] for rows in (one, r0))
    win2_r1 = [x for x in r1 if x["kind"] == "window"]
    assert len(win1) == len(win2) == len(win2_r1) == 2  # 4 optimizer steps = 2 rollouts × 2 iterations
    for a, b0, b1 in zip(win1, win2, win2_r1, strict=True):
        assert b0["rewards"] == pytest.approx(a["rewards"], rel=1e-5)  # every rank sees the global rewards
        assert b1["rewards"] == pytest.approx(a["rewards"], rel=1e-5)
        assert len(b0["advantages"]) == len(b1["advantages"]) == B  # each rank keeps its own slice
        assert b0["advantages"] + b1["advantages"] == pytest.approx(a["advantages"], rel=1e-5, abs=1e-7)
        assert any(abs(x) > 0.1 for x in a["advantages"])  # the rewards vary: the test has a signal

    # the loss: DDP averages the ranks' gradients, so the 1-process loss is the mean of the ranks' losses
    loss1 = [x["loss"] for x in one if x["kind"] == "micro"]
    loss2 = [
        (x["loss"] + y["loss"]) / 2
        for x, y in zip(*([x for x in r if x["kind"] == "micro"] for r in (r0, r1)), strict=True)
    ]
    assert len(loss1) == len(loss2) == 4
    assert all(_close(a, b) for a, b in zip(loss1, loss2)), (loss1, loss2)
    assert abs(loss1[1]) > 1e-3  # the off-policy step has a non-trivial loss
    # logging.jsonl (written by rank 0) reports the loss averaged over the ranks
    logged1, logged2 = (
        [r["loss"] for r in _log_rows(run / "out") if "loss" in r] for run in (grpo_runs.one, grpo_runs.two)
    )
    assert logged2 == pytest.approx(logged1, rel=1e-4, abs=2e-6)  # logs are rounded to 6 decimals
    # one scheduler step per optimizer step, whatever the number of processes (lr 3e-3 decays linearly to 0)
    lr1, lr2 = (
        [r["learning_rate"] for r in _log_rows(run / "out") if "loss" in r] for run in (grpo_runs.one, grpo_runs.two)
    )
    assert lr1 == lr2 == pytest.approx([2.25e-3, 1.5e-3, 7.5e-4, 0.0])

    p1, p2 = _params(grpo_runs.one / "dump"), _params(grpo_runs.two / "dump")
    assert _max_diff(p2, _params(grpo_runs.two / "dump", 1)) == 0.0  # DDP kept the replicas identical
    assert _max_diff(p1, p2) < 1e-4
    assert _max_diff(p1, setup.initial) > 3e-3  # and training moved the weights far more than the tolerance


@pytest.mark.slow
def test_two_process_checkpoint_resumes_in_two_processes(setup, grpo_runs):
    first = grpo_runs.two / "out"
    resumed = setup.root / "resumed"
    shutil.copytree(first, resumed / "out")
    ckpt = resumed / "out" / "checkpoint-2"
    assert (ckpt / "state" / "random_states_1.pkl").is_file()  # every rank saved its RNG state
    assert json.loads((ckpt / "trainer_state.json").read_text())["global_step"] == 2
    proc = _torchrun(
        _args(setup.model, setup.data, resumed / "out", setup.plugin, B, *GRPO, "--resume_from_checkpoint", str(ckpt)),
        resumed / "dump",
    )
    assert proc.stdout.count("done: 4 optimizer steps") == 1  # the summary is printed by rank 0 only
    steps = [r["step"] for r in _log_rows(resumed / "out") if "loss" in r]
    assert steps == [1, 2, 3, 4]  # steps 3-4 were truncated and rewritten once each: no gap, no duplicate
    # only the remaining window was generated again, from the same prompts
    windows = [x for x in _dumps(resumed / "dump", 2)[0] if x["kind"] == "window"]
    assert [w["step"] for w in windows] == [2]
    assert _max_diff(_params(resumed / "dump"), _params(grpo_runs.two / "dump")) < 1e-6


@pytest.mark.slow
def test_dapo_normalises_by_the_global_token_count(setup):
    """DAPO as a whole: token-level loss over the global token count, and dynamic sampling over the global batch."""
    dapo = (
        "--loss_type",
        "dapo",
        "--dynamic_sample",
        "true",
        "--max_resample_times",
        "1",
        "--max_steps",
        "2",
        "--beta",
        "0",
        "--optimizer",
        "sgd",
        "--learning_rate",
        "0.5",
        "--save_steps",
        "100",
    )
    one, two = setup.root / "dapo1", setup.root / "dapo2"
    _one_process(_args(setup.model, setup.data, one / "out", setup.plugin, 2 * B, *dapo), one / "dump")
    _torchrun(_args(setup.model, setup.data, two / "out", setup.plugin, B, *dapo), two / "dump")
    # each window had a group without signal (answer 2, then 6): one extra round, and every layout kept the same
    # groups in the same order (1 process: prompts 1-4, then 8, 9, 11, 12)
    rounds = [[r["dynamic_sampling/rounds"] for r in _log_rows(run / "out")] for run in (one, two)]
    assert rounds == [[1, 1], [1, 1]]
    (w1,), (w0, w2) = (
        ([x for x in r if x["kind"] == "window"] for r in _dumps(run / "dump", k)) for run, k in ((one, 1), (two, 2))
    )
    for a, x, y in zip(w1, w0, w2, strict=True):
        assert x["rewards"] == pytest.approx(a["rewards"], rel=1e-6) and 0.5 not in a["rewards"]
        assert x["advantages"] + y["advantages"] == pytest.approx(a["advantages"], rel=1e-5, abs=1e-7)

    (m1,) = ([x for x in r if x["kind"] == "micro"] for r in _dumps(one / "dump", 1))
    r0, r1 = ([x for x in r if x["kind"] == "micro"] for r in _dumps(two / "dump", 2))
    for a, x, y in zip(m1, r0, r1, strict=True):
        n = a["tokens"]
        assert x["tokens"] + y["tokens"] == n and x["tokens"] != y["tokens"]  # the ranks hold uneven token counts
        # 1 process divides by the step's N tokens; each of 2 ranks divides by N / 2, because DDP halves the sum
        assert a["num_items"] == n and x["num_items"] == y["num_items"] == n / 2
        assert _close((x["loss"] + y["loss"]) / 2, a["loss"])
        # per-rank normalisation (each rank by its own tokens) would give a different loss: rank r's summed token
        # loss is loss_r × N/2, so its mean would be (S0/n0 + S1/n1)/2
        per_rank = (x["loss"] * n / 2 / x["tokens"] + y["loss"] * n / 2 / y["tokens"]) / 2
        assert not _close(per_rank, a["loss"], rel=1e-2)
    # SGD: the update is lr × gradient, so equal parameters mean equal gradients (scale included)
    p1, p2 = _params(one / "dump"), _params(two / "dump")
    assert _max_diff(p1, setup.initial) > 1e-2
    assert _max_diff(p1, p2) < 1e-4


# ----------------------------------------------------------------------------------------------------------
# the mapping of --deepspeed / --fsdp onto accelerate (no launch)
# ----------------------------------------------------------------------------------------------------------
def _targs(**kw) -> SimpleNamespace:
    base = dict(
        deepspeed=None, fsdp=False, gradient_accumulation_steps=2, max_grad_norm=1.0, per_device_train_batch_size=4
    )
    return SimpleNamespace(**{**base, **kw})


def test_missing_deepspeed_package_and_flag_clash_are_clear(monkeypatch):
    import importlib.util

    from grpokit.distributed.processes import accelerate_plugins

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else real(name, *a))
    with pytest.raises(ConfigError, match="deepspeed package is not installed"):
        accelerate_plugins(_targs(deepspeed="zero2"))
    with pytest.raises(ConfigError, match="choose one"):
        accelerate_plugins(_targs(deepspeed="zero2", fsdp=True))
    assert accelerate_plugins(_targs()) == {}
    assert accelerate_plugins(_targs(fsdp=True)) == {}  # grpokit applies FSDP2 itself (test_sharded_fsdp.py)


def test_fsdp_and_deepspeed_pass_in_one_process():
    """grpokit drives FSDP2 and DeepSpeed itself (accelerate would drop both on CPU), so both pass in one process
    on CPU (the runs: test_fsdp_one_process.py, test_deepspeed_stages.py)."""
    from accelerate.utils import DistributedType

    from grpokit.distributed.processes import check_backend, check_engine

    acc = SimpleNamespace(distributed_type=DistributedType.NO, num_processes=1, device=torch.device("cpu"))
    check_backend(acc, _targs(fsdp=True))  # a one-process group: the same code path as under a launcher
    check_backend(acc, _targs(deepspeed="zero2"))  # grpokit drives DeepSpeed itself, in one process too
    check_backend(acc, _targs())  # plain: fine
    fsdp = SimpleNamespace(distributed_type=DistributedType.FSDP, num_processes=2, device=torch.device("cuda"))
    with pytest.raises(ConfigError, match="in-process transformers engine generates with the live"):
        check_engine(fsdp, SimpleNamespace(engine_type="transformers"))
    check_engine(fsdp, SimpleNamespace(engine_type="server"))  # rollouts on a server: weights are gathered to sync


def test_deepspeed_from_an_accelerate_config_is_refused():
    """grpokit drives DeepSpeed itself (distributed/zero.py); accelerate's DeepSpeed set-up would wrap the model
    twice."""
    from accelerate.utils import DistributedType

    from grpokit.distributed.processes import check_backend

    acc = SimpleNamespace(distributed_type=DistributedType.DEEPSPEED, num_processes=2, device=torch.device("cuda"))
    with pytest.raises(ConfigError, match="An accelerate config that turns on DeepSpeed: .* pass --deepspeed"):
        check_backend(acc, _targs())
    with pytest.raises(ConfigError, match="--deepspeed zero2 and an accelerate config that turns on DeepSpeed"):
        check_backend(acc, _targs(deepspeed="zero2"))
