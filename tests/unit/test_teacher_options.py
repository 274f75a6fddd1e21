"""The teacher options (config/teacher_args.py): what each form means, and one line for each bad combination;
the routing of rows to teachers by --teacher_tag_key (trainers/teachers.py)."""

from __future__ import annotations

import json

import pytest

from grpokit.config.parse import parse_train_args
from grpokit.config.teacher_args import TeacherArguments, TeacherSpec, teacher_specs
from grpokit.errors import ConfigError, DataError
from grpokit.trainers.teachers import Teacher, Teachers


@pytest.fixture
def folders(tmp_path):
    out = []
    for name in ("student", "teacher"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
        out.append(str(tmp_path / name))
    return out


def _parse(student, *extra):
    return parse_train_args(["--model", student, "--dataset", "d.jsonl", *extra])


def test_forms_of_the_options(folders):
    student, teacher = folders
    assert teacher_specs(TeacherArguments(), student, lora=False) == []
    assert teacher_specs(TeacherArguments(teacher_model=teacher), student, False) == [TeacherSpec("model", teacher)]
    # the student's own folder: under LoRA the base through disabled adapters, else a frozen copy
    assert teacher_specs(TeacherArguments(teacher_model=student), student, True) == [TeacherSpec("base", student)]
    assert teacher_specs(TeacherArguments(teacher_model=student), student, False) == [TeacherSpec("model", student)]
    many = json.dumps([{"url": "http://a:1", "tags": ["math"]}, {"url": "http://b:2", "tags": ["code", 7]}])
    got = teacher_specs(TeacherArguments(teacher_model_server=many), student, False)
    assert got == [TeacherSpec("server", "http://a:1", ("math",)), TeacherSpec("server", "http://b:2", ("code", "7"))]
    assert got[1].name == "code"


@pytest.mark.parametrize(
    "extra, says",
    [
        (["--teacher_model", "T", "--teacher_model_server", "http://x"], "both set"),
        (["--teacher_model_server", "[{'url': 1}]"], "not valid JSON"),
        (["--teacher_model_server", "[]"], "one or more"),
        (["--teacher_model_server", '[{"url": "http://a"}, {"url": "http://b", "tags": ["x"]}]'], "has no tags"),
        (
            ["--teacher_model_server", '[{"url": "http://a", "tags": ["x"]}, {"url": "http://b", "tags": ["x"]}]'],
            "belongs to teacher 0 and 1",
        ),
        (["--teacher_model_server", '[{"url": "http://a", "weight": 2}]'], "unknown key"),
        (["--teacher_model_server", "localhost:8000"], "not an http"),
        (["--teacher_model", "/no/such/teacher"], "no such folder"),
        (["--teacher_model", "TEACHER", "--loss_type", "real"], "one advantage per sequence"),
        (["--teacher_model", "TEACHER", "--dynamic_sample", "true"], "pure distillation"),
        (["--teacher_kl_coef", "-1"], "teacher_kl_coef"),
    ],
)
def test_bad_combinations_are_one_line(folders, extra, says):
    student, teacher = folders
    with pytest.raises(ConfigError, match=says) as e:
        _parse(student, *[teacher if x == "TEACHER" else x for x in extra])
    assert "\n" not in str(e.value)


def test_rewards_with_a_teacher_keep_dynamic_sampling(folders):
    student, teacher = folders
    cfg = _parse(student, "--teacher_model", teacher, "--reward_funcs", "accuracy", "--dynamic_sample", "true")
    assert cfg.teacher.teacher_model == teacher and cfg.flat()["teacher_kl_coef"] == 1.0


def _teachers(tags: list[tuple[str, ...]]) -> Teachers:
    return Teachers(
        [Teacher(TeacherSpec("server", f"http://t{i}", t)) for i, t in enumerate(tags)],
        1.0,
        "dataset",
        None,
        1.0,
        None,
        None,
        None,
    )


def test_rows_route_by_their_tag_column():
    assert _teachers([()]).route([{"dataset": "anything"}, {}]).tolist() == [0, 0]  # one teacher takes every row
    two = _teachers([("math",), ("code", "7")])
    assert two.route([{"dataset": "code"}, {"dataset": "math"}, {"dataset": 7}]).tolist() == [1, 0, 1]
    with pytest.raises(DataError, match=r"'poetry' is no teacher's tag; the tags are \['7', 'code', 'math'\]"):
        two.route([{"dataset": "poetry"}])
    with pytest.raises(DataError, match="None is no teacher's tag"):
        two.route([{}])
