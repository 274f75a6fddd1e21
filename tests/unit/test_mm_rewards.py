"""external_r1v_acc (rewards/multimodal.py), VLM part names (pipeline/vlm_parts.py) and the text-only-model check."""

from __future__ import annotations

import json

import pytest
from datasets import Dataset

from grpokit.config.args import RolloutArguments
from grpokit.errors import ConfigError
from grpokit.pipeline.vlm_parts import check_model_takes_images, vlm_part
from grpokit.rewards import orms


def test_r1v_accuracy_math_first_then_the_answer_string():
    reward = orms["external_r1v_acc"]()
    completions = [
        "<answer>1/2</answer>",
        "<answer>0.5</answer>",
        "<answer> red </answer>",
        "red",
        "blue",
        "<answer>3</answer>",
        "anything",
    ]
    solutions = ["<answer>0.5</answer>", "$\\frac{1}{2}$", "<answer>red</answer>", "red", "red", "4", None]
    # 1/2 == 0.5 by math-verify (both ways); 'red' by string (tags stripped, then whitespace); None: not scored
    assert reward(completions, solution=solutions, images=[[]] * 7) == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, None]


@pytest.mark.parametrize(
    "name, part",
    [
        ("model.visual.blocks.0.attn.qkv", "vit"),
        ("model.visual.merger.mlp.0", "aligner"),
        ("model.vision_model.encoder.layers.0.mlp.fc1", "vit"),
        ("model.connector.modality_projection.proj", "aligner"),
        ("model.vision_tower.vision_model.embeddings", "vit"),
        ("model.multi_modal_projector.mm_soft_emb_norm", "aligner"),
        ("model.language_model.layers.0.self_attn.q_proj", "llm"),
        ("model.text_model.layers.1.mlp.up_proj", "llm"),
        ("lm_head", "llm"),
    ],
)
def test_vlm_part_names_of_qwen_idefics_and_gemma(name, part):
    assert vlm_part(name) == part


def test_a_text_only_model_given_images_is_one_line():
    ds = Dataset.from_list([{"messages": [{"role": "user", "content": "x"}], "images": [b"png"]}])

    class Tokenizer:  # no image_processor: a text-only model's tokenizer
        pass

    with pytest.raises(ConfigError, match="--model m: a text-only model was given a dataset with images") as e:
        check_model_takes_images(ds, Tokenizer(), "m")
    assert "\n" not in str(e.value)
    check_model_takes_images(Dataset.from_list([{"messages": [], "images": []}]), Tokenizer(), "m")  # no images

    class Processor:
        image_processor = object()

    check_model_takes_images(ds, Processor(), "m")
    # server mode: the rollout server checks its own model (it refuses images for a text-only one)
    check_model_takes_images(ds, Processor(), "m", RolloutArguments(use_vllm=True, vllm_mode="server"))


@pytest.mark.parametrize("model_type", ["idefics3", "smolvlm", "qwen2_vl", "gemma3"])
def test_vllm_colocate_takes_images_of_idefics3_only(tmp_path, model_type):
    ds = Dataset.from_list([{"messages": [{"role": "user", "content": "x"}], "images": [b"png"]}])

    class Processor:
        image_processor = object()

    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    colocate = RolloutArguments(use_vllm=True, vllm_mode="colocate")
    if model_type == "idefics3":
        check_model_takes_images(ds, Processor(), str(tmp_path), colocate)
        return
    with pytest.raises(ConfigError) as e:
        check_model_takes_images(ds, Processor(), str(tmp_path), colocate)
    message = str(e.value)
    assert message.startswith(
        "--use_vllm true: image rows through vLLM are supported for Idefics3 models only, and "
        f"--model {tmp_path} is {model_type} ("
    ), message
    assert "torchvision" in message and "--use_vllm false" in message and "\n" not in message
