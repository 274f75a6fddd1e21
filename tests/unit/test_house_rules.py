"""The house rules that keep grpokit readable, checked on every run: imports point down the layers of
shared/DESIGN.md (import-linter, configured in pyproject.toml), a function-level grpokit import says why it is not
at the top, no module over 400 lines, no function over 60 lines unless a comment says why."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "grpokit"
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60
LAZY_REASON = "not at the top"  # the comment a function-level grpokit import must sit under
LONG_REASON = "long on purpose"  # the comment a function over MAX_FUNCTION_LINES must carry


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_imports_point_down_the_layers():
    lint = shutil.which("lint-imports") or str(Path(sys.executable).with_name("lint-imports"))
    if not Path(lint).exists():
        pytest.fail("lint-imports is missing: pip install -e '.[dev]' installs import-linter")
    proc = subprocess.run(
        [lint, "--config", str(ROOT / "pyproject.toml")], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def _lazy_imports(tree: ast.Module) -> list[tuple[ast.AST, ast.AST]]:
    """(function, import) pairs: grpokit imports inside a function body."""
    found = []
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("grpokit"):
                    found.append((fn, node))
                elif isinstance(node, ast.Import) and any(a.name.startswith("grpokit") for a in node.names):
                    found.append((fn, node))
    return found


def test_function_level_grpokit_imports_say_why():
    undocumented = []
    for path in _modules():
        lines = path.read_text().splitlines()
        for fn, node in _lazy_imports(ast.parse("\n".join(lines))):
            above = lines[fn.lineno - 1 : node.lineno - 1]
            if not any(LAZY_REASON in line for line in above if line.strip().startswith("#")):
                undocumented.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not undocumented, (
        f"grpokit imports inside functions without a comment saying why they are {LAZY_REASON} "
        f"(move them to the top, or explain: an optional or heavy package): {undocumented}"
    )


def test_modules_stay_short():
    long = [
        f"{p.relative_to(ROOT)} ({n} lines)"
        for p in _modules()
        if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES
    ]
    assert not long, f"modules over {MAX_FILE_LINES} lines usually hold more than one job: {long}"


def test_functions_stay_short_unless_a_comment_says_why():
    long = []
    for path in _modules():
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                body = lines[node.lineno - 1 : node.end_lineno]
                if len(body) > MAX_FUNCTION_LINES and not any(LONG_REASON in line for line in body):
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({len(body)} lines)")
    assert not long, (
        f"functions over {MAX_FUNCTION_LINES} lines: split them, or say why in a comment containing "
        f"'{LONG_REASON}': {long}"
    )


MAX_LAZY_IMPORTS = 10  # function-level grpokit imports in the whole package: each one an optional or heavy package


def test_function_level_grpokit_imports_stay_rare():
    lazy = sorted(
        {
            f"{path.relative_to(ROOT)}:{node.lineno}"
            for path in _modules()
            for _, node in _lazy_imports(ast.parse(path.read_text()))
        }
    )
    assert len(lazy) <= MAX_LAZY_IMPORTS, (
        f"{len(lazy)} function-level grpokit imports (at most {MAX_LAZY_IMPORTS}): move the ones that load no optional "
        f"or heavy package to the top, fixing a cycle by putting the code in the right layer: {lazy}"
    )
