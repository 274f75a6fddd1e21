"""Third-party source files that the porting tests run unmodified: ms-swift's GRPO plugin example and the reward
functions of TRL's GRPO documentation.

They are not stored in this repository: each test reads them at test time, at a pinned commit, from a local git
mirror of the project (``$GRPOKIT_MIRRORS/<owner>+<name>/repo``, default ``/work/.mirror``, a bare clone made by
``git clone --mirror``), and skips with the reason when the mirror is absent. The only edits are the ones a user
makes when porting: ms-swift's imports renamed (``swift.`` → ``grpokit.swift.``), and for TRL's examples the
lines that register each function in ``orms`` (TRL passes functions to its trainer; grpokit looks them up by name),
``trl_convention(f)`` where the signature alone reads as ms-swift's (``TRL_MARKED``). ``trl_reward_modules``
writes each example as a module of its own with no edit at all, for ``--reward_funcs module.function`` (TRL's CLI).
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
from pathlib import Path

import pytest

SWIFT = ("modelscope+ms-swift", "3602360a562313afbf2ef6065fdf61f271a2c5b9")
TRL = ("huggingface+trl", "f2cd57710ae345ea6428ae95363267fcf38a3dc8")

# TRL's documentation examples ("Using a custom reward function"): heading → {function: registered name}
TRL_EXAMPLES = {
    "Example 1:": {"reward_func": "trl_ex1_token_length"},
    "Example 1.1:": {"reward_func": "trl_ex1_1_char_length"},
    "Example 2:": {"format_reward_func": "trl_ex2_format"},
    "Example 3:": {"reward_func": "trl_ex3_reference"},
    "Example 4:": {"math_reward_func": "trl_ex4_math", "coding_reward_func": "trl_ex4_coding"},
    "Example 5:": {"async_reward_func": "trl_ex5_async"},
    "Example 6:": {"reward_func": "trl_ex6_logging"},
}
# Registered with trl_convention(f): Example 2's signature, format_reward_func(completions, **kwargs), is also
# ms-swift's, which grpokit calls with completion texts; the mark says "TRL's way". The format (strings or message
# lists) still comes from each dataset row, as in TRL. Every other example is registered plainly.
TRL_MARKED = {"trl_ex2_format"}
# Example 4 calls two helpers that the documentation leaves to the reader
_EXAMPLE_4_HELPERS = '''
def check_math_solution(prompt, completion):
    return any(ch.isdigit() for ch in completion)


def test_code_solution(prompt, completion):
    return "def " in completion
'''


def read_source(project: tuple[str, str], path: str) -> str:
    """``path`` at the pinned commit of ``project``'s local mirror; skips the test when it is not there."""
    name, commit = project
    git_dir = Path(os.environ.get("GRPOKIT_MIRRORS", "/work/.mirror")) / name / "repo"
    if not git_dir.is_dir():
        pytest.skip(f"needs a git mirror of {name} at {git_dir} (set GRPOKIT_MIRRORS) to read {path}")
    out = subprocess.run(["git", "--git-dir", str(git_dir), "show", f"{commit}:{path}"], capture_output=True,
                         text=True, check=False)
    if out.returncode != 0:
        pytest.skip(f"{name} mirror at {git_dir} lacks {commit[:10]}:{path}: {out.stderr.strip()[:200]}")
    return out.stdout


def swift_plugin(dest: Path) -> Path:
    """ms-swift's examples/train/grpo/plugin/plugin.py with its imports renamed, written to ``dest``."""
    text = read_source(SWIFT, "examples/train/grpo/plugin/plugin.py")
    dest.write_text(re.sub(r"\bfrom swift\.", "from grpokit.swift.", text))
    return dest


def trl_reward_examples(dest: Path) -> Path:
    """A plugin file: each TRL documentation example's imports and functions, as written there, each followed
    by the lines that register its functions (``TRL_EXAMPLES``)."""
    parts = ["from grpokit.rewards import orms, trl_convention\n", _EXAMPLE_4_HELPERS]
    for heading, names in TRL_EXAMPLES.items():
        parts.append(f"# --- {heading} ---")
        parts += _example_code(heading, names)
        for func, name in names.items():
            parts.append(f"orms[{name!r}] = trl_convention({func})" if name in TRL_MARKED
                         else f"orms[{name!r}] = {func}")
    dest.write_text("\n\n".join(parts) + "\n")
    return dest


def trl_reward_modules(folder: Path) -> dict[str, str]:
    """Each TRL documentation example as a module of its own in ``folder`` (its imports and functions as written,
    nothing added but Example 4's helpers); {registered name in TRL_EXAMPLES: "module.function"}."""
    paths = {}
    for heading, names in TRL_EXAMPLES.items():
        module = "trl_doc_" + re.sub(r"\W", "_", heading.rstrip(":").lower().replace("example ", "ex"))
        helpers = [_EXAMPLE_4_HELPERS] if heading == "Example 4:" else []
        (folder / f"{module}.py").write_text("\n\n".join(helpers + _example_code(heading, names)) + "\n")
        paths.update({name: f"{module}.{func}" for func, name in names.items()})
    return paths


def _example_code(heading: str, names: dict[str, str]) -> list[str]:
    """The imports and function definitions of TRL's example ``heading``, as written in its documentation."""
    code = _first_definition_block(read_source(TRL, "docs/source/grpo_trainer.md"), heading)
    tree = ast.parse(code)
    kept = [node for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            or (isinstance(node, (ast.Import, ast.ImportFrom)) and not _imports_a_trainer(node))]
    defined = {node.name for node in kept if not isinstance(node, (ast.Import, ast.ImportFrom))}
    assert set(names) <= defined, f"TRL's {heading} no longer defines {set(names) - defined}"
    return [ast.get_source_segment(code, node) for node in kept]


def _first_definition_block(doc: str, heading: str) -> str:
    """The first ```python block after the ``#### {heading}`` line that is not a doctest session."""
    start = doc.index(f"#### {heading}")
    for block in re.finditer(r"```python\n(.*?)```", doc[start:], flags=re.S):
        if not block.group(1).lstrip().startswith(">>>"):
            return block.group(1)
    raise AssertionError(f"no code block after {heading!r} in TRL's grpo_trainer.md")


def _imports_a_trainer(node: ast.Import | ast.ImportFrom) -> bool:
    """Example 4's block also builds a dataset and a TRL trainer; a plugin keeps only the functions."""
    modules = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
    return any(m.split(".")[0] in {"trl", "datasets"} for m in modules)
