"""Built-in rewards on hand-written completions: right, wrong, malformed, empty."""

from __future__ import annotations

import math

import pytest

from grpokit.errors import ConfigError
from grpokit.rewards import orms, prms
from grpokit.rewards.math_rewards import answer_matches, extract_answer, last_boxed, last_number
from grpokit.rewards.shape_rewards import CosineReward, RepetitionPenalty, SoftOverlong
from grpokit.rewards.toolbench import argument_f1, parse_react, rouge_l


class WordTokenizer:
    """Counts whitespace-separated words as tokens, so expected lengths are obvious."""

    def __call__(self, texts, add_special_tokens=False):
        return {"input_ids": [list(range(len(t.split()))) for t in texts]}


# --- accuracy ------------------------------------------------------------------------------------------------------


def test_accuracy_demo_task_replies():
    # The built-in demo task: "What is 7 + 5? Answer with just the number.", solution "12".
    replies = ["12", "The answer is 12.", "7 + 5 = 12", "7 + 5 = 13", "", "I don't know"]
    assert orms["accuracy"]()(replies, solution=["12"] * 6) == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]


def test_accuracy_prefers_answer_tag_then_boxed():
    acc = orms["accuracy"]()
    completions = [
        "<think>7+5 is 13? no</think><answer>12</answer>",  # tag wins over the 13 in the reasoning
        "so \\boxed{12}, not 13",  # boxed wins over the last number
        "<think>12</think><answer>13</answer>",  # tag says 13: wrong
        "<answer>12",  # malformed tag: falls back to the last number
        "\\boxed{12",  # unbalanced box: falls back to the last number
    ]
    assert acc(completions, solution=["12"] * 5) == [1.0, 1.0, 0.0, 1.0, 1.0]


def test_accuracy_math_equivalence_and_text_solutions():
    acc = orms["accuracy"]()
    completions = ["\\boxed{\\frac{1}{2}}", "0.5", "Paris.", "Lyon", "<answer>1,000</answer>"]
    solutions = ["0.5", "$\\frac{1}{2}$", "Paris", "Paris", "1000"]
    assert acc(completions, solution=solutions) == [1.0, 1.0, 1.0, 0.0, 1.0]


@pytest.mark.parametrize(
    ("answer", "gold"),
    [
        ("12", "12"),
        ("12", "13"),
        ("-3", "-3"),
        ("-3", "3"),
        ("007", "7"),
        ("-0", "0"),
        ("123456789012345678901", "123456789012345678901"),
        ("10", " 10 "),
    ],
)
def test_integer_shortcut_agrees_with_math_verify(answer, gold):
    from math_verify import parse, verify

    from grpokit.rewards.math_rewards import _verified

    assert _verified(answer, gold) == bool(verify(parse(gold), parse(answer)))


@pytest.mark.parametrize(
    "completion",
    ["so 2", "\\boxed{\\frac{4}{2}}", "<answer>2.0</answer>", "two", "", "\\boxed{3}", "<answer>1,000</answer>"],
)
@pytest.mark.parametrize("gold", ["2", "1000", " 2 "])
def test_integer_gold_verdict_agrees_with_math_verify(completion, gold):
    """An integer solution is not parsed by math-verify first (it is math for sure); the verdict is unchanged."""
    from math_verify import parse, verify

    answer = extract_answer(completion)
    expected = answer is not None and bool(verify(parse(gold), parse(answer)))
    assert answer_matches(completion, gold) == expected


def test_accuracy_none_solution_is_unscored():
    assert orms["accuracy"]()(["12"], solution=[None]) == [None]


def test_answer_extraction_helpers():
    assert last_boxed("a \\boxed{\\frac{1}{2}} b \\boxed{3}") == "3"
    assert last_boxed("\\boxed{x^{2}}") == "x^{2}"
    assert last_number("10-2") == "2"  # the minus is an operator here, not a sign
    assert last_number("it is -3") == "-3"
    assert last_number("1,000 apples") == "1000"
    assert extract_answer("") is None
    assert extract_answer("<answer> </answer>") is None


