"""Images in dataset rows: ms-swift's and TRL's multimodal row formats, checked at load time, opened on use.

Accepted rows:

- ms-swift: an ``images`` column (a list; one item is also accepted) and ``<image>`` placeholders in the text of
  the messages, one per image in order. Images without a placeholder are placed at the start of the first user
  message, as ms-swift does.
- TRL: an ``image`` (one) or ``images`` (a list) column and messages whose content is a list of typed parts,
  ``{"type": "image"}`` and ``{"type": "text", "text": ...}``.

An image is a local file path, raw bytes, a PIL image or a ``{"bytes": ..., "path": ...}`` dict (how ``datasets``
stores an ``Image`` feature). URLs are refused: this machine may have no network. At load time ``image`` becomes
``images`` and typed parts become ``<image>`` placeholders in text, so every image row travels in ms-swift's form;
its ``images`` column reaches reward functions by name like every other column.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
from pathlib import Path
from typing import Any

from grpokit.errors import DataError

IMAGE_PLACEHOLDER = "<image>"
IMAGE_COLUMNS = ("images", "image")
MAX_DECODED_IMAGE_BYTES = 64 * 1024 * 1024  # one base64 image decoded in process (a plugin's infer_request.images)
DATA_URI = re.compile(r"data:[\w.+/-]*(;[\w.+=-]+)*;base64,", re.ASCII)  # the prefix of a base64 data URI


def row_images(row: dict) -> list:
    """The row's images as a list (``image`` or ``images``; None or missing → [])."""
    value = row.get("images")
    if value is None:
        value = row.get("image")
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def count_placeholders(messages: list[dict]) -> int:
    """Image slots in a conversation: ``<image>`` in string content plus typed ``image`` parts."""
    n = 0
    for m in messages:
        content = m.get("content")
        if isinstance(content, str):
            n += content.count(IMAGE_PLACEHOLDER)
        elif isinstance(content, list):
            n += sum(1 for part in content if isinstance(part, dict) and part.get("type") == "image")
    return n


def check_image_ref(image: Any, where: str) -> None:
    """One line for an image that cannot be opened here: a URL, a missing file, an unknown type."""
    if isinstance(image, dict):
        if image.get("bytes"):
            return
        image = image.get("path")
    if isinstance(image, (bytes, bytearray)) or hasattr(image, "convert"):  # raw bytes or a PIL image
        return
    if not isinstance(image, str) or not image:
        raise DataError(f"{where}: an image must be a file path, bytes or a PIL image, got {type(image).__name__}")
    if image.startswith(("http://", "https://", "ftp://")):
        raise DataError(
            f"{where}: image URL {image[:120]!r} is refused (no network here); download it and pass the local path"
        )
    if not _is_file(image):
        raise DataError(f"{where}: image file {image[:200]!r} does not exist; fix the path in the images column")


def decode_image_ref(image: Any, where: str) -> Any:
    """An image as ``infer_request.images`` may hold it (ms-swift's field): a base64 string (a ``data:`` URI or
    raw) becomes its bytes, bounded by ``MAX_DECODED_IMAGE_BYTES``; a path, bytes, PIL image or ``{"bytes",
    "path"}`` dict stays as it is. DataError (one line) for anything that cannot be opened here."""
    if isinstance(image, str):
        match = DATA_URI.match(image)
        text = image[match.end() :] if match else image
        if match or not (_is_file(image) or "://" in image or "." in image):
            if len(text) * 3 // 4 > MAX_DECODED_IMAGE_BYTES + 2:
                raise DataError(
                    f"{where}: a base64 image of about {len(text) * 3 // 4} bytes exceeds "
                    f"{MAX_DECODED_IMAGE_BYTES} bytes; pass a smaller image or a file path"
                )
            try:
                return base64.b64decode(text, validate=True)
            except (binascii.Error, ValueError):
                if match:
                    raise DataError(
                        f"{where}: the data URI's base64 is not valid; pass 'data:image/png;base64,...', "
                        "raw base64, a file path, bytes or a PIL image"
                    ) from None
    check_image_ref(image, where)
    return image


