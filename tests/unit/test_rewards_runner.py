"""RewardRunner (sync + async, error messages) and reward construction / column checks."""

from __future__ import annotations

import asyncio
import logging
import math
import os
import threading

import pytest
import torch
from light_rewards import hanging_sync, length_reward, where_it_runs

from grpokit.errors import ConfigError, RewardError
from grpokit.rewards import (
    ORM,
    AsyncORM,
    RewardRunner,
    build_reward_funcs,
    check_reward_columns,
    orms,
    required_columns,
)
from grpokit.rewards.shape_rewards import CosineReward


class Sleepy(AsyncORM):
    def __init__(self, seconds: float, value: float) -> None:
        super().__init__()
        self.seconds, self.value = seconds, value

    async def __call__(self, completions, **kwargs):
        await asyncio.sleep(self.seconds)
        return [self.value] * len(completions)


# --- compute -------------------------------------------------------------------------------------------------------


def test_compute_shape_nan_and_kwargs_filtering():
    seen = {}

    def only_solution(completions, solution):  # no **kwargs: gets only what it names
        seen["solution"] = solution
        return [1.0 if c == s else None for c, s in zip(completions, solution)]

    async def async_half(completions, **kwargs):
        return [0.5, float("nan"), 0.5]

    with RewardRunner([length_reward, only_solution, async_half], ["len", "exact", "half"]) as runner:
        scores = runner.compute(["ab", "c", ""], {"solution": ["ab", "x", ""], "trainer_state": {"global_step": 1}})
    assert scores.shape == (3, 3) and scores.dtype == torch.float32  # [N, F]
    assert scores[:, 0].tolist() == [2.0, 1.0, 0.0]
    assert scores[0, 1] == 1.0 and math.isnan(scores[1, 1]) and scores[2, 1] == 1.0  # None -> NaN
    assert math.isnan(scores[1, 2])  # NaN passes through
    assert seen["solution"] == ["ab", "x", ""]


# Guards against a hang only: these tests wait on events, and a rendezvous that works never comes near them.
GUARD_S = 30.0


class Gate:
    """Counts the calls inside at once, on the runner's event loop (one thread: no lock needed)."""

    def __init__(self, parties: int) -> None:
        self.parties, self.active, self.most = parties, 0, 0
        self.all_in = asyncio.Event()


class Meet(AsyncORM):
    """Scores only once every party of its gate is inside at the same time. Awaited one after the other, the
    first call could never see the second arrive: it gives up after GUARD_S with a RewardError (which the runner
    re-raises as it is, without calling again per sample)."""

    def __init__(self, gate: Gate, value: float) -> None:
        super().__init__()
        self.gate, self.value = gate, value

    async def __call__(self, completions, **kwargs):
        g = self.gate
        g.active += 1
        g.most = max(g.most, g.active)
        if g.active == g.parties:
            g.all_in.set()
        try:
            await asyncio.wait_for(g.all_in.wait(), GUARD_S)
        except asyncio.TimeoutError:  # the builtin TimeoutError from Python 3.11 on
            raise RewardError(f"only {g.active} of {g.parties} async rewards ever ran at once") from None
        finally:
            g.active -= 1
        return [self.value] * len(completions)


def test_async_rewards_run_concurrently():
    gate = Gate(parties=3)
    with RewardRunner([Meet(gate, 1.0), Meet(gate, 2.0), Meet(gate, 3.0)], ["a", "b", "c"]) as runner:
        scores = runner.compute(["x", "y"], {})
    assert scores.tolist() == [[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]]
    assert gate.most == 3 and gate.active == 0  # all three were inside at once, and all left


def test_async_rewards_run_while_the_sync_ones_do():
    """The async judge is started before the sync rewards run and is still running when they finish: the sync
    reward sees it inside, and it sees the sync reward finish before it returns."""
    judge_in, rule_done = threading.Event(), threading.Event()
    seen: dict = {}

    async def judge(completions, **kwargs):
        judge_in.set()
        seen["judge saw the rule finish"] = await asyncio.to_thread(rule_done.wait, GUARD_S)
        return [1.0] * len(completions)

    def rule(completions, **kwargs):
        seen["rule saw the judge inside"] = judge_in.wait(GUARD_S)
        rule_done.set()
        return [0.5] * len(completions)

    with RewardRunner([rule, judge], ["rule", "judge"]) as runner:
        scores = runner.compute(["x"], {})
    assert scores.tolist() == [[0.5, 1.0]]
    assert seen == {"rule saw the judge inside": True, "judge saw the rule finish": True}


