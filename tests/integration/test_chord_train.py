"""CHORD (--chord_sft_dataset) on the tiny model: the loss is (1 - mu) * GRPO + mu * SFT on the expert replies,
mu follows its schedule, and a resume continues the SFT rows where the checkpoint left them."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch
from support import flags, shorter_reward_plugin, write_jsonl

from grpokit.algorithms import chord_mu

pytestmark = pytest.mark.slow

# ms-swift's SFT layout: messages ending in the expert's assistant reply
EXPERT = [
    {
        "messages": [
            {"role": "user", "content": f"What is {a} times {b}?"},
            {"role": "assistant", "content": f"{a} times {b} is {a * b}."},
        ]
    }
    for a in range(2, 6)
    for b in range(2, 4)
]
PLUGIN = shorter_reward_plugin("chord_short_is_good")


def _train(tiny_model_dir, math_jsonl, sft, out, extra):
    from grpokit.config.parse import parse_train_args
    from grpokit.pipeline.train import run_train

    plugin = sft.parent / "chord_plugin.py"
    plugin.write_text(PLUGIN)
    args = flags(
        {"--external_plugins": plugin, "--model": tiny_model_dir, "--dataset": math_jsonl, "--output_dir": out},
        {"--chord_sft_dataset": sft},
        "--reward_funcs chord_short_is_good --tuner_type full --num_generations 4 --per_device_train_batch_size 4",
        "--steps_per_generation 2 --max_completion_length 8 --max_steps 2 --learning_rate 1e-3",
        "--torch_dtype float32 --disable_tqdm true --plots false --save_final_model false --seed 1",
        "--chord_sft_per_device_train_batch_size 2",
        *extra,
    )
    trainer = run_train(parse_train_args(args))
    rows = [json.loads(line) for line in (out / "logging.jsonl").read_text().splitlines()]
    return trainer, [r for r in rows if "loss" in r]


@pytest.fixture
def sft(tmp_path):
    path = write_jsonl(tmp_path / "expert.jsonl", EXPERT)
    return path


@pytest.fixture
def mixes(monkeypatch) -> list[dict]:
    """Every call of ChordSFT.mix: the GRPO loss, the mixed loss, mu, the SFT batch and the SFT loss computed
    here from a plain forward of the policy (full logits, log-softmax) at that moment."""
    from grpokit.trainers.chord_sft import ChordSFT

    calls: list[dict] = []
    real_mix = ChordSFT.mix

    def spy(self, grpo_loss, step, logps_of):
        seen: dict = {"grpo": grpo_loss.detach().item(), "step": step}

        def logps_and_reference(batch):
            seen["batch"] = batch
            with torch.no_grad():
                ids, att = batch.input_ids, batch.attention_mask
                model = self._test_policy
                logits = model(input_ids=ids.to(model.device), attention_mask=att.to(model.device)).logits.float()
                c = batch.logits_to_keep
                lp = torch.log_softmax(logits[:, -c - 1 : -1], -1).gather(-1, ids[:, -c:, None].to(model.device))[
                    ..., 0
                ]
                m = batch.completion_mask.to(lp.device)
                seen["sft_ref"] = float(-(lp * m).sum() / m.sum())
            return logps_of(batch)

        loss, metrics = real_mix(self, grpo_loss, step, logps_and_reference)
        calls.append({**seen, "loss": loss.detach().item(), **{k: float(v) for k, v in metrics.items()}})
        return loss, metrics

    monkeypatch.setattr(ChordSFT, "mix", spy)
    return calls


def _bind_policy(monkeypatch):
    from grpokit.trainers.grpo_trainer import GRPOTrainer

    real_init = GRPOTrainer.__init__

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        self._chord._test_policy = self.policy

    monkeypatch.setattr(GRPOTrainer, "__init__", init)


@pytest.mark.parametrize("forward", [[], ["--padding_free", "true"]], ids=["padded", "padding_free"])
def test_chord_loss_is_grpo_plus_mu_times_the_sft_loss_of_the_expert_replies(
    tiny_model_dir, math_jsonl, sft, tmp_path, mixes, monkeypatch, forward, capsys
):
    _bind_policy(monkeypatch)
    trainer, logged = _train(
        tiny_model_dir,
        math_jsonl,
        sft,
        tmp_path / "out",
        ["--chord_mu_peak", "0.3", "--chord_mu_valley", "0.3", *forward],
    )  # a constant mu
    assert [r["step"] for r in logged] == [1, 2]
    assert [c["step"] for c in mixes] == [0, 1]  # one micro-step per optimizer step, one SFT batch each
    assert all(c["grpo"] != 0 for c in mixes)  # a reward with signal: both terms count
    tok = trainer.tokenizer
    replies = {r["messages"][1]["content"] for r in EXPERT}
    for call in mixes:
        assert call["chord/mu"] == pytest.approx(0.3)
        assert call["chord/sft_loss"] == pytest.approx(call["sft_ref"], rel=1e-4)  # mean NLL of the reply tokens
        assert call["loss"] == pytest.approx(0.7 * call["grpo"] + 0.3 * call["sft_ref"], rel=1e-4, abs=1e-6)
        batch = call["batch"]
        assert len(batch) == 2
        for row in range(2):  # the completion is an expert reply + end of sequence, all of it trained
            keep = batch.completion_mask[row].bool()
            ids = batch.input_ids[row, -batch.logits_to_keep :][keep].tolist()
            assert ids[-1] == tok.eos_token_id and tok.decode(ids[:-1]) in replies
    drawn = [tok.decode(c["batch"].input_ids[0]) for c in mixes]
    assert len(set(drawn)) > 1  # the rows move on from micro-step to micro-step
    for r in logged:
        assert r["chord/mu"] == pytest.approx(0.3) and r["chord/sft_loss"] > 0
    progress = [line for line in capsys.readouterr().err.splitlines() if line.startswith("train: step 2/2")]
    assert progress and f"| mu 0.300 | sft_loss {logged[1]['chord/sft_loss']:.4f}" in progress[0]


def test_mu_schedule_phi_and_resume_continue_the_sft_rows(
    tiny_model_dir, math_jsonl, sft, tmp_path, mixes, monkeypatch
):
    _bind_policy(monkeypatch)
    schedule = flags(
        "--chord_mu_warmup_steps 1 --chord_mu_decay_steps 2 --chord_mu_peak 0.8 --chord_mu_valley 0.2",
        "--chord_enable_phi_function true --max_steps 3 --save_steps 2",
    )
    _, logged = _train(tiny_model_dir, math_jsonl, sft, tmp_path / "out", schedule)
    # one micro-step per optimizer step; step 0: warm-up 0/1 → mu 0 (no SFT rows drawn); step 1: peak 0.8;
    # step 2: 0.2 + 0.6 * (1 + cos(pi/2)) / 2 = 0.5
    assert [r["chord/mu"] for r in logged] == pytest.approx([chord_mu(s, 1, 2, 0.8, 0.2) for s in range(3)])
    assert [r["chord/mu"] for r in logged] == pytest.approx([0.0, 0.8, 0.5])
    assert logged[0]["chord/sft_loss"] == 0.0 and logged[1]["chord/sft_loss"] > 0
    full = [c for c in mixes if c["step"] == 2]
    assert [c["sft_ref"] > c["chord/sft_loss"] > 0 for c in full] == [True]  # phi = p(1-p) < 1 shrinks it
    state = json.loads((tmp_path / "out" / "checkpoint-2" / "trainer_state.json").read_text())
    assert state["chord_sft_consumed"] == 2  # step 1: 2 rows; step 0 drew none (mu = 0)
    mixes.clear()
    _, resumed = _train(
        tiny_model_dir,
        math_jsonl,
        sft,
        tmp_path / "out",
        schedule + ["--resume_from_checkpoint", str(tmp_path / "out" / "checkpoint-2")],
    )
    assert [r["step"] for r in resumed] == [1, 2, 3]
    assert resumed[2]["chord/mu"] == pytest.approx(0.5)
    again = [c for c in mixes if c["step"] == 2]
    assert [c["batch"].input_ids.tolist() for c in again] == [c["batch"].input_ids.tolist() for c in full]


DUMP_PLUGIN = PLUGIN + textwrap.dedent("""
    import json, os
    from grpokit.trainers.chord_sft import ChordSFT

    _real_next_batch = ChordSFT.next_batch

    def _dumping_next_batch(self):
        rows = self.stream._indices(self.stream._positions(self.stream.position))
        batch = _real_next_batch(self)
        path = os.path.join(os.environ["GRPOKIT_TEST_DUMP"], f"chord_rank{os.environ.get('RANK', '0')}.jsonl")
        with open(path, "a") as f:
            f.write(json.dumps({"rows": rows}) + "\\n")
        return batch

    ChordSFT.next_batch = _dumping_next_batch
