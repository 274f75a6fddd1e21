"""The start-up line for a plan that takes minutes a step on a CPU (grpokit/pipeline/plan_time.py)."""

from __future__ import annotations

from grpokit.config.parse import parse_train_args


def test_a_plan_of_minutes_a_step_on_a_cpu_is_said_at_start_up():
    from grpokit.config.plan import batch_plan
    from grpokit.pipeline.plan_time import slow_plan_line

    # the defaults (8 completions of up to 512 tokens a step) with a 135M-parameter model: minutes a step
    plan = batch_plan(parse_train_args(["--dataset", "builtin:arithmetic", "--max_steps", "10"]))
    line = slow_plan_line(135_000_000, plan, 512, 10)
    assert line is not None and "8 completions × 512 tokens with a 135M-parameter model" in line
    assert "6 min a step on 2 cores; 10 steps: about 61 min" in line
    # the demo's plan (16 completions of 16 tokens a step): nothing to say
    demo = parse_train_args([])
    assert slow_plan_line(135_000_000, batch_plan(demo), demo.rollout.max_completion_length, 24) is None
