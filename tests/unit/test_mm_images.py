"""Image rows (grpokit/data/images.py): ms-swift's and TRL's formats, checked at load time with one-line errors."""

from __future__ import annotations

import io

import pytest
from datasets import Dataset
from PIL import Image

from grpokit.data.images import check_images, count_placeholders, load_image, row_images, to_parts, with_image_slots
from grpokit.data.loading import load_train_val
from grpokit.errors import DataError


def _png(tmp_path, name="a.png", colour=(255, 0, 0)):
    path = tmp_path / name
    Image.new("RGB", (8, 8), colour).save(path)
    return str(path)


def test_every_image_form_opens_as_rgb(tmp_path):
    path = _png(tmp_path)
    raw = open(path, "rb").read()
    for image in (path, raw, {"bytes": raw, "path": None}, {"bytes": None, "path": path}, Image.new("L", (8, 8), 7)):
        out = load_image(image)
        assert out.mode == "RGB" and out.size == (8, 8)


def test_a_url_a_missing_file_and_a_bad_type_are_refused_in_one_line(tmp_path):
    for image, words in (("https://x.org/a.png", "URL .* is refused"), (str(tmp_path / "nope.png"), "does not exist")):
        with pytest.raises(DataError, match=words) as e:
            check_images(
                Dataset.from_list([{"messages": [{"role": "user", "content": "<image>hi"}], "images": [image]}]),
                "--dataset d",
            )
        assert "\n" not in str(e.value) and str(e.value).startswith("--dataset d: row 0: image 0:")
    with pytest.raises(DataError, match="must be a file path, bytes or a PIL image, got int"):
        load_image(3)


def test_more_placeholders_than_images_is_one_line(tmp_path):
    row = {"messages": [{"role": "user", "content": "<image><image>which?"}], "images": [_png(tmp_path)]}
    with pytest.raises(DataError, match="2 image placeholder\\(s\\) but 1 image\\(s\\)") as e:
        check_images(Dataset.from_list([row]), "--dataset d")
    assert "\n" not in str(e.value)
    with pytest.raises(DataError, match="2 image placeholder"):
        with_image_slots(row["messages"], 1)


def test_ms_swift_placeholders_become_typed_parts_in_place():
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a<image>b<image>"}]
    assert to_parts(msgs)[1]["content"] == [
        {"type": "text", "text": "a"},
        {"type": "image"},
        {"type": "text", "text": "b"},
        {"type": "image"},
    ]
    assert count_placeholders(msgs) == 2


def test_images_without_placeholders_go_first_in_the_first_user_message():
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "what?"}]
    out = with_image_slots(msgs, 2)
    assert out[1]["content"] == [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "what?"}]


def test_trl_rows_with_image_column_and_typed_parts_load(tmp_path):
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (0, 0, 255)).save(buf, format="PNG")
    rows = [
        {
            "prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "colour?"}]}],
            "image": Image.open(io.BytesIO(buf.getvalue())),
            "solution": "blue",
        }
    ]
    path = tmp_path / "trl"
    Dataset.from_list(rows).save_to_disk(str(path))
    train, _ = load_train_val([str(path)], [], system=None, seed=0)
    row = train[0]
    assert "image" not in train.column_names and len(row_images(row)) == 1  # image → images
    assert load_image(row_images(row)[0]).getpixel((0, 0)) == (0, 0, 255)
    assert row["messages"] == [{"role": "user", "content": "<image>colour?"}]  # travels in ms-swift's form
    assert to_parts(row["messages"])[0]["content"] == [{"type": "image"}, {"type": "text", "text": "colour?"}]


def test_ms_swift_jsonl_with_a_missing_image_fails_at_load(tmp_path):
    import json

    data = tmp_path / "d.jsonl"
    data.write_text(
        json.dumps({"messages": [{"role": "user", "content": "<image>x"}], "images": [str(tmp_path / "gone.png")]})
        + "\n"
    )
    with pytest.raises(DataError, match="gone.png.*does not exist"):
        load_train_val([str(data)], [], system=None, seed=0)


def test_builtin_colours_has_disjoint_splits_of_solid_images():
    from grpokit.data.builtin import colours

    train, test = colours("train", 0), colours("test", 0)
    assert (len(train), len(test)) == (240, 60)
    assert {r["solution"] for r in test} == {"red", "green", "blue"}
    assert not {r["images"][0] for r in train} & {r["images"][0] for r in test}
    for r in test[:9]:
        img = load_image(r["images"][0])
        pixel = img.getpixel((3, 3))
        assert img.getextrema() == tuple((v, v) for v in pixel)  # solid
        assert max(range(3), key=lambda c: pixel[c]) == ("red", "green", "blue").index(r["solution"])