# --- math (boxed + sympy) ------------------------------------------------------------------------------------------


def test_math_boxed_sympy():
    m = orms["math"]()
    completions = ["\\boxed{2\\sqrt{2}}", "\\boxed{x^2+2x+1}", "\\boxed{3}", "the answer is 12", "", "\\boxed{"]
    solutions = ["\\sqrt{8}", "(x+1)^2", "\\boxed{4}", "12", "1", "1"]
    assert m(completions, solution=solutions) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]


# --- format / react_format -----------------------------------------------------------------------------------------


def test_format():
    f = orms["format"]()
    completions = [
        "<think>add</think><answer>12</answer>",
        "<think>add</think>\n\n<answer>12</answer>",  # whitespace between the blocks is allowed
        "<think>add</think><answer>12</answer> extra",  # text after the answer
        "<answer>12</answer>",  # no think block
        "",
    ]
    assert f(completions) == [1.0, 1.0, 0.0, 0.0, 0.0]


def test_react_format():
    f = orms["react_format"]()
    completions = [
        "<think>need a tool</think>\nAction: calculator\nAction Input: 3*4",
        "Action: calculator\nAction Input: 3*4",  # no think block
        "<think>done</think>\nThe answer is 12",  # no action
        "",
    ]
    assert f(completions) == [1.0, 0.0, 0.0, 0.0]


# --- cosine --------------------------------------------------------------------------------------------------------


def test_cosine_values_with_token_ids():
    r = CosineReward(cosine_max_len=10)
    # correct (r_0, r_L) = (1.0, 0.5); wrong (-0.5, 0.0); r(L) = r_L + (r_0 - r_L)(1 + cos(pi L / 10)) / 2
    # correct L=0 -> 1.0; correct L=5 -> 0.5 + 0.5 * 0.5 = 0.75; correct L=10 -> 0.5
    # wrong L=5 -> 0 + (-0.5) * 0.5 = -0.25; wrong L=20 is clipped to 10 -> 0.0
    completions = ["12", "12", "12", "13", "13"]
    ids = [[], [0] * 5, [[0] * 4, [0] * 6], [0] * 5, [0] * 20]  # the third is two turns: 4 + 6 tokens
    out = r(completions, solution=["12"] * 5, response_token_ids=ids)
    assert out == pytest.approx([1.0, 0.75, 0.5, -0.25, 0.0])


def test_cosine_counts_with_tokenizer_and_empty_completion():
    r = CosineReward(tokenizer=WordTokenizer(), cosine_max_len=10)
    # "7 + 5 = 12" is 5 words and correct -> 0.75; "" is 0 tokens and wrong -> -0.5
    assert r(["7 + 5 = 12", ""], solution=["12", "12"]) == pytest.approx([0.75, -0.5])


def test_cosine_needs_token_counts():
    with pytest.raises(ConfigError, match="tokenizer"):
        CosineReward(cosine_max_len=10)(["12"], solution=["12"])


def test_cosine_max_len_falls_back_to_max_completion_length():
    assert CosineReward(max_completion_length=64).max_len == 64
    assert CosineReward(cosine_max_len=32, max_completion_length=64).max_len == 32


# --- repetition ----------------------------------------------------------------------------------------------------


def test_repetition():
    r = RepetitionPenalty()  # 3-grams, max penalty -1.0
    # "a b c a b c": trigrams abc, bca, cab, abc -> 3 distinct of 4 -> (1 - 3/4) * -1 = -0.25
    # "a b c d": all distinct -> 0; "a b": shorter than 3 words -> 0; "" -> 0
    out = r(["a b c a b c", "a b c d", "a b", ""])
    assert out == pytest.approx([-0.25, 0.0, 0.0, 0.0])


def test_repetition_rejects_positive_penalty():
    with pytest.raises(ConfigError, match="repetition_max_penalty"):
        RepetitionPenalty(repetition_max_penalty=0.5)


# --- soft_overlong -------------------------------------------------------------------------------------------------


