"""Multimodal GRPO with tiny random Qwen2-VL, Idefics3 and Gemma3 built in the test (issue 21's acceptance):
the trainer's logps equal the engine's sampling logprobs, the image changes the logps, and a batch of rows with
0, 1 and 2 images gives the same loss whole or split into 2 micro-batches."""

from __future__ import annotations

import json

import pytest
import torch
from support import flags, grpo_trainer_class

pytestmark = pytest.mark.slow

FAMILIES = ("qwen2_vl", "idefics3", "gemma3")
COLOURS = {"red": (220, 20, 30), "green": (20, 200, 40), "blue": (30, 40, 210)}


@pytest.fixture(scope="module")
def vlm_dirs(tmp_path_factory):
    from grpokit.testing_vlm import build_tiny_vlm

    root = tmp_path_factory.mktemp("vlms")
    return {f: build_tiny_vlm(root / f, f) for f in FAMILIES}


def _image_dataset(tmp_path, rows: int = 6):
    """ms-swift rows: row i has i % 3 images (paths) and as many <image> placeholders."""
    from PIL import Image

    names = list(COLOURS)
    lines = []
    for i in range(rows):
        paths = []
        for k in range(i % 3):
            colour = names[(i + k) % 3]
            path = tmp_path / f"img{i}_{k}.png"
            Image.new("RGB", (12 + 4 * k, 16), COLOURS[colour]).save(path)
            paths.append(str(path))
        text = "<image>" * len(paths) + "What colour is this image?"
        lines.append({"messages": [{"role": "user", "content": text}], "images": paths, "solution": names[i % 3]})
    path = tmp_path / "colours.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    return path


def _train(model_dir, data, out, trainer_cls, extra=()):
    from grpokit.config.parse import parse_train_args
    from grpokit.pipeline.train import run_train

    with grpo_trainer_class(trainer_cls):
        return run_train(
            parse_train_args(
                flags(
                    {"--model": model_dir, "--dataset": data, "--output_dir": out},
                    "--tuner_type full --reward_funcs external_r1v_acc --num_generations 2",
                    "--per_device_train_batch_size 6 --generation_batch_size 6 --max_steps 1",
                    "--max_completion_length 6 --beta 0 --torch_dtype float32 --save_steps 100 --seed 0",
                    "--disable_tqdm true --rollout_importance_sampling_mode token_truncate --loss_type grpo",
                    "--dataset_shuffle false",
                    *extra,
                )
            )
        )


@pytest.mark.parametrize("family", FAMILIES)
def test_trainer_logps_equal_engine_logprobs_and_splitting_keeps_the_loss(family, vlm_dirs, tmp_path):
    from grpokit.trainers.grpo_trainer import GRPOTrainer

    seen: dict = {}

    class Recording(GRPOTrainer):
        def _compute_loss_and_metrics(self, model, inputs):
            logps, _ = self._get_per_token_logps_and_entropies(model, inputs.to(self.accelerator.device))
            seen["logps"], seen["batch"] = logps.detach(), inputs
            return super()._compute_loss_and_metrics(model, inputs)

    data = _image_dataset(tmp_path)
    trainer = _train(vlm_dirs[family], data, tmp_path / "out", Recording)
    batch = seen["batch"]
    assert sorted(len(r.tensors.get("pixel_values", [])) > 0 for r in batch.mm_inputs).count(True) == 4  # 0,1,2
    mask = batch.completion_mask.bool()
    assert mask.sum() > 0 and not torch.isnan(batch.rollout_logps[mask]).any()
    torch.testing.assert_close(seen["logps"][mask], batch.rollout_logps[mask], atol=1e-5, rtol=0)
    # the same loss from the whole batch and from 2 micro-batches of 3 rows (each with its own images)
    trainer.model.eval()
    with torch.no_grad():
        whole, _ = trainer._compute_loss_and_metrics(trainer.model, batch.trim())
        halves = [trainer._compute_loss_and_metrics(trainer.model, mb)[0] for mb in batch.split(2)]
    assert sum(len(mb.mm_inputs) for mb in batch.split(2)) == len(batch)
    torch.testing.assert_close(whole, torch.stack(halves).mean(), atol=1e-6, rtol=1e-5)


def _next_token_logps(model_dir) -> torch.Tensor:
    """[3, V]: the model's next-token logps after the same question about a red, a green and a blue image."""
    from PIL import Image

    from grpokit.config.args import ModelArguments
    from grpokit.pipeline.models import load_policy
    from grpokit.template.processor import ProcessorTemplate, collate_mm

    model, processor, _ = load_policy(
        ModelArguments(model=str(model_dir), torch_dtype="float32", tuner_type="full"), 0.0
    )
    template = ProcessorTemplate(processor)
    messages = [{"role": "user", "content": "<image>What colour is this image?"}]
    prompts = [template.encode_mm(messages, [Image.new("RGB", (16, 16), c)]) for c in COLOURS.values()]
    assert prompts[0][0] == prompts[1][0]  # same ids: only the pixels differ
    ids = torch.tensor([p[0] for p in prompts])
    with torch.no_grad():
        out = model(
            input_ids=ids, attention_mask=torch.ones_like(ids), **collate_mm([p[1] for p in prompts], ids.shape[1])
        )
    return torch.log_softmax(out.logits[:, -1].float(), -1)


