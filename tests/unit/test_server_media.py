"""Images on rollout-server requests (grpokit/server/media.py, grpokit/engines/media_wire.py): the trainer's wire
form decodes to the trainer's own pixels, and every hostile image is refused in one line with a 4xx status."""

from __future__ import annotations

import base64
import io

import pytest
from PIL import Image

from grpokit.data.images import load_image
from grpokit.engines.media_wire import image_to_wire, images_from_wire, request_to_wire
from grpokit.protocol import RolloutInferRequest
from grpokit.server.media import ImageLimits, ImageRefused, output_to_wire, take_images
from grpokit.server.options import ServerOptions

MSG = [{"role": "user", "content": "<image>What colour?"}]


def _png(size=(8, 6), colour=(200, 30, 40), fmt="PNG") -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, fmt)
    return buf.getvalue()


def _take(refs, limits=ImageLimits(), **data) -> RolloutInferRequest:
    r = RolloutInferRequest(messages=MSG, images=refs, data_dict=data)
    take_images([r], limits)
    return r


def _refused(refs, limits=ImageLimits(), **data) -> ImageRefused:
    with pytest.raises(ImageRefused) as e:
        _take(refs, limits, **data)
    assert "\n" not in str(e.value) and 400 <= e.value.status < 500
    return e.value


@pytest.mark.parametrize("source", ["path", "bytes", "pil", "dict"])
def test_the_wire_form_decodes_to_the_trainers_pixels(source, tmp_path):
    png = _png()
    path = tmp_path / "a.png"
    path.write_bytes(png)
    image = {"path": str(path), "bytes": png, "pil": Image.open(io.BytesIO(png)), "dict": {"bytes": png}}[source]
    wire = request_to_wire(RolloutInferRequest(messages=MSG, data_dict={"images": [image], "solution": "red"}))
    assert wire["data_dict"] == {"solution": "red"} and wire["images"][0].startswith("data:image/png;base64,")
    r = _take(wire["images"], solution="red")
    assert r.images == [] and r.data_dict["solution"] == "red"
    assert r.data_dict["images"][0].tobytes() == load_image(image).tobytes()


def test_raw_base64_jpeg_and_paths_under_the_media_root(tmp_path):
    jpeg = _png(fmt="JPEG")
    raw = base64.b64encode(jpeg).decode()
    assert raw.startswith("/9j/")  # looks like a path, is base64
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.png").write_bytes(_png())
    limits = ImageLimits(media_roots=(tmp_path.resolve(),))
    r = _take([raw, str(tmp_path / "sub" / "a.png"), "sub/a.png"], limits)
    assert [i.size for i in r.data_dict["images"]] == [(8, 6)] * 3


def test_hostile_images_get_one_line_4xx(tmp_path):
    png = _png()
    uri = "data:image/png;base64," + base64.b64encode(png).decode()
    outside = tmp_path / "outside.png"
    outside.write_bytes(png)
    root = tmp_path / "root"
    root.mkdir()
    (root / "link.png").symlink_to(outside)
    rooted = ImageLimits(media_roots=(root.resolve(),))
    assert _refused(["data:image/png;base64,@@@"]).status == 400
    assert "not valid base64" in str(_refused(["not base64!"]))
    assert "URL" in str(_refused(["https://example.com/a.png"]))
    assert _refused([str(outside)]).status == 403  # no --media_root: no path is read
    # outside the root, a symlink out of it, climbing out, missing, a directory: one answer, so that it tells
    # nothing about files elsewhere (no existence oracle)
    (root / "dir.png").mkdir()
    answers = {
        (e.status, str(e).replace(repr(ref), "REF"))
        for ref in (str(outside), "link.png", "../outside.png", "missing.png", str(tmp_path / "missing.png"), "dir.png")
        for e in [_refused([ref], rooted)]
    }
    assert len(answers) == 1 and next(iter(answers))[0] == 403, answers
    assert "not a readable file under the server's --media_root" in next(iter(answers))[1]
    nul = _refused(["a\x00.png"], rooted)
    assert nul.status == 400 and "control character" in str(nul)
    assert _refused([uri] * 3, ImageLimits(max_images_per_request=2)).status == 413
    assert "--max_image_mb" in str(_refused([uri], ImageLimits(max_image_bytes=len(png) - 1)))
    assert "--max_images_mb" in str(
        _refused([uri, image_to_wire(_png(colour=(1, 2, 3)))], ImageLimits(max_call_image_bytes=len(png) + 10))
    )
    assert "--max_image_pixels" in str(_refused([uri], ImageLimits(max_image_pixels=47)))
    assert _refused([image_to_wire(_png(fmt="BMP"))], ImageLimits(formats=("PNG",))).status == 415
    noisy = io.BytesIO()
    Image.effect_noise((64, 64), 50).convert("RGB").save(noisy, "PNG")
    assert "cannot be decoded" in str(_refused([image_to_wire(noisy.getvalue()[:2000])]))  # truncated
    assert "in its 'images' field" in str(_refused([], images=["/etc/passwd"]))


