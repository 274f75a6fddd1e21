"""grader: tests run in the trainer, the program only answers calls; every test style, refusals, bounds."""

from __future__ import annotations

import json
import math
import time

import pytest

from grpokit.rewards._grader_eval import decode
from grpokit.rewards._sandbox_child import _answer, encode
from grpokit.rewards.grader import Unconvertible, grade, prepare
from grpokit.rewards.sandbox_result import log_safe, parse_report


class FakeSandbox:
    """Answers calls the way the harness does, from a namespace of plain Python functions (no sandbox)."""

    def __init__(self, ns: dict) -> None:
        self.ns, self.results, self.sent = dict(ns), {}, []

    def __call__(self, src: str, args: list) -> dict:
        self.sent.append((src, args))
        return json.loads(_answer(len(self.sent), src, json.loads(json.dumps(args)), self.ns, self.results))


def score(tests: str, ns: dict) -> tuple[int, int]:
    g = grade(prepare(tests), FakeSandbox(ns), time.monotonic() + 30)
    return g.passed, g.checks


def right(n):
    return 2**n - 1


def wrong(n):
    return 0


class Yes:
    def __eq__(self, other):
        return True

    def __bool__(self):
        return True


STYLES = {
    "top_level": "expected = 8191\nassert f(13) == expected\nassert f(5) == 31\nassert abs(f(1) - 1) < 1e-9",
    "check_candidate": "def check(candidate):\n    assert candidate(13) == 8191\n    assert candidate(5) == 31\n"
    "check(f)",
    "zero_arg_test_called": "def test_x():\n    assert f(13) == 8191\n    assert f(5) == 31\ntest_x()",
    "pytest_uncalled_parametrize": "from solution import f\nimport pytest\ndef test_a():\n    assert f(13) == 8191\n"
    "@pytest.mark.parametrize('n, e', [(2, 3), (5, 31)])\ndef test_b(n, e):\n"
    "    assert f(n) == e\n",
    "while_loop": "i = 1\nwhile i < 6:\n    assert f(i) == 2 ** i - 1\n    i += 1",
    "main_guard": "if __name__ == '__main__':\n    for n in range(1, 5):\n        assert f(n) == 2 ** n - 1\n"
    "    print('ok')",
    "evalplus_assertion": (
        "import numpy as np\ndef is_floats(x) -> bool:\n    if isinstance(x, float):\n        return True\n"
        "    if isinstance(x, (list, tuple)):\n        return all(isinstance(i, float) for i in x)\n"
        "    if isinstance(x, np.ndarray):\n        return x.dtype == np.float64 or x.dtype == np.float32\n"
        "    return False\ndef assertion(out, exp, atol):\n    exact_match = out == exp\n"
        "    if atol == 0 and is_floats(exp):\n        atol = 1e-6\n    if not exact_match and atol != 0:\n"
        "        assert np.allclose(out, exp, rtol=1e-07, atol=atol)\n    else:\n        assert exact_match\n"
        "inputs = [[1], [5], [13]]\nresults = [1, 31, 8191]\ndef check(candidate):\n"
        "    for i, (inp, exp) in enumerate(zip(inputs, results)):\n        assertion(candidate(*inp), exp, 0)\n"
        "check(f)"
    ),
    "unittest": "import unittest\nclass T(unittest.TestCase):\n    def setUp(self):\n        self.n = 13\n"
    "    def test_a(self):\n        self.assertEqual(f(self.n), 8191)\n    def test_b(self):\n"
    "        self.assertTrue(f(1) == 1)\n        self.assertAlmostEqual(f(2), 3.0)\n"
    "if __name__ == '__main__':\n    unittest.main(exit=False)",
    "expected_side_helpers": "from math import factorial\ndef ref(n):\n    return 2 ** n - 1\n"
    "exp = list(map(lambda n: ref(n), [1, 5, 13]))\nassert [f(n) for n in [1, 5, 13]] == exp\n"
    "assert f(3) == int(f'{7}')\nassert f(10) == factorial(6) + 303",
    "raises": "import pytest\nassert f(3) == 7\nwith pytest.raises(TypeError):\n    f('x')",
}


