"""The trajectory viewer in a real browser: headless Chromium (scripts/setup_system.sh installs Debian's package)
opens the report.html of a real 3-step tiny run, the page's scripts run, and the rendered DOM (step selector,
groups, per-token colouring, uPlot's legend) is checked against logging.jsonl and completions.jsonl; a screenshot
is saved as an artefact ($GRPOKIT_TEST_ARTIFACTS, else the test's tmp folder; its path is printed). `--serve`
is checked to serve an updated page after the run's log grows."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import urllib.request
from html.parser import HTMLParser
from pathlib import Path

import pytest
from support import flags, shorter_reward_plugin

pytestmark = pytest.mark.slow

PLUGIN = shorter_reward_plugin("len_reward")


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    raise AssertionError("headless Chromium is not installed; run `bash scripts/setup_system.sh` (Debian's chromium)")


def _browser(url: str, *extra: str) -> subprocess.CompletedProcess:
    # --no-sandbox: the tests run as root in CI containers, where Chromium's own sandbox cannot start; the page is
    # our own file. --virtual-time-budget lets the page's scripts (uPlot, the viewer) finish before the dump.
    cmd = flags(
        _chromium(),
        "--headless --no-sandbox --disable-gpu --disable-dev-shm-usage --hide-scrollbars",
        "--virtual-time-budget=4000 --window-size=1400,1600",
        *extra,
        url,
    )
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out


class Node:
    def __init__(self, tag: str, attrs: dict, parent: Node | None) -> None:
        self.tag, self.attrs, self.parent, self.children = tag, attrs, parent, []

    def text(self) -> str:
        return "".join(c if isinstance(c, str) else c.text() for c in self.children)

    def find_all(self, pred) -> list[Node]:
        out = []
        for c in self.children:
            if isinstance(c, Node):
                if pred(c):
                    out.append(c)
                out.extend(c.find_all(pred))
        return out

    def classes(self) -> list[str]:
        return (self.attrs.get("class") or "").split()


VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}


class _Tree(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.root = self.cur = Node("#root", {}, None)

    def handle_starttag(self, tag, attrs):
        node = Node(tag, dict(attrs), self.cur)
        self.cur.children.append(node)
        if tag not in VOID:
            self.cur = node

    def handle_endtag(self, tag):
        n = self.cur
        while n is not None and n.tag != tag:
            n = n.parent
        if n is not None and n.parent is not None:
            self.cur = n.parent

    def handle_data(self, data):
        self.cur.children.append(data)


def _dom(url: str, *extra: str) -> Node:
    tree = _Tree()
    tree.feed(_browser(url, "--dump-dom", *extra).stdout)
    return tree.root


def by_class(name: str):
    return lambda n: name in n.classes()


@pytest.fixture(scope="module")
def run_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """One real 3-step run with --log_completions (its report.html written at the end, as every run's)."""
    from grpokit.config.parse import parse_train_args
    from grpokit.pipeline.train import run_train

    base = tmp_path_factory.mktemp("viewer")
    data = base / "math.jsonl"
    data.write_text(
        "".join(
            json.dumps({"query": f"What is {a} + {b}?", "solution": str(a + b)}) + "\n"
            for a in range(1, 5)
            for b in range(1, 5)
        )
    )
    plugin = base / "viewer_plugin.py"
    plugin.write_text(PLUGIN)
    out = base / "run"
    run_train(
        parse_train_args(
            flags(
                {"--model": tiny_model_dir, "--dataset": data, "--output_dir": out, "--external_plugins": plugin},
                "--tuner_type full --reward_funcs len_reward accuracy --num_generations 4",
                "--per_device_train_batch_size 8 --max_completion_length 12 --learning_rate 1e-3",
                "--torch_dtype float32 --logging_steps 1 --seed 0 --disable_tqdm true --max_steps 3",
                "--log_completions true --plots false --save_final_model false --save_steps 100",
            )
        )
    )
    return out


def _as_reparsed(text: str) -> str:
    """``text`` as it reads after a round trip through serialised HTML (--dump-dom, then parsing): CR and CRLF
    become LF and NUL becomes U+FFFD (HTML's input-stream rules), which the random tiny model does emit."""
    return text.replace("\r\n", "\n").replace("\r", "\n").replace("\x00", "\ufffd")


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _artifacts(tmp_path: Path) -> Path:
    out = Path(os.environ.get("GRPOKIT_TEST_ARTIFACTS") or tmp_path)
    out.mkdir(parents=True, exist_ok=True)
    return out


def test_report_renders_the_run_in_chromium(run_dir, tmp_path):
    report = run_dir / "report.html"
    assert report.is_file(), "the run did not write report.html (--write_report is on by default)"
    logs = [r for r in _jsonl(run_dir / "logging.jsonl") if "loss" in r]
    rows = _jsonl(run_dir / "completions.jsonl")
    steps = sorted({r["step"] for r in rows})
    assert steps == [1, 2, 3] and [r["step"] for r in logs] == [1, 2, 3]
    shot = _artifacts(tmp_path) / "viewer_report.png"
    dom = _dom(report.as_uri(), f"--screenshot={shot}")  # one launch renders the DOM and the screenshot
    assert shot.stat().st_size > 10_000
    print(f"viewer screenshot: {shot}")

    # the step selector lists the logged steps and shows the last one
    (select,) = dom.find_all(lambda n: n.attrs.get("id") == "step-select")
    assert [int(o.attrs["value"]) for o in select.find_all(lambda n: n.tag == "option")] == steps
    last = [r for r in rows if r["step"] == steps[-1]]
    # its groups: one card per prompt group, the completions side by side, as in completions.jsonl
    groups = dom.find_all(by_class("group"))
    assert [g.attrs["data-group"] for g in groups] == list(dict.fromkeys(r["group"] for r in last))
    cards = [c for g in groups for c in g.find_all(by_class("completion"))]
    assert len(cards) == len(last)
    for card, row in zip(cards, last, strict=True):
        assert math.isclose(float(card.attrs["data-reward"]), row["reward"], rel_tol=1e-6, abs_tol=1e-9)
        assert math.isclose(float(card.attrs["data-advantage"]), row["advantage"], rel_tol=1e-6, abs_tol=1e-9)
        assert f"len_reward {row['len_reward']:.3f}" in card.text()
        # token colouring (logprob by default): one span per logged token, its text and value, a red as
        # strong as the token was unlikely (alpha = 1 - p)
        toks = card.find_all(by_class("tok"))
        assert "".join(t.text() for t in toks) == _as_reparsed("".join(row["tokens"]["text"]))
        for t, lp, m in zip(toks, row["tokens"]["logprob"], row["tokens"]["mask"], strict=True):
            assert float(t.attrs["data-v"]) == pytest.approx(lp) and int(t.attrs["data-mask"]) == m
            alpha = float(re.search(r"rgba\(224,\s*49,\s*49,\s*([0-9.]+)\)", t.attrs["style"]).group(1))
            assert alpha == pytest.approx(1 - math.exp(lp), abs=2e-3)
    zero = sum(g.attrs["data-zero-signal"] == "1" for g in groups)
    rewards = {}
    for r in last:
        rewards.setdefault(r["group"], set()).add(r["reward"])
    assert zero == sum(len(v) == 1 for v in rewards.values())

    # a curve: uPlot drew the reward chart (a canvas) over every logged step, and its legend, which uPlot writes
    # at the cursor (set to the last step), shows the last step's values of logging.jsonl
    (chart,) = dom.find_all(lambda n: n.attrs.get("data-key") == "reward")
    assert chart.find_all(lambda n: n.tag == "canvas") and chart.attrs["data-points"] == str(len(logs))
    series = chart.attrs["data-series"].split(",")
    assert series == ["reward", "rewards/accuracy/mean", "rewards/len_reward/mean"]
    values = [v.text() for v in chart.find_all(by_class("u-value"))]
    assert values[0] == str(logs[-1]["step"])
    for key, shown in zip(series, values[1:], strict=True):
        assert float(shown) == pytest.approx(logs[-1][key], rel=1e-3, abs=1e-6)
    assert {c.attrs["data-key"] for c in dom.find_all(by_class("chart"))} >= {"loss", "lengths", "clip", "time"}

    # a link chooses the view: step 1, coloured by entropy (blue, relative to the step's highest), best first
    dom = _dom(report.as_uri() + "#step=1&colour=entropy&sort=high")
    (summary,) = dom.find_all(lambda n: n.attrs.get("id") == "step-summary")
    assert summary.text().startswith("step 1: ")
    first = [r for r in rows if r["step"] == 1]
    top = max(e for r in first for e in r["tokens"]["entropy"])
    means = []
    for g in dom.find_all(by_class("group")):
        cards = g.find_all(by_class("completion"))
        got = [float(c.attrs["data-reward"]) for c in cards]
        assert got == sorted(got, reverse=True)
        means.append(sum(got) / len(got))
        for c in cards:
            row = first[int(c.attrs["data-index"])]
            assert row["group"] == g.attrs["data-group"]
            for t, e in zip(c.find_all(by_class("tok")), row["tokens"]["entropy"], strict=True):
                alpha = float(re.search(r"rgba\(47,\s*111,\s*223,\s*([0-9.]+)\)", t.attrs["style"]).group(1))
                assert alpha == pytest.approx(min(1.0, e / top), abs=2e-3)
    assert means == sorted(means, reverse=True) and len(means) == len({r["group"] for r in first})


def test_multi_turn_and_vision_rows_show_masked_turns_and_thumbnails(tmp_path):
    """A row as a multi-turn vision run logs it: the tool turn and its tokens marked as masked, the thumbnail
    shown, and the other colourings available (the rendering, not the run, is what is checked here)."""
    thumb = (
        "data:image/jpeg;base64,/9j/4AAQSkZJRgABAQEASABIAAD/2wBDAP//////////////////////////////////////////"
        "////////////////////////////////////////////wgALCAABAAEBAREA/8QAFBABAAAAAAAAAAAAAAAAAAAAAP/aAAgBAQAB"
        "PxA="
    )
    msgs = [
        {"role": "user", "content": "<image>what is it?"},
        {"role": "assistant", "content": "look"},
        {"role": "tool", "content": "a cat"},
        {"role": "assistant", "content": "cat"},
    ]
    row = {
        "step": 1,
        "prompt": "<image>what is it?",
        "completion": "cat",
        "advantage": 0.5,
        "acc": 1.0,
        "group": "0",
        "reward": 1.0,
        "truncated": False,
        "messages": msgs,
        "thumbnails": [thumb],
        "tokens": {
            "text": ["look", "a cat", "cat"],
            "logprob": [-0.5, -2.0, -0.1],
            "entropy": [1, 2, 0.5],
            "mask": [1, 0, 1],
            "cut": 0,
        },
    }
    (tmp_path / "completions.jsonl").write_text(json.dumps(row) + "\n")
    (tmp_path / "logging.jsonl").write_text(json.dumps({"step": 1, "loss": 0.1, "rewards/acc/mean": 1.0}) + "\n")
    out = subprocess.run(
        [sys.executable, "-m", "grpokit", "view", str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    dom = _dom(Path(out.stdout.strip()).as_uri())
    turns = dom.find_all(by_class("turn"))
    assert [(t.attrs["data-role"], "masked" in t.classes()) for t in turns] == [
        ("assistant", False),
        ("tool", True),
        ("assistant", False),
    ]
    assert "masked (not trained)" in turns[1].text()
    toks = dom.find_all(by_class("tok"))
    assert ["masked" in t.classes() for t in toks] == [False, True, False]
    (img,) = dom.find_all(lambda n: n.tag == "img")
    assert img.attrs["src"] == thumb
    (colour,) = dom.find_all(lambda n: n.attrs.get("id") == "colour")
    assert [o.attrs["value"] for o in colour.find_all(lambda n: n.tag == "option")] == [
        "logprob",
        "entropy",
        "advantage",
        "mask",
    ]
    (filt,) = dom.find_all(lambda n: n.attrs.get("id") == "filter")
    assert {o.attrs["value"] for o in filt.find_all(lambda n: n.tag == "option")} == {
        "all",
        "signal",
        "zero",
        "truncated",
    }


ODD_ROWS = [  # rows of other shapes than grpokit writes: each must draw (or show as unreadable) on its own
    {"tokens": {"text": 5, "logprob": "x", "mask": None}},
    {"tokens": {"text": ["a", "b"], "logprob": [-1.0], "mask": [1, 1]}},  # lengths disagree
    {"messages": "not a list", "thumbnails": {"src": "x"}, "group": {"a": 1}, "completion": 7},
    {"messages": [None, 3, {"role": 5}, {"role": "tool", "content": {"deep": [1, 2]}}], "advantage": "high"},
    {"prompt": ["list"], "reward": {"n": 1}, "truncated": "yes", "group": None},
]


def test_rows_of_any_shape_never_stop_the_step_from_drawing(tmp_path):
    good = {"step": 1, "prompt": "p", "completion": "the good row", "group": "0", "reward": 1.0, "advantage": 0.5}
    rows = [good, *({"step": 1, **odd} for odd in ODD_ROWS)]
    (tmp_path / "completions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "logging.jsonl").write_text(json.dumps({"step": 1, "loss": 0.1}) + "\n" + "[" * 5000 + "\n")
    out = subprocess.run(
        [sys.executable, "-m", "grpokit", "view", str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    dom = _dom(Path(out.stdout.strip()).as_uri())
    cards = dom.find_all(by_class("completion"))
    assert len(cards) == len(rows)  # every row has its card: drawn, or marked as one that could not be
    assert any("the good row" in c.text() for c in cards)
    (summary,) = dom.find_all(lambda n: n.attrs.get("id") == "step-summary")
    assert "rows skipped as unreadable: 1 of logging.jsonl" in summary.text()


def test_serve_serves_an_updated_page_while_the_run_writes(run_dir, tmp_path):
    live = tmp_path / "live"
    live.mkdir()
    for name in ("logging.jsonl", "completions.jsonl", "args.json"):
        shutil.copy(run_dir / name, live / name)
    proc = subprocess.Popen(
        [sys.executable, "-m", "grpokit", "view", str(live), "--serve", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == str(live / "report.html")
        line = proc.stdout.readline()
        base = re.search(r"(http://127\.0\.0\.1:\d+/)", line).group(1)
        before = urllib.request.urlopen(base + "version", timeout=30).read().decode()
        row = {**_jsonl(live / "logging.jsonl")[-1], "step": 4, "loss": 0.125}
        with (live / "logging.jsonl").open("a") as f:
            f.write(json.dumps(row) + "\n")
        assert urllib.request.urlopen(base + "version", timeout=30).read().decode() != before
        data = json.loads(urllib.request.urlopen(base + "data.json", timeout=30).read())
        assert [r["step"] for r in data["logs"]][-1] == 4
        # the served page, rendered: live mode on and the new step on the curves
        dom = _dom(base)
        (status,) = dom.find_all(lambda n: n.attrs.get("id") == "live-status")
        assert status.text().startswith("live")
        (chart,) = dom.find_all(lambda n: n.attrs.get("data-key") == "loss")
        assert chart.attrs["data-points"] == "4" and json.loads(chart.attrs["data-last"]) == [0.125]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
