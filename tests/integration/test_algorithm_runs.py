"""Loss types in the trainer, dynamic sampling and kl_in_reward train on a tiny model.

Every loss type × importance-sampling level is checked against its formula in tests/unit/test_losses_combos.py
(synthetic tensors); here three of them train, each checked on the trainer's own tensors with the same formula, for
the wiring: what the trainer hands the loss (old, reference and current log-probs, advantages, the mask, the token
count of the optimizer step) and what it logs. The three differ in each place the trainer's inputs matter: a
per-sequence normaliser with a sequence-level ratio (grpo × sequence, GSPO), the optimizer step's token count with
the per-token sequence ratio (dapo × sequence_token), and a loss with its own metric and no clipping (vespo).
"""

from __future__ import annotations

import json
import math
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from support import flags

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from test_losses_combos import CLIP_KEYS, PPO_CLIP_KEYS, reference_loss  # noqa: E402 (the unit tests' formula)

pytestmark = pytest.mark.slow

PLUGIN = textwrap.dedent("""
    from grpokit.rewards import ORM, orms

    class ShortIsGood(ORM):
        def __call__(self, completions, **kwargs):
            return [1.0 / (1 + len(c)) for c in completions]

    class NoSignal(ORM):
        '''Draw k (one scoring call: a window or a resampling round) scores 100 * k for every completion, so every
        group is all-equal. From draw SIGNAL_FROM on, each completion adds its index: every group has a signal.
        The score tells which draw a trained completion came from.'''
        SIGNAL_FROM = None

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.draws = 0

        def __call__(self, completions, **kwargs):
            self.draws += 1
            signal = self.SIGNAL_FROM is not None and self.draws >= self.SIGNAL_FROM
            return [100.0 * self.draws + (i if signal else 0) for i in range(len(completions))]

    class SignalFromSecondDraw(NoSignal):
        SIGNAL_FROM = 2

    orms['short_is_good'] = ShortIsGood
    orms['no_signal'] = NoSignal
    orms['signal_from_second_draw'] = SignalFromSecondDraw
""")

WIRING = [("grpo", "sequence"), ("dapo", "sequence_token"), ("vespo", "token")]
LOSS_TYPE_KEYS = PPO_CLIP_KEYS.union(*CLIP_KEYS.values())


@pytest.fixture(scope="module")
def plugin(tmp_path_factory):
    p = tmp_path_factory.mktemp("alg") / "alg_plugin.py"
    p.write_text(PLUGIN)
    return p


def _train(tiny_model_dir, math_jsonl, out, plugin, extra):
    from grpokit.config.parse import parse_train_args
    from grpokit.pipeline.train import run_train

    args = flags(
        {"--model": tiny_model_dir, "--dataset": math_jsonl, "--output_dir": out, "--external_plugins": plugin},
        "--tuner_type full --reward_funcs short_is_good --num_generations 4 --per_device_train_batch_size 4",
        "--steps_per_generation 2 --max_completion_length 8 --max_steps 2 --learning_rate 1e-3",
        "--torch_dtype float32 --disable_tqdm true --plots false --save_final_model false --seed 1",
        *extra,
    )
    trainer = run_train(parse_train_args(args))
    rows = [json.loads(line) for line in (out / "logging.jsonl").read_text().splitlines()]
    return trainer, rows


@pytest.fixture
def micro_steps(monkeypatch) -> list[dict]:
    """Each micro-step's tensors (advantages, mask, old/ref logps, the policy's logps at that moment, taken with
    the trainer's own forward) and the loss and metrics the trainer computed from them."""
    from grpokit.trainers.grpo_trainer import GRPOTrainer

    steps: list[dict] = []
    compute = GRPOTrainer._compute_loss_and_metrics

    def recording(self, model, inputs):
        loss, metrics = compute(self, model, inputs)
        with torch.no_grad():
            logps, _ = self._get_per_token_logps_and_entropies(model, inputs.to(self.accelerator.device))
        steps.append(
            {
                "loss": float(loss.detach()),
                "metrics": {k: float(v) for k, v in metrics.items()},
                "logps": logps.float().cpu(),
                # the window's first optimizer step gets none: the loss takes its own forward's, detached
                "old": logps.float().cpu() if inputs.old_logps is None else inputs.old_logps,
                "old_computed": inputs.old_logps is not None,
                "ref": inputs.ref_logps,
                "adv": inputs.advantages,
                "mask": inputs.completion_mask,
                "rollout": inputs.rollout_logps,
            }
        )
        return loss, metrics

    monkeypatch.setattr(GRPOTrainer, "_compute_loss_and_metrics", recording)
    return steps


