"""`grpokit train --help` by topic, one screen each; every option reachable; the defaults it prints are the real
ones; a mistyped option (no prefix abbreviations) is one line naming the closest option, once."""

from __future__ import annotations

import dataclasses
import os
import re

import pytest

from grpokit.cli.main import main
from grpokit.config.args import ALL_GROUPS
from grpokit.config.help import help_text, overview_text, shown_value, topic_options, topic_text
from grpokit.config.parse import parse_train_args
from grpokit.errors import ConfigError

SCREEN_LINES = 50  # what one terminal screen shows
WIDTH = 80  # the narrowest usual terminal


def test_the_overview_and_each_topic_fit_one_screen():
    overview = overview_text("grpokit train", WIDTH).splitlines()
    assert len(overview) <= SCREEN_LINES and max(map(len, overview)) <= WIDTH
    for topic in topic_options():
        lines = topic_text(topic, WIDTH).splitlines()
        assert len(lines) <= SCREEN_LINES, f"{topic}: {len(lines)} lines; split it in help.TOPICS"
        assert max(map(len, lines)) <= WIDTH, topic


def test_every_option_is_in_exactly_one_topic_and_in_help_all():
    names = [f.name for g in ALL_GROUPS for f in dataclasses.fields(g)]
    listed = [n for options in topic_options().values() for n in options]
    assert sorted(listed) == sorted(names)
    text = help_text(["--help-all"], "grpokit train")
    shown = set(re.findall(r"^  (--\w+)", text, re.MULTILINE))
    assert {f"--{n}" for n in names} | {"--config"} <= shown


def _printed_defaults(text: str) -> dict[str, str]:
    """option -> the X of its '(default: X)', from the help text (an option's help wraps over lines)."""
    out = {}
    for block in re.split(r"\n(?=  --)", text):
        m = re.match(r"  --(\w+)", block)
        d = re.search(r"\(default: (.*?)\)$", " ".join(block.split()))
        if m and d:
            out[m.group(1)] = d.group(1)
    return out


def test_defaults_are_printed_once_and_are_what_a_run_gets():
    text = help_text(["--help-all"], "grpokit train")
    printed = _printed_defaults(text)
    assert len(printed) > 100
    cfg = parse_train_args(["--dataset", "builtin:arithmetic"]).flat()  # not the demo: the plain defaults
    helps = {f.name: f.metadata["help"] for g in ALL_GROUPS for f in dataclasses.fields(g)}
    for name, value in printed.items():
        if "default" not in helps[name].lower():  # (a help that words its own default is prose, not a value)
            got = shown_value(cfg[name])
            if os.path.isabs(got) and not os.path.isabs(value):  # a relative path is the working directory's
                value = os.path.abspath(value)
            assert got == value, name
    for block in re.split(r"\n(?=  --)", text):  # "(default" at most once per option
        assert " ".join(block.split()).lower().count("(default:") <= 1, block[:60]


def test_a_topic_by_name_and_an_unknown_topic(capsys):
    with pytest.raises(SystemExit) as e:
        main(["options", "lora"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("lora:") and "--lora_rank INT" in out and "--model " not in out
    with pytest.raises(ConfigError, match="--help nope: no such topic; use one of model, lora"):
        parse_train_args(["--help", "nope"])


@pytest.mark.parametrize(
    "argv, line",
    [
        (["train", "--learning_rat", "1e-5"], "unknown option --learning_rat; did you mean --learning_rate?"),
        (["train", "--learning-rat", "1e-5"], "unknown option --learning-rat; did you mean --learning_rate?"),
        (["train", "--num_gen", "4"], "unknown option --num_gen; did you mean --num_generations?"),
        (["eval", "--limt", "3"], "unknown option --limt; did you mean --limit?"),
        (["infer", "--max_new", "3"], "unknown option --max_new; did you mean --max_new_tokens?"),
        (["view", "out", "--serv"], "unknown option --serv; did you mean --serve?"),
    ],
)
def test_no_prefix_abbreviations_one_line_with_one_spelling(argv, line, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert capsys.readouterr().err == f"grpokit: error: {line}\n"


def test_rollout_takes_no_abbreviation_either():
    from grpokit.server.cli import rollout_parser

    with pytest.raises(ConfigError, match=r"^unknown option --por; did you mean --port\?$"):
        rollout_parser().parse_args(["--model", "m", "--por", "8001"])
