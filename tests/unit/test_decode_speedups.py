"""The decode loop's speed-ups change nothing it returns. It stops running finished rows (engines/fast_decode.py
``_Rows``): tokens and logprobs equal those of the loop that runs every row to the end, processors and stopping
criteria still see the whole batch in its order, and the paused-row draws (``uniform``) index batch rows. Its
dense layers at a few rows (engines/decode_matmul.py) equal ``F.linear``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_fast_decode import _model, _prompts
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

import grpokit.engines.fast_decode as fd
from grpokit.engines.decode_matmul import linear, weight_first
from grpokit.engines.fast_decode import FastDecoder
from grpokit.engines.sampling import inverse_cdf
from grpokit.errors import RolloutError

pytestmark = pytest.mark.numerics

DROP_SHARE = fd.DROP_SHARE  # the loop's own rule (tests below set fd.DROP_SHARE)

EOS = 1
ENDS = [0, 4, 1, 6, 2, 8, 3]  # the new token at which each of the 7 rows writes eos (8: never, in 7 tokens)


class EosAt(LogitsProcessor):
    """Row r samples eos at its step ENDS[r]; records the batch shape and that every row's scores are finite."""

    def __init__(self, prompt_width: int) -> None:
        self.prompt_width = prompt_width
        self.seen: list[tuple[int, bool]] = []

    def __call__(self, input_ids, scores):
        self.seen.append((scores.shape[0], bool(torch.isfinite(scores).all())))
        step = input_ids.shape[1] - self.prompt_width
        rows = [r for r, end in enumerate(ENDS) if end == step]
        scores = scores.clone()
        scores[rows] = float("-inf")
        scores[rows, EOS] = 0.0
        return scores


class StopRow5At(StoppingCriteria):
    """Row 5 stops after its third new token (a stopping criterion, not eos)."""

    def __init__(self, prompt_width: int) -> None:
        self.prompt_width = prompt_width

    def __call__(self, input_ids, scores, **kwargs):
        stop = torch.zeros(input_ids.shape[0], dtype=torch.bool)
        stop[5] = input_ids.shape[1] - self.prompt_width >= 3
        return stop


