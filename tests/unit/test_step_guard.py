"""StepGuard: non-finite optimizer steps are skipped with a warning, and N in a row stop the run (issue 27)."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from accelerate import Accelerator

from grpokit.errors import ConfigError, GrpokitError
from grpokit.trainers.state import NonFiniteStepsError, StepGuard, grads_finite

NAN, INF = float("nan"), float("inf")


def test_finite_steps_pass_and_reset_the_count(caplog):
    guard = StepGuard(3)
    with caplog.at_level(logging.WARNING, logger="grpokit.trainers.state"):
        assert guard.check(torch.tensor(0.5), torch.tensor(1.0), step=1)
        assert not guard.check(torch.tensor(NAN), torch.tensor(NAN), step=2)
        assert not guard.check(torch.tensor(0.1), torch.tensor(INF), step=3)
        assert guard.in_a_row == 2
        assert guard.check(torch.tensor(0.2), 0.7, step=4)  # finite again: trains on, the count restarts
    assert guard.in_a_row == 0 and guard.skipped == 2
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert lines[0].startswith(
        "step 2: non-finite loss and grad norm (loss nan, grad norm nan); optimizer step skipped, weights unchanged"
    ), lines[0]
    assert "step 3: non-finite grad norm (loss 0.1, grad norm inf)" in lines[1]
    assert "--max_nonfinite_steps 3" in lines[1]


def test_n_in_a_row_stop_with_one_line():
    guard = StepGuard(2)
    assert not guard.check(NAN, None, step=5)
    with pytest.raises(NonFiniteStepsError) as err:
        guard.check(torch.tensor(INF), None, step=6)
    msg = str(err.value)
    assert isinstance(err.value, GrpokitError) and "\n" not in msg
    assert msg.startswith("step 6: non-finite loss in 2 optimizer steps in a row (--max_nonfinite_steps 2)"), msg
    assert "lower --learning_rate" in msg


def test_without_a_grad_norm_the_gradients_themselves_are_checked():
    w = torch.nn.Parameter(torch.ones(3))
    w.grad = torch.tensor([1.0, NAN, 0.0])
    assert not grads_finite([w])
    assert not StepGuard(3).check(torch.tensor(1.0), None, params=[w])
    w.grad = torch.tensor([1.0, 2.0, 3.0])
    assert grads_finite([w]) and StepGuard(3).check(torch.tensor(1.0), None, params=[w])
    assert grads_finite([torch.nn.Parameter(torch.ones(1))])  # no gradient at all: nothing non-finite


def test_the_verdict_of_another_process_counts():
    guard = StepGuard(3)
    assert not guard.check(torch.tensor(1.0), torch.tensor(1.0), reduce=lambda flag: flag + 1)  # a peer saw NaN
    assert guard.in_a_row == 1


def test_a_skipped_step_leaves_the_weights_unchanged_through_an_accelerator():
    acc = Accelerator(cpu=True)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    before = [p.detach().clone() for p in model.parameters()]
    guard = StepGuard(3)
    loss = model(torch.tensor([[1.0, 2.0]])).sum() * NAN
    acc.backward(loss)
    norm = acc.clip_grad_norm_(list(model.parameters()), 1.0)
    if guard.allow_step(acc, loss, norm, step=1, params=list(model.parameters())):
        opt.step()
    opt.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert guard.skipped == 1 and math.isnan(float(norm))
    loss = model(torch.tensor([[1.0, 2.0]])).sum()
    acc.backward(loss)
    norm = acc.clip_grad_norm_(list(model.parameters()), 1.0)
    assert guard.allow_step(acc, loss, norm, step=2, params=list(model.parameters()))


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, None])
def test_max_nonfinite_steps_must_be_a_positive_whole_number(bad):
    with pytest.raises(ConfigError, match=r"--max_nonfinite_steps .*must be a whole number ≥ 1"):
        StepGuard(bad)


# --- sampling from non-finite logits is an error that says so ---------------------------------------------------------


@pytest.mark.parametrize("fast_decode", [True, False])
@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_sampling_from_nan_weights_says_the_logits_are_not_finite(tiny_model_dir, fast_decode, temperature):
    from grpokit.engines.transformers_engine import TransformersEngine
    from grpokit.errors import RolloutError
    from grpokit.modeling import load_causal_lm, load_tokenizer
    from grpokit.protocol import RequestConfig, RolloutInferRequest
    from grpokit.template.encode import ChatTemplate

    model = load_causal_lm(str(tiny_model_dir), torch.float32)
    with torch.no_grad():
        model.lm_head.weight.fill_(NAN)  # what a diverged step (lr 1e10) leaves behind
    engine = TransformersEngine(model, ChatTemplate(load_tokenizer(str(tiny_model_dir))))
    engine.fast_decode = fast_decode
    request = RolloutInferRequest(messages=[{"role": "user", "content": "1 + 1?"}])
    with pytest.raises(RolloutError, match=r"sampling: the model's logits are not finite .*weights have diverged"):
        engine.infer([request, request], RequestConfig(n=1, max_tokens=4, temperature=temperature))


def test_inverse_cdf_refuses_nan_probabilities():
    from grpokit.engines.sampling import inverse_cdf
    from grpokit.errors import RolloutError

    probs = torch.tensor([[0.5, 0.5], [NAN, NAN]])
    with pytest.raises(RolloutError, match="not finite"):
        inverse_cdf(probs, torch.full((2, 1), 0.3, dtype=torch.float64))
    assert inverse_cdf(probs[:1], torch.full((1, 1), 0.7, dtype=torch.float64)).tolist() == [1]