def test_loop_thread_is_long_lived_and_closes():
    runner = RewardRunner([Sleepy(0.0, 1.0)], ["a"])
    thread = runner._loop.thread
    runner.compute(["x"], {})
    runner.compute(["y"], {})
    assert runner._loop.thread is thread and thread.is_alive()  # one loop for every batch
    runner.close()
    assert not thread.is_alive()


def test_warns_once_when_a_sample_is_unscored(caplog):
    def none_for_b(completions, **kwargs):
        return [None if c == "b" else 1.0 for c in completions]

    runner = RewardRunner([none_for_b, lambda completions, **kw: [None] * len(completions)], ["f", "g"])
    with caplog.at_level(logging.WARNING, logger="grpokit.rewards.runner"):
        runner.compute(["a", "b", "b"], {})
    warnings = [r for r in caplog.records if "no score" in r.getMessage()]
    assert len(warnings) == 1
    assert "2 of 3 samples" in warnings[0].getMessage() and "sample 1" in warnings[0].getMessage()


# --- errors --------------------------------------------------------------------------------------------------------


def test_wrong_number_of_scores():
    runner = RewardRunner([lambda completions, **kw: [1.0]], ["short"])
    with pytest.raises(RewardError) as err:
        runner.compute(["a", "b", "c"], {})
    msg = str(err.value)
    assert "'short'" in msg and "1 scores for 3 completions" in msg and "sample without a score: 1" in msg
    assert "\n" not in msg


def test_raising_reward_names_first_failing_sample():
    def picky(completions, solution, **kwargs):
        for c in completions:
            if c == "boom":
                raise ValueError("cannot score boom")
        return [1.0] * len(completions)

    runner = RewardRunner([picky], ["picky"])
    with pytest.raises(RewardError) as err:
        runner.compute(["ok", "ok", "boom", "boom"], {"solution": ["s"] * 4})
    msg = str(err.value)
    assert "'picky'" in msg and "ValueError" in msg and "first failing sample 2" in msg and "'boom'" in msg


def test_raising_async_reward_is_reported():
    async def broken(completions, **kwargs):
        raise KeyError("missing")

    runner = RewardRunner([Sleepy(0.0, 1.0), broken], ["fine", "broken"])
    with pytest.raises(RewardError, match=r"'broken' raised KeyError.*first failing sample 0"):
        runner.compute(["a"], {})
    runner.close()


def test_non_numeric_and_infinite_scores():
    with pytest.raises(RewardError, match=r"'text'.*sample 1 got score 'high'"):
        RewardRunner([lambda completions, **kw: [1.0, "high"]], ["text"]).compute(["a", "b"], {})
    with pytest.raises(RewardError, match=r"'inf'.*sample 0"):
        RewardRunner([lambda completions, **kw: [float("inf")]], ["inf"]).compute(["a"], {})
    with pytest.raises(RewardError, match="not a list"):
        RewardRunner([lambda completions, **kw: 1.0], ["scalar"]).compute(["a"], {})


def test_tensor_and_bool_scores_are_accepted():
    runner = RewardRunner([lambda completions, **kw: torch.tensor([0.5, 1.0]), lambda completions, **kw: [True, False]],
                          ["t", "b"])  # fmt: skip
    assert runner.compute(["a", "b"], {}).tolist() == [[0.5, 1.0], [1.0, 0.0]]


# --- construction --------------------------------------------------------------------------------------------------


def test_unknown_reward_name_lists_registered():
    with pytest.raises(ConfigError) as err:
        build_reward_funcs(["acuracy"], {})
    msg = str(err.value)
    assert "'acuracy'" in msg and "accuracy" in msg and "format" in msg and "arithmetic_steps" in msg
    assert "\n" not in msg