@pytest.mark.parametrize("style", sorted(STYLES))
def test_each_style_right_one_wrong_zero_liar_zero(style):
    tests = STYLES[style]
    passed, checks = score(tests, {"f": right})
    assert passed == checks > 0
    assert score(tests, {"f": lambda n: Yes()})[0] == 0  # __eq__ always True, truthy: never reaches a verdict
    wrong_passed, _ = score(tests, {"f": wrong})
    assert wrong_passed == 0


def test_expected_values_never_reach_the_sandbox():
    sandbox = FakeSandbox({"f": right})
    grade(
        prepare(STYLES["expected_side_helpers"] + "\nexpected = [8191, 31]\nassert [f(13), f(5)] == expected"),
        sandbox,
        time.monotonic() + 30,
    )
    sent = json.dumps(sandbox.sent)
    assert "8191" not in sent and "5040" not in sent and "ref" not in sent
    assert all(src.startswith("f(") for src, _ in sandbox.sent)


def test_program_objects_kept_remote_and_methods_called():
    tests = "s = Solution()\nassert s.twice(4) == 8\nassert s.twice(1) == 2\nassert s == s"
    ns = {"Solution": type("Solution", (), {"twice": lambda self, x: 2 * x})}
    assert score(tests, ns) == (2, 3)  # comparing the program's object itself fails


def test_refused_files_say_why_in_one_line():
    for tests, why in [("import os\nassert f(1) == 1", "import of 'os'"), ("f(1)", "no assert"),
                       ("class A:\n    pass\nassert f(1)", "class A"), ("assert f(1).__class__", ".__class__"),
                       ("def test_a(tmp_path):\n    assert f(1)", "fixtures"), ("assert (", "not valid Python"),
                       ("global x\nassert f(1)", "Global"), ("import numpy.linalg\nassert f(1)", "numpy.linalg"),
                       ("import sympy\nassert f(1) == sympy.sqrt(4)", "sympy"),
                       ("from math import system\nassert f(1)", "math import system"),
                       ("assert f(3) == eval('7')", "eval"), ("assert f(1) == getattr(x, 'y')", "getattr"),
                       ("import numpy as np\nassert (f(1) == np.array([1])).all()", "numpy.array")]:  # fmt: skip
        with pytest.raises(Unconvertible, match=why) as err:
            prepare(tests)
        assert "\n" not in str(err.value)


def test_set_up_failure_fails_what_follows():
    tests = "x = g()\nassert f(x) == 2\nassert f(1) == 2"
    assert score(tests, {"f": lambda x: 2, "g": lambda: 1 / 0}) == (0, 2)
    assert score(
        "def test_a():\n    assert f(1) == 2\n    x = 1 / f(0)\n    assert f(2) == 2\ntest_a()",
        {"f": lambda x: 2 if x else 0},
    ) == (0, 1)  # one test: it fails as a whole where it stops


def test_parent_side_work_is_bounded():
    big = "assert 2 ** f(1) > 0\nassert len('x' * f(2)) > 0\nassert ('%0500000000d' % f(3))\n" \
          "assert f'{f(3):>999999999}'\nassert 'a'.replace('a', 'b' * 10**6) * f(4)"  # fmt: skip
    start = time.monotonic()
    assert score(big, {"f": lambda n: 10**9}) == (0, 5)
    assert time.monotonic() - start < 5
    assert score("while True:\n    assert f(1) == 1", {"f": lambda n: 1})[1] < 3_000_000  # the op budget


def test_integers_of_any_length():
    huge = math.factorial(2000)  # 5736 digits: beyond int()'s default limit of 4300
    assert score("from math import factorial\nassert f(2000) == factorial(2000)", {"f": math.factorial}) == (1, 1)
    assert decode(encode(huge)) == huge and decode(encode(-huge)) == -huge
    assert parse_report(b'{"q": 1, "v": ' + b"9" * 5000 + b"}") is None  # a forged plain long integer
    assert parse_report(b"[" * 100000) is None and parse_report(b"\xff") is None
    with pytest.raises(ValueError):
        decode({"__t": "int", "v": "0x" + "f" * (1 << 22)})


