"""config is a leaf: it imports no runtime package, and the rules that need a component are registered by it.

lint-imports checks the static imports (tests/unit/test_house_rules.py); these tests check what happens at run time:
importing every config module loads nothing of grpokit outside config and the leaves below it, nor torch, and
``COMPONENTS`` (config/checks.py) names every module that registers a rule, so none is skipped.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from grpokit.config import checks

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "grpokit" / "config"
LEAVES = ("grpokit.config", "grpokit.errors", "grpokit.protocol", "grpokit.wire", "grpokit.registry")
REGISTERS = re.compile(r"^@option_check\(|^provide\(|^LIVE\.update\(", re.MULTILINE)


def _in_fresh_python(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_importing_config_loads_no_runtime_package():
    names = sorted(f"grpokit.config.{p.stem}" for p in CONFIG.glob("*.py") if p.stem != "__init__")
    out = _in_fresh_python(
        "import importlib, sys\n"
        f"for name in {names!r}: importlib.import_module(name)\n"
        "print(' '.join(m for m in sys.modules if m.startswith(('grpokit', 'torch', 'transformers', 'datasets'))))"
    )
    loaded = out.split()
    assert "torch" not in loaded and "datasets" not in loaded
    outside = [m for m in loaded if m.startswith("grpokit.") and not m.startswith(LEAVES)]
    assert not outside, f"importing grpokit.config loads runtime modules: {outside}"


def _source(module: str) -> str:
    path = ROOT.joinpath(*module.split("."))
    return (path / "__init__.py" if path.is_dir() else path.with_suffix(".py")).read_text()


def test_every_registering_module_is_loaded_by_the_gate():
    """Each module that registers a rule is in COMPONENTS, or a COMPONENTS module imports it at its top."""
    registering = sorted(
        ".".join(p.relative_to(ROOT).with_suffix("").parts)
        for p in (ROOT / "grpokit").rglob("*.py")
        if p.parent != CONFIG and REGISTERS.search(p.read_text())
    )
    assert registering, "no module registers an option rule: the pattern above no longer matches them"
    sources = {name: _source(name) for name in checks.COMPONENTS}
    missed = [
        m
        for m in registering
        if m not in sources and not any(re.search(rf"^from {re.escape(m)} import", s, re.M) for s in sources.values())
    ]
    assert not missed, f"modules that register option rules but that config.checks.COMPONENTS never imports: {missed}"


def test_a_rule_in_an_unknown_slot_is_refused():
    with pytest.raises(ValueError, match="slot 'model': unknown; use one of data, sampling, names"):
        checks.option_check("model")
