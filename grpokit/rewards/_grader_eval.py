"""The parent-side expression walker of ``grader.py``: a small evaluator for the part of an assert that the
program has no say in, and the decoder of the values the sandbox sends back.

One class, two walks: with ``reports=None`` and a plan it *collects* (every leaf becomes an ``eval`` step and its
value is the placeholder ``REMOTE``, which poisons whatever uses it); with reports it *scores* (leaves take their
decoded values). Which sub-expressions are leaves is decided by the same static rules in both walks; where a walk
branches on a value (``and``/``or``, ``x if c else y``, comprehension filters), the collect walk takes every
branch, so the scoring walk finds every leaf it needs. Everything computed here runs on exact builtin values, and
the operations that could take long on large inputs (``**``, ``*`` on sequences, ``<<``, ``range``) are bounded.
"""

from __future__ import annotations

import ast
import builtins
import math
import operator
from typing import Any

_SAFE_BUILTINS = {n: getattr(builtins, n) for n in (
    "abs all any bin bool bytes chr complex dict divmod enumerate float frozenset hex int isinstance len list max "
    "min oct ord pow range repr reversed round set sorted str sum tuple type zip").split()}  # fmt: skip
_MATH = {n: getattr(math, n) for n in (
    "isclose sqrt floor ceil fabs isnan isinf isfinite inf nan pi e tau log log2 log10 exp sin cos tan atan2 "
    "hypot gcd trunc fsum copysign").split()}  # fmt: skip
_METHODS = set(
    "strip lstrip rstrip lower upper title split rsplit splitlines startswith endswith count index find rfind "
    "replace join isdigit isalpha isalnum isspace keys values items get real imag".split())  # fmt: skip
_PLAIN = (bool, int, float, complex, str, bytes, list, tuple, dict, set, frozenset, type(None))
_UNSUPPORTED = (ast.Lambda, ast.NamedExpr, ast.Starred, ast.Await, ast.Yield, ast.YieldFrom, ast.JoinedStr)
_COMPS = (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)
_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
           ast.LShift: operator.lshift, ast.RShift: operator.rshift, ast.BitOr: operator.or_,
           ast.BitAnd: operator.and_, ast.BitXor: operator.xor}  # fmt: skip
_UNOPS = {ast.UAdd: operator.pos, ast.USub: operator.neg, ast.Not: operator.not_, ast.Invert: operator.invert}
_CMPOPS = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
           ast.Gt: operator.gt, ast.GtE: operator.ge, ast.Is: operator.is_, ast.IsNot: operator.is_not,
           ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b}  # fmt: skip
MAX_ITEMS = 10_000  # comprehension iterations per assert
MAX_SIZE = 10_000_000  # elements a sequence product or range may have


class _Fail(Exception):
    """This assert cannot pass (a missing or undecodable value, an error, a guard)."""


class _Remote:
    """A value only the sandbox knows (collect walk)."""

    def __repr__(self) -> str:
        return "REMOTE"


REMOTE = _Remote()


def decode(obj: Any, depth: int = 0) -> Any:
    """Tagged JSON (see ``_sandbox_child.encode``) to exact builtin values; ValueError for anything else."""
    if depth > 200:
        raise ValueError("nested too deeply")
    if obj is None or type(obj) in (bool, int, float, str):
        return obj
    if type(obj) is list:
        return [decode(v, depth + 1) for v in obj]
    if type(obj) is not dict or set(obj) != {"__t", "v"}:
        raise ValueError("not a tagged value")
    tag, v = obj["__t"], obj["v"]
    if tag in ("tuple", "set", "frozenset") and type(v) is list:
        return {"tuple": tuple, "set": set, "frozenset": frozenset}[tag](decode(x, depth + 1) for x in v)
    if tag == "dict" and type(v) is list and all(type(p) is list and len(p) == 2 for p in v):
        return {decode(k, depth + 1): decode(x, depth + 1) for k, x in v}
    if tag == "bytes" and type(v) is str:
        return bytes.fromhex(v)
    if tag == "complex" and type(v) is list and len(v) == 2 and all(type(x) in (int, float) for x in v):
        return complex(v[0], v[1])
    raise ValueError(f"unknown tag {tag!r}")


