"""Expressions of the tests, evaluated in the trainer (``_grader_eval`` holds the values, bounds and decoder).

``Expressions.ev(node, scope)`` follows Python's own evaluation order and short-circuits; a program name or a
kept result is a ``Remote``, and using one as a function, an object with attributes, or a container is a call into
the sandbox through ``query(src, args)``: ``src`` names the program's objects and reads the parent's arguments as
``__A[i]``; the arguments travel as tagged JSON, never as source text. Test-defined functions and lambdas are
``Closure``s run here (``call_closure``, supplied by the statement interpreter).
"""

from __future__ import annotations

import ast
import builtins
from typing import Any

from grpokit.rewards._grader_eval import (
    _BINOPS, _CMPOPS, _METHODS, _PLAIN, _SAFE_BUILTINS, _UNOPS, Approx, Budget, CandidateError, Module,
    Remote, _Fail, _format_guard, call_guard, checked, copy_back, decode, guard, method_guard, plain_operands,
    spread_hashes, truth,
)  # fmt: skip
from grpokit.rewards._sandbox_child import encode

_ITERATORS = tuple({type(iter(x)) for x in ([], (), "", range(0))} | {type(reversed(x)) for x in ([], (), range(0))})

_BUILTIN_FUNCS = {id(v): k for k, v in _SAFE_BUILTINS.items()}
EXCEPTION_NAMES = {n for n, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, BaseException)}


class ExcName:
    """An exception class named by the tests (a builtin, or the program's own by its name)."""

    def __init__(self, name: str) -> None:
        self.name = name


class Closure:
    """A function the tests define (``def`` or ``lambda``), run in the trainer."""

    def __init__(self, node: ast.AST, scope: dict, run: Any) -> None:
        self.node, self.scope, self.run = node, scope, run

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.run(self, list(args), kwargs)


