"""Image rows (0, 1 and 2 images each) trained by 2 processes give the same losses and weights as 1 process
(issue 21): each process encodes its own rows with their images, and DDP averages the gradients. Completions come
from test_distributed.py's deterministic plugin, so both layouts train on the same tokens."""

from __future__ import annotations

import pytest
from support import write_jsonl
from test_distributed import PLUGIN, _args, _close, _dumps, _max_diff, _one_process, _params, _torchrun

pytestmark = pytest.mark.slow

B = 8  # completions per process and micro-step in the 2-process run (2 prompts × 4 generations)


def test_two_processes_match_one_process_with_images(tmp_path):
    from PIL import Image

    from grpokit.testing_vlm import build_tiny_vlm

    model = build_tiny_vlm(tmp_path / "model", "qwen2_vl")
    rows = []
    for i in range(8):
        paths = []
        for k in range(i % 3):
            path = tmp_path / f"img{i}_{k}.png"
            Image.new("RGB", (16, 12 + 4 * k), (40 * i % 256, 80 * k, 200 - 20 * i)).save(path)
            paths.append(str(path))
        rows.append({"query": "<image>" * len(paths) + f"What is {i} + 1?", "images": paths, "solution": str(i + 1)})
    data = write_jsonl(tmp_path / "mm.jsonl", rows)
    plugin = tmp_path / "dist_plugin.py"
    plugin.write_text(PLUGIN)
    steps = (
        "--max_steps",
        "2",
        "--num_iterations",
        "2",
        "--beta",
        "0.04",
        "--learning_rate",
        "3e-3",
        "--save_steps",
        "2",
    )
    one, two = tmp_path / "one", tmp_path / "two"
    _one_process(_args(model, data, one / "out", plugin, 2 * B, *steps), one / "dump")
    _torchrun(_args(model, data, two / "out", plugin, B, *steps), two / "dump", timeout=420)

    (d1,), (r0, r1) = _dumps(one / "dump", 1), _dumps(two / "dump", 2)
    win1, w0, w1 = ([x for x in rows if x["kind"] == "window"] for rows in (d1, r0, r1))
    assert w0[0]["advantages"] + w1[0]["advantages"] == pytest.approx(win1[0]["advantages"], rel=1e-5, abs=1e-7)
    assert any(abs(x) > 0.1 for x in win1[0]["advantages"])  # the rewards vary: the test has a signal
    loss1 = [x["loss"] for x in d1 if x["kind"] == "micro"]
    loss2 = [
        (x["loss"] + y["loss"]) / 2
        for x, y in zip(*([x for x in r if x["kind"] == "micro"] for r in (r0, r1)), strict=True)
    ]
    assert len(loss1) == len(loss2) == 2
    assert all(_close(a, b, rel=1e-4, abs_=1e-6) for a, b in zip(loss1, loss2)), (loss1, loss2)
    p1, p2 = _params(one / "dump"), _params(two / "dump")
    assert _max_diff(p2, _params(two / "dump", 1)) == 0.0  # DDP kept the replicas identical
    assert _max_diff(p1, p2) < 1e-4