def _literal(value: Any) -> ast.expr:
    """An AST that evaluates to ``value``; _Fail when the value has no literal form."""
    try:
        node = ast.parse(repr(value), mode="eval").body
        if ast.literal_eval(node) == value:
            return node
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        pass
    raise _Fail(f"no literal for {type(value).__name__}")


def _bound_inside(node: ast.AST) -> set[str]:
    names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    for n in ast.walk(node):
        if isinstance(n, ast.Lambda):
            names |= {a.arg for a in n.args.args + n.args.kwonlyargs}
    return names


class _Substitute(ast.NodeTransformer):
    def __init__(self, names: dict[str, Any], bound: set[str]) -> None:
        self.names, self.bound = names, bound

    def visit_Name(self, node: ast.Name) -> ast.expr:
        if isinstance(node.ctx, ast.Load) and node.id in self.names and node.id not in self.bound:
            return ast.copy_location(_literal(self.names[node.id]), node)
        return node


def source_of(node: ast.AST, names: dict[str, Any]) -> str:
    """The node's source with parent-known names replaced by literals (so the sandbox needs none of them)."""
    copy = ast.parse(ast.unparse(node), mode="eval").body
    return ast.unparse(_Substitute(names, _bound_inside(node)).visit(copy))


def _guard(op: type, left: Any, right: Any) -> None:
    if op is ast.Pow and isinstance(right, (int, float)) and abs(right) > 4096 and isinstance(left, (int, float)):
        if abs(left) > 1:
            raise _Fail("power too large")
    if op is ast.LShift and isinstance(right, int) and right > 65536:
        raise _Fail("shift too large")
    if op is ast.Mult:
        for seq, n in ((left, right), (right, left)):
            if isinstance(seq, (str, bytes, list, tuple)) and isinstance(n, int) and n * max(1, len(seq)) > MAX_SIZE:
                raise _Fail("sequence too large")


def _call_guard(fn: Any, args: list) -> None:
    if fn is range and len(range(*args)) > MAX_SIZE:
        raise _Fail("range too large")
    if fn is pow and len(args) == 2:
        _guard(ast.Pow, args[0], args[1])


