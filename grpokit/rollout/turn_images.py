"""The images of a multi-turn trajectory on a vision-language model (``MultiTurnScheduler.run``'s helper)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from grpokit.data.images import IMAGE_PLACEHOLDER, count_placeholders, row_images
from grpokit.errors import RolloutError
from grpokit.protocol import RolloutInferRequest
from grpokit.template.processor import MMRow, join_rows

if TYPE_CHECKING:
    from grpokit.rollout.multi_turn import StepResult


def check_takes_images(template, where: str, images: list) -> None:
    """RolloutError when an observation brings images but the model (its template) is text-only."""
    if images and not getattr(template, "multimodal", False):
        raise RolloutError(f"{where} returned {len(images)} image(s) but the model is text-only; use a "
                           "vision-language model (a model folder with a processor) for image observations")


class TrajectoryImages:
    """A trajectory's images and, with a processor template, the next turn's prompt as the trainer encodes it:
    the prompt, every turn's tokens as trained, and the template's text between them with its images expanded by
    the processor. It is pinned on the template for the engine (``ProcessorTemplate.pin``), so a later turn is
    sampled from exactly the ids and tensors that train."""

    def __init__(self, template, request: RolloutInferRequest) -> None:
        self.template = template if getattr(template, "multimodal", False) else None
        self.images = row_images(request.data_dict)
        self.pinned: set[str] = set()
        self.ids: list[int] = []
        self.row = MMRow()
        if self.template is not None:
            self.ids, self.row = self.template.encode_mm(request.messages, self.images)

    def between(self, where: str, result: StepResult, seg: list[int]) -> tuple[list[int], MMRow] | None:
        """The template's ids and row after the step's messages (None: a text template, use its own count)."""
        msgs = result.infer_request.messages
        if self.template is None:
            check_takes_images(None, where, result.images)
            return None
        if msgs[-1]["role"] == "assistant":  # the next turn continues the assistant message
            if result.images:
                raise RolloutError(f"{where} returned images but appended no message to hold them; add a message "
                                   f"with one {IMAGE_PLACEHOLDER} per image")
            return [], MMRow()
        last = max(i for i, m in enumerate(msgs) if m["role"] == "assistant")
        slots = count_placeholders(msgs[last + 1:])
        if slots != len(result.images):
            raise RolloutError(f"{where}: the new message(s) hold {slots} {IMAGE_PLACEHOLDER} placeholder(s) but "
                               f"{len(result.images)} image(s) came with them; give one image per placeholder "
                               "('images' in step()'s dict, info['images'] of an env's step)")
        return self.template.encode_between_mm(msgs, last, len(msgs), seg, result.images)

    def commit(self, result: StepResult, gap: tuple[list[int], MMRow] | None, infos: dict) -> None:
        """Take the step's images and pin the next turn's prompt for the engine."""
        req = result.infer_request
        if result.images:
            self.images += result.images
            infos["images"] = list(self.images)
        if self.template is None:
            return
        if self.images:
            req.data_dict["images"] = list(self.images)
        gap_ids, gap_row = gap or ([], MMRow())
        n, k = len(self.ids), len(result.token_ids)
        self.row = join_rows(join_rows(self.row, n, MMRow(), k), n + k, gap_row, len(gap_ids))
        self.ids = self.ids + list(result.token_ids) + gap_ids
        self.template.pin(req.request_id, req.messages, self.images, self.ids, self.row)
        self.pinned.add(req.request_id)

    def close(self) -> None:
        for rid in self.pinned:
            self.template.unpin(rid)