def _is_file(path: str) -> bool:
    try:
        return Path(path).expanduser().is_file()
    except (OSError, ValueError):  # a name too long for a path (base64 text), a NUL byte
        return False


def check_row_images(row: dict, where: str) -> None:
    """An image row is usable: every image opens, and the conversation has no more image slots than images."""
    images = row_images(row)
    for k, image in enumerate(images):
        check_image_ref(image, f"{where}: image {k}")
    slots = count_placeholders(row.get("messages") or [])
    if slots > len(images):
        raise DataError(
            f"{where}: {slots} image placeholder(s) but {len(images)} image(s); give one image per "
            f"{IMAGE_PLACEHOLDER} (or image part), or remove the extra placeholders"
        )


def check_images(ds, source: str):
    """Check every row of a normalised dataset that has an image column (``image`` is renamed ``images``)."""
    columns = ds.column_names
    if not any(c in columns for c in IMAGE_COLUMNS):
        return ds
    if "image" in columns and "images" not in columns:  # TRL's one image per row: a list of one, as images
        ds = ds.map(
            lambda row: {"images": [] if row["image"] is None else [row["image"]]},
            remove_columns=["image"],
            desc=f"images of {source}",
        )
    if any(isinstance(m.get("content"), list) for row in ds.select_columns(["messages"]) for m in row["messages"]):
        ds = ds.map(lambda row: {"messages": to_placeholders(row["messages"])}, desc=f"image parts of {source}")
    for i in range(len(ds)):
        check_row_images(ds[i], f"{source}: row {i}")
    return ds


def to_placeholders(messages: list[dict]) -> list[dict]:
    """TRL's typed content parts as ms-swift's text with ``<image>`` placeholders (the one form rows travel in:
    requests carry text content; the processor template turns placeholders back into image parts)."""
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(IMAGE_PLACEHOLDER if p.get("type") == "image" else (p.get("text") or "") for p in content)
        out.append({**m, "content": content})
    return out


def load_image(image: Any):
    """A PIL RGB image from a path, bytes, a PIL image or a ``{"bytes", "path"}`` dict."""
    from PIL import Image  # Pillow comes with transformers' image processors; text-only runs never import it

    if isinstance(image, dict):
        image = image.get("bytes") or image.get("path")
    check_image_ref(image, "image")
    if isinstance(image, (bytes, bytearray)):
        image = Image.open(io.BytesIO(image))
    elif isinstance(image, str):
        image = Image.open(Path(image).expanduser())
    return image.convert("RGB")


def to_parts(messages: list[dict]) -> list[dict]:
    """Messages with typed content parts: ``<image>`` in string content becomes an ``image`` part in place."""
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, str):
            parts: list[dict] = []
            for k, piece in enumerate(content.split(IMAGE_PLACEHOLDER)):
                if k:
                    parts.append({"type": "image"})
                if piece:
                    parts.append({"type": "text", "text": piece})
            content = parts
        elif isinstance(content, list):  # typed parts (TRL); datasets fills a struct's missing keys with None
            content = [
                {"type": "image"} if p.get("type") == "image" else {"type": "text", "text": p.get("text") or ""}
                for p in content
            ]
        out.append({**m, "content": content})
    return out


def with_image_slots(messages: list[dict], n_images: int) -> list[dict]:
    """Typed-part messages with one ``image`` part per image: missing slots go first in the first user message
    (ms-swift); more slots than images is an error."""
    parts = to_parts(messages)
    slots = count_placeholders(parts)
    if slots > n_images:
        raise DataError(
            f"{slots} image placeholder(s) but {n_images} image(s) in the row; give one image per "
            f"{IMAGE_PLACEHOLDER}, or remove the extra placeholders"
        )
    missing = n_images - slots
    if missing:
        k = next((i for i, m in enumerate(parts) if m["role"] == "user"), 0)
        parts[k] = {**parts[k], "content": [{"type": "image"}] * missing + parts[k]["content"]}
    return parts
