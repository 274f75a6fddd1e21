"""Property: any value for any option either passes the whole set-up validation or stops it with one line.

Hypothesis drives ``grpokit train``'s parser and checks with random values for every option (grpokit's fields and
ms-swift's names alike), as flags and as ``--config`` YAML: each run either passes everything that happens before a
model loads (parsing, the per-field checks, ``resolve``, ``validate``, the pipeline's plugin load and registry-name
checks, the batch plan) or raises a ``GrpokitError`` whose message is one non-empty line. Any other exception is a
traceback a user would see, and fails the test. A configuration that passes is also checked to be a fixed point of
``resolve`` and to be left unchanged by ``validate``. The example counts are bounded so the file runs in well under
a minute."""

from __future__ import annotations

import copy
import string

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from grpokit.config.args import ALL_GROUPS
from grpokit.config.fields import option_fields
from grpokit.config.swift_options import REFUSED, WARNED
from grpokit.errors import GrpokitError

FIELDS = option_fields(ALL_GROUPS)
SWIFT = sorted(WARNED.keys() | REFUSED.keys())
# options whose value names a file to import or a folder to write: random text there stays inside the test's folder
PATH_OPTIONS = {"external_plugins", "output_dir"}
WORDS = st.text(alphabet=string.ascii_letters + string.digits + "_-./:#{}[]\"', =", min_size=0, max_size=12)
EDGE_INTS = [-(2**63), -(2**31) - 1, -2, -1, 0, 1, 2, 3, 7, 8, 2**31 - 1, 2**31, 2**32, 2**63]
EDGE_FLOATS = ["nan", "-nan", "inf", "-inf", "1e-5", "-1e-5", "1e308", "1e-320", "0", "-0.0", "0.5", "1", "1.5"]


def _int_text():
    return st.one_of(st.integers(-(2**40), 2**40), st.sampled_from(EDGE_INTS)).map(str)


def _float_text():
    finite = st.floats(allow_nan=False, allow_infinity=False, width=64).map(repr)
    return st.one_of(finite, st.sampled_from(EDGE_FLOATS), st.integers(-1000, 1000).map(str))


def _flag_words(name: str) -> st.SearchStrategy[list[str]]:
    """The words after ``--name`` on a command line: typed values, choices, garbage, or none."""
    if name not in FIELDS:  # ms-swift's names: any words, or a bare flag
        return st.lists(st.one_of(WORDS, st.sampled_from(["true", "false", "None", "0", "1"])), max_size=2)
    field, kind = FIELDS[name]
    typed = {
        bool: st.sampled_from(["true", "false", "yes", "no", "1", "0"]),
        int: _int_text(),
        float: _float_text(),
        str: WORDS,
    }[kind.base]
    choices = kind.literal or field.metadata.get("choices")
    if choices:
        typed = st.one_of(st.sampled_from([str(c) for c in choices]), typed)
    one = st.one_of(typed, typed, WORDS)  # mostly well-typed, sometimes garbage
    if kind.is_list:
        return st.lists(one, min_size=0, max_size=3)
    return st.one_of(one.map(lambda w: [w]), st.just([]))  # no value at all: argparse's own error


def _yaml_value(name: str):
    """A YAML value for ``name``: of the field's type, of another type, a list where a scalar is due, or null."""
    any_scalar = st.one_of(
        st.none(), st.booleans(), st.integers(-(2**40), 2**40), st.floats(allow_nan=True, allow_infinity=True), WORDS
    )
    if name not in FIELDS:
        return st.one_of(any_scalar, st.lists(WORDS, max_size=2))
    field, kind = FIELDS[name]
    typed = {
        bool: st.booleans(),
        int: st.integers(-(2**40), 2**40),
        float: st.floats(allow_nan=True, allow_infinity=True),
        str: WORDS,
    }[kind.base]
    choices = kind.literal or field.metadata.get("choices")
    if choices:
        typed = st.one_of(st.sampled_from(list(choices)), typed)
    return st.one_of(typed, typed, any_scalar, st.lists(typed, max_size=3), st.dictionaries(WORDS, WORDS, max_size=2))


def _set_up(argv: list[str]):
    """Everything `grpokit train` runs before a model loads (grpokit/pipeline/train.py run_train's first lines)."""
    from grpokit.config.parse import parse_train_args
    from grpokit.config.plan import batch_plan
    from grpokit.config.resolve import resolve
    from grpokit.config.validate import check_registry_names, validate
    from grpokit.pipeline.train import check_names
    from grpokit.plugins.loader import load_plugins_once

    cfg = parse_train_args(argv)
    before = copy.deepcopy(cfg)
    validate(cfg)
    assert cfg == before, "validate changed the configuration"
    assert resolve(cfg) == cfg, "a parsed configuration is not a fixed point of resolve"
    load_plugins_once(cfg.reward.external_plugins)
    check_registry_names(cfg)
    check_names(cfg)
    batch_plan(cfg)
    return cfg


def _judge(argv: list[str]) -> None:
    try:
        _set_up(argv)
    except GrpokitError as e:
        message = str(e)
        assert message.strip() and "\n" not in message, f"not one line: {message!r} for {argv}"
    # anything else propagates: a traceback for the user, and a failure here


def _pairs(draw, tmp) -> list[tuple[str, object]]:
    names = draw(st.lists(st.sampled_from(sorted(FIELDS) + SWIFT), min_size=1, max_size=3, unique=True))
    return [(name, tmp) if name in PATH_OPTIONS else (name, None) for name in names]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("property")


@settings(
    max_examples=250,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_any_flag_values_pass_setup_or_stop_in_one_line(data, workdir):
    argv = ["--dataset", "builtin:arithmetic"]
    for name, path in _pairs(data.draw, workdir):
        if path is not None:
            words = [str(path / data.draw(st.text(alphabet=string.ascii_lowercase, min_size=1, max_size=6)))]
            if name == "external_plugins":
                words = [w + ".py" for w in words]  # never an existing file: a one-line "file not found"
        else:
            words = data.draw(_flag_words(name), label=name)
        argv += [f"--{name}", *words]
    if "--output_dir" not in argv:
        argv += ["--output_dir", str(workdir / "out")]
    _judge(argv)


@settings(
    max_examples=120,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_any_yaml_values_pass_setup_or_stop_in_one_line(data, workdir):
    options = {"dataset": ["builtin:arithmetic"], "output_dir": str(workdir / "yaml-out")}
    for name, path in _pairs(data.draw, workdir):
        if path is None:
            options[name] = data.draw(_yaml_value(name), label=name)
    path = workdir / "run.yaml"
    path.write_text(yaml.safe_dump(options))
    _judge(["--config", str(path)])


def test_every_option_has_value_strategies():
    """The strategies above know every option's type: a new field of a type they lack fails here, by name."""
    for name in sorted(FIELDS) + SWIFT:
        assert isinstance(_flag_words(name), st.SearchStrategy), name
        assert isinstance(_yaml_value(name), st.SearchStrategy), name
