"""--offload_model / --offload_optimizer (distributed/offload.py): what is moved while the engine generates, that
it comes back with the same values to where it was, and where the options have no effect or are refused."""

from __future__ import annotations

import logging
import re
import threading

import pytest
import torch

from grpokit.config.args import RolloutArguments
from grpokit.config.parse import parse_train_args
from grpokit.distributed.offload import Offloader, make_offloader
from grpokit.errors import ConfigError
from grpokit.trainers.rollouts import EngineTurns
from grpokit.trainers.window_producer import WindowHooks, WindowProducer

# numerics: run again by .ci/run under the other dtype choice and torch's default thread count;
# offloaded and restored tensors are compared value for value
pytestmark = pytest.mark.numerics


def _model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 2))
    model.register_buffer("scale", torch.ones(2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    return model, opt


def _step(model, opt, x):
    opt.zero_grad()
    (model(x) * model.scale).pow(2).sum().backward()
    opt.step()


def _tensors(model, opt):
    return [t for t in [*model.parameters(), *model.buffers()]] + [
        v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)
    ]


class FakeEngine:
    """Records, while it 'generates', where each tracked tensor lives and whether it still shares storage."""

    engine_type = "fake"

    def __init__(self, model, opt):
        self.model, self.opt, self.seen = model, opt, None

    def generate(self, before_ptrs):
        now = _tensors(self.model, self.opt)
        self.seen = {
            "devices": {t.device.type for t in now},
            "shared": [t.data_ptr() in before_ptrs for t in now],
            "values": [t.detach().clone() for t in now],
        }


def test_weights_and_optimizer_state_are_away_during_generation_and_back_with_the_same_values():
    model, opt = _model_and_optimizer()
    ref_model, ref_opt = _model_and_optimizer()
    x = torch.randn(3, 4)
    _step(model, opt, x)
    _step(ref_model, ref_opt, x)
    before = [t.detach().clone() for t in _tensors(model, opt)]
    kept = [t.detach() for t in _tensors(model, opt)]  # keeps the training storage alive: no reuse of its memory
    ptrs = {t.data_ptr() for t in kept}
    params = list(model.parameters())
    offloader = Offloader([model], opt, offload_model=True, offload_optimizer=True, offload_device="cpu")
    engine = FakeEngine(model, opt)
    with offloader.offloaded():
        engine.generate(ptrs)
    n = len(before)
    assert offloader.moves == 2 * n  # every weight, buffer and state tensor out and back
    assert engine.seen["devices"] == {"cpu"}
    assert not any(engine.seen["shared"])  # copies: nothing still in the training-device storage
    assert all(torch.equal(a, b) for a, b in zip(before, engine.seen["values"], strict=True))
    after = _tensors(model, opt)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert all(a.device == b.device for a, b in zip(before, after, strict=True))  # Adam's step stays where it was
    assert list(model.parameters()) == params and all(p is q for p, q in zip(model.parameters(), params))
    # the optimizer still drives the same parameters: the next step equals one without offloading
    _step(model, opt, x)
    _step(ref_model, ref_opt, x)
    for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
        assert torch.equal(p, q)


def test_only_what_is_asked_for_moves():
    model, opt = _model_and_optimizer()
    _step(model, opt, torch.randn(2, 4))
    weights = sum(1 for _ in [*model.parameters(), *model.buffers()])
    state = sum(isinstance(v, torch.Tensor) for s in opt.state.values() for v in s.values())
    only_model = Offloader([model, None], opt, offload_model=True, offload_optimizer=False)
    with only_model.offloaded():
        pass
    only_opt = Offloader([model], opt, offload_model=False, offload_optimizer=True)
    with only_opt.offloaded():
        pass
    assert (only_model.moves, only_opt.moves) == (2 * weights, 2 * state)


def test_a_failure_half_way_out_brings_back_what_moved():
    model, opt = _model_and_optimizer()
    _step(model, opt, torch.randn(2, 4))
    before = [t.detach().clone() for t in _tensors(model, opt)]
    offloader = Offloader([model], opt, offload_model=True, offload_optimizer=True)
    real_move, calls = offloader._move, [0]

    def failing_move(tensor, device):
        calls[0] += 1
        if calls[0] == 5:
            raise RuntimeError("out of CPU memory")
        return real_move(tensor, device)

    offloader._move = failing_move
    with pytest.raises(RuntimeError, match="out of CPU memory"), offloader.offloaded():
        pass
    after = _tensors(model, opt)
    assert offloader.moves == 2 * 4  # 4 tensors out, the same 4 back
    assert all(torch.equal(a, b) and a.device == b.device for a, b in zip(before, after, strict=True))


def _fake_engine(kind):
    return type("E", (), {"engine_type": kind})()


@pytest.mark.parametrize(
    ("kind", "device", "why"),
    [
        ("transformers", "cuda", "samples with the training model itself"),
        ("server", "cuda", "rollout server"),
        ("vllm", "cpu", "training runs on the CPU"),
    ],
)
def test_no_effect_is_one_warning_line(kind, device, why, caplog):
    model, opt = _model_and_optimizer()
    args = RolloutArguments(offload_model=True, offload_optimizer=True)
    with caplog.at_level(logging.WARNING, logger="grpokit.distributed.offload"):
        assert make_offloader(args, _fake_engine(kind), [model], opt, torch.device(device)) is None
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "--offload_model and --offload_optimizer have no effect" in lines[0] and why in lines[0]


def test_only_the_main_process_warns(caplog):
    model, opt = _model_and_optimizer()
    with caplog.at_level(logging.WARNING, logger="grpokit.distributed.offload"):
        assert (
            make_offloader(
                RolloutArguments(offload_model=True),
                _fake_engine("server"),
                [model],
                opt,
                torch.device("cuda"),
                main_process=False,
            )
            is None
        )
    assert not caplog.records


def test_vllm_on_an_accelerator_gets_an_offloader_and_off_means_none(caplog):
    model, opt = _model_and_optimizer()
    on = make_offloader(
        RolloutArguments(offload_optimizer=True), _fake_engine("vllm"), [model], opt, torch.device("cuda")
    )
    assert isinstance(on, Offloader) and on.models == [] and on.optimizer is opt
    assert make_offloader(RolloutArguments(), _fake_engine("vllm"), [model], opt, torch.device("cuda")) is None
    assert not caplog.records


def test_the_rollout_generates_inside_the_offload_and_scores_after():
    events = []

    class Offload:
        def offloaded(self):
            from contextlib import contextmanager

            @contextmanager
            def ctx():
                events.append("out")
                yield
                events.append("back")

            return ctx()

    class Hooks:
        def _generate_completions(self, requests):
            events.append("generate")
            return []

        def _score_completions(self, requests, outputs):
            events.append("score")
            return torch.zeros(0, 0)

    producer = WindowProducer.__new__(WindowProducer)
    hooks = Hooks()  # the callables the producer is given (window_producer.WindowHooks)
    producer._score = hooks._score_completions
    producer._around_generation = Offload().offloaded
    producer._turns, producer.weights_at = EngineTurns(), 0
    producer._score_lock, producer._hook_lock = threading.Lock(), threading.Lock()
    # its phases (the progress bar's) are set
    producer.hooks = WindowHooks(logps=None, progress=dict, generate=hooks._generate_completions)
    producer.requests = lambda prompts: []
    producer.rollout([])
    assert events == ["out", "generate", "back", "score"]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--async_generate", "true"], "--offload_model true with --async_generate true"),
        (["--deepspeed", "zero2"], "--offload_model true with --deepspeed and vLLM colocate is not implemented"),
    ],
)
def test_combinations_that_cannot_work_are_refused(tiny_model_dir, math_jsonl, flags, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_train_args(
            [
                "--model",
                str(tiny_model_dir),
                "--dataset",
                str(math_jsonl),
                "--use_vllm",
                "true",
                "--offload_model",
                "true",
                *flags,
            ]
        )


def test_both_names_parse_with_ms_swift_defaults(tiny_model_dir, math_jsonl):
    base = ["--model", str(tiny_model_dir), "--dataset", str(math_jsonl)]
    assert (parse_train_args(base).rollout.offload_model, parse_train_args(base).rollout.offload_optimizer) == (
        False,
        False,
    )
    cfg = parse_train_args([*base, "--offload_model", "true", "--offload_optimizer", "true"])
    assert (cfg.rollout.offload_model, cfg.rollout.offload_optimizer) == (True, True)
