"""Turn the test styles of code-RL datasets into one form the grader runs in the trainer, or refuse the file.

``convert(source)`` returns a module of plain statements: top-level asserts, ``check(candidate)`` and other test
functions (run by the grader as functions of its own), loops and ``if __name__ == "__main__":`` guards (their
bodies inlined), pytest ``test_*`` functions (called at the end, once per ``@pytest.mark.parametrize`` case), and
``unittest.TestCase`` / pytest ``Test*`` classes (each test method becomes a function: ``setUp`` then its body,
``self.x`` a local name, ``self.assertEqual(a, b)`` an ``assert a == b``, ``assertRaises`` a raises block).
A file that holds anything the grader does not evaluate itself (an import outside math/typing/collections/numpy's
``allclose``/pytest/unittest, a class that is not a test case, a fixture, ``global``, ``yield``, a dunder name …)
raises ``Unconvertible`` with one line saying what and where; code_exec refuses such rows when they load.
"""

from __future__ import annotations

import ast

from grpokit.rewards._grader_eval import MODULES, UNSAFE_BUILTINS

GRADER_MODULES = {*MODULES, "pytest", "unittest", "__future__"}
# the module names under which test files import the program (``from solution import f``); any other import of a
# module the grader does not evaluate is refused: taken for the program's, its functions would be the program's
# word on the expected side
PROGRAM_MODULES = {"solution", "main", "candidate", "submission", "user_solution", "program", "code", "answer"}
_PYTEST_NAMES = {"approx", "raises", "mark"}
RAISES = "grader_raises__"  # the raises helper the converted unittest code calls (bound by the grader)
COUNT_EQUAL = "grader_count_equal__"
_STMTS = (ast.Assert, ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Expr, ast.If, ast.For, ast.While, ast.Break,
          ast.Continue, ast.Pass, ast.FunctionDef, ast.Return, ast.Import, ast.ImportFrom, ast.With, ast.Try,
          ast.Raise)  # fmt: skip
_EXPRS = (ast.Constant, ast.Name, ast.Tuple, ast.List, ast.Set, ast.Dict, ast.UnaryOp, ast.BinOp, ast.BoolOp,
          ast.Compare, ast.IfExp, ast.JoinedStr, ast.FormattedValue, ast.Lambda, ast.Attribute, ast.Subscript,
          ast.Slice, ast.Call, ast.Starred, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp,
          ast.comprehension, ast.keyword, ast.arguments, ast.arg, ast.alias, ast.ExceptHandler, ast.withitem,
          ast.expr_context, ast.operator, ast.unaryop, ast.cmpop, ast.boolop)  # fmt: skip
_CMP = {"assertEqual": ast.Eq, "assertNotEqual": ast.NotEq, "assertIs": ast.Is, "assertIsNot": ast.IsNot,
        "assertIn": ast.In, "assertNotIn": ast.NotIn, "assertGreater": ast.Gt, "assertGreaterEqual": ast.GtE,
        "assertLess": ast.Lt, "assertLessEqual": ast.LtE, "assertListEqual": ast.Eq, "assertTupleEqual": ast.Eq,
        "assertDictEqual": ast.Eq, "assertSetEqual": ast.Eq, "assertSequenceEqual": ast.Eq,
        "assertMultiLineEqual": ast.Eq}  # fmt: skip


class Unconvertible(ValueError):
    """The tests cannot be turned into checks the trainer evaluates (the message says what, one line)."""


def _where(node: ast.AST) -> str:
    return f"line {getattr(node, 'lineno', '?')}"


def _is_main_guard(stmt: ast.stmt) -> bool:
    t = stmt.test if isinstance(stmt, ast.If) else None
    return (isinstance(t, ast.Compare) and isinstance(t.left, ast.Name) and t.left.id == "__name__"
            and len(t.comparators) == 1 and isinstance(t.comparators[0], ast.Constant)
            and t.comparators[0].value == "__main__")  # fmt: skip


def _is_runner_call(stmt: ast.stmt) -> bool:
    """``unittest.main()``, ``pytest.main([...])``, ``sys.exit(pytest.main())``: the grader is the runner."""
    call = stmt.value if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call) else None
    while call is not None and isinstance(call.func, ast.Attribute) and call.func.attr == "exit" and call.args:
        call = call.args[0] if isinstance(call.args[0], ast.Call) else None
    f = call.func if call is not None else None
    return isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.attr == "main" and \
        f.value.id in ("unittest", "pytest")  # fmt: skip


