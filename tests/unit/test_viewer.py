"""The trajectory viewer without a browser: the page's data (bounded, JSON-safe), the per-token rows that
--log_completions writes, the CLI's refusals, and the server's answers. The browser tests are in
tests/integration/test_viewer_browser.py."""

from __future__ import annotations

import base64
import io
import json
import os
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch

from grpokit.errors import ConfigError
from grpokit.protocol import ChatCompletionResponse, ChatCompletionResponseChoice, RolloutInferRequest, RolloutOutput
from grpokit.runs.outputs import CompletionLimits
from grpokit.server.viewer_site import ViewerSite, start
from grpokit.trainers.batch import RolloutBatch
from grpokit.trainers.completion_log import TokenForward, completion_log_rows, thumbnail, token_pieces
from grpokit.viewer.report import chosen_steps, render_html, report_data, write_report


def _run_dir(tmp_path, logs: list[str], completions: list[dict]):
    (tmp_path / "logging.jsonl").write_text("".join(line + "\n" for line in logs))
    (tmp_path / "completions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in completions))
    (tmp_path / "args.json").write_text(json.dumps({"model": "m", "dataset": ["d"]}, indent=2))
    return tmp_path


def test_chosen_steps_keep_first_last_and_even_spacing():
    assert chosen_steps([1, 2, 3], 5) == [1, 2, 3]
    # 10 steps into 4: positions round(i * 9 / 3) = 0, 3, 6, 9
    assert chosen_steps(list(range(1, 11)), 4) == [1, 4, 7, 10]
    assert chosen_steps([1, 2, 3], 1) == [3]


def test_report_data_is_json_safe_and_bounded(tmp_path):
    rows = [{"step": s, "prompt": "p", "completion": "</script><!--", "group": "0"} for s in range(1, 6)]
    run = _run_dir(
        tmp_path, ['{"step": 1, "loss": NaN, "reward": 0.5}', '{"step": 2, "loss": 1.0}', '{"step": 3, "lo'], rows
    )  # a torn last line, as while a run writes
    data = report_data(run, max_completion_steps=2)
    assert [r["step"] for r in data["logs"]] == [1, 2] and data["logs"][0]["loss"] is None
    assert sorted(data["completions"]) == ["1", "5"]
    assert data["completion_steps"] == {"logged": 5, "shown": 2, "limit": 2}
    html = render_html(data)
    # the completion's "</script>" cannot end the data element: only the page's own three scripts end
    assert html.count("</script>") == 3 and "\\u003c/script>\\u003c!--" in html
    start = html.index('id="grpokit-data">') + len('id="grpokit-data">')
    assert json.loads(html[start : html.index("</script>", start)])["logs"][1]["loss"] == 1.0
    assert write_report(run, max_completion_steps=2) == run / "report.html"
    assert (run / "report.html").read_text() == html


def test_a_run_without_completions_has_a_page(tmp_path):
    (tmp_path / "logging.jsonl").write_text('{"step": 1, "loss": 1.0}\n')  # --log_completions false
    assert report_data(tmp_path)["completion_steps"] == {"logged": 0, "shown": 0, "limit": 100}


def test_report_refuses_a_folder_that_is_no_run(tmp_path):
    with pytest.raises(ConfigError, match="is not a folder"):
        report_data(tmp_path / "missing")
    with pytest.raises(ConfigError, match="has no logging.jsonl"):
        report_data(tmp_path)


def test_view_never_imports_torch_and_refuses_port_without_serve(tmp_path):
    run = _run_dir(tmp_path, ['{"step": 1, "loss": 1.0}'], [])
    code = (
        "import sys; from grpokit.cli.main import main; main(['view', sys.argv[1]]); "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    out = subprocess.run([sys.executable, "-c", code, str(run)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(run / "report.html")
    bad = subprocess.run(
        [sys.executable, "-m", "grpokit", "view", str(run), "--port", "9"], capture_output=True, text=True, timeout=60
    )
    assert bad.returncode == 2 and "--port is for --serve" in bad.stderr


def _get(url: str, method: str = "GET", headers: dict | None = None) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method=method, headers=headers or {}), timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_server_answers_its_three_paths_and_refuses_the_rest(tmp_path):
    run = _run_dir(tmp_path, ['{"step": 1, "loss": 1.0}'], [])
    server = start(run, 0)
    base = server.url
    try:
        before = _get(base + "/version")[1].decode()
        with (run / "logging.jsonl").open("a") as f:
            f.write('{"step": 2, "loss": 0.5}\n')
        assert _get(base + "/version")[1].decode() != before
        data = json.loads(_get(base + "/data.json")[1])
        assert [r["step"] for r in data["logs"]] == [1, 2]
        assert b'data-live="1"' in _get(base + "/")[1]
        refused = {
            "unknown path": (_get(base + "/etc/passwd"), 404),
            "a write": (_get(base + "/", "POST"), 405),
            # a rebound name: the page is not handed to that site
            "foreign Host": (_get(base + "/data.json", headers={"Host": "evil.example"}), 421),
            # a page of another site (a browser sends no Origin with a plain GET, but says where it comes from)
            "cross-site": (_get(base + "/data.json", headers={"Sec-Fetch-Site": "cross-site"}), 403),
        }
        for name, ((code, body), want) in refused.items():
            assert code == want, name
            assert isinstance(json.loads(body)["error"], str), name  # one error shape on every surface
    finally:
        server.close()


HOSTILE_LINES = [
    "[" * 100_000,  # nested past any parser's recursion
    '{"step": 1, "completion": "\\ud800"}',  # a lone surrogate: no UTF-8 page can carry it
    '{"step": 1, "n": ' + "7" * 5000 + "}",  # past Python's int conversion limit
    '{"step": "1"}',  # wrong types
    '{"step": true}',
    "[1, 2]",
    '"text"',
    "\xff\xfe not utf-8",
]


def test_hostile_rows_are_skipped_counted_and_never_stop_the_page(tmp_path):
    good = {"step": 1, "prompt": "p", "completion": "ok", "group": "0"}
    run = _run_dir(tmp_path, ['{"step": 1, "loss": 1.0}', *HOSTILE_LINES], [good])
    with (run / "completions.jsonl").open("a", encoding="utf-8", errors="surrogateescape") as f:
        f.write("".join(line + "\n" for line in HOSTILE_LINES))
        f.write(json.dumps({**good, "tokens": {"text": 5}, "messages": "x", "group": {"a": 1}}) + "\n")
    data = report_data(run)
    assert [r["step"] for r in data["logs"]] == [1]
    assert data["skipped_rows"] == {"logging.jsonl": len(HOSTILE_LINES), "completions.jsonl": len(HOSTILE_LINES)}
    assert len(data["completions"]["1"]) == 2  # the odd-shaped row is app.js's to type-check, row by row
    assert write_report(run) == run / "report.html"
    assert sorted(p.name for p in run.iterdir()) == ["args.json", "completions.jsonl", "logging.jsonl", "report.html"]
    server = start(run, 0)
    try:
        for path in ("/", "/data.json", "/version"):
            assert _get(server.url + path)[0] == 200, path
    finally:
        server.close()


def test_a_page_that_cannot_be_built_is_an_http_error_and_no_temporary_file_is_left(tmp_path, monkeypatch):
    run = _run_dir(tmp_path, ['{"step": 1, "loss": 1.0}'], [])
    server = start(run, 0)
    try:
        monkeypatch.setattr("grpokit.server.viewer_site.render_html", _broken)
        with (run / "logging.jsonl").open("a") as f:
            f.write('{"step": 2, "loss": 0.5}\n')  # a new version: the next request rebuilds, and the build fails
        code, body = _get(server.url + "/data.json")
        assert code == 500 and "could not be built" in json.loads(body)["error"]
    finally:
        server.close()
    monkeypatch.setattr("grpokit.viewer.report.render_html", _broken)
    with pytest.raises(RuntimeError):
        write_report(run)
    (run / "report.html").unlink(missing_ok=True)
    monkeypatch.undo()
    monkeypatch.setattr("pathlib.Path.replace", _broken)
    with pytest.raises(RuntimeError):
        write_report(run)
    assert not list(run.glob("*.tmp"))


def test_one_build_per_version_however_many_requests(tmp_path, monkeypatch):
    run = _run_dir(tmp_path, ['{"step": 1, "loss": 1.0}'], [])
    server = start(run, 0)
    builds, release = [], threading.Event()
    original = ViewerSite.build

    def slow_build(self):
        builds.append(1)
        release.wait(30)  # every request below arrives while this build runs
        return original(self)

    monkeypatch.setattr(ViewerSite, "build", slow_build)
    try:
        with (run / "logging.jsonl").open("a") as f:
            f.write('{"step": 2, "loss": 0.5}\n')  # a new version
        answers = []
        fetch = lambda: answers.append(_get(server.url + "/data.json")[0])  # noqa: E731 - a thread's target
        callers = [threading.Thread(target=fetch) for _ in range(8)]
        for t in callers:
            t.start()
        threading.Event().wait(0.5)
        release.set()
        for t in callers:
            t.join(30)
        assert answers == [200] * 8 and len(builds) == 1  # joined, not repeated
        assert _get(server.url + "/")[0] == 200 and len(builds) == 1  # cached until the files change
    finally:
        server.close()


def _broken(*args, **kwargs):
    raise RuntimeError("broken on purpose")


def test_the_page_holds_only_the_shown_steps_and_no_secret_or_local_path(tmp_path, monkeypatch):
    rows = [{"step": s, "prompt": "p", "completion": "c" * 1000, "group": "0"} for s in range(1, 201)]
    run = _run_dir(tmp_path, ['{"step": 1, "loss": 1.0}'], rows)
    monkeypatch.setenv("MY_SERVICE_TOKEN", "tok-0123456789")
    (run / "args.json").write_text(
        json.dumps(
            {
                "model": "/home/someone/models/qwen",
                "vllm_server_api_key": "sk-secret-key",
                "vllm_server_base_url": "http://user:hunter22@10.0.0.1:8000",
                "notes": "uses tok-0123456789",
                "max_new_tokens": 64,
            }
        )
    )
    data = report_data(run, max_completion_steps=3)
    assert sorted(map(int, data["completions"])) == [1, 101, 200]  # positions round(i * 199 / 2) = 0, 100, 199
    html = render_html(data)
    for leak in ("sk-secret-key", "hunter22", "tok-0123456789", "/home/someone", str(tmp_path)):
        assert leak not in html, leak
    assert data["args"]["max_new_tokens"] == 64 and data["args"]["model"] == ".../qwen"


class _CharTokenizer:
    """Token id = a character's code point; decoding is joining them."""

    def decode(self, ids):
        return "".join(chr(i) for i in ids)

    def batch_decode(self, seqs):
        return [self.decode(s) for s in seqs]


def _output(req, text, finish, extra_messages=()):
    return RolloutOutput(
        response=ChatCompletionResponse(
            choices=[
                ChatCompletionResponseChoice(
                    message={"role": "assistant", "content": text}, finish_reason=finish, token_ids=[1]
                )
            ]
        ),
        messages=[*req.messages, *extra_messages, {"role": "assistant", "content": text}],
        response_token_ids=[[1]],
        response_loss_mask=[[1]],
        request_id=req.request_id,
        prompt_id="7",
    )


def test_completion_log_rows_carry_bounded_token_data_masks_and_thumbnails():
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (600, 300), (200, 30, 30)).save(buf, format="PNG")
    req = RolloutInferRequest(
        messages=[{"role": "user", "content": "q"}], data_dict={"images": [buf.getvalue()]}, prompt_id="7"
    )
    tool = [{"role": "assistant", "content": "call"}, {"role": "tool", "content": "out"}]
    outputs = [_output(req, "abcd", "length", tool), _output(req, "xy", "stop"), _output(req, "z", "stop")]
    # completions right-padded to C = 4 after a prompt of 2; row 0's tokens 2-3 are tool output (mask 0)
    comp = torch.tensor([[ord(c) for c in "abcd"], [ord("x"), ord("y"), 0, 0], [ord("z"), 0, 0, 0]])
    att = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]])
    batch = RolloutBatch(
        input_ids=torch.cat([torch.full((3, 2), 5), comp], 1),
        attention_mask=torch.cat([torch.ones(3, 2, dtype=torch.long), att], 1),
        position_ids=torch.arange(6).repeat(3, 1),
        completion_mask=torch.tensor([[1.0, 1, 0, 0], [1, 1, 0, 0], [1, 0, 0, 0]]),
        truncated=torch.tensor([True, False, False]),
        advantages=torch.tensor([1.0, -0.5, -0.5]),
    )

    def logps(model, chunk, compute_entropy=False):  # logp = -(column+1)/10, entropy = column+1, per chunk
        cols = torch.arange(1, chunk.logits_to_keep + 1, dtype=torch.float32).repeat(len(chunk), 1)
        return -cols / 10, cols

    fwd = TokenForward(logps, None, SimpleNamespace(device="cpu", autocast=nullcontext), micro_batch_size=2)
    rows = completion_log_rows(
        [req],
        outputs,
        torch.tensor([[1.0], [0.0], [0.0]]),
        batch,
        torch.tensor([1.0, 0.0, 0.0]),
        ["acc"],
        2,
        limits=CompletionLimits(max_tokens=3, max_rows=2),
        forward=fwd,
        tokenizer=_CharTokenizer(),
        images=True,
    )
    assert [r["group"] for r in rows] == ["7"] * 3 and [r["truncated"] for r in rows] == [True, False, False]
    assert rows[0]["reward"] == 1.0 and rows[0]["acc"] == 1.0 and rows[0]["advantage"] == 1.0
    # row 0: 4 tokens, 3 kept, one counted as cut; its third token is tool output (mask 0)
    assert rows[0]["tokens"] == {
        "text": ["a", "b", "c"],
        "logprob": [-0.1, -0.2, -0.3],
        "entropy": [1.0, 2.0, 3.0],
        "mask": [1, 1, 0],
        "cut": 1,
    }
    # row 1 sits in the second chunk, trimmed to its own width of 2: the values are that chunk's columns
    assert rows[1]["tokens"] == {
        "text": ["x", "y"],
        "logprob": [-0.1, -0.2],
        "entropy": [1.0, 2.0],
        "mask": [1, 1],
        "cut": 0,
    }
    assert "tokens" not in rows[2] and "thumbnails" not in rows[2]  # beyond max_rows: text and scores only
    assert rows[0]["messages"][-3]["role"] == "assistant" and rows[0]["messages"][-2]["role"] == "tool"
    uri = rows[0]["thumbnails"][0]
    assert uri.startswith("data:image/jpeg;base64,")
    assert Image.open(io.BytesIO(base64.b64decode(uri.split(",", 1)[1]))).size == (128, 64)


def test_token_pieces_join_into_the_decoded_text():
    from grpokit.testing import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    text = "héllo ✓ 数学 🙂 end"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    pieces = token_pieces(tok, ids)
    assert len(pieces) == len(ids) and "".join(pieces) == tok.decode(ids) == text
    assert "\ufffd" not in "".join(pieces)


def test_thumbnail_is_bounded():
    from PIL import Image

    uri = thumbnail(Image.new("RGB", (50, 400)), 100)
    assert Image.open(io.BytesIO(base64.b64decode(uri.split(",", 1)[1]))).size == (12, 100)


@pytest.mark.parametrize("kind", ["fifo", "nested", "huge"])
def test_a_hostile_args_json_is_left_out_of_the_page(tmp_path, kind):
    """The run folder is data: a FIFO is not waited on, a deeply nested or huge args.json is not shown."""
    (tmp_path / "logging.jsonl").write_text(json.dumps({"step": 1, "loss": 0.5}) + "\n")
    path = tmp_path / "args.json"
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.write_text("[" * 100_000 + "]" * 100_000 if kind == "nested" else '{"a": "' + "x" * (5 << 20) + '"}')
    assert report_data(tmp_path, 10)["args"] == {}
