"""Images on the wire between a trainer and its rollout servers (ms-swift's form: base64 strings).

The trainer sends each request's images (``data_dict["images"]``: paths, bytes, PIL images or ``datasets``
``{"bytes", "path"}`` dicts) as data URIs in the request's ``images`` field: a file's or bytes' own encoding, so
the server decodes exactly the pixels the trainer's processor reads, and a PIL image as PNG (lossless). The server
answers a trajectory's images (``rollout_infos["images"]``, those a multi-turn environment added) the same way,
and the trainer turns them back into bytes.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

from grpokit.data.images import IMAGE_COLUMNS, row_images
from grpokit.errors import ServerError
from grpokit.protocol import RolloutInferRequest

_MIME = ((b"\x89PNG", "png"), (b"\xff\xd8", "jpeg"), (b"GIF8", "gif"), (b"BM", "bmp"))


def image_to_wire(image: Any) -> str:
    """A data URI holding ``image``'s encoded bytes (a path is read here, on the sending side)."""
    if isinstance(image, str) and image.startswith("data:"):
        return image  # already on the wire (an image that came back from a server)
    if isinstance(image, dict):
        image = image.get("bytes") or image.get("path")
    if isinstance(image, str):
        image = Path(image).expanduser().read_bytes()
    elif hasattr(image, "save"):  # a PIL image
        buf = io.BytesIO()
        (image if image.mode in ("RGB", "RGBA", "L", "LA", "P", "I", "1") else image.convert("RGB")).save(buf, "PNG")
        image = buf.getvalue()
    if not isinstance(image, (bytes, bytearray)):
        raise TypeError(f"an image must be a file path, bytes or a PIL image, got {type(image).__name__}")
    data = bytes(image)
    kind = next((k for magic, k in _MIME if data.startswith(magic)), None)
    if kind is None and data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        kind = "webp"
    return f"data:image/{kind or 'unknown'};base64,{base64.b64encode(data).decode('ascii')}"


def request_to_wire(request: RolloutInferRequest) -> dict:
    """The request's JSON body: its images (``data_dict``) moved into ``images`` as data URIs."""
    images = row_images(request.data_dict)
    if not images:
        return request.model_dump(mode="json")
    data = {k: v for k, v in request.data_dict.items() if k not in IMAGE_COLUMNS}
    wire = request.model_copy(
        update={"data_dict": data, "images": [*request.images, *(image_to_wire(i) for i in images)]}
    )
    return wire.model_dump(mode="json")


def images_from_wire(values: Any, where: str) -> list[bytes]:
    """A trajectory's images answered by a server (data URIs or raw base64) as bytes, for the trainer's processor."""
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise ServerError(f"{where}: rollout_infos['images'] must be a list of base64 strings")
    out = []
    for k, v in enumerate(values):
        try:
            out.append(base64.b64decode(v.split(",", 1)[1] if v.startswith("data:") else v, validate=True))
        except (ValueError, IndexError) as e:
            raise ServerError(f"{where}: rollout_infos['images'][{k}] is not base64 ({e})") from None
    return out
