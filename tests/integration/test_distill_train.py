"""On-policy distillation trains on a tiny model, two steps per case: a teacher in this process, a teacher on a
`grpokit rollout` server, two teachers routed by a tag column, a ``teacher_prompt`` column, LoRA with the base
model as teacher, and pure distillation without reward functions. Every case logs a finite ``teacher_kl``; where
the teacher is the student as it starts (the LoRA base; the second tagged teacher) the first window's is 0."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from support import flags, write_jsonl
from tiny_runs import tiny_run

from grpokit.modeling import load_causal_lm
from grpokit.testing import serve_in_thread

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def teacher_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny student with every weight nudged (same tokenizer): a teacher that differs from it."""
    out = tmp_path_factory.mktemp("teacher") / "teacher"
    shutil.copytree(tiny_model_dir, out)
    model = load_causal_lm(str(tiny_model_dir), torch.float32)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def teacher_url(teacher_dir):
    from grpokit.server.app import create_app
    from grpokit.server.state import ServerOptions, build_state

    state = build_state(ServerOptions(model=str(teacher_dir), torch_dtype="float32"))
    with serve_in_thread(create_app(state)) as (url, _port):
        yield url


@pytest.fixture(scope="module")
def rows_jsonl(tmp_path_factory) -> Path:
    rows = [
        {
            "query": f"What is {a} + {b}?",
            "solution": str(a + b),
            "dataset": "a" if (a + b) % 2 else "b",
            "teacher_prompt": f"What is {a} + {b}? The answer is {a + b}.",
        }
        for a in range(1, 5)
        for b in range(1, 5)
    ]
    path = write_jsonl(tmp_path_factory.mktemp("rows") / "rows.jsonl", rows)
    return path


def _metric(rows: list[dict], key: str) -> list[float]:
    return [r[k] for r in rows for k in (key, f"train/{key}") if k in r]


CASES = {
    "in_process": lambda t, s, url: ["--teacher_model", str(t), "--reward_funcs", "accuracy"],
    "server": lambda t, s, url: ["--teacher_model_server", url, "--reward_funcs", "accuracy"],
    "two_teachers_by_tag": lambda t, s, url: flags(
        {"--teacher_model": json.dumps([{"model": str(t), "tags": ["a"]}, {"model": str(s), "tags": ["b"]}])},
        "--reward_funcs accuracy --per_device_train_batch_size 8 --dataset_shuffle false",
    ),
    "teacher_prompt": lambda t, s, url: ["--teacher_model", str(t), "--reward_funcs", "accuracy"],
    "lora_base_as_teacher": lambda t, s, url: [
        "--tuner_type",
        "lora",
        "--teacher_model",
        str(s),
        "--reward_funcs",
        "accuracy",
    ],
    "pure_distillation": lambda t, s, url: ["--teacher_model", str(t)],
}


@pytest.mark.parametrize("case", list(CASES))
def test_distillation_runs_log_teacher_kl(case, teacher_dir, teacher_url, tiny_model_dir, rows_jsonl, tmp_path):
    data = rows_jsonl
    if case != "teacher_prompt":  # the same rows without the column: the teacher sees the student's prompt
        data = tmp_path / "rows.jsonl"
        rows = [json.loads(x) for x in rows_jsonl.read_text().splitlines()]
        data.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "teacher_prompt"}) + "\n" for r in rows))
    _, logged = tiny_run(tiny_model_dir, data, tmp_path / "out", *CASES[case](teacher_dir, tiny_model_dir, teacher_url))
    kl = _metric(logged, "teacher_kl")
    assert len(kl) == 2 and all(math.isfinite(x) and x >= 0 for x in kl), logged
    if case == "lora_base_as_teacher":  # LoRA's B starts at 0: the base is the student at the first rollout
        assert kl[0] == pytest.approx(0.0, abs=1e-6)
    elif case == "two_teachers_by_tag":
        # unshuffled, the first window holds a "b" row (1 + 1) and an "a" row (1 + 2)
        assert _metric(logged, "teacher/b/kl")[0] == pytest.approx(0.0, abs=1e-6)  # b: the starting student
        assert _metric(logged, "teacher/a/kl")[0] > 1e-4  # a: the nudged teacher
    else:
        assert kl[0] > 1e-4
    if case == "pure_distillation":  # no default accuracy reward
        assert not any(k.startswith(("rewards/", "train/rewards/")) for r in logged for k in r)