def test_build_picks_constructor_options_by_name():
    tok = object()
    options = {"cosine_max_len": 100, "max_completion_length": 64, "unrelated": 1, "repetition_n_grams": 2}
    cosine, rep, fmt, fn = build_reward_funcs(["cosine", "repetition", "format", length_reward], options, tok)
    assert isinstance(cosine, CosineReward) and cosine.max_len == 100 and cosine.tokenizer is tok
    assert rep.n == 2 and rep.max_penalty == -1.0  # default kept when the option is absent
    assert isinstance(fmt, orms["format"])
    assert fn is length_reward  # plain functions are used as they are


def test_build_reports_missing_and_bad_options():
    with pytest.raises(ConfigError, match="soft_max_length"):
        build_reward_funcs(["soft_overlong"], {})
    with pytest.raises(ConfigError, match="code_exec_timeout"):
        build_reward_funcs(["code_exec"], {"code_exec_timeout": 0})


def test_build_passes_args_namespace_to_ms_swift_style_rewards():
    class Scaled(ORM):
        def __init__(self, args=None, **kwargs):
            super().__init__(args)
            self.scale = args.reward_scale

        def __call__(self, completions, **kwargs):
            return [self.scale] * len(completions)

    orms["test_scaled"] = Scaled
    try:
        (func,) = build_reward_funcs(["test_scaled"], {"reward_scale": 3.0})
        assert func(["a"]) == [3.0]
    finally:
        del orms["test_scaled"]


def test_required_columns():
    def f(completions, solution, test_cases, hint=None, **kwargs): ...

    class C(ORM):
        def __call__(self, completions, target, nums, **kwargs): ...

    assert required_columns(f) == {"solution", "test_cases"}
    assert required_columns(C) == {"target", "nums"}  # the class
    assert required_columns(C()) == {"target", "nums"}  # an instance
    assert required_columns(orms["accuracy"]) == {"solution"}
    assert required_columns(orms["format"]) == set()


def test_check_reward_columns():
    funcs = build_reward_funcs(["format", "accuracy"], {})
    check_reward_columns(funcs, ["format", "accuracy"], {"messages", "solution"})  # fine
    with pytest.raises(ConfigError) as err:
        check_reward_columns(funcs, ["format", "accuracy"], {"messages", "prompt"})
    msg = str(err.value)
    assert "accuracy" in msg and "solution" in msg and "messages, prompt" in msg and "\n" not in msg

    def needs_trainer_keys(completions, messages, response_token_ids, trainer_state, **kw): ...

    check_reward_columns([needs_trainer_keys], ["t"], set())  # the trainer always supplies these


# --- timeouts, heartbeats, BaseException, float32 range (issue 27) ---------------------------------------------------


async def hanging_async(completions, **kwargs):
    await asyncio.sleep(30)
    return [0.0] * len(completions)


async def blocking_async(completions, **kwargs):  # blocks the event loop: asyncio's own timeout cannot fire
    threading.Event().wait(30)
    return [0.0] * len(completions)


@pytest.mark.parametrize("func, blocks", [(hanging_sync, False), (hanging_async, False), (blocking_async, True)])
def test_reward_timeout_cuts_off_a_hanging_reward_and_names_it(func, blocks):
    import time

    with RewardRunner([length_reward, func], ["len", "judge"], timeout=0.3) as runner:
        t0 = time.monotonic()
        with pytest.raises(RewardError) as err:
            runner.compute(["a", "b"], {})
        elapsed = time.monotonic() - t0
        assert elapsed < 5, elapsed  # 0.3 s, plus the grace for a reward that blocks the loop
        msg = str(err.value)
        assert "reward 'judge' timed out after 0.3 s (--reward_timeout 0.3)" in msg, msg
        assert ("blocks the event loop" in msg) == blocks
        # the runner still works afterwards (a fresh loop replaces one a reward blocks)
        assert RewardRunner([length_reward], ["len"], timeout=1).compute(["ab"], {}).tolist() == [[2.0]]
        if blocks:
            good = RewardRunner([Sleepy(0.0, 1.0)], ["ok"], timeout=1)
            assert good.compute(["a"], {}).tolist() == [[1.0]]
            good.close()