""")


def test_under_ddp_each_process_trains_on_its_own_sft_rows(tiny_model_dir, math_jsonl, sft, tmp_path):
    from test_distributed import _torchrun

    plugin = tmp_path / "chord_dump_plugin.py"
    plugin.write_text(DUMP_PLUGIN)
    out, dump = tmp_path / "out", tmp_path / "dump"
    args = flags(
        {"--model": tiny_model_dir, "--dataset": math_jsonl, "--output_dir": out, "--external_plugins": plugin},
        {"--chord_sft_dataset": sft},
        "--tuner_type full --reward_funcs chord_short_is_good --num_generations 4 --per_device_train_batch_size 4",
        "--max_completion_length 8 --max_steps 2 --torch_dtype float32 --use_cpu true --disable_tqdm true",
        "--plots false --save_final_model false --dataset_shuffle false --chord_sft_per_device_train_batch_size 1",
        "--chord_mu_peak 0.5 --chord_mu_valley 0.5",
    )
    _torchrun(args, dump)
    ranks = [
        [json.loads(line)["rows"] for line in (dump / f"chord_rank{r}.jsonl").read_text().splitlines()]
        for r in range(2)
    ]
    # 2 micro-steps; SFT row order without shuffling: rank 0 takes rows 0, 2, rank 1 rows 1, 3
    assert ranks == [[[0], [2]], [[1], [3]]]
    logged = [json.loads(line) for line in (out / "logging.jsonl").read_text().splitlines() if '"loss"' in line]
    assert [r["step"] for r in logged] == [1, 2] and all(
        r["chord/mu"] == 0.5 and r["chord/sft_loss"] > 0 for r in logged
    )
