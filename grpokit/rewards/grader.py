"""Assert-mode grading in the parent: the sandbox only evaluates what depends on the program, the parent compares.

``plan_asserts(tests)`` parses the test statements with ``ast`` and walks each ``assert`` twice. The first walk
(collect) finds the *leaves*: the smallest sub-expressions that need the program (calls of its functions, its
names, and anything this module cannot evaluate itself). Each leaf, with loop variables and test constants filled
in, becomes an ``eval`` step for the sandbox; other test statements become ``exec`` steps (set-up). The rest of
the expression (the comparison, the expected values, builtin arithmetic, ``sorted``/``len``/``math.isclose`` …,
comprehensions over constant ranges) never enters the sandbox.

``passed_asserts(plan, reports)`` walks each assert again with the leaves' values: tagged JSON decoded into exact
builtin types (a value the parent cannot decode fails the assert), so comparisons run on plain ``int``/``str``/
``list``… objects that the program cannot have touched. Whatever the program does to its interpreter, it controls
only the values of its own leaves, and the expected values are never shown to it.

Simple test-level assignments (``expected = [1, 2]``) are evaluated here too and never sent. HumanEval's
``def check(candidate): …`` + ``check(f)`` is inlined, and ``for x, y in [...]: assert …`` over constants is
unrolled, so that their asserts count one by one. Tests with no assert at all pass when every set-up step runs;
that verdict comes from inside the sandbox and is only as strong as it.
"""

from __future__ import annotations

import ast
import itertools
from dataclasses import dataclass, field
from typing import Any

from grpokit.rewards._grader_eval import Evaluator, _bind, _bound_inside, _Fail, _literal, decode  # noqa: F401

MAX_UNROLL = 1000  # items of a test-level ``for`` loop over constants that are unrolled into asserts


@dataclass
class Check:
    test: ast.expr
    env: dict[str, Any]
    leaves: dict[str, int] = field(default_factory=dict)  # leaf source -> step index
    broken: bool = False  # a leaf could not be formed: the assert fails


@dataclass
class Plan:
    steps: list[list[str]] = field(default_factory=list)  # [kind, source], kind "exec" or "eval"
    checks: list[Check] = field(default_factory=list)


def _inline_check(stmts: list[ast.stmt]) -> list[ast.stmt]:
    """``def check(candidate): <body>`` + ``check(f)`` -> <body> with ``candidate`` replaced by ``f``."""
    defs = {s.name: s for s in stmts if isinstance(s, ast.FunctionDef) and len(s.args.args) == 1}
    out: list[ast.stmt] = []
    for s in stmts:
        call = s.value if isinstance(s, ast.Expr) and isinstance(s.value, ast.Call) else None
        fn = defs.get(call.func.id) if call and isinstance(call.func, ast.Name) else None
        if fn is None or len(call.args) != 1 or call.keywords or not isinstance(call.args[0], ast.Name):
            out.append(s)
            continue
        param, target = fn.args.args[0].arg, call.args[0].id
        for inner in fn.body:
            renamed = ast.parse(ast.unparse(inner)).body[0]
            for n in ast.walk(renamed):
                if isinstance(n, ast.Name) and n.id == param:
                    n.id = target
            out.append(renamed)
    return out


def _bound_names(stmt: ast.stmt) -> set[str]:
    names = _bound_inside(stmt)
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        names.add(stmt.name)
    elif isinstance(stmt, (ast.Import, ast.ImportFrom)):
        names |= {(a.asname or a.name).split(".")[0] for a in stmt.names}
    return names


def _env_assignment(stmt: ast.stmt, env: dict[str, Any]) -> bool:
    """Evaluate ``name = <expression the parent can compute>`` into ``env``; False when it is not one."""
    if not (isinstance(stmt, ast.Assign) and all(isinstance(t, ast.Name) for t in stmt.targets)):
        return False
    ev = Evaluator(env, None)
    if not ev.parent_only(stmt.value, {}):
        return False
    try:
        value = ev.ev(stmt.value, {})
    except Exception:  # noqa: BLE001 - any failure: leave it to the sandbox
        return False
    for t in stmt.targets:
        env[t.id] = value
    return True


def _exec_step(stmt: ast.stmt, env: dict[str, Any]) -> str:
    """The statement's source, preceded by the test constants it reads (which the sandbox otherwise lacks)."""
    used = {n.id for n in ast.walk(stmt) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    prelude = []
    for name in sorted(used & set(env)):
        try:
            prelude.append(f"{name} = {ast.unparse(_literal(env[name]))}")
        except _Fail:
            pass
    return "\n".join([*prelude, ast.unparse(stmt)])


def _unrolled(stmt: ast.stmt, env: dict[str, Any]) -> list[tuple[ast.expr, dict]] | None:
    """``for v in <iterable the parent computes>: assert …`` -> (test, loop bindings) per item and assert."""
    if not (isinstance(stmt, ast.For) and not stmt.orelse and all(isinstance(b, ast.Assert) for b in stmt.body)):
        return None
    ev = Evaluator(env, None)
    if not ev.parent_only(stmt.iter, {}):
        return None
    try:
        items = list(itertools.islice(ev.ev(stmt.iter, {}), MAX_UNROLL + 1))
        out = []
        for item in items:
            local: dict[str, Any] = {}
            _bind(stmt.target, item, local)
            out += [(a.test, local) for a in stmt.body]
    except Exception:  # noqa: BLE001 - not unrollable: the loop runs in the sandbox as set-up
        return None
    return out if len(items) <= MAX_UNROLL else None


def _add_check(plan: Plan, test: ast.expr, env: dict[str, Any]) -> None:
    check = Check(test, env)
    try:
        Evaluator(check.env, None, plan, check).ev(test, {})
    except Exception:  # noqa: BLE001 - _Fail, or an error in the tests themselves: this assert fails, not the run
        check.broken = True
    plan.checks.append(check)


def plan_asserts(tests: str) -> Plan:
    plan, env = Plan(), {}
    for stmt in _inline_check(ast.parse(tests).body):
        unrolled = _unrolled(stmt, env)
        if isinstance(stmt, ast.Assert):
            _add_check(plan, stmt.test, dict(env))
        elif unrolled is not None:
            for test, local in unrolled:
                _add_check(plan, test, {**env, **local})
        elif not _env_assignment(stmt, env):
            plan.steps.append(["exec", _exec_step(stmt, env)])
            for name in _bound_names(stmt):
                env.pop(name, None)
    return plan


def _passes(check: Check, reports: dict[int, dict]) -> bool:
    if check.broken:
        return False
    try:
        return bool(Evaluator(check.env, reports, None, check).ev(check.test, {}))
    except Exception:  # noqa: BLE001 - _Fail, or any error on the decoded values: the assert fails
        return False


def passed_asserts(plan: Plan, reports: dict[int, dict]) -> set[int]:
    """Indexes of the asserts that hold; with no asserts, {0} when every set-up step ran."""
    if not plan.checks:
        ran = all(reports.get(k, {}).get("ok") is True for k in range(len(plan.steps)))
        return {0} if ran else set()
    return {i for i, c in enumerate(plan.checks) if _passes(c, reports)}


def n_asserts(plan: Plan) -> int:
    return len(plan.checks) or 1
