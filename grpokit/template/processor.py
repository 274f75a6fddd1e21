"""The processor is the template of a vision-language model.

A multimodal prompt is rendered by the chat template and tokenized by the model's processor, which expands each
image slot into the model's image tokens and returns the model-specific tensors (``pixel_values``,
``image_grid_thw``, ``mm_token_type_ids``, ``pixel_attention_mask``, ``token_type_ids``). The engine samples from
those ids and tensors, and the trainer's batch carries the very same ids and, per row, the same tensors
(``MMRow``); ``collate_mm`` turns a list of rows into model inputs for both, so a micro-batch or a process's share
is always a list of whole rows and splitting can never separate an image from its tokens.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from grpokit.data.images import count_placeholders, load_image, to_parts, with_image_slots
from grpokit.errors import ConfigError, DataError, RolloutError
from grpokit.protocol import RolloutOutput
from grpokit.template.encode import ChatTemplate, EncodedSample, _memo_key

# per-token tensors: left-padded like the prompt, zeros over the completion
TOKEN_KEYS = ("mm_token_type_ids", "token_type_ids")
_MEMO_SIZE = 1024


@dataclass
class MMRow:
    """One prompt's processor outputs besides its ids: name → tensor with the processor's batch layout for one
    row (``[1, L]`` per-token tensors; ``pixel_values`` as the processor stacks one row's images)."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def has_images(self) -> bool:
        return "pixel_values" in self.tensors


def collate_mm(rows: list[MMRow], prompt_width: int, completion_width: int = 0) -> dict[str, torch.Tensor]:
    """Model inputs of a batch of rows whose prompts are left-padded to ``prompt_width`` and followed by
    ``completion_width`` completion columns. Per-token tensors are padded with zeros; ``pixel_values`` are
    concatenated image by image (Qwen-VL's patches, Gemma3's images) or, where the processor gives each row its
    own slot ([1, N, C, H, W], Idefics3), padded to the row with the most images (all-zero images are padding
    to the model) together with ``pixel_attention_mask``; ``image_grid_thw`` is concatenated."""
    keys = {k for r in rows for k in r.tensors}
    out: dict[str, torch.Tensor] = {}
    for key in sorted(keys):
        present = [r.tensors[key] for r in rows if key in r.tensors]
        if key in TOKEN_KEYS:
            cols = []
            for r in rows:
                t = r.tensors.get(key)
                t = t.reshape(-1) if t is not None else torch.zeros(0, dtype=torch.long)
                cols.append(torch.cat([t.new_zeros(prompt_width - len(t)), t, t.new_zeros(completion_width)]))
            out[key] = torch.stack(cols)
        elif present[0].dim() in (4, 5) and key in ("pixel_values", "pixel_attention_mask") and _row_slots(rows):
            most = max(r.tensors[key].shape[1] if key in r.tensors else 0 for r in rows)
            like = present[0][0, :1]
            out[key] = torch.stack([_pad_images(r.tensors.get(key), most, like) for r in rows])
        else:
            out[key] = torch.cat(present)
    if "pixel_values" not in out:  # no image in this batch: the model runs its text-only path
        out = {k: v for k, v in out.items() if k in TOKEN_KEYS}
    return out


def _row_slots(rows: list[MMRow]) -> bool:
    """The processor keeps a per-row image axis (Idefics3: pixel_values [1, N, C, H, W])."""
    pv = next((r.tensors["pixel_values"] for r in rows if r.has_images), None)
    return pv is not None and pv.dim() == 5


def _pad_images(t: torch.Tensor | None, most: int, like: torch.Tensor) -> torch.Tensor:
    have = 0 if t is None else t.shape[1]
    pad = like.new_zeros((most - have, *like.shape[1:]))
    return pad if t is None else torch.cat([t[0], pad])


class ProcessorTemplate(ChatTemplate):
    """A ChatTemplate whose image prompts are tokenized by the model's processor (``encode_mm``)."""

    multimodal = True

    def __init__(self, processor, system: str | None = None, *, chat_template_kwargs: dict | None = None) -> None:
        self.processor = processor
        tokenizer = processor.tokenizer
        if getattr(tokenizer, "chat_template", None) is None and getattr(processor, "chat_template", None):
            tokenizer.chat_template = processor.chat_template
        super().__init__(tokenizer, system, chat_template_kwargs=chat_template_kwargs)
        self._mm: OrderedDict[tuple, tuple[list[int], MMRow]] = OrderedDict()
        # sampling must never emit an image (or other special) token: the training forward would then look for
        # an image that is not there ("Image features and image tokens do not match")
        special = set(tokenizer.all_special_ids)
        special |= {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
        self.blocked_token_ids = sorted(special - {self.eos_token_id})

    def render_prompt(self, messages: list[dict]) -> str:
        if count_placeholders(messages):
            messages = to_parts(messages)
        return super().render_prompt(messages)

    def render_mm(self, messages: list[dict], n_images: int) -> str:
        """The prompt text of a conversation with images, one image slot per image (before the processor expands
        the slots into image tokens)."""
        return self.render_prompt(with_image_slots(self.with_system(messages), n_images))

    def encode_mm(self, messages: list[dict], images: list) -> tuple[list[int], MMRow]:
        """Prompt ids (image tokens expanded) and the row's tensors; memoised per conversation and images (the
        num_generations requests of a group share them)."""
        if not images:
            if count_placeholders(messages):
                raise DataError(f"{count_placeholders(messages)} image placeholder(s) but no image in the row; "
                                "add an images column or remove the placeholders")
            return self.encode_prompt(messages), MMRow()
        key = (_memo_key(messages), tuple(_fingerprint(i) for i in images))
        if key not in self._mm:
            text = self.render_mm(messages, len(images))
            pil = [load_image(i) for i in images]
            out = self.processor(text=[text], images=[pil], return_tensors="pt", add_special_tokens=False)
            ids = out["input_ids"][0].tolist()
            tensors = {k: v for k, v in out.items() if k not in ("input_ids", "attention_mask")}
            self._mm[key] = (ids, MMRow(tensors))
            while len(self._mm) > _MEMO_SIZE:
                self._mm.popitem(last=False)
        ids, row = self._mm[key]
        return list(ids), row

    def encode_output(self, prompt_messages: list[dict], output: RolloutOutput, images=()) -> EncodedSample:
        """As ChatTemplate.encode_output, with the prompt from ``encode_mm`` and its row in ``extra["mm"]``."""
        images = list(images or [])
        sample = super().encode_output(prompt_messages, output) if not images else None
        if sample is None:
            if len(output.response_token_ids) != 1:
                raise RolloutError(f"request {output.request_id}: multi-turn trajectories with images are not "
                                   "supported yet; use single-turn rollouts for image rows")
            prompt_ids, row = self.encode_mm(prompt_messages, images)
            text = super().encode_output(prompt_messages, output)
            sample = EncodedSample(prompt_ids, text.completion_ids, text.completion_mask, text.rollout_logprobs)
            sample.extra["mm"] = row
        else:
            sample.extra["mm"] = MMRow()
        return sample


def _fingerprint(image) -> str:
    if isinstance(image, dict):
        image = image.get("bytes") or image.get("path")
    if isinstance(image, str):
        return image
    if isinstance(image, (bytes, bytearray)):
        return hashlib.sha1(image).hexdigest()
    return hashlib.sha1(image.tobytes() + str(image.size).encode()).hexdigest()  # PIL


def is_vlm_folder(path: str) -> bool:
    """A model folder with an image processor (a processor_config.json or preprocessor_config.json)."""
    p = Path(path)
    return (p / "processor_config.json").is_file() or (p / "preprocessor_config.json").is_file()


def load_processor(path: str, tokenizer):
    """The model's processor. Processors that declare a video processor need torchvision in ``AutoProcessor``;
    without it they are assembled here from their PIL image processor and the tokenizer (images only)."""
    import transformers  # not at the top: only vision-language runs load a processor

    try:
        return transformers.AutoProcessor.from_pretrained(path)
    except (ImportError, OSError, ValueError, TypeError, AttributeError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
    p = Path(path)
    config = p / "processor_config.json" if (p / "processor_config.json").is_file() else p / "preprocessor_config.json"
    name = json.loads(config.read_text()).get("processor_class")
    cls = getattr(transformers, name or "", None)
    if cls is None:
        raise ConfigError(f"--model {path}: cannot load its processor ({reason})")
    image_processor = transformers.AutoImageProcessor.from_pretrained(path)
    return image_only(cls)(image_processor=image_processor, tokenizer=tokenizer,
                           chat_template=getattr(tokenizer, "chat_template", None))


def image_only(cls):
    """``cls`` (a transformers processor class) without its video processor, which needs torchvision."""
    if "video_processor" not in cls.get_attributes():
        return cls

    class ImageOnly(cls):
        @classmethod
        def get_attributes(klass):
            return [a for a in super().get_attributes() if a != "video_processor"]

    ImageOnly.__name__ = ImageOnly.__qualname__ = cls.__name__  # saves under the model's own processor class
    return ImageOnly


def make_template(tokenizer_or_processor, system: str | None = None) -> ChatTemplate:
    """The processor template for a processor (it has an image processor), else the tokenizer's ChatTemplate."""
    if hasattr(tokenizer_or_processor, "image_processor"):
        return ProcessorTemplate(tokenizer_or_processor, system)
    return ChatTemplate(tokenizer_or_processor, system)