def test_log_safe_escapes_and_cuts():
    s = log_safe("a\nFORGED LINE\x1b[31mred" + "x" * 200_000)
    assert "\n" not in s and "\x1b" not in s and len(s) <= 201


def test_test_values_never_travel_with_program_objects():
    """``zip(f(), expected)`` answered by the program could pair every expected value with itself."""

    class Gen:
        def __iter__(self):
            return iter([0, 0, 0])

    tests = "expected = [1, 31, 8191]\nassert all(a == b for a, b in zip(g(), expected))\n" \
            "assert list(map(f, [1, 5, 13])) == expected\nassert sorted(g()) == [0, 0, 0]"  # fmt: skip
    sandbox = FakeSandbox({"g": Gen, "f": right})
    sandbox.ns["g"] = lambda: Gen()
    g = grade(prepare(tests), sandbox, time.monotonic() + 30)
    assert (g.passed, g.checks) == (2, 3)  # zip over the program's items fails honestly; map(f) and sorted pass
    assert "8191" not in json.dumps(sandbox.sent)


def test_program_variables_are_fetched_as_values():
    assert score("assert ANSWER == 42\nassert TABLE[2] == 'c'\nassert not EMPTY",
                 {"ANSWER": 42, "TABLE": "abc", "EMPTY": []}) == (3, 3)  # fmt: skip
    assert score("assert ANSWER == 42", {"ANSWER": Yes()}) == (0, 1)


def test_answers_are_bounded_in_what_they_keep():
    tests = "xs = [f(i) for i in range(8)]\nassert len(xs) == 8"
    assert score(tests, {"f": lambda i: list(range(200_000))}) == (0, 1)  # 1.6 M values: over the bound
    assert score(tests, {"f": lambda i: list(range(1000))}) == (1, 1)


def test_test_names_are_never_the_programs():
    tests = "if False:\n    expected = 7\nassert f(3) == expected\nprint('done')\nassert f(3) == 7"
    assert score(tests, {"f": right, "expected": 0}) == (1, 2)  # not the program's `expected`, which it defines
    assert score("def g():\n    return next(it)\nit = iter([7])\nassert f(3) == g()", {"f": right}) == (1, 1)


def test_answers_that_would_take_the_trainer_quadratic_time_fail():
    m = 2**61 - 1  # ints equal modulo m hash alike: a set of 100 000 of them would take minutes to build
    colliding = [k * m for k in range(1, 100_001)]
    answers = {"set": {"__t": "set", "v": colliding}, "list": colliding}

    def call(src, args):  # answers as the harness would send them (a real set of these would hang this test too)
        return {"q": 1, "v": answers[src.split("(")[0][2:]]}

    start = time.monotonic()
    for tests in (
        "assert len(f_set(1)) == 100000",
        "assert len(set(f_list(1))) == 100000",
        "assert len({x for x in f_list(1)}) == 100000",
    ):
        g = grade(prepare(tests), call, time.monotonic() + 30)
        assert (g.passed, g.checks) == (0, 1), tests
    big = 3**400_000
    assert score("assert f(1) % f(2) == 0", {"f": lambda n: big + n}) == (0, 1)  # quadratic long division
    assert time.monotonic() - start < 10
    assert score("assert len(f(1)) == 5000", {"f": lambda n: set(range(5000))}) == (1, 1)  # plain sets are fine


# --- a test passes or fails as a whole; right programs get Python's verdict (issue 53) -------------------------------


def test_the_program_cannot_choose_how_many_checks_there_are():
    tests = "assert f(3) == 7\nfor v in g():\n    assert v > 0"
    many = {"f": wrong, "g": lambda: [1] * 20_000}
    assert score(tests, many) == (1, 2)  # the looped assert is one test, whatever g returns
    assert score(tests, {"f": right, "g": lambda: [1, 0] * 10_000}) == (1, 2)


