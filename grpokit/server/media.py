"""Images on ``/infer/`` requests: decoded and bounded before any scheduler or engine sees them.

A request carries its prompt's images in ``images`` (ms-swift's wire form), each a string: a ``data:`` URI with
base64 data, raw base64, or a path. A path is read only under a directory the server was started with
(``--media_root DIR``); a URL is refused (the server fetches nothing). Every image is checked against the
server's limits (count per request, encoded bytes per image and per call, pixels, format) and opened with PIL,
whose header gives the size before any pixel is decoded, so a decompression bomb is refused without being
unpacked. The decoded RGB images go into ``data_dict["images"]``, where schedulers and engines read a row's
images in process; a request that puts images in ``data_dict`` itself is refused, since those would be opened as
paths without these checks.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import re
from dataclasses import dataclass
from pathlib import Path

from grpokit.data.images import DATA_URI, IMAGE_COLUMNS
from grpokit.engines.media_wire import image_to_wire
from grpokit.protocol import RolloutInferRequest, RolloutOutput

DEFAULT_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
KNOWN_FORMATS = (*DEFAULT_FORMATS, "TIFF", "ICO", "PPM", "TGA")  # what --image_formats may add
_URL = re.compile(r"[a-zA-Z][a-zA-Z0-9+.-]*://")


class ImageRefused(ValueError):
    """An image the server will not take; ``status`` is the HTTP answer (4xx), the message one line."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class ImageLimits:
    """The server's bounds on request images (``grpokit rollout`` options of the same names)."""

    max_images_per_request: int = 16
    max_image_bytes: int = 16 * 1024 * 1024  # one image's encoded bytes (--max_image_mb)
    max_call_image_bytes: int = 256 * 1024 * 1024  # distinct images' encoded bytes in one call (--max_images_mb)
    max_image_pixels: int = 4096 * 4096
    max_call_pixels: int = 64 * 1024 * 1024  # decoded pixels of one call's distinct images (--max_images_pixels)
    formats: tuple[str, ...] = DEFAULT_FORMATS
    media_roots: tuple[Path, ...] = ()  # resolved directories paths may name; empty: no path is read


def take_images(requests: list[RolloutInferRequest], limits: ImageLimits) -> None:
    """Decode every request's ``images`` into its ``data_dict["images"]`` (PIL RGB images) in place, or raise
    ``ImageRefused``. Identical strings in one call (a GRPO group's copies of a prompt) are decoded once. Every
    image's header is read and the call's pixels counted against ``max_call_pixels`` before any is decoded."""
    opened: dict[str, object] = {}
    total = pixels = 0
    for i, r in enumerate(requests):
        where = f"requests[{i}]"
        hidden = [k for k in IMAGE_COLUMNS if r.data_dict.get(k)]
        if hidden:
            raise ImageRefused(
                422,
                f"{where}.data_dict.{hidden[0]}: send a request's images in its 'images' field "
                "(base64, or paths under the server's --media_root), not in data_dict",
            )
        if len(r.images) > limits.max_images_per_request:
            raise ImageRefused(
                413,
                f"{where}.images: {len(r.images)} images exceed the server's "
                f"--max_images_per_request {limits.max_images_per_request}",
            )
        for k, ref in enumerate(r.images):
            key = hashlib.sha1(ref.encode()).hexdigest()
            if key in opened:
                continue
            data = image_bytes(ref, limits, f"{where}.images[{k}]")
            total += len(data)
            if total > limits.max_call_image_bytes:
                raise ImageRefused(
                    413,
                    f"{where}.images[{k}]: the call's images exceed the server's "
                    f"--max_images_mb {limits.max_call_image_bytes / 2**20:g}; send fewer "
                    "images per call",
                )
            opened[key] = image = open_header(data, limits, f"{where}.images[{k}]")
            pixels += image.size[0] * image.size[1]
            if pixels > limits.max_call_pixels:
                raise ImageRefused(
                    413,
                    f"{where}.images[{k}]: the call's images hold more than "
                    f"{limits.max_call_pixels} pixels, the server's --max_images_pixels; send "
                    "fewer or smaller images per call",
                )
    decoded: dict[str, object] = {}
    for i, r in enumerate(requests):
        if not r.images:
            continue
        pil = []
        for k, ref in enumerate(r.images):
            key = hashlib.sha1(ref.encode()).hexdigest()
            if key not in decoded:
                decoded[key] = decode(opened.pop(key), f"requests[{i}].images[{k}]")
            pil.append(decoded[key])
        r.data_dict = {**r.data_dict, "images": pil}
        r.images = []


def image_bytes(ref: str, limits: ImageLimits, where: str) -> bytes:
    """The encoded image a wire string names: base64 data (a data URI or raw) or a file under a media root."""
    match = DATA_URI.match(ref)
    if match:
        return _b64(ref[match.end() :], limits, where)
    if _URL.match(ref):
        raise ImageRefused(
            400,
            f"{where}: image URL {ref[:80]!r} is refused (the rollout server fetches nothing, "
            "and may have no network); send the image as base64",
        )
    if "." in ref:  # base64's alphabet has no '.': a path (with a file extension)
        return _read_under_root(ref, limits, where)
    return _b64(ref, limits, where)