class Expressions:
    def __init__(self, globals_: dict, query: Any, budget: Budget) -> None:
        self.globals, self.query_fn, self.budget = globals_, query, budget

    # ---- calls into the sandbox
    def query(self, src: str, args: list) -> Any:
        try:
            sent = [encode(a) for a in args]
        except (TypeError, ValueError, RecursionError) as exc:
            raise _Fail(f"an argument the sandbox cannot receive ({exc})") from None
        answer = self.query_fn(src, sent)
        if answer is None:
            raise _Fail("no answer from the sandbox")
        if type(answer.get("m")) is dict and answer["m"]:
            copy_back(args, answer["m"], self.budget)
        if "v" in answer:
            try:
                self.budget.decoding(answer["v"])
                return checked(decode(answer["v"]))
            except (ValueError, TypeError, RecursionError) as exc:
                raise _Fail(f"undecodable value ({exc})") from None
        if type(answer.get("ref")) is int:
            return Remote(f"__R[{answer['ref']}]")
        if type(answer.get("err")) is str:
            mro = answer.get("mro")
            names = [str(n)[:100] for n in mro[:16]] if type(mro) is list else []
            err = CandidateError(answer["err"][:100], names)
            err.msg = answer["msg"][:200] if type(answer.get("msg")) is str else ""
            raise err
        raise _Fail("an answer of no known form")

    def val(self, value: Any) -> Any:
        """A program *name* used as a value (``assert ANSWER == 42``) is fetched: its value, or a kept object."""
        if isinstance(value, Remote) and not value.src.startswith("__R["):
            return self.query(value.src, [])
        return value

    def truth(self, value: Any) -> bool:
        value = self.val(value)
        if isinstance(value, Remote):  # a program object's truth is its own (__bool__, __len__), as in Python
            answer = self.query(f"bool({value.src})", [])
            if type(answer) is not bool:
                raise _Fail("truth of a program object")
            return answer
        return truth(value)

    def remote_call(self, func_src: str, args: list, kwargs: dict) -> Any:
        parts, sent = [], []
        for value in list(args) + list(kwargs.values()):
            if isinstance(value, Remote):
                parts.append(value.src)
            else:
                parts.append(f"__A[{len(sent)}]")
                sent.append(value)
        names = [""] * len(args) + [f"{k}=" for k in kwargs]
        return self.query(f"{func_src}({', '.join(n + p for n, p in zip(names, parts))})", sent)

    # ---- the walk
    def ev(self, node: ast.AST, scope: dict) -> Any:
        self.budget.tick()
        method = getattr(self, "_" + type(node).__name__, None)
        if method is None:
            raise _Fail(f"unsupported expression {type(node).__name__}")
        return method(node, scope)

    def lookup(self, name: str, scope: dict) -> Any:
        for space in (scope, self.globals):
            if name in space:
                return space[name]
        if name in _SAFE_BUILTINS:
            return _SAFE_BUILTINS[name]
        if name in EXCEPTION_NAMES:
            return ExcName(name)
        return Remote(name)  # the program's (the converter checked it is a plain identifier)

    def _Constant(self, node, scope):
        return node.value

    def _Name(self, node, scope):
        return self.lookup(node.id, scope)

    def _seq(self, node, scope, kind):
        out = []
        for e in node.elts:
            if isinstance(e, ast.Starred):
                out.extend(self.iterate(self.ev(e.value, scope)))
            else:
                out.append(self.ev(e, scope))
        return checked(kind(out))

    def _Tuple(self, node, scope):
        return self._seq(node, scope, tuple)

    def _List(self, node, scope):
        return self._seq(node, scope, list)

    def _Set(self, node, scope):
        return self._seq(node, scope, lambda items: set(spread_hashes(items)))

    def _Dict(self, node, scope):
        out = {}
        for k, v in zip(node.keys, node.values):
            if k is None:
                out.update(self.ev(v, scope))
            else:
                out[self.ev(k, scope)] = self.ev(v, scope)
        return out

    def _UnaryOp(self, node, scope):
        v = self.val(self.ev(node.operand, scope))
        if isinstance(node.op, ast.Not):
            return not self.truth(v)
        plain_operands(v)
        return _UNOPS[type(node.op)](v)

    def _BinOp(self, node, scope):
        left, right = self.val(self.ev(node.left, scope)), self.val(self.ev(node.right, scope))
        plain_operands(left, right)
        guard(type(node.op), left, right)
        return checked(_BINOPS[type(node.op)](left, right))

    def _BoolOp(self, node, scope):
        is_and = isinstance(node.op, ast.And)
        for v in node.values:
            value = self.val(self.ev(v, scope))
            if self.truth(value) != is_and:
                return value
        return value

    def _Compare(self, node, scope):
        left = self.val(self.ev(node.left, scope))
        for op, comp in zip(node.ops, node.comparators):
            right = self.val(self.ev(comp, scope))
            plain_operands(left, right)
            result = _CMPOPS[type(op)](left, right)
            if not truth(result):
                return False
            left = right
        return True

    def _IfExp(self, node, scope):
        return self.ev(node.body if self.truth(self.ev(node.test, scope)) else node.orelse, scope)

    def _JoinedStr(self, node, scope):
        out = []
        for part in node.values:
            out.append(self.ev(part, scope) if not isinstance(part, ast.Constant) else part.value)
        return checked("".join(out))

    def _FormattedValue(self, node, scope):
        value = self.val(self.ev(node.value, scope))
        plain_operands(value)
        spec = self.ev(node.format_spec, scope) if node.format_spec is not None else ""
        _format_guard(spec)
        value = {-1: lambda v: v, 115: str, 114: repr, 97: ascii}[node.conversion](value)
        return checked(format(value, spec))

    def _Lambda(self, node, scope):
        return Closure(node, dict(scope), self.call_closure)

    def _Attribute(self, node, scope):
        base = self.ev(node.value, scope)
        return self.member(base, node.attr)

    def member(self, base: Any, attr: str) -> Any:
        if isinstance(base, Remote):
            return self.query(f"{base.src}.{attr}", [])
        if isinstance(base, Module):
            if attr not in base.names:
                raise _Fail(f"{base.name}.{attr} is not evaluated by the grader")
            return base.names[attr]
        if attr.startswith("_") or attr not in _METHODS or not isinstance(base, _PLAIN):
            raise _Fail(f"attribute {attr[:40]} of {type(base).__name__}")
        return getattr(base, attr)

    def _Subscript(self, node, scope):
        base, index = self.ev(node.value, scope), self.val(self.ev(node.slice, scope))
        if isinstance(base, Remote):
            return self._remote_item(base, index)
        plain_operands(index)
        if not isinstance(base, _PLAIN):
            raise _Fail("subscript of a non-plain value")
        return base[index]

    def _remote_item(self, base: Remote, index: Any) -> Any:
        if isinstance(index, Remote):
            return self.query(f"{base.src}[{index.src}]", [])
        return self.query(f"{base.src}[__A[0]]", [index])

    def _Slice(self, node, scope):
        parts = [None if p is None else self.ev(p, scope) for p in (node.lower, node.upper, node.step)]
        plain_operands(*parts)
        return slice(*parts)

    def _args(self, node: ast.Call, scope: dict) -> tuple[list, dict]:
        args: list = []
        for a in node.args:
            if isinstance(a, ast.Starred):
                args.extend(self.iterate(self.ev(a.value, scope)))
            else:
                args.append(self.ev(a, scope))
        kwargs: dict = {}
        for k in node.keywords:
            value = self.ev(k.value, scope)
            if k.arg is None:
                if type(value) is not dict or not all(type(key) is str and key.isidentifier() for key in value):
                    raise _Fail("** of a non-dict")
                kwargs.update(value)
            else:
                kwargs[k.arg] = value
        return args, kwargs

    def _Call(self, node, scope):
        func = node.func
        if isinstance(func, ast.Attribute):
            base = self.ev(func.value, scope)
            if isinstance(base, Remote):  # a method of a program object: one call
                args, kwargs = self._args(node, scope)
                return self.remote_call(f"{base.src}.{func.attr}", args, kwargs)
            fn = self.member(base, func.attr)
            args, kwargs = self._args(node, scope)
            method_guard(base, func.attr, args)
        else:
            fn = self.ev(func, scope)
            args, kwargs = self._args(node, scope)
        return self.call(fn, args, kwargs)

    def call(self, fn: Any, args: list, kwargs: dict) -> Any:
        if isinstance(fn, Remote):
            return self.remote_call(fn.src, args, kwargs)
        if isinstance(fn, Closure):
            return self.call_closure(fn, args, kwargs)
        if any(isinstance(a, Remote) for a in [*args, *kwargs.values()]):
            return self._builtin_on_remote(fn, args, kwargs)
        if isinstance(fn, type) and issubclass(fn, (Exception,)):
            raise _Fail("exception objects are not evaluated")
        if not callable(fn):
            raise _Fail(f"{type(fn).__name__} is not callable")
        call_guard(fn, args, kwargs)
        return checked(fn(*args, **kwargs))

    def _builtin_on_remote(self, fn: Any, args: list, kwargs: dict) -> Any:
        """A builtin given a program object. Test values never travel with it into the sandbox (``zip(f(),
        expected)`` answered there could pair each expected value with itself): builtins that consume iterables
        get the object's items (``list(obj)``, the program's answer) and run here; ``map``/``filter`` of a program
        function call it once per item; any other builtin runs in the sandbox only on program objects alone."""
        name = _BUILTIN_FUNCS.get(id(fn))
        if name in ("map", "filter") and args and isinstance(args[0], Remote) and not kwargs:
            items = [list(self.iterate(a)) for a in args[1:]]
            if name == "filter":
                if len(items) != 1:
                    raise _Fail("filter takes one iterable")
                return [x for x in items[0] if self.truth(self.call(args[0], [x], {}))]
            return [self.call(args[0], list(xs), {}) for xs in zip(*items)]
        if name in _CONSUMERS:
            args = [list(self.iterate(a)) if isinstance(a, Remote) else a for a in args]
            if any(isinstance(v, Remote) for v in kwargs.values()):
                raise _Fail("a program object as a keyword of a builtin")
            return self.call(fn, args, kwargs)
        if name is None or kwargs or not all(isinstance(a, Remote) for a in args):
            raise _Fail("a program object passed to a builtin together with test values")
        return self.remote_call(name, args, {})

    def iterate(self, value: Any) -> Any:
        if isinstance(value, Remote):
            value = self.query(f"list({value.src})", [])
        if isinstance(value, (Module, Approx)) or not isinstance(
            value, _PLAIN + (range, map, filter, zip, enumerate, reversed) + _ITERATORS
        ):
            raise _Fail("iteration over a non-plain value")
        for item in value:
            self.budget.tick()
            yield item

    def _comp(self, node, scope):
        out: list = []
        self._generate(node, 0, dict(scope), out)
        if isinstance(node, ast.DictComp):
            spread_hashes([k for k, _ in out])
            return checked(dict(out))
        return checked(set(spread_hashes(out)) if isinstance(node, ast.SetComp) else out)

    _ListComp = _SetComp = _DictComp = _comp

    def _GeneratorExp(self, node, scope):
        return self._comp(node, scope)  # eagerly: bounded by the budget

    def _generate(self, node, i: int, scope: dict, out: list) -> None:
        if i == len(node.generators):
            if isinstance(node, ast.DictComp):
                out.append((self.ev(node.key, scope), self.ev(node.value, scope)))
            else:
                out.append(self.ev(node.elt, scope))
            if len(out) > MAX_ITEMS:
                raise _Fail("comprehension too large")
            return
        gen = node.generators[i]
        for item in self.iterate(self.ev(gen.iter, scope)):
            inner = dict(scope)
            bind(gen.target, item, inner)
            if all(self.truth(self.ev(c, inner)) for c in gen.ifs):
                self._generate(node, i + 1, inner, out)

    def call_closure(self, fn: Closure, args: list, kwargs: dict) -> Any:  # the statement interpreter overrides
        node = fn.node
        if not isinstance(node, ast.Lambda):
            raise _Fail("a function outside a test")
        local = dict(fn.scope)
        bind_args(node.args, args, kwargs, local, self, fn.scope)
        return self.ev(node.body, local)