def test_raising_early_scores_no_better_than_answering_wrong():
    tests = "def check(candidate):\n" + "".join(f"    assert candidate({n}) == {2**n - 1}\n" for n in range(10))
    tests += "check(f)\nassert f(3) == 7"

    def raises(n):
        raise ValueError(n)

    assert score(tests, {"f": raises}) == score(tests, {"f": wrong}) == (0, 2)
    assert score(tests, {"f": lambda n: 2**n - 1 if n < 9 else 0}) == (1, 2)  # check() fails as a whole


@pytest.mark.parametrize(
    "a, b",
    [("[]", "[[], [], []]"), ("[1, 2]", "[1, 2, 3]"), ("[[1, 2], [3]]", "[1, 2]"), ("[[1], [2]]", "[1, 2]"),
     ("[1.0]", "1.0"), ("[0.1, 0.2]", "[0.1, 0.2]")],
)  # fmt: skip
@pytest.mark.parametrize("fn", ["isclose", "allclose"])
def test_numpy_stand_ins_give_numpys_verdict(a, b, fn):
    import numpy as np

    try:
        expected = 1 if bool(getattr(np, fn)(eval(a), eval(b))) else 0
    except ValueError:  # numpy raises (shapes, ambiguous truth): the check fails
        expected = 0
    tests = f"import numpy as np\nassert np.{fn}(f({a}), {b})"
    assert score(tests, {"f": lambda x: x}) == (expected, 1)


LINKED = """
def build(xs):
    head = None
    for x in reversed(xs):
        head = ListNode(x, head)
    return head
def to_list(node):
    out = []
    assert not (node and not node)
    while node and True:
        out.append(node.val)
        node = node.next
    return out
assert to_list(reverse(build([1, 2, 3]))) == [3, 2, 1]
assert not reverse(None)
"""


class ListNode:
    def __init__(self, val=0, next=None):
        self.val, self.next = val, next


def _reverse(head):
    prev = None
    while head:
        head.next, prev, head = prev, head, head.next
    return prev


@pytest.mark.parametrize(
    "tests, ns",
    [
        ("nums = [3, 1, 2]\nsort_in_place(nums)\nassert nums == [1, 2, 3]", {"sort_in_place": lambda a: a.sort()}),
        ("d = {}\nfill(d)\nassert d == {'a': 1}", {"fill": lambda d: d.update(a=1)}),
        (LINKED, {"ListNode": ListNode, "reverse": _reverse}),
        ("try:\n    f(-1)\n    assert False\nexcept ValueError:\n    pass", {"f": lambda n: math.sqrt(n)}),
        ("try:\n    f(-1)\nexcept ValueError as e:\n    assert 'domain' in str(e)\nelse:\n    assert False",
         {"f": lambda n: math.sqrt(n)}),
        ("import unittest\nclass T(unittest.TestCase):\n    def test_a(self):\n"
         "        with self.assertRaises(ValueError) as cm:\n            f(-1)\n"
         "        self.assertIn('domain', str(cm.exception))", {"f": lambda n: math.sqrt(n)}),
        ("import pytest\ndef test_k():\n    with pytest.raises(KeyError, match='missing'):\n        f('missing')",
         {"f": lambda k: {}[k]}),
    ],
)  # fmt: skip
def test_right_programs_get_pythons_verdict_in_every_documented_style(tests, ns):
    passed, checks = score(tests, ns)
    assert passed == checks > 0
    broken = {k: (lambda *a, **kw: None) if k != "ListNode" else v for k, v in ns.items()}
    assert score(tests, broken)[0] < checks  # and a program that does nothing does not pass them


def test_each_parametrize_case_is_a_test_as_pytest_counts_them():
    tests = STYLES["pytest_uncalled_parametrize"]  # test_a, and test_b with two cases
    assert score(tests, {"f": right}) == (3, 3)
    assert score(tests, {"f": lambda n: 0 if n == 5 else right(n)}) == (2, 3)


@pytest.mark.parametrize("use", ["e.value.args[0] == 'x'", "e.match('x')", "e.exception.errno == 2"])
def test_what_the_grader_cannot_know_of_an_exception_is_refused_at_load(use):
    with pytest.raises(Unconvertible, match="knows its type and message only"):
        prepare(f"import pytest\nwith pytest.raises(ValueError) as e:\n    f(1)\nassert {use}")
