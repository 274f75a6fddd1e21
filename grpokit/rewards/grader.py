"""Assert-mode grading in the trainer: the tests run here, the program only answers calls.

``prepare(tests)`` converts a test file (``test_convert``: top-level asserts, ``check(candidate)``, test functions,
loops, main guards, EvalPlus helpers, pytest, unittest) into statements this module runs, or raises
``Unconvertible`` (code_exec refuses such a row when the rows load). ``grade(program, call, deadline)`` runs them:
every expression, the expected side included, is evaluated in this process (``_grader_expr``); a name the tests do
not define belongs to the program, and using it is one ``call`` into the sandbox, whose answer is data (tagged
JSON decoded into fresh builtin values). The program never sees the tests, their expected values or a verdict,
and nothing it writes is a verdict: every ``assert`` is evaluated here, and fails when it involves anything but
plain values.

Scoring follows the tests' structure, as pytest does, never the program's answers: each top-level statement that
holds checks (an ``assert``, a raises block, or a call of a test function that holds them, such as ``check(f)``,
``test_x()`` or a parametrize case) is one test, which passes as a whole when it runs to its end: a failed
``assert`` ends it there, as does anything it raises and does not catch (an ``assert`` over 20 000 returned items in
a loop is one test, and raising early fails it as answering wrong does). An error in set-up fails every test after
it. The score is passed tests / tests, fixed by the file.
"""

from __future__ import annotations

import ast
import re
import time
from dataclasses import dataclass
from typing import Any, Callable

from grpokit.rewards._grader_eval import MODULES, Approx, Budget, CandidateError, Module, Remote, _Fail
from grpokit.rewards._grader_expr import Closure, ExcName, Expressions, bind, bind_args
from grpokit.rewards.test_convert import (  # noqa: F401 (Unconvertible: API)
    COUNT_EQUAL,
    PROGRAM_MODULES,
    RAISES,
    Unconvertible,
    bound_names,
    convert,
)  # fmt: skip

MAX_DEPTH = 50  # nested calls of test functions
_ERRORS = (_Fail, CandidateError, ArithmeticError, LookupError, TypeError, ValueError, AttributeError,
           RuntimeError, MemoryError, AssertionError)  # fmt: skip


@dataclass
class Program:
    module: ast.Module
    source_checks: int  # tests in the file: top-level statements that hold checks (the module docstring)
    test_names: frozenset[str] = frozenset()  # names the tests bind: never the program's


@dataclass
class Grade:
    passed: int
    checks: int

    @property
    def score(self) -> float:
        return self.passed / self.checks if self.checks else 0.0


def _static_checks(nodes: list[ast.AST]) -> int:
    return sum(isinstance(n, (ast.Assert, ast.With)) for s in nodes for n in ast.walk(s))


def _holding_functions(body: list[ast.stmt]) -> set[str]:
    """Top-level functions that hold checks, themselves or through the test functions they call."""
    defs = {s.name: s for s in body if isinstance(s, ast.FunctionDef)}
    holding = {name for name, d in defs.items() if _static_checks([d]) > 0}
    while True:
        more = {name for name, d in defs.items() if name not in holding and _calls(d) & holding}
        if not more:
            return holding
        holding |= more


def _calls(node: ast.AST) -> set[str]:
    return {n.func.id for n in ast.walk(node) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}


def test_statements(body: list[ast.stmt]) -> list[bool]:
    """Per top-level statement: whether it is a test (holds checks; function definitions are not)."""
    holding = _holding_functions(body)
    return [not isinstance(s, ast.FunctionDef) and (_static_checks([s]) > 0 or bool(_calls(s) & holding)) for s in body]


def prepare(tests: str) -> Program:
    module = convert(tests)
    return Program(module, sum(test_statements(module.body)), frozenset(bound_names(module)))


class _Return(Exception):
    def __init__(self, value: Any) -> None:
        self.value = value


class _Break(Exception):
    pass


class _Continue(Exception):
    pass


class _AssertFailed(AssertionError):
    """An ``assert`` of the tests did not hold (or a raises block saw no matching error): the test ends here."""


class _Raises:
    def __init__(self, names: list[str], match: str | None) -> None:
        self.names, self.match = names, match


def _raises(expected: Any, match: str | None = None) -> _Raises:
    items = expected if type(expected) is tuple else (expected,)
    names = []
    for e in items:
        if isinstance(e, ExcName):
            names.append(e.name)
        elif isinstance(e, Remote) and e.src.isidentifier():
            names.append(e.src)  # the program's own exception class, by name
        else:
            raise _Fail("raises of something that is not an exception class")
    if match is not None and type(match) is not str:
        raise _Fail("raises(match=) needs a string")
    return _Raises(names, match)


