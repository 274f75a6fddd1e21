"""examples/vlm/colours.yaml parses into the settings docs/multimodal.md describes."""

from __future__ import annotations

from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "vlm" / "colours.yaml"


def test_colours_example_parses():
    from grpokit.config.parse import parse_train_args

    cfg = parse_train_args(["--config", str(EXAMPLE)])
    assert cfg.data.dataset == ["builtin:colours"] and cfg.data.val_dataset == ["builtin:colours:test"]
    assert cfg.reward.reward_funcs == ["external_r1v_acc"]
    assert cfg.rollout.structured_outputs_regex == "(red|green|blue)"
    # the model's aligner starts at zero (python -m grpokit.testing_vlm ... --zero_aligner) and must train
    assert (cfg.model.freeze_vit, cfg.model.freeze_aligner, cfg.model.tuner_type) == (True, False, "full")
    assert "--zero_aligner" in EXAMPLE.read_text()
    assert cfg.training.learning_rate == 3e-4