def _flatten(body: list[ast.stmt]) -> list[ast.stmt]:
    out: list[ast.stmt] = []
    for stmt in body:
        if _is_main_guard(stmt):
            out += _flatten(stmt.body)
        elif not _is_runner_call(stmt):
            out.append(stmt)
    return out


def _is_test_class(cls: ast.ClassDef) -> bool:
    bases = [b.attr if isinstance(b, ast.Attribute) else getattr(b, "id", "") for b in cls.bases]
    return "TestCase" in bases or (not cls.bases and cls.name.startswith("Test"))


class _SelfRewriter(ast.NodeTransformer):
    """A test method's body as a plain function body: ``self.assertX(...)`` statements become asserts."""

    def __init__(self, cls: str, helpers: set[str]) -> None:
        self.cls, self.helpers = cls, helpers

    def visit_Attribute(self, node: ast.Attribute) -> ast.AST:
        if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            if node.attr in self.helpers:
                return ast.copy_location(ast.Name(f"{self.cls}_{node.attr}", ast.Load()), node)
            return ast.copy_location(ast.Name(f"self_{node.attr}", node.ctx), node)
        return self.generic_visit(node)

    def visit_Name(self, node: ast.Name) -> ast.AST:
        if node.id in ("self", "cls"):
            raise Unconvertible(f"`{node.id}` used as a value in a test class ({_where(node)})")
        return node

    def visit_With(self, node: ast.With) -> ast.AST:
        for item in node.items:
            c = item.context_expr
            if isinstance(c, ast.Call) and _self_method(c) in ("assertRaises", "assertRaisesRegex"):
                kw = list(c.keywords)
                if _self_method(c) == "assertRaisesRegex" and len(c.args) > 1:
                    kw.append(ast.keyword("match", c.args[1]))
                item.context_expr = ast.Call(ast.Name(RAISES, ast.Load()), c.args[:1], kw)
        return self.generic_visit(node)

    def visit_Expr(self, node: ast.Expr) -> ast.AST:
        call = node.value
        name = _self_method(call) if isinstance(call, ast.Call) else None
        if name is None or not name.startswith("assert"):
            return self.generic_visit(node)
        args = [self.visit(a) for a in call.args]
        kw = {k.arg: self.visit(k.value) for k in call.keywords}
        new = _assert_for(name, args, kw, node)
        return ast.copy_location(new, node) if not isinstance(new, list) else new


def _self_method(call: ast.Call) -> str | None:
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "self" else None


def _assert_for(name: str, args: list, kw: dict, node: ast.AST) -> ast.stmt:
    def need(n: int) -> None:
        if len(args) < n:
            raise Unconvertible(f"self.{name} with {len(args)} arguments ({_where(node)})")

    if name in _CMP:
        need(2)
        return ast.Assert(ast.Compare(args[0], [_CMP[name]()], [args[1]]))
    if name in ("assertTrue", "assertFalse", "assertIsNone", "assertIsNotNone"):
        need(1)
        test = {"assertTrue": args[0], "assertFalse": ast.UnaryOp(ast.Not(), args[0]),
                "assertIsNone": ast.Compare(args[0], [ast.Is()], [ast.Constant(None)]),
                "assertIsNotNone": ast.Compare(args[0], [ast.IsNot()], [ast.Constant(None)])}[name]  # fmt: skip
        return ast.Assert(test)
    if name in ("assertAlmostEqual", "assertNotAlmostEqual"):
        need(2)
        diff = ast.Call(ast.Name("abs", ast.Load()), [ast.BinOp(args[0], ast.Sub(), args[1])], [])
        if "delta" in kw:
            test = ast.Compare(diff, [ast.LtE()], [kw["delta"]])
        else:
            places = kw.get("places", args[2] if len(args) > 2 else ast.Constant(7))
            test = ast.Compare(ast.Call(ast.Name("round", ast.Load()), [diff, places], []), [ast.Eq()],
                               [ast.Constant(0)])  # fmt: skip
        return ast.Assert(test if name == "assertAlmostEqual" else ast.UnaryOp(ast.Not(), test))
    if name == "assertCountEqual":
        need(2)
        return ast.Assert(ast.Call(ast.Name(COUNT_EQUAL, ast.Load()), args[:2], []))
    if name in ("assertIsInstance", "assertNotIsInstance"):
        need(2)
        test = ast.Call(ast.Name("isinstance", ast.Load()), args[:2], [])
        return ast.Assert(test if name == "assertIsInstance" else ast.UnaryOp(ast.Not(), test))
    if name in ("assertRaises", "assertRaisesRegex"):
        need(2)
        if name == "assertRaisesRegex":
            need(3)
        fn_args = args[1:] if name == "assertRaises" else args[2:]
        keywords = [ast.keyword("match", args[1])] if name == "assertRaisesRegex" else []
        call = ast.Expr(ast.Call(fn_args[0], fn_args[1:], [ast.keyword(k, v) for k, v in kw.items()]))
        return ast.With([ast.withitem(ast.Call(ast.Name(RAISES, ast.Load()), args[:1], keywords))], [call])
    raise Unconvertible(f"self.{name} is not graded ({_where(node)})")


