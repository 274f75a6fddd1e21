"""The images of a trajectory on a vision-language model (``MultiTurnScheduler.run``'s helper), and
``infer_request.images``, ms-swift's field, as plugins use it in process.

In process a row's images live in ``data_dict["images"]`` (what engines read). While a scheduler's hooks run
(``on_trajectory_start``, ``on_turn_end``, ``step``) the loop also shows them on ``infer_request.images``, as
ms-swift does: a ported plugin reads ``infer_request.images[0]`` and appends an observation's image. What a hook
appended there joins the trajectory's images in order (``take_appended``); the engine gets the request with
``images`` empty, so the images are never counted twice.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from grpokit.data.images import IMAGE_PLACEHOLDER, check_image_ref, count_placeholders, decode_image_ref, row_images
from grpokit.errors import DataError, RolloutError
from grpokit.protocol import RolloutInferRequest
from grpokit.template.processor import MMRow, join_rows

if TYPE_CHECKING:
    from grpokit.rollout.multi_turn import StepResult

logger = logging.getLogger(__name__)


def same_image(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        return bool(a == b)  # PIL images compare their pixels, strings and bytes their content
    except Exception:  # noqa: BLE001 - objects whose == is not a plain truth value (arrays) are not the same
        return False


def _decoded(images: list, first: int, where: str) -> list:
    try:
        return [
            decode_image_ref(image, f"{where}: infer_request.images[{first + k}]") for k, image in enumerate(images)
        ]
    except DataError as e:
        raise RolloutError(str(e)) from None


def take_entry_images(request: RolloutInferRequest, where: str) -> None:
    """A request entering the in-process rollout with images on ``request.images`` (ms-swift's field: base64
    strings, paths, bytes or PIL images): they become its ``data_dict["images"]`` (a new dict: a group's requests
    share the row's), ``request.images`` empty. Images in both places must be the same ones."""
    if not request.images:
        return
    given, row = list(request.images), row_images(request.data_dict)
    if row and (len(row) != len(given) or not all(map(same_image, row, given))):
        raise RolloutError(
            f"{where}: request {request.request_id} has {len(given)} image(s) in infer_request.images "
            f"and {len(row)} other(s) in data_dict['images']; give a request's images in one of them"
        )
    request.data_dict = {**request.data_dict, "images": row or _decoded(given, 0, where)}
    request.images = []


def take_appended(request: RolloutInferRequest, known: list, where: str) -> list:
    """The images a hook appended to ``request.images``, which the loop had set to the trajectory's ``known``
    images, decoded (``decode_image_ref``). An empty ``request.images`` (a request built anew) appended nothing;
    any other change to the known images is refused, since earlier turns were sampled with them."""
    got = list(request.images or [])
    if not got:
        return []
    if len(got) < len(known) or not all(map(same_image, got, known)):
        raise RolloutError(
            f"{where}: infer_request.images no longer starts with the trajectory's {len(known)} "
            "image(s); earlier turns were sampled with them, so only append new images to it"
        )
    return _decoded(got[len(known) :], len(known), where)


def take_start_images(request: RolloutInferRequest, known: list, where: str) -> bool:
    """After ``on_trajectory_start``: images it appended to ``request.images`` join the prompt's (after those in
    ``data_dict``, which an env's reset may have extended), with no more placeholders than images, as for a
    dataset row. ``request.images`` is emptied again; True when the prompt's images changed."""
    added = take_appended(request, known, where)
    request.images = []
    if added:
        images = row_images(request.data_dict) + added
        slots = count_placeholders(request.messages)
        if slots > len(images):
            raise RolloutError(
                f"{where}: the prompt holds {slots} {IMAGE_PLACEHOLDER} placeholder(s) but "
                f"{len(images)} image(s); put one {IMAGE_PLACEHOLDER} per image it appended to "
                "infer_request.images"
            )
        request.data_dict = {**request.data_dict, "images": images}
    return bool(added) or not (
        len(known) == len(row_images(request.data_dict)) and all(map(same_image, known, row_images(request.data_dict)))
    )


def warn_unheld(request: RolloutInferRequest, known: list, where: str) -> None:
    """The trajectory ended after a hook appended images that no message will hold: say so, never drop silently."""
    added = take_appended(request, known, where)
    if added:
        logger.warning(
            "%s: %d image(s) appended to infer_request.images after the last turn are not part of the "
            "trajectory (no message holds them)",
            where,
            len(added),
        )


def check_takes_images(template, where: str, images: list) -> None:
    """RolloutError when an observation brings images but the model (its template) is text-only."""
    if images and not getattr(template, "multimodal", False):
        raise RolloutError(
            f"{where} returned {len(images)} image(s) but the model is text-only; use a "
            "vision-language model (a model folder with a processor) for image observations"
        )


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
                raise RolloutError(
                    f"{where} returned images but appended no message to hold them; add a message "
                    f"with one {IMAGE_PLACEHOLDER} per image"
                )
            return [], MMRow()
        last = max(i for i, m in enumerate(msgs) if m["role"] == "assistant")
        slots = count_placeholders(msgs[last + 1 :])
        if slots != len(result.images):
            raise RolloutError(
                f"{where}: the new message(s) hold {slots} {IMAGE_PLACEHOLDER} placeholder(s) but "
                f"{len(result.images)} image(s) came with them; give one image per placeholder "
                "('images' in step()'s dict, appended to infer_request.images, or info['images'] "
                "of an env's step)"
            )
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


def step_images(images: Any, where: str) -> list:
    """``step()``'s ``images``: a list of images that open here (paths, bytes, PIL)."""
    if images is None:
        return []
    if not isinstance(images, (list, tuple)):
        raise RolloutError(f"{where}: 'images' must be a list of images, got {type(images).__name__}")
    try:
        for k, image in enumerate(images):
            check_image_ref(image, f"{where}: image {k}")
    except DataError as e:
        raise RolloutError(str(e)) from e
    return list(images)


def same_images(a: Any, b: Any) -> bool:
    """Two image lists hold the same images (the same list, or equal item by item)."""
    return a is b or (isinstance(a, (list, tuple)) and len(a) == len(b) and all(map(same_image, a, b)))