def _run(model, share: float, greedy: bool, stopping: bool, monkeypatch):
    """(tokens, logprobs, rows run at each decode step, what the processor saw) with DROP_SHARE ``share``."""
    monkeypatch.setattr(fd, "DROP_SHARE", share)
    decoder = FastDecoder(model)
    ids, att = _prompts(shared=True)
    width = ids.shape[1]
    run_rows = []
    original = decoder._next_logits
    monkeypatch.setattr(decoder, "_next_logits", lambda tok, *a: run_rows.append(len(tok)) or original(tok, *a))
    eos = EosAt(width)
    uniform = torch.rand(7, 7, 1, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    new, lps = decoder.generate(
        ids,
        att,
        7,
        eos_token_id=EOS,
        pad_token_id=0,
        greedy=greedy,
        processors=LogitsProcessorList([eos]),
        stopping=StoppingCriteriaList([StopRow5At(width)]) if stopping else None,
        want_logprobs=True,
        uniform=uniform,
    )
    return new, lps, run_rows, eos.seen


@pytest.fixture(scope="module")
def qwen3():
    return _model("qwen3")


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
@pytest.mark.parametrize("stopping", [False, True], ids=["eos", "eos+stop"])
def test_dropping_finished_rows_changes_no_token_nor_logprob(qwen3, greedy, stopping, monkeypatch):
    model = qwen3
    every = _run(model, float("inf"), greedy, stopping, monkeypatch)  # never drops a row
    dropped = _run(model, DROP_SHARE, greedy, stopping, monkeypatch)
    assert torch.equal(dropped[0], every[0])
    torch.testing.assert_close(dropped[1], every[1], atol=1e-6, rtol=1e-6)
    new, lps = dropped[0], dropped[1]
    for row, end in enumerate(ENDS):
        if stopping and row == 5:
            end = 2  # its third token is its last
        if end < new.shape[1]:  # finished: pad, and logprob 0, after its last token
            assert (new[row, end + 1 :] == 0).all() and (lps[row, end + 1 :] == 0).all()
            assert new[row, end] == EOS or (stopping and row == 5)
    assert lps[0, 0] == 0 and (lps[1:, 0] < 0).all()  # row 0's eos was forced; the others were drawn
    assert every[2] == [7] * len(every[2])  # every row, every step
    running = [sum(end > t for end in ENDS) for t in range(len(dropped[2]))]
    if stopping:
        running = [n - (t >= 2) for t, n in enumerate(running)]  # row 5 (ENDS 8) stopped after token 2
    assert dropped[2] == running  # each step ran only the rows still going
    assert all(shape == (7, True) for shape in dropped[3])  # processors saw the whole batch, finite scores


def test_a_row_left_alone_by_every_other_finishing_keeps_its_draws(monkeypatch):
    """A batch row's draws are ``uniform[:, row]`` however many rows run: row 6 of a 7-row batch whose other rows
    end at once samples the tokens that row 6 alone samples with the same draws."""
    decoder = FastDecoder(_model("llama"))
    ids, att = _prompts(shared=False)
    uniform = torch.rand(6, 7, 1, dtype=torch.float64, generator=torch.Generator().manual_seed(5))

    class AllButLastEnd(LogitsProcessor):
        def __call__(self, input_ids, scores):
            scores = scores.clone()
            scores[:6] = float("-inf")
            scores[:6, EOS] = 0.0
            return scores

    kw = dict(eos_token_id=EOS, pad_token_id=0, greedy=False, want_logprobs=True)
    batch, batch_lps = decoder.generate(
        ids, att, 6, processors=LogitsProcessorList([AllButLastEnd()]), uniform=uniform, **kw
    )
    alone, alone_lps = decoder.generate(ids[6:], att[6:], 6, uniform=uniform[:, 6:], **kw)
    assert (batch[:6, 0] == EOS).all() and (batch[:6, 1:] == 0).all()
    assert torch.equal(batch[6], alone[0])
    torch.testing.assert_close(batch_lps[6], alone_lps[0], atol=1e-6, rtol=1e-6)


def test_structured_outputs_equal_with_and_without_dropping(tiny_model_dir, monkeypatch):
    """The grammar processor keeps one matcher per batch row: rows that end at different lengths (1 to 3 digits)
    and leave the model's batch keep their matchers' rows, and the outputs equal the every-row loop's."""
    from grpokit.engines.transformers_engine import TransformersEngine
    from grpokit.modeling import load_causal_lm, load_tokenizer
    from grpokit.protocol import RequestConfig, RolloutInferRequest
    from grpokit.template.encode import ChatTemplate

    model = load_causal_lm(str(tiny_model_dir), torch.float32)
    engine = TransformersEngine(model, ChatTemplate(load_tokenizer(str(tiny_model_dir))))
    requests = [RolloutInferRequest(messages=[{"role": "user", "content": f"What is {i} + 7?"}]) for i in range(2)]
    config = RequestConfig(n=4, max_tokens=24, seed=0, logprobs=True, structured_outputs_regex=r"<a>[0-9]{1,3}</a>")
    out, drops = {}, []
    original = fd._Rows.drop_finished
    monkeypatch.setattr(fd._Rows, "drop_finished", lambda self, *a: drops.append(1) or original(self, *a))
    for share in (float("inf"), DROP_SHARE):
        monkeypatch.setattr(fd, "DROP_SHARE", share)
        out[share] = [
            (c.token_ids, c.message["content"], [x["logprob"] for x in c.logprobs["content"]])
            for r in engine.infer(requests, config)
            for c in r.choices
        ]
    assert len({len(ids) for ids, _, _ in out[DROP_SHARE]}) > 1 and drops  # rows ended apart, and were dropped
    for (ids_a, text_a, lp_a), (ids_b, text_b, lp_b) in zip(out[DROP_SHARE], out[float("inf")], strict=True):
        assert (ids_a, text_a) == (ids_b, text_b)
        assert lp_a == pytest.approx(lp_b, abs=1e-6)


def test_a_non_finite_row_is_named_by_its_batch_row():
    """Once rows are dropped, the sampler sees some rows of the batch: its error names the batch row."""
    probs = torch.tensor([[0.5, 0.5], [float("nan"), 0.5]])
    with pytest.raises(RolloutError, match="batch row 6"):
        inverse_cdf(probs, torch.full((2, 1), 0.3, dtype=torch.float64), rows=torch.tensor([4, 6]))


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9])
@pytest.mark.parametrize("shape", [(40, 24), (24, 40)], ids=["wide", "narrow"])
@pytest.mark.parametrize("bias", [False, True])
def test_few_rows_linear_equals_f_linear(rows, shape, bias):
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(*shape, generator=g)
    b = torch.randn(shape[0], generator=g) if bias else None
    x = torch.randn(rows, 1, shape[1], generator=g)
    assert not weight_first(weight)  # a small weight: its layer calls F.linear
    assert weight_first(torch.zeros(512, 512)) and not weight_first(torch.zeros(512, 512, dtype=torch.bfloat16))
    out = linear(x, weight, b)
    assert out.shape == (rows, 1, shape[0]) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, weight, b), atol=1e-5, rtol=1e-5)
    half = x.to(torch.bfloat16)  # other dtypes keep F.linear itself
    assert torch.equal(linear(half, weight.to(half.dtype), None), F.linear(half, weight.to(half.dtype)))