MAX_ITEMS = 1_000_000
_CONSUMERS = {"list", "tuple", "set", "frozenset", "sorted", "sum", "min", "max", "all", "any", "zip", "enumerate",
              "reversed", "dict", "len"}  # fmt: skip


def bind(target: ast.expr, value: Any, scope: dict) -> None:
    if isinstance(target, ast.Name):
        scope[target.id] = value
    elif isinstance(target, (ast.Tuple, ast.List)):
        if isinstance(value, Remote):
            raise _Fail("unpacking a program object")
        values = list(value) if isinstance(value, _PLAIN + (range,)) else None
        if values is None or len(values) != len(target.elts):
            raise _Fail("cannot unpack")
        for t, v in zip(target.elts, values):
            bind(t, v, scope)
    else:
        raise _Fail("unsupported assignment target")


def bind_args(a: ast.arguments, args: list, kwargs: dict, local: dict, ex: Expressions, defaults_scope: dict) -> None:
    """Bind a call's arguments to a test function's parameters (positional, keyword, defaults, *args)."""
    params = [p.arg for p in a.posonlyargs + a.args]
    defaults = [ex.ev(d, defaults_scope) for d in a.defaults]
    if len(args) > len(params) and a.vararg is None:
        raise _Fail("too many arguments")
    for name, value in zip(params, args):
        local[name] = value
    if a.vararg is not None:
        local[a.vararg.arg] = tuple(args[len(params) :])
    for k, v in kwargs.items():
        if k not in params and k not in [p.arg for p in a.kwonlyargs]:
            raise _Fail(f"unexpected argument {k[:40]}")
        local[k] = v
    for name, d in zip(params[len(params) - len(defaults) :], defaults):
        local.setdefault(name, d)
    for p, d in zip(a.kwonlyargs, a.kw_defaults):
        if p.arg not in local and d is not None:
            local[p.arg] = ex.ev(d, defaults_scope)
    missing = [p for p in params + [p.arg for p in a.kwonlyargs] if p not in local]
    if missing:
        raise _Fail(f"missing argument {missing[0][:40]}")