def _function(name: str, args: ast.arguments, body: list[ast.stmt]) -> ast.FunctionDef:
    return ast.FunctionDef(name=name, args=args, body=body, decorator_list=[], returns=None)


def _convert_class(cls: ast.ClassDef) -> list[ast.stmt]:
    methods = {f.name: f for f in cls.body if isinstance(f, ast.FunctionDef)}
    for s in cls.body:
        if not isinstance(s, (ast.FunctionDef, ast.Pass, ast.Expr)):
            raise Unconvertible(f"class {cls.name}: a {type(s).__name__} in the class body ({_where(s)})")
    setup = [*(methods["setUpClass"].body if "setUpClass" in methods else []),
             *(methods["setUp"].body if "setUp" in methods else []),
             *(methods["setup_method"].body if "setup_method" in methods else [])]  # fmt: skip
    skip = {"setUp", "tearDown", "setUpClass", "tearDownClass", "setup_method", "teardown_method"}
    helpers = {n for n in methods if not n.startswith("test") and n not in skip}
    rw = _SelfRewriter(cls.name, helpers)
    out: list[ast.stmt] = []
    for name in sorted(helpers):
        f = methods[name]
        args = ast.arguments([], f.args.args[1:], f.args.vararg, f.args.kwonlyargs, f.args.kw_defaults,
                             f.args.kwarg, f.args.defaults)  # fmt: skip
        out.append(_function(f"{cls.name}_{name}", args, [rw.visit(s) for s in f.body]))
    for name, f in methods.items():
        if not name.startswith("test"):
            continue
        if len(f.args.args) != 1 or f.decorator_list:
            raise Unconvertible(f"{cls.name}.{name}: test methods with fixtures or decorators are not graded")
        body = [rw.visit(s) for s in [*ast.parse(ast.unparse(setup)).body, *f.body]] if setup else \
            [rw.visit(s) for s in f.body]  # fmt: skip
        fn = f"{cls.name}_{name}"
        out.append(_function(fn, ast.arguments([], [], None, [], [], None, []), body))
        out.append(ast.Expr(ast.Call(ast.Name(fn, ast.Load()), [], [])))
    return out


def _parametrize(f: ast.FunctionDef) -> list[ast.stmt]:
    """``@pytest.mark.parametrize("a, b", [(1, 2), ...])`` -> a loop calling the function once per case."""
    loops: list[tuple[list[str], ast.expr]] = []
    for d in f.decorator_list:
        ok = isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute) and d.func.attr == "parametrize" \
            and len(d.args) == 2 and isinstance(d.args[0], (ast.Constant, ast.List, ast.Tuple))  # fmt: skip
        if not ok:
            raise Unconvertible(f"{f.name}: decorator {ast.unparse(d)[:60]!r} is not graded ({_where(d)})")
        first = d.args[0]
        names = [n.strip() for n in first.value.split(",")] if isinstance(first, ast.Constant) else \
            [e.value for e in first.elts]  # fmt: skip
        loops.append((names, d.args[1]))
    params = [a.arg for a in f.args.args]
    bound = [n for names, _ in loops for n in names]
    if sorted(params) != sorted(bound):
        raise Unconvertible(f"{f.name}: arguments {params} that are pytest fixtures are not graded ({_where(f)})")
    f.decorator_list = []
    cases = _literal_cases(loops)
    if cases is not None:  # one statement, so one test, per case, as pytest counts them
        return [ast.Expr(ast.Call(ast.Name(f.name, ast.Load()), [], [ast.keyword(p, case[p]) for p in params]))
                for case in cases]  # fmt: skip
    call: ast.stmt = ast.Expr(
        ast.Call(ast.Name(f.name, ast.Load()), [], [ast.keyword(p, ast.Name(f"p_{p}", ast.Load())) for p in params])
    )
    for names, values in reversed(loops):
        target = ast.Name(f"p_{names[0]}", ast.Store()) if len(names) == 1 else \
            ast.Tuple([ast.Name(f"p_{n}", ast.Store()) for n in names], ast.Store())  # fmt: skip
        call = ast.For(target, values, [call], [])
    return [call]


