"""Every loss type × importance-sampling level, dynamic sampling and kl_in_reward train on a tiny model."""

from __future__ import annotations

import json
import math
import textwrap

import pytest

pytestmark = pytest.mark.slow

PLUGIN = textwrap.dedent("""
    from grpokit.rewards import ORM, orms

    class ShortIsGood(ORM):
        def __call__(self, completions, **kwargs):
            return [1.0 / (1 + len(c)) for c in completions]

    class ContainsDigit(ORM):
        '''Sparse 0/1 reward: many groups are all-equal, which dynamic sampling must resample.'''
        def __call__(self, completions, **kwargs):
            return [float(any(ch.isdigit() for ch in c)) for c in completions]

    orms['short_is_good'] = ShortIsGood
    orms['contains_digit'] = ContainsDigit
""")

COMBOS = [(loss, level) for loss in ("grpo", "bnpo", "dr_grpo", "dapo", "cispo")
          for level in ("token", "sequence", "sequence_token")] + [("sapo", "token")]


@pytest.fixture(scope="module")
def plugin(tmp_path_factory):
    p = tmp_path_factory.mktemp("alg") / "alg_plugin.py"
    p.write_text(PLUGIN)
    return p


def _train(tiny_model_dir, math_jsonl, out, plugin, extra):
    from grpokit.config.parse import parse_train_args
    from grpokit.pipeline.train import run_train

    args = ["--model", str(tiny_model_dir), "--dataset", str(math_jsonl), "--output_dir", str(out),
            "--external_plugins", str(plugin), "--reward_funcs", "short_is_good", "--num_generations", "4",
            "--per_device_train_batch_size", "4", "--steps_per_generation", "2", "--max_completion_length", "8",
            "--max_steps", "2", "--learning_rate", "1e-3", "--torch_dtype", "float32", "--disable_tqdm", "true",
            "--plots", "false", "--save_final_model", "false", "--seed", "1", *extra]
    trainer = run_train(parse_train_args(args))
    rows = [json.loads(line) for line in (out / "logging.jsonl").read_text().splitlines()]
    return trainer, rows


@pytest.mark.parametrize("loss_type, level", COMBOS)
def test_every_loss_and_level_trains(tiny_model_dir, math_jsonl, tmp_path, plugin, loss_type, level):
    # steps_per_generation 2 > gradient_accumulation_steps 1: the second micro-step is off-policy, the ratio acts
    _, rows = _train(tiny_model_dir, math_jsonl, tmp_path / "run", plugin,
                     ["--loss_type", loss_type, "--importance_sampling_level", level, "--beta", "0.04"])
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert math.isfinite(r["loss"])
        assert {"kl", "reward", "advantages/mean"} <= set(r)
        if loss_type == "cispo":  # only the upper cap clips
            assert "cispo_clip_ratio" in r
        elif loss_type != "sapo":  # sapo gates softly and clips nothing
            assert {"clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"} <= set(r)


def test_dynamic_sampling_resamples_groups_without_signal(tiny_model_dir, math_jsonl, tmp_path, plugin):
    _, rows = _train(tiny_model_dir, math_jsonl, tmp_path / "dyn", plugin,
                     ["--reward_funcs", "contains_digit", "--dynamic_sample", "true", "--max_resample_times", "2",
                      "--beta", "0"])
    assert all(math.isfinite(r["loss"]) for r in rows)
    assert all("dynamic_sampling/rounds" in r and "dynamic_sampling/groups_without_signal" in r for r in rows)


def test_kl_in_reward_moves_kl_out_of_the_loss(tiny_model_dir, math_jsonl, tmp_path, plugin):
    trainer, rows = _train(tiny_model_dir, math_jsonl, tmp_path / "klr", plugin,
                           ["--kl_in_reward", "true", "--beta", "0.1"])
    assert trainer.loss_cfg.beta == 0.0  # no KL term in the loss
    assert all(math.isfinite(r["loss"]) for r in rows)


def test_off_policy_iterations_and_ref_sync(tiny_model_dir, math_jsonl, tmp_path, plugin):
    trainer, rows = _train(tiny_model_dir, math_jsonl, tmp_path / "mu", plugin,
                           ["--num_iterations", "2", "--beta", "0.04", "--sync_ref_model", "true",
                            "--ref_model_sync_steps", "1", "--ref_model_mixup_alpha", "0.5", "--epsilon", "0.1",
                            "--max_steps", "4"])
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    # with μ = 2 the policy moves inside a window; a large lr pushes some ratios out of the clip range
    assert any(r["clip_ratio/region_mean"] > 0 or r["is_ratio/mean"] != 1.0 for r in rows)
    policy = dict(trainer.accelerator.unwrap_model(trainer.model).named_parameters())
    ref = dict(trainer.ref_model.named_parameters())
    name = next(n for n in ref if n.endswith("q_proj.weight"))
    assert not policy[name].detach().equal(ref[name])  # EMA moved the ref towards, not onto, the policy


@pytest.mark.parametrize("extra, needle", [
    (["--scale_rewards", "gdpo", "--kl_in_reward", "true"], "gdpo"),
    (["--epsilon", "-0.1"], "--epsilon"),
    (["--top_entropy_quantile", "1.5"], "top_entropy_quantile"),
    (["--loss_type", "sapo", "--importance_sampling_level", "sequence"], "sapo"),
])
def test_invalid_combinations_fail_at_start(tiny_model_dir, math_jsonl, extra, needle):
    from grpokit.config.parse import parse_train_args
    from grpokit.errors import ConfigError

    with pytest.raises(ConfigError, match=needle):
        parse_train_args(["--model", str(tiny_model_dir), "--dataset", str(math_jsonl), *extra])


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