def test_reward_within_the_timeout_is_scored_as_without_one():
    with RewardRunner([length_reward, Sleepy(0.05, 0.5)], ["len", "sleepy"], timeout=5) as runner:
        assert runner.compute(["ab", "c"], {}).tolist() == [[2.0, 0.5], [1.0, 0.5]]


def test_sync_reward_runs_on_the_callers_thread_without_a_timeout_and_in_a_worker_process_with_one():
    here = RewardRunner([where_it_runs], ["where"]).compute(["a"], {})
    with RewardRunner([where_it_runs], ["where"], timeout=5) as runner:
        there = runner.compute(["a"], {})
    assert here.item() == os.getpid()  # math-verify's signal-based limit keeps working when no timeout is asked for
    assert there.item() not in (os.getpid(), -1)  # its own process, on that process's main thread


@pytest.mark.parametrize("timeout", [None, 5.0])
def test_heartbeat_line_while_a_reward_is_slow(caplog, timeout):
    import time

    def slow(completions, **kwargs):
        time.sleep(0.35)
        return [1.0] * len(completions)

    with caplog.at_level(logging.WARNING, logger="grpokit.rewards.runner"):
        with RewardRunner([slow, Sleepy(0.7, 1.0)], ["slow", "slow_async"], timeout=timeout, heartbeat_s=0.1) as runner:
            assert runner.compute(["a"], {}).tolist() == [[1.0, 1.0]]
    beats = [r.getMessage() for r in caplog.records if "still running after" in r.getMessage()]
    assert any(m.startswith("reward 'slow' still running after") for m in beats), beats
    assert any(m.startswith("reward 'slow_async' still running after") for m in beats), beats


@pytest.mark.parametrize(
    "exc, needle",
    [
        (SystemExit(0), "raised SystemExit: exit status 0; a reward must return scores, not end the process"),
        (GeneratorExit(), "raised GeneratorExit"),
        (asyncio.CancelledError(), "raised CancelledError"),
    ],
)
@pytest.mark.parametrize("is_async", [False, True])
def test_base_exceptions_from_a_reward_are_reward_errors(exc, needle, is_async):
    def sync_reward(completions, **kwargs):
        raise exc

    async def async_reward(completions, **kwargs):
        raise exc

    with RewardRunner([async_reward if is_async else sync_reward], ["quits"]) as runner:
        with pytest.raises(RewardError) as err:
            runner.compute(["a", "b"], {})
    assert f"reward 'quits' {needle}" in str(err.value), str(err.value)
    assert "(first failing sample 0 " in str(err.value)


@pytest.mark.parametrize("timeout", [None, 5.0])
def test_keyboard_interrupt_from_a_reward_goes_through(timeout):
    def interrupted(completions, **kwargs):
        raise KeyboardInterrupt

    with RewardRunner([interrupted, Sleepy(30, 1.0)], ["ctrl_c", "slow"], timeout=timeout) as runner:
        with pytest.raises(KeyboardInterrupt):
            runner.compute(["a"], {})  # and the pending async reward is not waited for


@pytest.mark.parametrize("score", [1e39, -1e39, 3.5e38])
def test_scores_beyond_float32_are_refused_not_trained_on_as_inf(score):
    with RewardRunner([lambda completions, **kw: [0.5, score]], ["huge"]) as runner:
        with pytest.raises(RewardError) as err:
            runner.compute(["a", "b"], {})
    assert "reward 'huge': sample 1 got score" in str(err.value)
    assert "beyond float32's range" in str(err.value)
    ok = RewardRunner([lambda completions, **kw: [3.4e38, -3.4e38]], ["edge"]).compute(["a", "b"], {})
    assert bool(ok.isfinite().all())


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf"), "5", True])
def test_reward_timeout_must_be_a_positive_number(bad):
    with pytest.raises(ConfigError, match="--reward_timeout"):
        RewardRunner([length_reward], ["len"], timeout=bad)
