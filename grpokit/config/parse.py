"""argv / YAML → `TrainConfig`, resolved and validated before anything heavy loads.

Flags are parsed by `transformers.HfArgumentParser` into the dataclasses of `args.py`; `--config file.yaml`
supplies defaults that flags override, each value first turned into its field's type (``fields.coerce_yaml``).
`grpokit train` with neither `--model` nor `--dataset` runs the built-in demo (`demo.yaml`). Then every value is
checked against its field (``fields.check_fields``), the derived defaults are filled (``resolve.resolve``) and the
rules between options checked (``validate.validate``). The ``--external_plugins`` load in the pipeline, once;
with plugins given, the names they may register are checked there, right after (``validate.check_registry_names``).
"""

from __future__ import annotations

import copy
import difflib
import logging
import os
import re
import shutil
import sys
from pathlib import Path
from types import MappingProxyType

import yaml

from grpokit.config.args import ALL_GROUPS, TrainConfig
from grpokit.config.checked import checked_config
from grpokit.config.checks import provided
from grpokit.config.fields import OWN_KEYS, coerce_yaml, option_fields
from grpokit.config.help import HELP_FLAGS, did_you_mean, help_text
from grpokit.config.swift_options import REFUSED, WARNED
from grpokit.errors import ConfigError

logger = logging.getLogger(__name__)

DEMO_YAML = Path(__file__).with_name("demo.yaml")
NEGATIVE_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$|^-(inf|infinity|nan)$", re.IGNORECASE)


def _make_parser(prog: str):
    from transformers import HfArgumentParser

    class Parser(HfArgumentParser):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            # `--learning_rate -1e-5`, `--beta -inf`: a negative number is a value (argparse's own pattern knows
            # only -1 and -0.5, and reads -1e-5 as an unknown flag); the bounds then refuse what is out of range
            self._negative_number_matcher = NEGATIVE_NUMBER

        @staticmethod
        def _parse_dataclass_field(parser, field):
            if any(key in field.metadata for key in OWN_KEYS):  # bounds are ours (fields.py), not argparse's
                field = copy.copy(field)
                field.metadata = MappingProxyType({k: v for k, v in field.metadata.items() if k not in OWN_KEYS})
            HfArgumentParser._parse_dataclass_field(parser, field)

        def _get_formatter(self):
            # argparse builds a formatter, and asks the terminal its size, for each of the ~800 add_argument calls;
            # asked once, parsing takes half the time
            width = self.__dict__.get("_grpokit_width")
            if width is None:
                width = self.__dict__["_grpokit_width"] = shutil.get_terminal_size().columns - 2
            return self.formatter_class(prog=self.prog, width=width)

        def error(self, message: str):  # one line, no usage dump
            raise ConfigError(_argparse_line(message) or f"{self.prog}: {message} (see `{self.prog} --help`)")

    # no prefix abbreviations: `--learning_rat` is a typo to name, not `--learning_rate`; the help is help.py's
    parser = Parser(ALL_GROUPS, prog=prog, allow_abbrev=False, add_help=False)
    parser.add_argument("--config", type=str, default=None, help="YAML file of options; flags override it")
    _add_swift_options(parser)
    return parser


_ARGPARSE = re.compile(
    r"^argument (--\w+)(?:/[-\w]+)*: (invalid choice|invalid (\w+) value): '(.*)'(?: \(choose from "
    r"(.*)\))?$",
    re.DOTALL,
)
_TYPE_WORDS = {"int": "a whole number", "float": "a number", "string_to_bool": "true or false"}


def _argparse_line(message: str) -> str | None:
    """argparse's bad-value messages in grpokit's form: ``--option value: what it must be``."""
    m = _ARGPARSE.match(message)
    if m is None:
        return None
    option, kind, type_name, value, choices = m.groups()
    if kind == "invalid choice":
        return f"{option} {value}: unknown value; use one of {choices.replace(chr(39), '')}"
    return f"{option} {value}: expected {_TYPE_WORDS.get(type_name, type_name)}"