def _literal_cases(loops: list[tuple[list[str], ast.expr]]) -> list[dict[str, ast.expr]] | None:
    """Every case of literal parametrize lists (the product of stacked ones) as {name: value}; None when a list
    is not written out (a name, a call), which then stays one loop."""
    cases: list[dict[str, ast.expr]] = [{}]
    for names, values in loops:
        if not isinstance(values, (ast.List, ast.Tuple)):
            return None
        rows = []
        for elt in values.elts:
            if len(names) == 1:
                rows.append({names[0]: elt})
            elif isinstance(elt, (ast.Tuple, ast.List)) and len(elt.elts) == len(names):
                rows.append(dict(zip(names, elt.elts)))
            else:
                return None
        cases = [{**c, **r} for c in cases for r in rows]
    return cases


def _check_import(node: ast.Import | ast.ImportFrom) -> None:
    known = ", ".join(sorted(GRADER_MODULES - {"__future__"}))
    if isinstance(node, ast.Import):
        for a in node.names:
            if a.name not in GRADER_MODULES and a.name not in PROGRAM_MODULES:
                raise Unconvertible(
                    f"import of {a.name!r}: the grader evaluates tests itself and knows only {known}"
                    f" (and the program as {'/'.join(sorted(PROGRAM_MODULES))}) ({_where(node)})"
                )
        return
    mod = node.module or ""
    if node.level or (mod not in GRADER_MODULES and mod not in PROGRAM_MODULES):
        raise Unconvertible(
            f"import from {mod or '.'!r}: the grader evaluates tests itself and knows only {known} "
            f"(and the program as {'/'.join(sorted(PROGRAM_MODULES))}) ({_where(node)})"
        )
    allowed = MODULES.get(mod, _PYTEST_NAMES if mod == "pytest" else None)
    if mod == "typing" or allowed is None:  # typing: annotations only; the program's module: any of its names
        return
    for a in node.names:
        if a.name != "*" and a.name not in allowed:
            raise Unconvertible(f"from {mod} import {a.name}: not a name the grader evaluates ({_where(node)})")


_MODULE_NAMES = {**MODULES, "pytest": _PYTEST_NAMES, "unittest": {"TestCase", "main"}}


