"""Tools for ``tool_call_scheduler``: a safe calculator and the ReAct ``Action:`` / ``Action Input:`` parser.

The calculator never calls ``eval``: it walks the ``ast`` of the expression and allows only numbers, ``+ - * /
** %``, unary signs and parentheses. Exponents are bounded and integer results are capped in size, so a model
cannot make the trainer compute ``9**9**9``. ``^`` is read as power, ``×``/``÷`` as ``*``/``/``.
"""

from __future__ import annotations

import ast
import math
import operator
import re
from collections.abc import Callable

from grpokit.registry import Registry

MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 1000  # |b| in a ** b
MAX_INT_BITS = 4096  # integer results beyond ~1233 digits are refused

_BINARY: dict[type, Callable] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class ToolError(ValueError):
    """Bad tool input; its message becomes the observation the model sees."""


def _check_size(value: int | float) -> int | float:
    if isinstance(value, complex):  # e.g. (-8) ** 0.5
        raise ToolError("result is not a real number")
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise ToolError("result too large")
    if isinstance(value, float) and not math.isfinite(value):
        raise ToolError("result is not a finite number")
    return value


def _power(base: int | float, exp: int | float) -> int | float:
    if abs(exp) > MAX_EXPONENT:
        raise ToolError(f"exponent {exp} is larger than {MAX_EXPONENT}")
    if isinstance(base, int) and isinstance(exp, int) and exp > 0:
        if max(base.bit_length(), 1) * exp > MAX_INT_BITS * 2:  # refuse before computing a huge power
            raise ToolError("result too large")
    return base**exp


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            return _check_size(_power(left, right))
        return _check_size(_BINARY[type(node.op)](left, right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    raise ToolError(f"unsupported expression element {type(node).__name__}; use numbers, + - * / ** % and ()")


def format_number(value: int | float) -> str:
    """Integers as is; floats with up to 12 significant digits, whole floats without '.0'."""
    if isinstance(value, float):
        if value.is_integer() and abs(value) < 1e15:
            return str(int(value))
        return f"{value:.12g}"
    return str(value)


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression safely; ToolError with a readable reason otherwise."""
    expr = expression.strip().strip("`'\"").strip()
    if not expr:
        raise ToolError("empty expression")
    if len(expr) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    expr = expr.replace("^", "**").replace("×", "*").replace("÷", "/")
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError:
        raise ToolError(f"cannot parse {expr!r}") from None
    try:
        return format_number(_eval(tree))
    except ZeroDivisionError:
        raise ToolError("division by zero") from None
    except OverflowError:
        raise ToolError("result too large") from None


# name → callable(str) -> str; a plugin may add tools: ``tools['search'] = my_search``
tools = Registry("tool", "Action:")
tools["calculator"] = calculator

_ACTION_RE = re.compile(r"Action:\s*(?P<name>[^\n]*?)\s*\n\s*Action Input:\s*(?P<input>[^\n]*)", re.DOTALL)


def parse_action(text: str) -> tuple[str, str] | None:
    """The last ``Action: name`` / ``Action Input: input`` pair of a ReAct completion, or None."""
    found = list(_ACTION_RE.finditer(text))
    if not found:
        return None
    m = found[-1]
    tool_input = m.group("input").split("Observation:")[0].strip()
    return m.group("name").strip(), tool_input


def run_tool(name: str, tool_input: str, registry: dict[str, Callable[[str], str]] | None = None) -> str:
    """The tool's output, or an ``error: ...`` text the model can read (unknown tool, bad input)."""
    registry = tools if registry is None else registry
    fn = registry.get(name)
    if fn is None:
        return f"error: unknown tool {name!r}; available tools: {', '.join(sorted(registry))}"
    try:
        return str(fn(tool_input))
    except ToolError as e:
        return f"error: {e}"
