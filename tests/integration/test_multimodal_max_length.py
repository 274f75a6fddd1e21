"""--max_length with a processor (issue 21): the length of an image row is counted after the processor expanded its
images; delete and raise act on those lengths; left/right cut text only, never an image's tokens (else one line
naming the row), and the cut prompt trains with the engine's logprobs. Tiny random Qwen2-VL, Idefics3, Gemma3."""

from __future__ import annotations

import json

import pytest
import torch
from support import flags

pytestmark = pytest.mark.slow

FAMILIES = ("qwen2_vl", "idefics3", "gemma3")
SYSTEM = "You look at images and name their colour. " * 3


@pytest.fixture(scope="module")
def vlm_dirs(tmp_path_factory):
    from grpokit.testing_vlm import build_tiny_vlm

    root = tmp_path_factory.mktemp("vlms")
    return {f: build_tiny_vlm(root / f, f) for f in FAMILIES}


def _square(colour=(220, 20, 30)):
    from PIL import Image

    return Image.new("RGB", (16, 16), colour)


def _template(model_dir, max_length=None, strategy="left"):
    from grpokit.modeling import load_tokenizer
    from grpokit.template.processor import load_processor
    from grpokit.template.prompts import PromptOptions

    processor = load_processor(str(model_dir), load_tokenizer(str(model_dir)))
    return PromptOptions(max_length=max_length, truncation_strategy=strategy).template(processor)


def _rows(image_last: bool = False) -> list[dict]:
    """A long system prompt and one image: at the start of the user message, or (image_last) at its end."""
    user = "What colour is this image?<image>" if image_last else "<image>What colour is this image?"
    return [
        {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}], "images": [_square()]},
        {"messages": [{"role": "user", "content": "Say red."}], "images": []},
    ]


@pytest.mark.parametrize("family", FAMILIES)
def test_left_and_right_cut_text_only_and_keep_every_image_token(family, vlm_dirs):
    full = _template(vlm_dirs[family])
    row = _rows()[0]
    ids, row_full = full.encode_mm(row["messages"], row["images"])
    images = full.image_spans(ids)
    assert len(images) == 1  # one image: its tokens and the special tokens around them
    start, end = images[0]
    for strategy, limit in (("left", len(ids) - start), ("right", end)):  # the shortest cuts that keep it
        cut = _template(vlm_dirs[family], limit, strategy)
        got, got_row = cut.encode_mm(row["messages"], row["images"])
        assert len(got) == limit  # len(ids) - limit ids cut, at the side the strategy names (next line)
        assert got == (ids[-limit:] if strategy == "left" else ids[:limit])
        torch.testing.assert_close(got_row.tensors["pixel_values"], row_full.tensors["pixel_values"])
        for key in ("mm_token_type_ids", "token_type_ids"):  # per-token tensors cut with the ids
            if key in row_full.tensors:
                assert (
                    got_row.tensors[key].shape[-1] == limit
                    and got_row.tensors[key].sum() == row_full.tensors[key].sum()
                )
        with pytest.raises(Exception) as e:  # one token more: the cut would reach the image
            _template(vlm_dirs[family], limit - 1, strategy).encode_mm(row["messages"], row["images"])
        assert "would be cut through its image tokens; use --truncation_strategy delete" in str(e.value)


@pytest.mark.parametrize("family", ["qwen2_vl", "idefics3"])
def test_delete_raise_and_a_cut_through_an_image_count_image_tokens_and_name_the_row(family, vlm_dirs):
    from datasets import Dataset

    from grpokit.errors import DataError
    from grpokit.template.prompts import PromptOptions, prepare_prompts

    rows = _rows(image_last=True)
    full = _template(vlm_dirs[family])
    ids = full.encode_mm(rows[0]["messages"], rows[0]["images"])[0]
    text_only = len(full.tokenize(full.render_mm(rows[0]["messages"], 1)))  # the image as one slot
    assert len(ids) > text_only + 2  # the image counts for more than its placeholder
    ds = Dataset.from_list([{"messages": r["messages"], "images": [_png()] if r["images"] else []} for r in rows])

    def prepare(limit: int, strategy: str):
        return prepare_prompts(
            ds,
            _template(vlm_dirs[family], limit, strategy),
            PromptOptions(max_length=limit, truncation_strategy=strategy),
            "--dataset d",
        )

    limit = len(ids) - 1  # the rendered text alone would fit; with its image tokens the row does not
    kept = prepare(limit, "delete")
    assert len(kept) == 1 and kept[0]["messages"][0]["content"] == "Say red."
    assert len(prepare(limit, "left")) == 2 and len(prepare(limit, "right")) == 2  # 1 token off either end: fine
    _, end = full.image_spans(ids)[0]
    for strategy, limit, message in (
        ("raise", len(ids) - 1, f"--dataset d: row 0 has a {len(ids)}-token prompt, over --max_length {len(ids) - 1}"),
        (
            "right",
            end - 1,
            f"--dataset d: row 0 has a {len(ids)}-token prompt (images expanded), over "
            f"--max_length {end - 1}, and a --truncation_strategy right cut would pass through "
            "its image tokens; use --truncation_strategy delete",
        ),
    ):
        with pytest.raises(DataError) as e:
            prepare(limit, strategy)
        assert message in str(e.value) and "\n" not in str(e.value)


