"""What the vLLM engine sends for image rows (engines/vllm_mm.py), without vLLM: unexpanded prompt ids with the
PIL images, the processor's ids to check vLLM's against, the tokens completions may use, and which folders get
the processor template."""

from __future__ import annotations

import io
from types import SimpleNamespace

import pytest

from grpokit.engines.vllm_mm import allowed_token_ids, check_prompt_ids, collapse_images, engine_template, vllm_inputs
from grpokit.errors import RolloutError
from grpokit.protocol import RolloutInferRequest
from grpokit.template.encode import ChatTemplate
from grpokit.template.processor import ProcessorTemplate


def _png(rgb) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (16, 16), rgb).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def idefics3(tmp_path_factory):
    from grpokit.testing_vlm import build_tiny_vlm

    return build_tiny_vlm(tmp_path_factory.mktemp("idefics3"), "idefics3")


def test_image_rows_go_unexpanded_with_their_images(idefics3):
    template, processor = engine_template(str(idefics3))
    assert isinstance(template, ProcessorTemplate) and processor is template.processor
    image_id = template.tokenizer.convert_tokens_to_ids("<image>")
    two = RolloutInferRequest(
        messages=[{"role": "user", "content": "<image> and <image>?"}],
        data_dict={"images": [_png((200, 0, 0)), _png((0, 0, 200))]},
    )
    text = RolloutInferRequest(messages=[{"role": "user", "content": "no image"}])
    inputs, expected = vllm_inputs(template, [two, text])
    ids, _ = template.encode_mm(two.messages, two.data_dict["images"])
    assert expected == [ids, template.encode_prompt(text.messages)]
    assert inputs[0]["prompt_token_ids"].count(image_id) == 2  # one slot per image: vLLM expands them
    assert ids.count(image_id) > 2 and len(inputs[0]["prompt_token_ids"]) < len(ids)
    assert [im.getpixel((0, 0)) for im in inputs[0]["multi_modal_data"]["image"]] == [(200, 0, 0), (0, 0, 200)]
    assert inputs[1] == {"prompt_token_ids": expected[1]}


def test_a_pinned_later_turn_goes_as_the_trajectory_ids_with_images_collapsed(idefics3):
    """A continued trajectory's prompt is its pinned ids (a reply kept as sampled, one token per character here),
    each image's expanded tokens collapsed back to one slot; ids missing an image's tokens stop the rollout."""
    template, _ = engine_template(str(idefics3))
    tok = template.tokenizer
    req = RolloutInferRequest(
        messages=[{"role": "user", "content": "<image> and <image>?"}],
        data_dict={"images": [_png((200, 0, 0)), _png((0, 0, 200))]},
    )
    images = req.data_dict["images"]
    ids, row = template.encode_mm(req.messages, images)
    reply = [i for c in "a red one" for i in tok(c, add_special_tokens=False)["input_ids"]]
    template.pin(req.request_id, req.messages, images, ids + reply, row)
    inputs, expected = vllm_inputs(template, [req])
    slots = tok(template.render_mm(req.messages, 2), add_special_tokens=False)["input_ids"]
    assert expected == [ids + reply] and inputs[0]["prompt_token_ids"] == slots + reply
    spans = template.image_spans(ids)
    template.pin(req.request_id, req.messages, images, ids[: spans[1][0]] + ids[spans[1][1] :], row)
    with pytest.raises(RolloutError, match=r"image 1 of 2: its \d+ expanded tokens are not in the prompt"):
        vllm_inputs(template, [req])


def test_collapsing_split_images_gives_the_rendered_slots(idefics3):
    """Image splitting on (each image tiled, rows separated by newlines): the expanded ids still collapse to the
    rendered prompt tokenized with one slot per image."""
    from PIL import Image

    template, _ = engine_template(str(idefics3))
    template.processor.image_processor.do_image_splitting = True
    template.processor.image_processor.size = {"longest_edge": 48}
    images = [Image.new("RGB", (200, 90), (200, 0, 0)), Image.new("RGB", (16, 16), (0, 200, 0))]
    messages = [{"role": "user", "content": "Look:\n<image>\nWhat colour? <image> and"}]
    ids, _ = template.encode_mm(messages, images)
    slots = collapse_images(template, ids, images)
    assert len(ids) > len(slots) + 200  # the first image is tiled
    assert slots == template.tokenizer(template.render_mm(messages, 2), add_special_tokens=False)["input_ids"]


def test_completions_may_not_use_special_tokens_but_end_of_sequence(idefics3):
    template, _ = engine_template(str(idefics3))
    allowed = allowed_token_ids(template, 600)
    assert template.eos_token_id in allowed and len(allowed) == 600 - len(template.blocked_token_ids)
    assert template.tokenizer.convert_tokens_to_ids("<image>") not in allowed
    assert allowed_token_ids(ChatTemplate(template.tokenizer), 600) is None  # text models sample freely


def test_other_families_stay_text_only_and_refuse_image_rows(tmp_path):
    from grpokit.testing_vlm import build_tiny_vlm

    folder = build_tiny_vlm(tmp_path / "qwen", "qwen2_vl")
    template, _ = engine_template(str(folder))
    assert not isinstance(template, ProcessorTemplate)
    row = RolloutInferRequest(
        messages=[{"role": "user", "content": "<image>?"}], data_dict={"images": [_png((1, 2, 3))]}
    )
    with pytest.raises(RolloutError, match="the vLLM engine was given image rows but serves this model as text-only"):
        vllm_inputs(template, [row])


def test_prompt_ids_vllm_expanded_otherwise_stop_the_rollout():
    check_prompt_ids([SimpleNamespace(prompt_token_ids=[1, 2, 3])], [[1, 2, 3]])
    with pytest.raises(RolloutError) as e:
        check_prompt_ids([SimpleNamespace(prompt_token_ids=[1, 2, 3])], [[1, 9, 9, 3]])
    assert str(e.value).startswith(
        "request 0: vLLM's prompt ids differ from the processor's (3 vs 4 ids, first difference at position 1)"
    )
    assert "\n" not in str(e.value)