class Evaluator:
    def __init__(self, env: dict[str, Any], reports: dict[int, dict] | None, plan: Any = None, check: Any = None):
        self.env, self.reports, self.plan, self.check = env, reports, plan, check
        self.collect = reports is None and plan is not None
        self.items = 0

    # ---- static rules (the same in both walks)
    def known(self, name: str, local: dict) -> bool:
        return name in local or name in self.env or name in _SAFE_BUILTINS or name == "math"

    def _safe_func(self, func: ast.expr) -> bool:
        if isinstance(func, ast.Name):
            return func.id in _SAFE_BUILTINS
        if isinstance(func, ast.Attribute):
            if isinstance(func.value, ast.Name) and func.value.id == "math":
                return func.attr in _MATH
            return func.attr in _METHODS
        return False

    def parent_only(self, node: ast.AST, local: dict) -> bool:
        """True when the node needs nothing from the program."""
        inner = _bound_inside(node)
        for n in ast.walk(node):
            if isinstance(n, _UNSUPPORTED) or (isinstance(n, ast.Call) and not self._safe_func(n.func)):
                return False
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load):
                if not (self.known(n.id, local) or n.id in inner):
                    return False
        return True

    def _is_program_ref(self, node: ast.expr, local: dict) -> bool:
        """A bare name (or attribute of one) that belongs to the program, e.g. an object or a function."""
        while isinstance(node, ast.Attribute):
            node = node.value
        return isinstance(node, ast.Name) and not self.known(node.id, local)

    # ---- the walk
    def ev(self, node: ast.AST, local: dict) -> Any:
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, _UNSUPPORTED):
            return self.leaf(node, local)
        method = getattr(self, "_" + type(node).__name__, None)
        if isinstance(node, _COMPS):
            method = self._comp
        return self.leaf(node, local) if method is None else method(node, local)

    def leaf(self, node: ast.AST, local: dict) -> Any:
        src = source_of(node, {**self.env, **local})
        if self.collect:
            if src not in self.check.leaves:
                self.plan.steps.append(["eval", src])
                self.check.leaves[src] = len(self.plan.steps) - 1
            return REMOTE
        k = self.check.leaves.get(src) if self.check is not None and self.reports is not None else None
        report = self.reports.get(k) if k is not None else None
        if not report or "v" not in report:
            raise _Fail(f"no value for {src}")
        try:
            return decode(report["v"])
        except (ValueError, TypeError, RecursionError) as exc:
            raise _Fail(str(exc)) from exc

    def _soft(self, node: ast.AST, local: dict) -> Any:
        """Collect walk: evaluate a branch that Python might skip; its errors do not matter yet."""
        try:
            return self.ev(node, local)
        except _Fail:
            raise
        except Exception:  # noqa: BLE001
            return REMOTE

    def _Name(self, node: ast.Name, local: dict) -> Any:
        for scope in (local, self.env, _SAFE_BUILTINS):
            if node.id in scope:
                return scope[node.id]
        return math if node.id == "math" else self.leaf(node, local)

    def _seq(self, node, local, kind):
        values = [self.ev(e, local) for e in node.elts]
        return REMOTE if REMOTE in values else kind(values)

    def _Tuple(self, node, local):
        return self._seq(node, local, tuple)

    def _List(self, node, local):
        return self._seq(node, local, list)

    def _Set(self, node, local):
        return self._seq(node, local, set)

    def _Dict(self, node, local):
        if any(k is None for k in node.keys):
            return self.leaf(node, local)
        keys = [self.ev(k, local) for k in node.keys]
        values = [self.ev(v, local) for v in node.values]
        return REMOTE if REMOTE in keys or REMOTE in values else dict(zip(keys, values))

    def _UnaryOp(self, node, local):
        v = self.ev(node.operand, local)
        return REMOTE if v is REMOTE else _UNOPS[type(node.op)](v)

    def _BinOp(self, node, local):
        left, right = self.ev(node.left, local), self.ev(node.right, local)
        if left is REMOTE or right is REMOTE:
            return REMOTE
        _guard(type(node.op), left, right)
        return _BINOPS[type(node.op)](left, right)

    def _operands(self, nodes: list, local: dict) -> list | None:
        """Collect walk: every operand (Python might skip some); None when one is only known to the sandbox."""
        values = [self._soft(n, local) for n in nodes]
        return None if REMOTE in values else values

    def _BoolOp(self, node, local):
        if self.collect and self._operands(node.values, local) is None:
            return REMOTE
        is_and = isinstance(node.op, ast.And)
        for v in node.values:
            value = self.ev(v, local)
            if bool(value) != is_and:
                return value
        return value

    def _Compare(self, node, local):
        if self.collect and self._operands([node.left, *node.comparators], local) is None:
            return REMOTE
        left = self.ev(node.left, local)
        for op, comp in zip(node.ops, node.comparators):
            right = self.ev(comp, local)
            if not _CMPOPS[type(op)](left, right):
                return False
            left = right
        return True

    def _IfExp(self, node, local):
        test = self.ev(node.test, local)
        if test is REMOTE:
            self._soft(node.body, local)
            self._soft(node.orelse, local)
            return REMOTE
        return self.ev(node.body if test else node.orelse, local)

    def _Attribute(self, node, local):
        is_math = isinstance(node.value, ast.Name) and node.value.id == "math" and "math" not in local
        if (is_math and node.attr not in _MATH) or self._is_program_ref(node.value, local) or node.attr.startswith("_"):
            return self.leaf(node, local)
        return self._member(node.value, node.attr, local)

    def _member(self, value: ast.expr, attr: str, local: dict) -> Any:
        """``value.attr`` for math's whitelisted names and for plain values (never a dunder)."""
        if isinstance(value, ast.Name) and value.id == "math" and "math" not in local:
            return _MATH[attr]
        base = self.ev(value, local)
        if base is REMOTE:
            return REMOTE
        if not isinstance(base, _PLAIN):
            raise _Fail("attribute of a non-plain value")
        return getattr(base, attr)

    def _Subscript(self, node, local):
        base, index = self.ev(node.value, local), self.ev(node.slice, local)
        return REMOTE if base is REMOTE or index is REMOTE else base[index]

    def _Slice(self, node, local):
        parts = [None if p is None else self.ev(p, local) for p in (node.lower, node.upper, node.step)]
        return REMOTE if REMOTE in parts else slice(*parts)

    def _Call(self, node, local):
        func = node.func
        program_args = [a for a in [*node.args, *(k.value for k in node.keywords)] if self._is_program_ref(a, local)]
        unsupported = any(isinstance(n, _UNSUPPORTED) for n in ast.walk(node))
        if not self._safe_func(func) or program_args or unsupported or any(k.arg is None for k in node.keywords):
            return self.leaf(node, local)
        if isinstance(func, ast.Attribute) and func.attr in _METHODS and self._is_program_ref(func.value, local):
            return self.leaf(node, local)
        fn = self._member(func.value, func.attr, local) if isinstance(func, ast.Attribute) else self.ev(func, local)
        args = [self.ev(a, local) for a in node.args]
        kwargs = {k.arg: self.ev(k.value, local) for k in node.keywords}
        if fn is REMOTE or REMOTE in args or REMOTE in kwargs.values():
            return REMOTE
        _call_guard(fn, args)
        return fn(*args, **kwargs)

    def _comp(self, node, local):
        scope = {**local, **{n: None for n in _bound_inside(node)}}
        if not all(self.parent_only(g.iter, scope) for g in node.generators) or any(
            g.is_async for g in node.generators
        ):
            return self.leaf(node, local)
        out: list = []
        self._generate(node, 0, dict(local), out)
        if REMOTE in out or any(isinstance(o, tuple) and REMOTE in o for o in out):
            return REMOTE
        if isinstance(node, ast.DictComp):
            return dict(out)
        return set(out) if isinstance(node, ast.SetComp) else out

    def _generate(self, node, i: int, local: dict, out: list) -> None:
        if i == len(node.generators):
            if isinstance(node, ast.DictComp):
                out.append((self.ev(node.key, local), self.ev(node.value, local)))
            else:
                out.append(self.ev(node.elt, local))
            return
        gen = node.generators[i]
        items = self.ev(gen.iter, local)
        if items is REMOTE:
            raise _Fail("an iterable the parent could not compute")
        for item in items:
            self.items += 1
            if self.items > MAX_ITEMS:
                raise _Fail("too many iterations")
            inner = dict(local)
            _bind(gen.target, item, inner)
            conds = [self.ev(c, inner) for c in gen.ifs]
            if any(c is not REMOTE and not c for c in conds):
                continue
            self._generate(node, i + 1, inner, out)


def _bind(target: ast.expr, value: Any, local: dict) -> None:
    if isinstance(target, ast.Name):
        local[target.id] = value
    elif isinstance(target, (ast.Tuple, ast.List)):
        values = list(value)
        if len(values) != len(target.elts):
            raise _Fail("cannot unpack")
        for t, v in zip(target.elts, values):
            _bind(t, v, local)
    else:
        raise _Fail("unsupported loop target")