def _png(colour=(220, 20, 30)) -> bytes:
    import io

    buf = io.BytesIO()
    _square(colour).save(buf, format="PNG")
    return buf.getvalue()


def test_a_left_cut_prompt_trains_and_its_logps_equal_the_engine(vlm_dirs, tmp_path):
    from grpokit.config.parse import parse_train_args
    from grpokit.pipeline.train import run_train
    from grpokit.trainers.factory import TrainerFactory
    from grpokit.trainers.grpo_trainer import GRPOTrainer

    seen: list = []  # (the training forward's logps, the batch) of each loss computation

    class Recording(GRPOTrainer):
        def _compute_loss_and_metrics(self, model, inputs):
            forward = self._get_per_token_logps_and_entropies(model, inputs.to(self.accelerator.device))
            seen.append((forward[0].detach(), inputs))
            return super()._compute_loss_and_metrics(model, inputs)

    paths = []
    for i, colour in enumerate([(220, 20, 30), (20, 200, 40), (30, 40, 210)]):
        _square(colour).save(tmp_path / f"{i}.png")
        paths.append(str(tmp_path / f"{i}.png"))
    data = tmp_path / "rows.jsonl"
    data.write_text(
        "\n".join(
            json.dumps(
                {
                    "messages": [
                        {"role": "system", "content": SYSTEM},
                        {"role": "user", "content": "<image>What colour?"},
                    ],
                    "images": [p],
                    "solution": "red",
                }
            )
            for p in paths
        )
        + "\n"
    )
    full = _template(vlm_dirs["qwen2_vl"])
    row = json.loads(data.read_text().splitlines()[0])
    ids, _ = full.encode_mm(row["messages"], row["images"])
    limit = len(ids) - 10
    saved = dict(TrainerFactory.TRAINER_MAPPING)
    TrainerFactory.TRAINER_MAPPING["grpo"] = Recording
    try:
        run_train(
            parse_train_args(
                flags(
                    {"--model": vlm_dirs["qwen2_vl"], "--dataset": data, "--output_dir": tmp_path / "out"},
                    {"--max_length": limit},
                    "--tuner_type full --reward_funcs external_r1v_acc --num_generations 2",
                    "--per_device_train_batch_size 6 --generation_batch_size 6 --max_steps 1",
                    "--max_completion_length 4 --beta 0 --torch_dtype float32 --save_steps 100 --seed 0",
                    "--disable_tqdm true --rollout_importance_sampling_mode token_truncate",
                    "--truncation_strategy left",
                )
            )
        )
    finally:
        TrainerFactory.TRAINER_MAPPING.clear()
        TrainerFactory.TRAINER_MAPPING.update(saved)
    logps, batch = seen[-1]
    width = batch.input_ids.shape[1] - batch.completion_mask.shape[1]
    assert width == limit and bool(batch.attention_mask[:, :width].all())  # every prompt cut to the limit
    assert batch.input_ids[0, :width].tolist() == ids[10:]
    mask = batch.completion_mask.bool()
    torch.testing.assert_close(logps[mask], batch.rollout_logps[mask], atol=1e-5, rtol=0)


def test_vllm_gets_the_same_cut_before_it_expands_the_image(vlm_dirs):
    """vLLM takes the prompt with one slot per image and expands it itself: its slot ids lose the same text tokens,
    so what it expands is the processor's cut prompt (the engine checks that the ids agree)."""
    from grpokit.engines.vllm_mm import vllm_inputs
    from grpokit.protocol import RolloutInferRequest

    row = _rows()[0]
    ids, _ = _template(vlm_dirs["idefics3"]).encode_mm(row["messages"], row["images"])
    template = _template(vlm_dirs["idefics3"], len(ids) - 7, "left")
    inputs, expected = vllm_inputs(
        template, [RolloutInferRequest(messages=row["messages"], data_dict={"images": row["images"]})]
    )
    assert expected[0] == ids[7:]
    slots = inputs[0]["prompt_token_ids"]
    text = template.tokenizer.decode(slots)
    again = template.processor(text=[text], images=[row["images"]], add_special_tokens=False)["input_ids"][0]
    assert list(again) == expected[0]