def _count_equal(a: Any, b: Any) -> bool:
    if type(a) not in (list, tuple) or type(b) not in (list, tuple) or len(a) != len(b):
        return False
    rest = list(b)
    for x in a:
        for i, y in enumerate(rest):
            if type(x) is type(y) and x == y:
                del rest[i]
                break
        else:
            return False
    return True


def _error_names(exc: BaseException) -> list[str]:
    if isinstance(exc, CandidateError):
        return exc.mro or [exc.name]
    return [c.__name__ for c in type(exc).__mro__]


class Interpreter(Expressions):
    def __init__(self, call: Callable[[str, list], dict | None], budget: Budget,
                 test_names: frozenset[str] = frozenset()) -> None:  # fmt: skip
        super().__init__({}, call, budget)
        self.test_names = test_names
        self.checks: list[bool] = []
        self.depth = 0
        self.globals.update({RAISES: _raises, COUNT_EQUAL: _count_equal})

    # ---- the module, statement by statement, with the scoring rules of the module docstring
    def run_module(self, body: list[ast.stmt]) -> None:
        tests = test_statements(body)
        for i, stmt in enumerate(body):
            try:
                self.exec_block([stmt], self.globals)
            except Exception:  # noqa: BLE001 - anything that goes wrong evaluating a test fails it, never the run
                if not tests[i]:  # set-up: every test after it fails
                    self.checks += [False] * sum(tests[i + 1 :])
                    return
                self.checks.append(False)
                continue
            if tests[i]:
                self.checks.append(True)

    def exec_block(self, stmts: list[ast.stmt], scope: dict) -> None:
        for stmt in stmts:
            self.budget.tick()
            getattr(self, "_s_" + type(stmt).__name__)(stmt, scope)

    def _s_Assert(self, s, scope):
        try:
            ok = self.truth(self.ev(s.test, scope))
        except (_Return, _Break, _Continue):
            raise
        except Exception:  # noqa: BLE001 - an assert that cannot be evaluated fails
            ok = False
        if not ok:
            raise _AssertFailed

    def assign(self, target: ast.expr, value: Any, scope: dict) -> None:
        if isinstance(target, ast.Subscript):
            base, index = self.ev(target.value, scope), self.ev(target.slice, scope)
            if type(base) not in (list, dict) or isinstance(index, Remote):
                raise _Fail("item assignment on a non-plain value")
            base[index] = value
        else:
            bind(target, value, scope)

    def _s_Assign(self, s, scope):
        value = self.ev(s.value, scope)
        for t in s.targets:
            self.assign(t, value, scope)

    def _s_AnnAssign(self, s, scope):
        if s.value is not None:
            self.assign(s.target, self.ev(s.value, scope), scope)

    def _s_AugAssign(self, s, scope):
        load = ast.parse(ast.unparse(s.target), mode="eval").body
        value = self.ev(ast.BinOp(load, s.op, s.value), scope)
        self.assign(s.target, value, scope)

    def _s_Expr(self, s, scope):
        self.ev(s.value, scope)

    def _s_Pass(self, s, scope):
        pass

    def _s_Break(self, s, scope):
        raise _Break

    def _s_Continue(self, s, scope):
        raise _Continue

    def _s_Return(self, s, scope):
        raise _Return(None if s.value is None else self.ev(s.value, scope))

    def _s_Raise(self, s, scope):
        raise _Fail("the tests raised")

    def _s_If(self, s, scope):
        self.exec_block(s.body if self.truth(self.ev(s.test, scope)) else s.orelse, scope)

    def _loop_body(self, body: list[ast.stmt], scope: dict) -> bool:
        """False on break."""
        try:
            self.exec_block(body, scope)
        except _Break:
            return False
        except _Continue:
            pass
        return True

    def _s_For(self, s, scope):
        for item in self.iterate(self.ev(s.iter, scope)):
            self.assign(s.target, item, scope)
            if not self._loop_body(s.body, scope):
                return
        self.exec_block(s.orelse, scope)

    def _s_While(self, s, scope):
        while self.truth(self.ev(s.test, scope)):
            self.budget.tick()
            if not self._loop_body(s.body, scope):
                return
        self.exec_block(s.orelse, scope)

    def _s_FunctionDef(self, s, scope):
        scope[s.name] = Closure(s, scope, self.call_closure)

    def _s_Import(self, s, scope):
        for a in s.names:
            top = a.name.split(".")[0]
            scope[a.asname or top] = self._module(a.name if a.asname else top)

    def _s_ImportFrom(self, s, scope):
        mod = self._module(s.module or "")
        for a in s.names:
            if a.name == "*":
                if mod.name in MODULES or mod.name == "pytest":
                    scope.update(mod.names)
                continue  # the program's module: its names are found as the program's anyway
            if mod.name == "typing":
                scope[a.asname or a.name] = Module(f"typing.{a.name}", {})  # for annotations, which are not run
            elif mod.name in MODULES or mod.name == "pytest":
                scope[a.asname or a.name] = mod.names[a.name] if a.name in mod.names else _missing(mod.name, a.name)
            else:
                scope[a.asname or a.name] = Remote(a.name)  # the program's module (test_convert.PROGRAM_MODULES)

    def _module(self, name: str) -> Module:
        if name in MODULES:
            return Module(name, MODULES[name])
        if name == "pytest":
            return Module(name, {"approx": Approx, "raises": _raises})
        return Module(name, {})  # unittest (converted away), __future__, or the program's module (see member)

    def lookup(self, name: str, scope: dict) -> Any:
        value = super().lookup(name, scope)
        if isinstance(value, Remote) and value.src == name and name in self.test_names and \
                name not in scope and name not in self.globals:  # fmt: skip
            raise _Fail(f"test name {name} used before it is bound")  # never the program's value instead
        return value

    def member(self, base: Any, attr: str) -> Any:
        if isinstance(base, Module) and base.name in PROGRAM_MODULES:
            return Remote(attr)
        return super().member(base, attr)

    def _s_With(self, s, scope):
        if len(s.items) != 1:
            raise _Fail("a with-statement of several items")
        ctx = self.ev(s.items[0].context_expr, scope)
        if not isinstance(ctx, _Raises):
            raise _Fail("a with-statement that is not a raises check")
        try:
            self.exec_block(s.body, scope)
        except CandidateError as exc:
            ok = any(n in exc.mro or n == exc.name for n in ctx.names)
            msg = getattr(exc, "msg", "")
            if ok and ctx.match is not None:
                ok = re.search(ctx.match, msg) is not None
            if s.items[0].optional_vars is not None:  # pytest's excinfo.value, unittest's cm.exception
                names = {"value": msg, "exception": msg, "type": exc.name, "typename": exc.name}
                scope[s.items[0].optional_vars.id] = Module("excinfo", names)
            if not ok:
                raise _AssertFailed
            return
        except _ERRORS:
            raise _AssertFailed from None
        raise _AssertFailed  # nothing raised

    def _s_Try(self, s, scope):
        try:
            self.exec_block(s.body, scope)
        except (CandidateError, ArithmeticError, LookupError, TypeError, ValueError, AttributeError,
                AssertionError) as exc:  # fmt: skip
            names = _error_names(exc)
            for h in s.handlers:
                wanted = _handler_names(h)
                if wanted is None or any(w in names for w in wanted):
                    if h.name:
                        scope[h.name] = getattr(exc, "msg", str(exc)[:200])
                    self.exec_block(h.body, scope)
                    break
            else:
                raise
        else:
            self.exec_block(s.orelse, scope)
        finally:
            self.exec_block(s.finalbody, scope)

    # ---- test functions
    def call_closure(self, fn: Closure, args: list, kwargs: dict) -> Any:
        if isinstance(fn.node, ast.Lambda):
            return super().call_closure(fn, args, kwargs)
        if self.depth >= MAX_DEPTH:
            raise _Fail("test functions nested too deeply")
        local: dict = {} if fn.scope is self.globals else dict(fn.scope)
        bind_args(fn.node.args, args, kwargs, local, self, fn.scope)
        self.depth += 1
        try:
            self.exec_block(fn.node.body, local)
        except _Return as r:
            return r.value
        finally:
            self.depth -= 1
        return None


def _missing(module: str, name: str) -> Any:
    raise Unconvertible(f"from {module} import {name}: not a name the grader evaluates")


def _handler_names(h: ast.ExceptHandler) -> list[str] | None:
    if h.type is None:
        return None
    elts = h.type.elts if isinstance(h.type, ast.Tuple) else [h.type]
    return [e.id if isinstance(e, ast.Name) else ast.unparse(e)[:60] for e in elts]


def grade(program: Program, call: Callable[[str, list], dict | None], deadline: float | None = None) -> Grade:
    """Run the converted tests; ``call(src, args)`` asks the sandbox (None when it cannot answer)."""
    budget = Budget(deadline if deadline is not None else time.monotonic() + 3600)
    interp = Interpreter(call, budget, program.test_names)
    try:
        interp.run_module(program.module.body)
    except Unconvertible:
        return Grade(0, max(1, program.source_checks))
    return Grade(sum(interp.checks), len(interp.checks))
