"""The processor is the template of a vision-language model.

A multimodal prompt is rendered by the chat template and tokenized by the model's processor, which expands each
image slot into the model's image tokens and returns the model-specific tensors (``pixel_values``,
``image_grid_thw``, ``mm_token_type_ids``, ``pixel_attention_mask``, ``token_type_ids``). The engine samples from
those ids and tensors, and the trainer's batch carries the very same ids and, per row, the same tensors
(``MMRow``, in ``mm_rows.py``); ``collate_mm`` turns a list of rows into model inputs for both, so a micro-batch or
a process's share is always a list of whole rows and splitting can never separate an image from its tokens.

Multi-turn trajectories (``encode_turns``): the template's text between assistant turns goes through the processor
too, so an observation's ``<image>`` placeholders become image tokens, and the trajectory's row holds every image in
sequence order plus per-token tensors over the completion (``MMRow.completion``). The scheduler hands the engine
each later turn's prompt as exactly these ids and tensors (``pin``/``encode_request``), so what trains is what was
sampled from, token for token.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from pathlib import Path

import torch

from grpokit.data.images import (
    IMAGE_PLACEHOLDER,
    count_placeholders,
    load_image,
    row_images,
    to_parts,
    with_image_slots,
)
from grpokit.errors import ConfigError, DataError, RolloutError
from grpokit.protocol import RolloutInferRequest, RolloutOutput
from grpokit.template.encode import ChatTemplate, EncodedSample, _memo_key, segment_masks
from grpokit.template.mm_rows import TOKEN_KEYS, MMRow, join_rows
from grpokit.template.mm_rows import collate_mm as collate_mm  # importable from here too, as before

_MEMO_SIZE = 1024


class ProcessorTemplate(ChatTemplate):
    """A ChatTemplate whose image prompts are tokenized by the model's processor (``encode_mm``)."""

    multimodal = True

    def __init__(
        self,
        processor,
        system: str | None = None,
        *,
        chat_template_kwargs: dict | None = None,
        max_length: int | None = None,
        truncation_strategy: str = "left",
    ) -> None:
        self.processor = processor
        tokenizer = processor.tokenizer
        if getattr(tokenizer, "chat_template", None) is None and getattr(processor, "chat_template", None):
            tokenizer.chat_template = processor.chat_template
        super().__init__(
            tokenizer,
            system,
            chat_template_kwargs=chat_template_kwargs,
            max_length=max_length,
            truncation_strategy=truncation_strategy,
        )
        self._mm: OrderedDict[tuple, tuple[list[int], MMRow]] = OrderedDict()  # ids, row
        self._expansions: OrderedDict[str, list[int]] = OrderedDict()  # image fingerprint → its expanded ids
        self._pinned: dict[str, tuple[tuple, list[int], MMRow]] = {}  # request_id → a later turn's prompt
        # sampling must never emit an image (or other special) token: the training forward would then look for
        # an image that is not there ("Image features and image tokens do not match")
        special = set(tokenizer.all_special_ids)
        special |= {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
        self.blocked_token_ids = sorted(special - {self.eos_token_id})
        self._special = special
        self.image_token_ids = _image_token_ids(processor)

    def render_prompt(self, messages: list[dict]) -> str:
        if count_placeholders(messages):  # a reply's own text "<image>" is text, never an image slot
            messages = [
                m if m["role"] == "assistant" and isinstance(m.get("content"), str) else p
                for m, p in zip(messages, to_parts(messages))
            ]
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
                raise DataError(
                    f"{count_placeholders(messages)} image placeholder(s) but no image in the row; "
                    "add an images column or remove the placeholders"
                )
            return self.encode_prompt(messages), MMRow()
        key = (_memo_key(messages), tuple(_fingerprint(i) for i in images))
        if key not in self._mm:
            ids, tensors = self.expand(messages, images)
            ids, tensors = self._cut(ids, tensors)
            self._mm[key] = (ids, MMRow(tensors))
            while len(self._mm) > _MEMO_SIZE:
                self._mm.popitem(last=False)
        ids, row = self._mm[key]
        return list(ids), row

    def image_expansion(self, image) -> list[int]:
        """The ids the processor expands one image's slot into, for that image alone (memoised by its contents)."""
        key = _fingerprint(image)
        if key not in self._expansions:
            one = self.processor(
                text=[self.processor.image_token],
                images=[[load_image(image)]],
                return_tensors="pt",
                add_special_tokens=False,
            )
            self._expansions[key] = one["input_ids"][0].tolist()
            while len(self._expansions) > _MEMO_SIZE:
                self._expansions.popitem(last=False)
        return self._expansions[key]

    def expand(self, messages: list[dict], images: list) -> tuple[list[int], dict[str, torch.Tensor]]:
        """The processor's prompt ids (image slots expanded into image tokens) and tensors, before --max_length."""
        text = self.render_mm(messages, len(images))
        out = self.processor(
            text=[text], images=[[load_image(i) for i in images]], return_tensors="pt", add_special_tokens=False
        )
        return out["input_ids"][0].tolist(), {k: v for k, v in out.items() if k not in ("input_ids", "attention_mask")}

    def image_spans(self, ids: list[int]) -> list[tuple[int, int]]:
        """[start, end) of each image's tokens: a run of image tokens with the special tokens around it (Qwen-VL's
        vision start/end, Idefics3's fake-token and global-image tags, Gemma3's begin/end of image)."""
        spans: list[tuple[int, int]] = []
        k = 0
        while k < len(ids):
            if ids[k] not in self.image_token_ids:
                k += 1
                continue
            a, b = k, k
            while b < len(ids) and ids[b] in self.image_token_ids:
                b += 1
            while a > 0 and ids[a - 1] in self._special and ids[a - 1] != self.eos_token_id:
                a -= 1
            while b < len(ids) and ids[b] in self._special and ids[b] != self.eos_token_id:
                b += 1
            spans.append((a, b))
            k = b
        return spans

    def cut_crosses_images(self, ids: list[int]) -> bool:
        """The --truncation_strategy left/right cut of these (over-long) ids would remove image tokens."""
        n = len(ids) - (self.max_length or len(ids))
        if n <= 0 or self.truncation_strategy not in ("left", "right"):
            return False
        spans = self.image_spans(ids)
        if self.truncation_strategy == "left":
            return any(a < n for a, _ in spans)
        return any(b > self.max_length for _, b in spans)

    def _cut(self, ids: list[int], tensors: dict) -> tuple[list[int], dict]:
        """--max_length left/right on an expanded prompt: ids and per-token tensors cut alike, every image kept.
        DataError when the cut would pass through an image's tokens (the load-time check names the row)."""
        n = len(ids) - (self.max_length or len(ids))
        if n <= 0 or self.truncation_strategy not in ("left", "right"):
            return ids, tensors
        if self.cut_crosses_images(ids):
            raise DataError(
                f"--max_length {self.max_length} --truncation_strategy {self.truncation_strategy}: a "
                f"{len(ids)}-token prompt would be cut through its image tokens; use "
                "--truncation_strategy delete"
            )
        keep = slice(n, None) if self.truncation_strategy == "left" else slice(0, self.max_length)
        tensors = {k: (v.reshape(1, -1)[:, keep] if k in TOKEN_KEYS else v) for k, v in tensors.items()}
        return ids[keep], tensors

    # -- later turns: the trajectory's own tokens as the next prompt ----------------------------------------
    def pin(self, request_id: str, messages: list[dict], images: list, ids: list[int], row: MMRow) -> None:
        """The prompt of ``request_id``'s next turn is ``ids``/``row`` (the trajectory so far, as it trains) while
        its conversation and images are these; ``encode_request`` returns it instead of re-encoding the text."""
        self._pinned[request_id] = (_key(messages, images), list(ids), row)

    def unpin(self, request_id: str) -> None:
        self._pinned.pop(request_id, None)

    def encode_request(self, request: RolloutInferRequest) -> tuple[list[int], MMRow]:
        """The engine's prompt of a request: the pinned ids of a continued trajectory, else ``encode_mm``."""
        images = row_images(request.data_dict)
        pinned = self._pinned.get(request.request_id)
        if pinned is not None and pinned[0] == _key(request.messages, images):
            return list(pinned[1]), pinned[2]
        return self.encode_mm(request.messages, images)

    def encode_requests(self, requests: list[RolloutInferRequest]) -> list[list[int]]:
        """Each request's prompt ids as ``encode_request`` gives them (a later turn's pinned ids included)."""
        return [self.encode_request(r)[0] for r in requests]

    def encode_between_mm(
        self, full: list[dict], i: int, j: int, seg: list[int], images: list
    ) -> tuple[list[int], MMRow]:
        """``encode_between`` with the images of the messages in between (one per placeholder, in order)
        expanded by the processor into image tokens; their tensors in the returned row."""
        slots = count_placeholders(full[i + 1 : j])
        if slots != len(images):
            raise RolloutError(
                f"messages {i + 1}..{j - 1}: {slots} image placeholder(s) but {len(images)} image(s); "
                f"give one image per {IMAGE_PLACEHOLDER} of an observation"
            )
        text = self.between_text(full, i, j, seg)
        if not images:
            return self.tokenize(text), MMRow()
        out = self.processor(
            text=[text], images=[[load_image(x) for x in images]], return_tensors="pt", add_special_tokens=False
        )
        return out["input_ids"][0].tolist(), MMRow(
            {k: v for k, v in out.items() if k not in ("input_ids", "attention_mask")}
        )

    def encode_turns(
        self, prompt_messages: list[dict], messages: list[dict], segments: list[list[int]], images: list, rid: str = ""
    ) -> tuple[list[int], MMRow, list[tuple[list[int], MMRow]]]:
        """(prompt ids, prompt row, per gap between segments the template's ids and row up to the next assistant
        message). Placeholders after the prompt take the trajectory's last images in order; the prompt the rest."""
        later = count_placeholders([m for m in messages[len(prompt_messages) :] if m["role"] != "assistant"])
        if later > len(images):
            raise RolloutError(
                f"request {rid}: {later} image placeholder(s) after the prompt but {len(images)} "
                "image(s) in the trajectory; give one image per placeholder of an observation"
            )
        used = len(images) - later
        prompt_ids, row = self.encode_mm(prompt_messages, images[:used])
        turns = self._assistant_turns(prompt_messages, messages, len(segments), rid)
        gaps = []
        for k, end in enumerate(turns[1:]):
            n = count_placeholders(messages[turns[k] + 1 : end])
            gaps.append(self.encode_between_mm(messages, turns[k], end, segments[k], images[used : used + n]))
            used += n
        return prompt_ids, row, gaps

    def encode_output(self, prompt_messages: list[dict], output: RolloutOutput, images=()) -> EncodedSample:
        """As ChatTemplate.encode_output, with the prompt from ``encode_mm`` and the trajectory's row (every image,
        the observations' after the prompt's) in ``extra["mm"]``."""
        images = list(images or [])
        if not images or len(output.response_token_ids) == 1:  # the images, if any, are all in the prompt
            sample = super().encode_output(prompt_messages, output)
            sample.extra["mm"] = MMRow()
            if images:
                sample.prompt_ids, sample.extra["mm"] = self.encode_mm(prompt_messages, images)
            return sample
        segments = output.response_token_ids
        masks, lp_segs = segment_masks(output)
        prompt_ids, row, gaps = self.encode_turns(prompt_messages, output.messages, segments, images, output.request_id)
        ids: list[int] = []
        mask: list[int] = []
        lps: list[float] = []
        full, images_end = row, 0
        for k, seg in enumerate(segments):
            gap_ids, gap_row = gaps[k] if k < len(gaps) else ([], MMRow())
            full = join_rows(full, len(prompt_ids) + len(ids), MMRow(), len(seg))
            full = join_rows(full, len(prompt_ids) + len(ids) + len(seg), gap_row, len(gap_ids))
            it = iter(lp_segs[k]) if lp_segs is not None else None
            lps += [next(it) if m else float("nan") for m in masks[k]] if it is not None else []
            lps += [float("nan")] * len(gap_ids) if it is not None else []
            ids += seg + gap_ids
            mask += masks[k] + [0] * len(gap_ids)
            if gap_row.has_images:
                images_end = len(ids)
        sample = EncodedSample(prompt_ids, ids, mask, lps if lp_segs is not None else None)
        sample.extra["mm"] = full.split(len(prompt_ids))
        sample.extra["images_end"] = images_end  # completion tokens up to the end of the last observation image
        return sample


def _image_token_ids(processor) -> set[int]:
    """Ids of the tokens an image expands into (ms-swift's placeholder tokens: the processor's image token)."""
    tok = processor.tokenizer
    ids = {getattr(processor, "image_token_id", None), getattr(tok, "image_token_id", None)}
    for owner in (processor, tok):
        token = getattr(owner, "image_token", None)
        if isinstance(token, str):
            ids.add(tok.convert_tokens_to_ids(token))
    return {i for i in ids if isinstance(i, int) and i != tok.unk_token_id}


def _key(messages: list[dict], images: list) -> tuple:
    return (_memo_key(messages), tuple(_fingerprint(i) for i in images))


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
    return image_only(cls)(
        image_processor=image_processor, tokenizer=tokenizer, chat_template=getattr(tokenizer, "chat_template", None)
    )


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