@pytest.mark.parametrize("family", FAMILIES)
def test_changing_only_the_image_changes_the_logps(family, vlm_dirs, tmp_path):
    """... and with ``--zero_aligner`` (the colours example's model) it does not: every image reaches the language
    model as the same zero embeddings until the aligner trains."""
    from grpokit.testing_vlm import build_tiny_vlm

    logps = _next_token_logps(vlm_dirs[family])
    assert (logps[0] - logps[1]).abs().max() > 1e-4
    assert (logps[0] - logps[2]).abs().max() > 1e-4
    blind = _next_token_logps(build_tiny_vlm(tmp_path / "zero", family, zero_aligner=True))
    torch.testing.assert_close(blind[0], blind[1], atol=1e-6, rtol=0)
    torch.testing.assert_close(blind[0], blind[2], atol=1e-6, rtol=0)


def _changed(before: dict, model) -> dict[str, bool]:
    """Per VLM part: whether any of its parameters moved."""
    from grpokit.pipeline.vlm_parts import vlm_part

    moved: dict[str, bool] = {}
    for name, p in model.named_parameters():
        key = name.replace("base_model.model.", "").replace(".base_layer", "")
        if key in before:
            part = vlm_part(key)
            moved[part] = moved.get(part, False) or not torch.equal(before[key], p.detach())
    return moved


@pytest.mark.parametrize(
    "extra, moves",
    [
        ((), {"llm": True, "vit": False, "aligner": False}),
        (("--freeze_vit", "false"), {"llm": True, "vit": True, "aligner": False}),
        (
            ("--freeze_aligner", "false", "--tuner_type", "lora", "--lora_dropout", "0"),
            {"llm": True, "vit": False, "aligner": True},
        ),
    ],
)
def test_freeze_flags_choose_the_parts_that_train(extra, moves, vlm_dirs, tmp_path):
    """Full fine-tuning (or LoRA, merged for the check) trains the language model; the vision tower and the
    aligner only when unfrozen."""
    from grpokit.trainers.grpo_trainer import GRPOTrainer

    before: dict = {}

    class Snapshot(GRPOTrainer):
        def _next_window(self):
            if not before:
                base = self.policy.get_base_model() if hasattr(self.policy, "get_base_model") else self.policy
                before.update({n: p.detach().clone() for n, p in base.named_parameters()})
            return super()._next_window()

    from grpokit.rewards import orms

    orms["test_alternating"] = lambda completions, **kw: [float(i % 2) for i in range(len(completions))]
    try:  # 0 and 1 in every group of 2: every row has an advantage, so every trainable part gets a gradient
        trainer = _train(
            vlm_dirs["qwen2_vl"],
            _image_dataset(tmp_path),
            tmp_path / "out",
            Snapshot,
            ("--learning_rate", "1e-2", "--reward_funcs", "test_alternating", *extra),
        )
    finally:
        del orms["test_alternating"]
    model = trainer.policy
    if hasattr(model, "peft_config"):  # LoRA: adapters only on the parts that train, and each of them moved
        from grpokit.pipeline.vlm_parts import vlm_part

        trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
        assert trainable and all("lora_" in n for n in trainable)
        moved = {part: False for part in moves}
        for n, p in trainable.items():
            moved[vlm_part(n)] |= "lora_B" in n and bool(p.abs().sum() > 0)
        assert moved == moves
    else:
        assert _changed(before, model) == moves


def test_trl_rows_train_and_rewards_get_the_images(vlm_dirs, tmp_path):
    """TRL's format (an image column, typed content parts) through a run; a reward sees each row's image."""
    from datasets import Dataset
    from PIL import Image

    from grpokit.rewards import orms
    from grpokit.trainers.grpo_trainer import GRPOTrainer

    got: list = []

    def sees_images(completions, images, **kwargs):
        got.extend(images)
        return [1.0] * len(completions)

    orms["test_sees_images"] = sees_images
    rows = [
        {
            "prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "colour?"}]}],
            "image": Image.new("RGB", (16, 16), c),
            "solution": name,
        }
        for name, c in COLOURS.items()
    ]
    rows.append({**rows[0], "image": Image.new("RGB", (16, 16), (1, 2, 3))})
    data = tmp_path / "trl"
    Dataset.from_list(rows * 2).save_to_disk(str(data))
    try:
        _train(
            vlm_dirs["idefics3"],
            data,
            tmp_path / "out",
            GRPOTrainer,
            ("--reward_funcs", "test_sees_images", "--rollout_importance_sampling_mode", "token_mask"),
        )
    finally:
        del orms["test_sees_images"]
    assert len(got) == 6  # 3 prompts × 2 generations, one image list each
    assert all(len(imgs) == 1 for imgs in got)
    colours = {
        load(imgs[0]).getpixel((0, 0))
        for imgs in got
        for load in [__import__("grpokit.data.images", fromlist=["load_image"]).load_image]
    }
    assert colours <= {*COLOURS.values(), (1, 2, 3)} and len(colours) >= 2


def test_a_text_only_model_given_images_fails_in_one_line(tiny_model_dir, tmp_path):
    from grpokit.config.parse import parse_train_args
    from grpokit.errors import ConfigError
    from grpokit.pipeline.train import run_train

    data = _image_dataset(tmp_path, rows=3)
    with pytest.raises(ConfigError, match="a text-only model was given a dataset with images") as e:
        run_train(
            parse_train_args(
                flags(
                    {"--model": tiny_model_dir, "--dataset": data, "--output_dir": tmp_path / "o"},
                    "--tuner_type full --max_steps 1",
                )
            )
        )
    assert "\n" not in str(e.value)  # the CLI prints a ConfigError as this one line