@pytest.mark.parametrize("side, shown", [(5000, "5000x5000 = 25000000 pixels"), (20000, "400000000 pixels")])
def test_a_decompression_bomb_is_refused_from_its_header(side, shown):
    # a 20000 x 20000 1-bit PNG compresses to ~50 KB; decoded as RGB it would take 1.2 GB. Beyond twice PIL's own
    # limit PIL refuses it on opening; below that the server's --max_image_pixels (default 4096 x 4096) does
    buf = io.BytesIO()
    Image.new("1", (side, side)).save(buf, "PNG")
    e = _refused([image_to_wire(buf.getvalue())])
    assert e.status == 413 and f"image of {shown} exceeds the server's --max_image_pixels" in str(e)


def test_a_group_shares_one_decoded_image():
    uri = image_to_wire(_png())
    requests = [RolloutInferRequest(messages=MSG, images=[uri]) for _ in range(4)]
    take_images(requests, ImageLimits(max_call_image_bytes=len(_png()) + 1))  # counted once
    assert len({id(r.data_dict["images"][0]) for r in requests}) == 1


def test_a_trajectorys_images_go_back_as_base64_and_return_as_bytes():
    from grpokit.protocol import ChatCompletionResponse, ChatCompletionResponseChoice, RolloutOutput

    png = _png()
    choice = ChatCompletionResponseChoice(
        message={"role": "assistant", "content": "x"}, finish_reason="stop", token_ids=[1]
    )
    out = RolloutOutput(
        response=ChatCompletionResponse(choices=[choice]),
        messages=MSG,
        rollout_infos={"images": [Image.open(io.BytesIO(png))]},
    )
    wire = output_to_wire(out)
    back = images_from_wire(wire["rollout_infos"]["images"], "r")
    assert load_image(back[0]).tobytes() == load_image(png).tobytes()


def test_server_image_options_are_checked(tmp_path):
    from grpokit.errors import ConfigError

    with pytest.raises(ConfigError, match="--media_root .*: no such directory"):
        ServerOptions(model="m", media_root=[str(tmp_path / "nope")])
    with pytest.raises(ConfigError, match="--image_formats XCF: give one or more of PNG"):
        ServerOptions(model="m", image_formats=["xcf"])
    with pytest.raises(ConfigError, match="--max_image_pixels 0: must be positive"):
        ServerOptions(model="m", max_image_pixels=0)
    limits = ServerOptions(model="m", media_root=[str(tmp_path)], image_formats=["png"]).image_limits()
    assert limits.media_roots == (tmp_path.resolve(),) and limits.formats == ("PNG",)


def test_a_text_only_server_refuses_images_and_serves_text():
    from test_server_app import make_client

    client, state = make_client(max_body_mb=1)
    assert client.get("/get_engine_type/").json()["multimodal"] is False
    body = {"requests": [{"messages": MSG, "images": [image_to_wire(_png())]}]}
    resp = client.post("/infer/", json=body)
    assert resp.status_code == 400 and "serves a text-only model (echo)" in resp.json()["error"]
    resp = client.post("/infer/", json={"requests": [{"messages": MSG, "images": ["data:,"]}]})
    assert resp.status_code == 400 and "text-only" in resp.json()["error"]  # refused before any decoding
    assert client.post("/infer/", json={"requests": [{"messages": MSG}]}).status_code == 200


def test_the_trainer_stops_when_the_servers_prompt_ids_are_not_its_processors():
    from grpokit.errors import RolloutError
    from grpokit.protocol import ChatCompletionResponse, ChatCompletionResponseChoice, RolloutOutput
    from grpokit.rollout.remote import check_prompt_ids

    class Template:  # the trainer's processor template: 3 image tokens between two text tokens
        multimodal = True

        def encode_mm(self, messages, images):
            return [1, 9, 9, 9, 2], None

    request = RolloutInferRequest(messages=MSG, data_dict={"images": [_png()]})
    choice = ChatCompletionResponseChoice(
        message={"role": "assistant", "content": "x"}, finish_reason="stop", token_ids=[5]
    )

    def output(prompt_ids):
        return RolloutOutput(
            response=ChatCompletionResponse(choices=[choice], prompt_token_ids=prompt_ids),
            messages=MSG,
            response_token_ids=[[5]],
            request_id=request.request_id,
        )

    check_prompt_ids(Template(), [request], [output([1, 9, 9, 9, 2])])
    with pytest.raises(
        RolloutError,
        match=r"prompt ids differ from this trainer's processor's \(4 vs 5 ids, first "
        r"difference at position 3\)",
    ) as e:
        check_prompt_ids(Template(), [request], [output([1, 9, 9, 2])])
    assert "\n" not in str(e.value)


def test_the_calls_pixels_are_counted_from_headers_before_any_decode(monkeypatch):
    from grpokit.server import media

    decoded = []
    monkeypatch.setattr(media, "decode", lambda image, where: decoded.append(where) or image.convert("RGB"))
    big = [image_to_wire(_png(colour=(i, 0, 0))) for i in range(3)]  # distinct images of 8 x 6 = 48 pixels each
    e = _refused(big, ImageLimits(max_call_pixels=100))
    assert e.status == 413 and "--max_images_pixels" in str(e) and "images[2]" in str(e)
    assert decoded == []  # refused from the headers: nothing was decoded
    r = _take(big[:2] * 2, ImageLimits(max_call_pixels=100))  # copies of one image count once
    assert len(r.data_dict["images"]) == 4 and len(decoded) == 2