def _check_module_attributes(tree: ast.Module) -> None:
    """``np.array``, ``math.foo``: a name of a grader module that the grader does not evaluate is refused here, at
    load, rather than failing every sample's check later."""
    aliases = {a.asname or a.name: a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            mod = aliases[node.value.id]
            names = _MODULE_NAMES.get(mod)
            if mod == "typing" or names is None:
                continue
            if node.attr not in names:
                raise Unconvertible(f"{mod}.{node.attr} is not evaluated by the grader ({_where(node)})")


def _validate(tree: ast.Module) -> None:
    for node in ast.walk(tree):
        if isinstance(node, ast.stmt) and not isinstance(node, _STMTS):
            raise Unconvertible(f"`{type(node).__name__}` statements are not graded ({_where(node)})")
        if isinstance(node, ast.expr) and not isinstance(node, _EXPRS):
            raise Unconvertible(f"`{type(node).__name__}` expressions are not graded ({_where(node)})")
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            _check_import(node)
        if isinstance(node, ast.Name) and node.id.startswith("__"):
            raise Unconvertible(f"the name {node.id[:40]} is not graded ({_where(node)})")
        if isinstance(node, ast.Attribute) and node.attr.startswith("_"):
            raise Unconvertible(f"the attribute .{node.attr[:40]} is not graded ({_where(node)})")
        if isinstance(node, ast.FunctionDef) and node.decorator_list:
            raise Unconvertible(f"{node.name}: decorators are not graded ({_where(node)})")
        if isinstance(node, ast.With) and any(
            i.optional_vars is not None and not isinstance(i.optional_vars, ast.Name) for i in node.items
        ):
            raise Unconvertible(f"a with-target that is not a name ({_where(node)})")
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in UNSAFE_BUILTINS and \
                node.id not in bound_names(tree):  # fmt: skip
            raise Unconvertible(f"the builtin {node.id}() is not evaluated by the grader ({_where(node)})")
    _check_module_attributes(tree)
    if not any(isinstance(n, (ast.Assert, ast.With)) for n in ast.walk(tree)):
        raise Unconvertible("no assert (nor raises check) the grader can evaluate")


def bound_names(tree: ast.AST) -> set[str]:
    """Every name the tests bind anywhere (assignments, defs, parameters, imports, loop and with targets): such a
    name is never the program's, even where it is not bound yet."""
    names: set[str] = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Store, ast.Del)):
            names.add(n.id)
        elif isinstance(n, (ast.FunctionDef, ast.ClassDef)):
            names.add(n.name)
        elif isinstance(n, ast.arg):
            names.add(n.arg)
        elif isinstance(n, ast.alias):
            names.add((n.asname or n.name).split(".")[0])
        elif isinstance(n, ast.ExceptHandler) and n.name:
            names.add(n.name)
    return names


def convert(source: str) -> ast.Module:
    """The tests as plain statements the grader evaluates (see the module docstring); Unconvertible if not."""
    try:
        tree = ast.parse(source)
    except SyntaxError as exc:
        raise Unconvertible(f"not valid Python ({exc.msg}, line {exc.lineno})") from None
    body = _flatten(tree.body)
    called = {n.func.id for s in body for n in ast.walk(s)
              if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}  # fmt: skip
    out: list[ast.stmt] = []
    tail: list[ast.stmt] = []
    for stmt in body:
        if isinstance(stmt, ast.ClassDef):
            if not _is_test_class(stmt):
                raise Unconvertible(
                    f"class {stmt.name}: only unittest.TestCase / pytest Test* classes are graded ({_where(stmt)})"
                )
            tail += _convert_class(stmt)
        elif isinstance(stmt, ast.FunctionDef) and stmt.name.startswith("test") and stmt.name not in called:
            if stmt.decorator_list:
                tail += _parametrize(stmt)
            elif stmt.args.args:
                raise Unconvertible(
                    f"{stmt.name}: pytest fixtures ({', '.join(a.arg for a in stmt.args.args)}) "
                    f"are not graded ({_where(stmt)})"
                )
            else:
                tail.append(ast.Expr(ast.Call(ast.Name(stmt.name, ast.Load()), [], [])))
            out.append(stmt)
        else:
            out.append(stmt)
    module = ast.fix_missing_locations(ast.Module(out + tail, []))
    _validate(module)
    _check_excinfo(module)
    return module


_EXCINFO = {"value", "exception", "type", "typename"}  # what the grader knows of a caught exception


def _check_excinfo(module: ast.Module) -> None:
    """Refuse what the grader cannot answer about a raises block's exception (``cm.exception.args``,
    ``excinfo.match(...)``): it knows the type's name and the message only, and a test that asks for more would
    fail a right program without a word."""
    caught = {i.optional_vars.id for n in ast.walk(module) if isinstance(n, ast.With)
              for i in n.items if isinstance(i.optional_vars, ast.Name)}  # fmt: skip
    for n in ast.walk(module):
        if not isinstance(n, ast.Attribute):
            continue
        base = n.value
        if isinstance(base, ast.Name) and base.id in caught and n.attr not in _EXCINFO:
            bad = ast.unparse(n)
        elif isinstance(base, ast.Attribute) and isinstance(base.value, ast.Name) and base.value.id in caught:
            bad = ast.unparse(n)
        else:
            continue
        raise Unconvertible(
            f"{bad[:60]}: of a caught exception the grader knows its type and message only (str(e.value) or "
            f"str(cm.exception), e.type) ({_where(n)})"
        )