def _b64(text: str, limits: ImageLimits, where: str) -> bytes:
    if len(text) * 3 // 4 > limits.max_image_bytes + 2:
        raise _too_big(where, len(text) * 3 // 4, limits)
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageRefused(
            400,
            f"{where}: not valid base64 ({e}); send a data URI 'data:image/png;base64,...', "
            "raw base64, or a path with a file extension under the server's --media_root",
        ) from None


def _too_big(where: str, size: int, limits: ImageLimits) -> ImageRefused:
    return ImageRefused(
        413,
        f"{where}: image of {size} bytes exceeds the server's --max_image_mb "
        f"{limits.max_image_bytes / 2**20:g}; send smaller images",
    )


def _read_under_root(ref: str, limits: ImageLimits, where: str) -> bytes:
    """A file under a media root. Every path that is not a regular file under one (missing, outside, a directory,
    unreadable) gets the same 403, so that answers tell nothing about files elsewhere."""
    if not limits.media_roots:
        raise ImageRefused(
            403,
            f"{where}: image path {ref[:120]!r} refused: this server reads no files (start it "
            "with --media_root DIR to serve images from DIR, or send the image as base64)",
        )
    if any(ord(c) < 32 for c in ref) or len(ref) > 4096:
        raise ImageRefused(
            400,
            f"{where}: image path has a control character (NUL, newline, ...) or more than "
            "4096 characters; fix the path",
        )
    shown = ", ".join(map(str, limits.media_roots))
    path = Path(ref)
    candidates = [path] if path.is_absolute() else [root / path for root in limits.media_roots]
    for candidate in candidates:
        try:
            resolved = candidate.resolve(strict=True)
            if not any(resolved.is_relative_to(root) for root in limits.media_roots) or not resolved.is_file():
                continue  # outside every root, or a directory, FIFO or device: never opened
            size = resolved.stat().st_size
            if size > limits.max_image_bytes:
                raise _too_big(where, size, limits)
            with open(resolved, "rb") as f:
                return f.read(limits.max_image_bytes + 1)
        except ImageRefused:
            raise
        except (OSError, RuntimeError, ValueError):  # missing, a loop of links, unreadable
            continue
    raise ImageRefused(
        403,
        f"{where}: image path {ref[:120]!r} is not a readable file under the server's "
        f"--media_root ({shown}); put the file there or send it as base64",
    )


def open_header(data: bytes, limits: ImageLimits, where: str):
    """A PIL image from encoded bytes with only its header read, checked: an allowed format, at most
    ``max_image_pixels``. Nothing is decoded yet (``decode`` does that)."""
    from PIL import Image  # not at the top: Pillow is needed only by servers that receive images

    if len(data) > limits.max_image_bytes:
        raise _too_big(where, len(data), limits)
    try:
        image = Image.open(io.BytesIO(data), formats=None)
    except Image.DecompressionBombError as e:  # beyond twice PIL's own limit: refused by PIL from the header
        pixels = re.search(r"\((\d+) pixels\)", str(e))
        raise _bomb(where, pixels.group(1) + " pixels" if pixels else "too many pixels", limits) from None
    except Exception as e:  # noqa: BLE001 - PIL raises many types for data that is not an image
        raise ImageRefused(
            400,
            f"{where}: not an image PIL can open ({type(e).__name__}); send PNG, JPEG or "
            "another of the server's formats",
        ) from None
    if image.format not in limits.formats:
        raise ImageRefused(
            415, f"{where}: image format {image.format} is not accepted; send one of {', '.join(limits.formats)}"
        )
    width, height = image.size
    if width * height > limits.max_image_pixels:
        raise _bomb(where, f"{width}x{height} = {width * height} pixels", limits)
    return image


def decode(image, where: str):
    """The RGB pixels of an image ``open_header`` checked; 400 if its data is truncated or corrupt."""
    try:
        return image.convert("RGB")
    except Exception as e:  # noqa: BLE001 - truncated or corrupt pixel data
        raise ImageRefused(
            400,
            f"{where}: the {image.format} image cannot be decoded ({type(e).__name__}: "
            f"{str(e)[:80]}); send a complete image",
        ) from None


def open_image(data: bytes, limits: ImageLimits, where: str):
    """A PIL RGB image from encoded bytes, checked (``open_header``) and then decoded."""
    return decode(open_header(data, limits, where), where)


def _bomb(where: str, shown: str, limits: ImageLimits) -> ImageRefused:
    return ImageRefused(
        413,
        f"{where}: image of {shown} exceeds the server's --max_image_pixels "
        f"{limits.max_image_pixels}; send a smaller image",
    )


def output_to_wire(output: RolloutOutput) -> dict:
    """A trajectory's JSON answer; the images a multi-turn environment added (``rollout_infos["images"]``) as data
    URIs, as ms-swift answers them."""
    images = output.rollout_infos.get("images")
    if images:
        output = output.model_copy(
            update={"rollout_infos": {**output.rollout_infos, "images": [image_to_wire(i) for i in images]}}
        )
    return output.model_dump(mode="json")
