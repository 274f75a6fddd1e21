"""The viewer against rows and requests the other viewer tests do not send: rows that are JSON only to a lax
parser (a key twice, NaN steps, a float or huge step), BOM, NUL and CRLF lines, a completions file of more distinct
steps than a page chooses from and a log longer than the charts draw (both skipped and counted, memory bounded by
the caps), odd args.json values; and over ``--serve``, a page of another port (Origin, Referer), a header sent
twice, encoded paths and a body on a GET. Every answer is the page or one JSON error, no file but report.html is
left, and a new version of the files is rebuilt once."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import pytest

from grpokit.server.viewer_site import ViewerSite, start
from grpokit.viewer import report
from grpokit.viewer.report import report_data, write_report

GOOD = {"step": 1, "prompt": "p", "completion": "ok", "group": "0"}
LAX_LINES = [
    '{"step": 1, "step": 2, "completion": "x"}',  # a key twice: two readers would disagree on its step
    '{"step": NaN}',
    '{"step": 1.0}',
    '\ufeff{"step": 1}',  # a byte-order mark starts no JSON text
    '{"step": 1, "completion": "a\\u0000b", "\\udc80": 1}',
    "\x00\x00\x00",
    '{"step": 1, "prompt": ' + "[" * 40 + "]" * 40 + "}",
]


def _run(tmp_path, logs: list[str], completions: list[str], args: dict | None = None):
    (tmp_path / "logging.jsonl").write_text("".join(line + "\n" for line in logs), encoding="utf-8")
    (tmp_path / "completions.jsonl").write_text("".join(line + "\r\n" for line in completions), encoding="utf-8")
    (tmp_path / "args.json").write_text(json.dumps(args if args is not None else {"model": "m"}))
    return tmp_path


def test_rows_only_a_lax_parser_takes_are_skipped_and_counted(tmp_path):
    run = _run(tmp_path, ['{"step": 1, "loss": NaN}', *LAX_LINES[:2]], [json.dumps(GOOD), *LAX_LINES])
    data = report_data(run)
    assert [r["step"] for r in data["logs"]] == [1] and data["logs"][0]["loss"] is None
    assert data["completions"] == {"1": [GOOD]}  # CRLF line ends read as lines
    assert data["skipped_rows"] == {"logging.jsonl": 2, "completions.jsonl": len(LAX_LINES)}
    assert write_report(run) == run / "report.html"
    assert sorted(p.name for p in run.iterdir()) == ["args.json", "completions.jsonl", "logging.jsonl", "report.html"]


def test_more_steps_than_a_page_chooses_from_and_a_longer_log_are_capped(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "MAX_STEPS", 50)
    monkeypatch.setattr(report, "MAX_LOG_ROWS", 30)
    logs = [json.dumps({"step": s, "loss": 1.0}) for s in range(100)]
    rows = [json.dumps({**GOOD, "step": s}) for s in range(200)]
    data = report_data(_run(tmp_path, logs, rows), max_completion_steps=5)
    assert [r["step"] for r in data["logs"]] == list(range(30))
    assert sorted(map(int, data["completions"])) == [0, 12, 24, 37, 49]  # chosen among the first 50 steps
    assert data["completion_steps"] == {"logged": 50, "shown": 5, "limit": 5}
    assert data["skipped_rows"] == {"logging.jsonl": 70, "completions.jsonl": 150}


@pytest.mark.parametrize("args", [[1, 2], "text", {"a": {"b": {"api_key": "sk-live-77aa99"}}}, {"path": "/root/x/y"}])
def test_args_of_any_shape_give_a_page_without_secrets_or_local_paths(tmp_path, args):
    data = report_data(_run(tmp_path, ['{"step": 1, "loss": 1.0}'], [], args))
    shown = json.dumps(data)
    assert "sk-live-77aa99" not in shown and "/root/x" not in shown


def _get(url: str, headers: dict | None = None, method: str = "GET", data: bytes | None = None):
    request = urllib.request.Request(url, headers=headers or {}, method=method, data=data)
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_serve_refuses_other_pages_and_odd_requests_with_one_error_shape(tmp_path):
    run = _run(tmp_path, ['{"step": 1, "loss": 1.0}'], [json.dumps(GOOD)])
    server = start(run, 0)
    base = server.url
    try:
        own = {"Origin": base, "Referer": base + "/"}
        assert _get(base + "/data.json", own)[0] == 200  # the page's own requests
        refused = {
            "Origin of another port": (_get(base + "/data.json", {"Origin": "http://127.0.0.1:1"}), 421),
            "Referer of another port": (_get(base + "/data.json", {"Referer": "http://localhost:1/a"}), 403),
            "Referer of another site": (_get(base + "/", {"Referer": "https://evil.example/"}), 403),
            "encoded dot segments": (_get(base + "/%2e%2e/%2e%2e/etc/passwd"), 404),
            "a query on data.json": (_get(base + "/data.json?x=" + "a" * 2000), 200),
            "a body on a GET": (_get(base + "/data.json", {"Content-Type": "application/json"}, "GET", b"{}"), 413),
            "DELETE": (_get(base + "/version", method="DELETE"), 405),
        }
        for name, ((code, body), want) in refused.items():
            assert code == want, (name, code, body[:200])
            if want != 200:
                assert isinstance(json.loads(body)["error"], str), name
    finally:
        server.close()
    assert sorted(p.name for p in run.iterdir()) == ["args.json", "completions.jsonl", "logging.jsonl"]


def test_a_new_version_is_built_once_however_many_ask(tmp_path, monkeypatch):
    asyncio.run(_built_once(tmp_path, monkeypatch))


async def _built_once(tmp_path, monkeypatch):
    run = _run(tmp_path, ['{"step": 1, "loss": 1.0}'], [json.dumps(GOOD)])
    site = ViewerSite(run)
    builds = []
    real = site.build
    monkeypatch.setattr(site, "build", lambda: builds.append(1) or real())
    first = await asyncio.gather(*(site.current() for _ in range(8)))
    with (run / "logging.jsonl").open("a") as f:
        f.write('{"step": 2, "loss": 0.5}\n')
    second = await asyncio.gather(*(site.current() for _ in range(8)))
    site.close()
    assert len(builds) == 2 and len({b.stamp for b in first}) == 1 and len({b.stamp for b in second}) == 1