@pytest.mark.parametrize("loss_type, level", WIRING)
def test_loss_types_train_on_the_trainers_tensors(
    tiny_model_dir, math_jsonl, tmp_path, plugin, micro_steps, loss_type, level
):
    """Per micro-step, the trainer's loss and metrics equal the variant's formula on the same tensors, its clip
    metrics (and only those) are logged, the ratio acts once the policy moved, and the policy moved."""
    # steps_per_generation 2 > gradient_accumulation_steps 1: the second micro-step is off-policy, the ratio acts.
    # The stop string ends completions at different lengths, which the normalisers weigh differently.
    trainer, rows = _train(
        tiny_model_dir,
        math_jsonl,
        tmp_path / "run",
        plugin,
        flags({"--loss_type": loss_type, "--importance_sampling_level": level}, "--beta 0.04 --stop_words e"),
    )
    cfg = trainer.loss_cfg
    assert (cfg.loss_type, cfg.importance_sampling_level, cfg.beta) == (loss_type, level, 0.04)
    assert [r["step"] for r in rows] == [1, 2] and len(micro_steps) == 2
    assert all(len(set(s["mask"].sum(1).tolist())) > 1 for s in micro_steps)  # lengths vary in each micro-batch
    clip_keys = CLIP_KEYS.get(loss_type, PPO_CLIP_KEYS)
    for row, step in zip(rows, micro_steps, strict=True):
        loss, metrics = reference_loss(cfg, step)
        assert step["loss"] == pytest.approx(loss, rel=1e-4, abs=1e-6)
        assert set(step["metrics"]) == set(metrics) == {"is_ratio/mean", "kl", *clip_keys}
        for key, value in metrics.items():
            assert step["metrics"][key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
        assert row["loss"] == pytest.approx(step["loss"], abs=2e-6)  # the step's log is its one micro-step
        assert {k for k in row if k in LOSS_TYPE_KEYS} == clip_keys  # logged, and no other type's
    on_policy, off_policy = micro_steps
    mask = on_policy["mask"].bool()
    assert not on_policy["old_computed"]  # before any update the ratio is 1 by construction: no extra forward
    assert on_policy["metrics"]["kl"] < 1e-6  # the policy is the reference
    mask = off_policy["mask"].bool()
    assert off_policy["old_computed"]  # taken at the window's start, before the update
    assert (off_policy["logps"] - off_policy["old"])[mask].abs().max() > 1e-4  # one update later the ratio acts
    assert off_policy["metrics"]["kl"] > 0
    policy = dict(trainer.policy.named_parameters())
    ref = dict(trainer.ref_model.named_parameters())
    assert all(not policy[n].detach().equal(ref[n]) for n in ref if n.endswith("q_proj.weight"))  # it trained


@pytest.mark.parametrize(
    "reward, draws, rounds, without_signal, trained_draw",
    [
        ("signal_from_second_draw", 2, 1, 0.0, 2),  # window 1 has no signal; the first resampling round replaces it
        ("no_signal", 3, 2, 2.0, 1),  # max_resample_times rounds, none with a signal: the window's own groups train
    ],
)
def test_dynamic_sampling_resamples_groups_without_signal(
    tiny_model_dir, math_jsonl, tmp_path, plugin, reward, draws, rounds, without_signal, trained_draw
):
    out = tmp_path / "dyn"
    trainer, rows = _train(
        tiny_model_dir,
        math_jsonl,
        out,
        plugin,
        flags(
            {"--reward_funcs": reward}, "--dynamic_sample true --max_resample_times 2 --beta 0 --log_completions true"
        ),
    )
    assert trainer.reward_runner.funcs[0].draws == draws  # one window, then a rollout per resampling round
    assert trainer.state.prompts_consumed == 2 * draws  # each round drew the next window's 2 prompts
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:  # both steps train on the one window
        assert r["dynamic_sampling/rounds"] == rounds
        assert r["dynamic_sampling/groups_without_signal"] == without_signal
        assert r["frac_reward_zero_std"] == without_signal / 2
    trained = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert len(trained) == 8 and {c["step"] for c in trained} == {1}
    assert {int(c[reward] // 100) for c in trained} == {trained_draw}  # the groups that trained came from there
    groups: dict[str, list[float]] = {}
    for c in trained:
        groups.setdefault(c["prompt"], []).append(c[reward])
    assert sorted(len(g) for g in groups.values()) == [4, 4]
    assert all((len(set(g)) > 1) == (without_signal == 0) for g in groups.values())


def test_kl_in_reward_moves_kl_out_of_the_loss(tiny_model_dir, math_jsonl, tmp_path, plugin, monkeypatch):
    """β·Σ_t(log π_old − log π_ref) is subtracted from each completion's reward before the advantages, and the
    loss has no KL term. Two windows of one step: no penalty while the policy is the reference, one after."""
    from grpokit.trainers.grpo_trainer import GRPOTrainer

    windows: list[dict] = []
    prepare = GRPOTrainer._prepare_inputs

    def record_window(self, prompts, rollout=None):
        window = prepare(self, prompts, rollout)
        batch, raw = window.batch, window.rewards_per_func
        windows.append(
            {
                "old": batch.old_logps,
                "ref": batch.ref_logps,
                "mask": batch.completion_mask,
                "raw": raw.clone(),
                "penalty": raw.sum(1) - window.rewards,
            }
        )  # one process: all rows
        return window

    monkeypatch.setattr(GRPOTrainer, "_prepare_inputs", record_window)
    trainer, rows = _train(
        tiny_model_dir,
        math_jsonl,
        tmp_path / "klr",
        plugin,
        flags("--kl_in_reward true --beta 0.1 --steps_per_generation 1"),
    )
    assert trainer.loss_cfg.beta == 0.0 and trainer.cfg.algorithm.beta == 0.1
    assert trainer.ref_model is not None  # kept for the penalty
    assert [r["step"] for r in rows] == [1, 2] and len(windows) == 2
    assert not any("kl" in r for r in rows)  # no KL term in the loss
    for row, w in zip(rows, windows, strict=True):
        expected = 0.1 * ((w["old"] - w["ref"]) * w["mask"]).sum(1)
        torch.testing.assert_close(w["penalty"], expected)
        assert row["rewards/short_is_good/mean"] == pytest.approx(float(w["raw"].mean()), abs=2e-6)
        assert row["reward"] == pytest.approx(float((w["raw"].sum(1) - w["penalty"]).mean()), abs=2e-6)
    first, second = windows
    assert first["penalty"].abs().max() < 1e-6  # the policy is still the reference
    assert second["penalty"].abs().max() > 1e-4  # after one update the reward pays for the distance
    assert rows[1]["reward"] != pytest.approx(rows[1]["rewards/short_is_good/mean"], abs=1e-5)


def test_off_policy_iterations_and_ref_sync(tiny_model_dir, math_jsonl, tmp_path, plugin):
    trainer, rows = _train(
        tiny_model_dir,
        math_jsonl,
        tmp_path / "mu",
        plugin,
        flags(
            "--num_iterations 2 --beta 0.04 --sync_ref_model true --ref_model_sync_steps 1",
            "--ref_model_mixup_alpha 0.5 --epsilon 0.1 --max_steps 4",
        ),
    )
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    # with μ = 2 the policy moves inside a window; a large lr pushes some ratios out of the clip range
    assert any(r["clip_ratio/region_mean"] > 0 or r["is_ratio/mean"] != 1.0 for r in rows)
    policy = dict(trainer.accelerator.unwrap_model(trainer.model).named_parameters())
    ref = dict(trainer.ref_model.named_parameters())
    name = next(n for n in ref if n.endswith("q_proj.weight"))
    assert not policy[name].detach().equal(ref[name])  # EMA moved the ref towards, not onto, the policy


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--scale_rewards", "gdpo", "--kl_in_reward", "true"], "gdpo"),
        (["--epsilon", "-0.1"], "--epsilon"),
        (["--top_entropy_quantile", "1.5"], "top_entropy_quantile"),
        (["--loss_type", "vespo", "--rollout_importance_sampling_mode", "sequence_mask"], "vespo"),
        (["--loss_type", "vespo", "--vespo_lambda_pos", "0"], "--vespo_lambda_pos"),
    ],
)
def test_invalid_combinations_fail_at_start(tiny_model_dir, math_jsonl, extra, needle):
    from grpokit.config.parse import parse_train_args
    from grpokit.errors import ConfigError

    with pytest.raises(ConfigError, match=needle):
        parse_train_args(["--model", str(tiny_model_dir), "--tuner_type", "full", "--dataset", str(math_jsonl), *extra])


@pytest.mark.parametrize("fast", ["true", "false"])
def test_fast_decode_flag_chooses_the_sampler(tiny_model_dir, math_jsonl, tmp_path, plugin, monkeypatch, fast):
    from transformers.generation.utils import GenerationMixin

    from grpokit.engines.fast_decode import FastDecoder

    calls = {"fast": 0, "hf": 0}
    fast_generate, hf_generate = FastDecoder.generate, GenerationMixin.generate

    def counting(name, fn):
        def wrapped(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(FastDecoder, "generate", counting("fast", fast_generate))
    monkeypatch.setattr(GenerationMixin, "generate", counting("hf", hf_generate))
    trainer, rows = _train(tiny_model_dir, math_jsonl, tmp_path / "run", plugin, ["--fast_decode", fast])
    assert trainer.engine.fast_decode is (fast == "true")
    assert calls == ({"fast": 1, "hf": 0} if fast == "true" else {"fast": 0, "hf": 1})  # one window: 2 steps
    assert all(math.isfinite(r["loss"]) for r in rows)


def test_off_policy_sequence_mask_in_the_trainer(tiny_model_dir, math_jsonl, tmp_path, plugin, micro_steps):
    """--off_policy_sequence_mask_delta: the engine is asked for its logprobs (the mismatch metrics appear without
    --rollout_importance_sampling_mode); each micro-step's mask holds the engine's logprobs (the behaviour policy)
    against the policy's current ones, and a masked completion trains as one with advantage 0 would (β = 0). With
    μ = 2 the second pass over the window sees the policy moved by the first: its negative completions got less
    likely, past δ."""
    delta = 1e-3
    trainer, rows = _train(
        tiny_model_dir,
        math_jsonl,
        tmp_path / "run",
        plugin,
        flags(
            {"--off_policy_sequence_mask_delta": delta},
            "--beta 0 --stop_words e --steps_per_generation 1 --num_iterations 2",
        ),
    )
    assert [r["step"] for r in rows] == [1, 2] and len(micro_steps) == 2
    for row, step in zip(rows, micro_steps, strict=True):
        assert "mismatch/max_abs" in row and step["rollout"] is not None
        mask = step["mask"]
        kl = torch.where(mask > 0, step["rollout"] - step["logps"], 0.0).sum(1) / mask.sum(1).clamp(min=1)
        assert (kl - delta).abs().min() > 1e-5  # no row at the threshold: the comparison below is not a coin toss
        masked = (step["adv"] < 0) & (kl > delta)
        assert step["metrics"]["off_policy_mask/masked_ratio"] == pytest.approx(masked.float().mean().item())
        assert row["off_policy_mask/masked_ratio"] == pytest.approx(masked.float().mean().item())
        assert row["off_policy_mask/kl_mean"] == pytest.approx(kl.mean().item(), abs=1e-6)
        zeroed = {**step, "adv": torch.where(masked, 0.0, step["adv"]), "ref": step["old"]}
        assert step["loss"] == pytest.approx(reference_loss(trainer.loss_cfg, zeroed)[0], rel=1e-4, abs=1e-6)
    on_policy, second_pass = (r["off_policy_mask/masked_ratio"] for r in rows)
    assert on_policy == 0 and second_pass > 0


def test_real_loss_in_the_trainer(tiny_model_dir, math_jsonl, tmp_path, plugin, micro_steps):
    """--loss_type real: per micro-step (one group of 4: per_device_train_batch_size = num_generations), the
    trainer's loss is REAL's classification loss on the mean log-ratios (τ = 0.5) plus β·KL as a token mean; only
    is_ratio/mean and kl are logged; rewards are unscaled; the policy moved."""
    trainer, rows = _train(
        tiny_model_dir,
        math_jsonl,
        tmp_path / "run",
        plugin,
        flags("--loss_type real --beta 0.04 --stop_words e"),
    )
    assert (trainer.loss_cfg.num_generations, trainer.loss_cfg.real_tau) == (4, 0.5)
    assert trainer.cfg.algorithm.scale_rewards == "none"
    assert [r["step"] for r in rows] == [1, 2] and len(micro_steps) == 2
    for step in micro_steps:
        mask = step["mask"]
        keep = mask > 0
        lp, old, ref = (torch.where(keep, step[k], 0.0) for k in ("logps", "old", "ref"))
        s = ((lp - old) * mask).sum(1) / mask.sum(1).clamp(min=1) / 0.5  # logits s_k / τ
        pos = step["adv"] > 0
        real = (
            torch.log1p(torch.exp(s[~pos]).sum()) + torch.log1p(torch.exp(-s[pos]).sum())
            if pos.any() and (~pos).any()
            else torch.tensor(0.0)
        )
        kl = torch.exp(ref - lp) - (ref - lp) - 1
        loss = real + 0.04 * (kl * mask).sum() / mask.sum()
        assert step["loss"] == pytest.approx(float(loss), rel=1e-4, abs=1e-6)
        assert set(step["metrics"]) == {"is_ratio/mean", "kl"}
    assert any(float(s["adv"].abs().max()) > 0 for s in micro_steps)  # a group with both labels
    policy = dict(trainer.policy.named_parameters())
    ref = dict(trainer.ref_model.named_parameters())
    assert all(not policy[n].detach().equal(ref[n]) for n in ref if n.endswith("q_proj.weight"))  # it trained