def test_soft_overlong():
    r = SoftOverlong(soft_max_length=10, soft_cache_length=4)
    # expected length 10 - 4 = 6: L=6 -> 0; L=8 -> (6 - 8) / 4 = -0.5; L=10 -> -1; L=12 -> clipped at -1; L=0 -> 0
    ids = [[0] * 6, [0] * 8, [0] * 10, [0] * 12, []]
    assert r(["x"] * 5, response_token_ids=ids) == pytest.approx([0.0, -0.5, -1.0, -1.0, 0.0])


def test_soft_overlong_uses_tokenizer_without_token_ids():
    r = SoftOverlong(tokenizer=WordTokenizer(), soft_max_length=4, soft_cache_length=2)
    # expected 2 tokens: "a b c" is 3 words -> (2 - 3) / 2 = -0.5
    assert r(["a b c"]) == pytest.approx([-0.5])


def test_soft_overlong_needs_lengths_configured():
    with pytest.raises(ConfigError, match="soft_max_length"):
        SoftOverlong(soft_cache_length=4)
    with pytest.raises(ConfigError, match="soft_cache_length"):
        SoftOverlong(soft_max_length=10, soft_cache_length=10)


# --- toolbench -----------------------------------------------------------------------------------------------------


def test_toolbench_actions_and_answers():
    r = orms["toolbench"]()
    ref_call = 'Action: calculator\nAction Input: {"a": 1, "b": 2}'
    completions = [
        'Thought: compute\nAction: calculator\nAction Input: {"a": 1, "b": 2}',  # exact -> 1
        'Action: calculator\nAction Input: {"a": 1, "b": 3}',  # b differs: matched 1 + 0.5 -> P = R = 0.75
        'Action: search\nAction Input: {"a": 1, "b": 2}',  # wrong tool -> 0
        "Action: calculator\nAction Input: a=1",  # non-JSON against JSON -> 0
        "",  # empty -> 0
        'Action: calculator\nAction Input: {"a": 1, "b": 2}\nObservation: 3',  # an invented observation is ignored
    ]
    assert r(completions, solution=[ref_call] * 6) == pytest.approx([1.0, 0.75, 0.0, 0.0, 0.0, 1.0])


def test_toolbench_plain_answer_rouge_l():
    r = orms["toolbench"]()
    ref = "Final Answer: the cat sat on the mat"
    # "the cat sat": LCS 3, P = 3/3, R = 3/6 -> F1 = 2 * 1 * 0.5 / 1.5 = 2/3; a tool call instead -> 0
    out = r(["Final Answer: the cat sat", "Action: x\nAction Input: {}", ""], solution=[ref] * 3)
    assert out == pytest.approx([2 / 3, 0.0, 0.0])


def test_toolbench_helpers():
    assert parse_react("Action: a\nAction Input: {}").action == "a"
    assert parse_react("hello").action is None
    assert rouge_l("", "x") == 0.0
    assert argument_f1("{}", "{}") == 1.0
    assert argument_f1('{"a": 1}', "{}") == 0.0
    assert argument_f1('{"x": 1}', '{"a": 1}') == 0.0


# --- PRM example ---------------------------------------------------------------------------------------------------


def test_arithmetic_steps_prm():
    prm = prms["arithmetic_steps"]()
    good_bad_good = "Step 1: 2 + 3 = 5\nStep 2: 5 * 4 = 21\nStep 3: 20 / 4 = 5\nSo 5."
    out = prm([good_bad_good, "Step 1: 7 + 5 = 12", "no steps here", ""])
    assert out[0] == pytest.approx(2 / 3)  # 2 of 3 steps right
    assert out[1] == 1.0
    assert out[2] is None and out[3] is None  # nothing to score
    assert prm.score_steps("Step 1: 1 / 0 = 1") == [0.0]
    assert prms["arithmetic_steps"](aggregate="min")([good_bad_good]) == [0.0]


def test_scores_are_finite_numbers():
    for name in ("format", "react_format", "repetition"):
        assert all(math.isfinite(v) for v in orms[name]()(["", "x"]))