def _add_swift_options(parser) -> None:
    """ms-swift's names that grpokit warns about or refuses (config/swift_options.py): accepted with any words
    (a bare flag is true), hidden from --help (docs/porting.md lists them), absent from the result unless given."""
    import argparse

    for name in sorted(WARNED.keys() | REFUSED.keys()):
        parser.add_argument(f"--{name}", nargs="*", default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def _load_plugins_for_help(argv: list[str]) -> None:
    """`grpokit train --external_plugins p.py --help`: load the plugins first, so the help lists their names."""
    import argparse

    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--external_plugins", "--external-plugins", nargs="*", default=[])
    known, _ = pre.parse_known_args(argv)
    if known.external_plugins:
        provided("load_plugins")(known.external_plugins)  # grpokit/plugins/loader.py


def _known_flags(parser) -> list[str]:
    return [s for a in parser._actions for s in a.option_strings if s.startswith("--")]


def _check_unknown(parser, extra: list[str]) -> None:
    flags = [a for a in extra if a.startswith("--")]
    if not extra:
        return
    if not flags:
        raise ConfigError(f"unexpected value(s) {extra}: every value follows a --flag (see --help)")
    name = flags[0].split("=", 1)[0]
    hint = did_you_mean(name, _known_flags(parser)) or "; see `grpokit train --help`"
    raise ConfigError(f"unknown option {name}{hint}")


def _load_yaml(path: str, parser) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--config {path}: file not found")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"--config {path}: not valid YAML ({e.__class__.__name__}: {str(e).splitlines()[0]})")
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping of option: value")
    known = {f[2:] for f in _known_flags(parser)} - {"config"}
    for key in data:
        if not isinstance(key, str) or key not in known:
            if key == "config":
                raise ConfigError(f"--config {path}: a config file cannot name another (config: ...); merge them")
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise ConfigError(f"--config {path}: unknown option {key!r}{hint}")
    # `learning-rate:` is the flag's other spelling; argparse's defaults go by the underscore name
    data = {key.replace("-", "_"): value for key, value in data.items()}
    return coerce_yaml(data, option_fields(ALL_GROUPS), where=f"--config {path}: ")


def parse_train_args(
    argv: list[str] | None = None, prog: str = "grpokit train", supplied_rewards: int = 0, supplied_eval: bool = False
) -> TrainConfig:
    """``supplied_rewards``, ``supplied_eval``: reward callables and evaluation rows a Python caller gives besides
    the options (TRL's API)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in HELP_FLAGS for a in argv):
        _load_plugins_for_help(argv)  # the help lists the names the plugins register
        try:
            print(help_text(argv, prog), flush=True)
        except BrokenPipeError:  # `grpokit train --help | head`: the reader has what it wanted
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (no second error at exit)
        raise SystemExit(0)
    parser = _make_parser(prog)
    pre, _ = parser.parse_known_args(argv)
    defaults: dict = {}
    if pre.config:
        defaults.update(_load_yaml(pre.config, parser))
    user_keys = set(defaults) | {a[2:].split("=", 1)[0] for a in argv if a.startswith("--")}
    if any(a.split("=", 1)[0] == "--vllm_server_api_key" for a in argv):
        logger.warning(
            "--vllm_server_api_key on the command line is readable by every process on this host "
            "(/proc/PID/cmdline, ps); set GRPOKIT_API_KEY in the environment instead"
        )
    if "model" not in user_keys and "dataset" not in user_keys:
        demo = coerce_yaml(yaml.safe_load(DEMO_YAML.read_text()), option_fields(ALL_GROUPS), where="demo.yaml: ")
        defaults = {**demo, **defaults}
    if defaults:
        parser.set_defaults(**defaults)
    *groups, extra = parser.parse_args_into_dataclasses(args=argv, return_remaining_strings=True)
    _check_unknown(parser, extra)
    swift = {
        k: v for g in groups if type(g) not in ALL_GROUPS for k, v in vars(g).items() if k in WARNED or k in REFUSED
    }
    groups = [g for g in groups if type(g) in ALL_GROUPS]
    cfg = TrainConfig(*groups, swift_options=swift)
    return checked_config(cfg, supplied_rewards, supplied_eval)
