"""grader: which parts of an assert enter the sandbox, and how the parent scores the values that come back."""

from __future__ import annotations

import math

import pytest

from grpokit.rewards.grader import decode, n_asserts, passed_asserts, plan_asserts


def simulate(tests: str, program: dict) -> set[int]:
    """Grade ``tests`` against a fake sandbox that evaluates each leaf in ``program``'s namespace."""
    plan = plan_asserts(tests)
    ns = dict(program)
    reports = {}
    for k, (kind, src) in enumerate(plan.steps):
        try:
            if kind == "exec":
                exec(src, ns)
                reports[k] = {"k": k, "ok": True}
            else:
                reports[k] = {"k": k, "v": _encode(eval(src, ns))}
        except Exception as exc:  # noqa: BLE001
            reports[k] = {"k": k, "err": type(exc).__name__}
            if kind == "exec":
                break
    return passed_asserts(plan, reports)


def _encode(v):
    from grpokit.rewards._sandbox_child import encode

    return encode(v)


def test_only_program_dependent_leaves_enter_the_sandbox():
    plan = plan_asserts(
        "import math\nexpected = [1, 4, 9]\nassert f(2) == 4\nassert abs(h(1) - 0.5) < 1e-6\n"
        "assert [f(x) for x in range(1, 4)] == expected\nassert sorted(g([3, 1, 2])) == [1, 2, 3]"
    )
    evals = [src for kind, src in plan.steps if kind == "eval"]
    assert evals == ["f(2)", "h(1)", "f(1)", "f(2)", "f(3)", "g([3, 1, 2])"]
    sent = " ".join(src for _, src in plan.steps)
    assert "expected" not in sent and "[1, 4, 9]" not in sent and "0.5" not in sent and "1e-06" not in sent
    assert n_asserts(plan) == 4


def test_forms_graded_like_python():
    tests = ("assert f(3) == 9\nassert f(2) != 5\nassert 0 < f(1) <= 1\nassert f(4) in (16, 17)\n"
             "assert not f(0)\nassert f(2) is not None\nassert math.isclose(r(), 0.1 + 0.2)\n"
             "assert all(f(i) == i * i for i in range(5))\nassert s(' Ab ').strip().lower() == 'ab'\n"
             "assert t() == (1, 2) and t() != [1, 2]\nassert d() == {'a': {1, 2}}\nassert f(2) == 4.0")
    square = {"f": lambda x: x * x, "r": lambda: 0.30000000000000004, "s": lambda x: x,
              "t": lambda: (1, 2), "d": lambda: {"a": {2, 1}}}  # fmt: skip
    assert simulate(tests, square) == set(range(12))
    wrong = {"f": lambda x: x + x, "r": lambda: 0.3001, "s": lambda x: x + "x", "t": lambda: [1, 2],
             "d": lambda: {"a": [1, 2]}}  # fmt: skip
    assert simulate(tests, wrong) == {1, 4, 5, 11}  # what x + x passes in Python too (4 != 5, not 0, 4 == 4.0)


def test_setup_statements_and_humaneval_check():
    tests = ("def check(candidate):\n    assert candidate(1) == 2\n    assert candidate(5) == 10\n"
             "    helper = 3\n    assert candidate(helper) == 6\ncheck(double)")
    assert simulate(tests, {"double": lambda x: 2 * x}) == {0, 1, 2}
    assert simulate(tests, {"double": lambda x: x + 1}) == {0}
    loop = "cases = [(1, 2), (5, 10)]\nfor x, y in cases:\n    assert double(x) == y\n    assert double(x) > 0"
    assert simulate(loop, {"double": lambda x: 2 * x}) == {0, 1, 2, 3}
    assert simulate(loop, {"double": lambda x: x + 1}) == {0, 1, 3}
    assert all("10" not in src for _, src in plan_asserts(loop).steps)  # expected values stay outside
    failing_setup = "x = g()\nassert f(x) == 2\nassert f(1) == 2"
    assert simulate(failing_setup, {"f": lambda x: 2, "g": lambda: 1 / 0}) == set()  # set-up fails: all after fail


def test_values_the_parent_cannot_decode_fail():
    assert decode({"__t": "tuple", "v": [1, {"__t": "bytes", "v": "ff"}]}) == (1, b"\xff")
    for bad in ({"__t": "eq", "v": 1}, {"__t": "tuple", "v": 8191}, {"a": 1}, {"__t": "dict", "v": [[1]]}):
        with pytest.raises(ValueError):
            decode(bad)
    plan = plan_asserts("assert f(1) == 1\nassert f(2) == 2")
    forged = {0: {"k": 0, "v": {"__t": "eq", "v": 1}}, 1: {"k": 1, "err": "TypeError"}}
    assert passed_asserts(plan, forged) == set()


def test_guards_and_no_asserts():
    big = plan_asserts("assert 2 ** f(1) > 0\nassert len('x' * f(2)) > 0")
    assert passed_asserts(big, {0: {"k": 0, "v": 10**9}, 1: {"k": 1, "v": 10**12}}) == set()  # bounded, not hung
    setup_only = plan_asserts("f(1)")
    assert passed_asserts(setup_only, {0: {"k": 0, "ok": True}}) == {0}
    assert passed_asserts(setup_only, {0: {"k": 0, "err": "ValueError"}}) == set()
    assert math.isnan(decode(float("nan")))
