"""The weight-sync check's parts on synthetic tensors: checksums against hand-worked sums, their tolerance, the
comparison's one-line problems, the sender's sums over a real gloo broadcast read back on the receiving side, the
check body's bounds, and the logprob probe against a float64 reference."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError
from test_server_weight_sync import _loopback_post, _tiny_net

from grpokit.engines.sync_check.checksums import StreamTap, check_body, check_stream
from grpokit.engines.sync_check.probe import least_precise, run_probe, trainer_logprobs
from grpokit.engines.vllm_load import _read_back
from grpokit.engines.weight_sender import WeightSender
from grpokit.errors import WeightSyncError
from grpokit.protocol import ChatCompletionResponse, ChatCompletionResponseChoice
from grpokit.server.weight_sync import WeightReceiver, check_held
from grpokit.wire import checksum
from grpokit.wire.bodies import CheckWeightsBody
from grpokit.wire.checksum import SumsOf, compare_sums, rtol_for, sums_agree, tensor_sums


def test_sums_of_a_small_tensor_by_hand():
    # x = [1, -2, 3]: Σx = 2, Σ|x| = 6, weights 1, 1 + 1/1021, 1 + 2/1021:
    # Σw·x = 1 − 2(1 + 1/1021) + 3(1 + 2/1021) = 2 + 4/1021
    s = tensor_sums(torch.tensor([1.0, -2.0, 3.0]))
    assert s.dtype == torch.float64
    assert s.tolist() == pytest.approx([2.0, 6.0, 2.0 + 4.0 / 1021], rel=1e-15)


def test_sums_in_chunks_equal_a_float64_loop(monkeypatch):
    # period 3, chunks of 6: 10 elements are a chunk of two whole rows, then one row and a rest of one;
    # the position weight counts the flat index across chunks: w_i = 1 + (i mod 3)/3
    monkeypatch.setattr(checksum, "PERIOD", 3)
    monkeypatch.setattr(checksum, "CHUNK", 6)
    x = torch.randn(2, 5, generator=torch.Generator().manual_seed(0))
    flat = x.reshape(-1).double().tolist()
    weighted = sum(v * (1 + (i % 3) / 3) for i, v in enumerate(flat))
    got = tensor_sums(x).tolist()
    assert got == pytest.approx([sum(flat), sum(map(abs, flat)), weighted], rel=1e-12)
    assert tensor_sums(torch.tensor([True, False, True])).tolist() == pytest.approx([2.0, 2.0, 2.0 + 2 / 3])


def test_sums_change_for_a_transpose_a_shift_and_one_element():
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(1))
    base = tensor_sums(x).tolist()
    bumped = x.clone()
    bumped[3, 4] += 1e-3
    for other in (x.t(), torch.roll(x, 1), bumped):
        assert not sums_agree(base, tensor_sums(other).tolist(), checksum.RTOL_SAME)
    # the same values summed in another order agree within the tolerance
    assert sums_agree(base, tensor_sums(x.clone()).tolist(), checksum.RTOL_SAME)


def test_tolerance_follows_the_dtype_the_receiver_holds():
    assert rtol_for(torch.bfloat16, torch.float32) == checksum.RTOL_SAME  # fp32 holds every bf16 exactly
    assert rtol_for(torch.float32, torch.bfloat16) == torch.finfo(torch.bfloat16).eps
    x = torch.randn(1000, generator=torch.Generator().manual_seed(2))
    held = tensor_sums(x.to(torch.bfloat16)).tolist()  # a float32 wire value held in bf16: rounded
    assert sums_agree(tensor_sums(x).tolist(), held, rtol_for(torch.float32, torch.bfloat16))
    assert not sums_agree(tensor_sums(x).tolist(), held, checksum.RTOL_SAME)


def test_compare_names_the_bucket_the_tensor_and_a_whole_bucket_that_was_not_loaded():
    a, b, c = torch.ones(3), torch.arange(4.0), torch.full((2,), 5.0)
    sent = [
        (0, "a", torch.float32, tensor_sums(a).tolist()),
        (1, "b", torch.float32, tensor_sums(b).tolist()),
        (1, "c", torch.float32, tensor_sums(c).tolist()),
    ]
    held = {
        "a": (tensor_sums(a).tolist(), torch.float32),
        "b": (tensor_sums(b + 1).tolist(), torch.float32),
        "c": (tensor_sums(c).tolist(), torch.float32),
    }
    problems, checked, unreadable = compare_sums(sent, held, 2)
    assert (checked, unreadable) == (3, 0)
    # the sum that moved most is named: Σw·b = 1(1 + 1/1021) + 2(1 + 2/1021) + 3(1 + 3/1021) = 6 + 14/1021,
    # Σw·(b + 1) = that + Σw = 10 + 20/1021 (Σx moved by 4 only)
    assert problems == [f"bucket 1 of 2: b (weighted_sum {10 + 20 / 1021:.9g}, sent {6 + 14 / 1021:.9g})"]
    held["c"] = (tensor_sums(c - 1).tolist(), torch.float32)
    problems, _, _ = compare_sums(sent, held, 2)
    assert problems[0].startswith("bucket 1 of 2: every one of its 2 tensors differs (was it loaded?), e.g. b")
    del held["a"]
    held["b"] = None  # cannot be read back: counted, not compared
    problems, checked, unreadable = compare_sums(sent, held, 2)
    assert problems[0] == "bucket 0 of 2: a is not held at all (dropped)" and (checked, unreadable) == (1, 1)


def test_non_finite_sums_travel_as_null_and_are_not_compared():
    sums = tensor_sums(torch.tensor([1.0, float("nan")])).tolist()
    assert checksum.finite_or_none(sums) == [None, None, None]
    assert sums_agree([None, None, None], [0.0, 1.0, 2.0], checksum.RTOL_SAME)


def test_check_body_is_bounded_and_strict():
    ok = {"name": "w", "dtype": "float32", "sums": [1.0, 2.0, 3.0]}
    CheckWeightsBody(buckets=[[ok]])
    for bad in (
        {"buckets": [[ok, ok]]},  # a name twice
        {"buckets": [[{**ok, "sums": [1.0, 2.0]}]]},  # not three sums
        {"buckets": [[{**ok, "dtype": "complex64"}]]},
        {"buckets": [[ok]], "extra": 1},
        {"buckets": [[ok]], "weight_version": -1},
    ):
        with pytest.raises(ValidationError):
            CheckWeightsBody(**bad)


def _sync_and_check(corrupt: str | None):
    """One sync over gloo into a target net (two buckets), then the check against the target's parameters as
    loaded; ``corrupt`` names a tensor the receiving side changes after loading it."""
    source, target = _tiny_net(0), _tiny_net(1)
    receiver = WeightReceiver()
    sender = WeightSender([("127.0.0.1", 1)], _loopback_post([receiver], [target]), bucket_mb=1, timeout_s=20)
    sender.bucket_bytes = 64
    params = dict(target.named_parameters())
    try:
        sums = SumsOf()
        buckets, _ = sender.sync_summed(source, sums=sums)
    finally:
        sender.close()
    if corrupt is not None:
        with torch.no_grad():
            params[corrupt].view(-1)[0] += 0.5
    body = CheckWeightsBody(**check_body(buckets, sums.values()))

    def held(names):
        return {n: (tensor_sums(params[n]).tolist(), params[n].dtype) for n in names}

    return len(buckets), check_held(body, held)


def test_an_intact_sync_checks_every_tensor_and_a_corrupt_one_is_named_with_its_bucket():
    n_buckets, answer = _sync_and_check(None)
    assert n_buckets >= 2 and answer == {"ok": True, "problems": [], "count": 0, "checked": 3, "unreadable": 0}
    _, answer = _sync_and_check("2.weight")  # the last Linear: 8x3 float32 = 96 B > 64: a bucket of its own
    assert not answer["ok"] and answer["count"] == 1
    assert answer["problems"][0].startswith(f"bucket {n_buckets - 1} of {n_buckets}: 2.weight (")


def test_stream_tap_and_the_colocate_comparison():
    weights = [("a", torch.randn(4, 3)), ("b", torch.randn(5))]
    tap = StreamTap(iter(weights), torch.bfloat16)
    consumed = [n for n, _ in tap]
    held = {n: (tensor_sums(t.to(torch.bfloat16)).tolist(), "bfloat16") for n, t in weights}
    report = check_stream(tap, consumed, held, "vLLM")
    assert (report.checked, report.unreadable) == (2, 0)
    with pytest.raises(WeightSyncError, match="b never reached vLLM's weight loader"):
        check_stream(tap, ["a"], held, "vLLM")
    held["a"] = (tensor_sums(weights[0][1].to(torch.bfloat16) * 2).tolist(), "bfloat16")
    with pytest.raises(WeightSyncError, match=r"^weight sync check: vLLM does not hold the weights just synced: a \("):
        check_stream(tap, consumed, held, "vLLM")


def test_fused_parameters_are_read_back_by_slices():
    q, k, v = torch.randn(4, 2), torch.randn(2, 2), torch.randn(2, 2)
    params = {
        "l.qkv_proj.weight": torch.cat([q, k, v]),
        "l.norm.weight": torch.ones(2),
        "l.o_proj.weight": torch.empty(0),
    }  # a repacked (emptied) weight cannot be read back
    packed = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    numel = {"l.q_proj.weight": 8, "l.k_proj.weight": 4, "l.v_proj.weight": 4, "l.norm.weight": 2, "l.o_proj.weight": 4}
    assert torch.equal(_read_back("l.k_proj.weight", params, packed, numel), k.reshape(-1))
    assert torch.equal(_read_back("l.v_proj.weight", params, packed, numel), v.reshape(-1))
    assert torch.equal(_read_back("l.norm.weight", params, packed, numel), torch.ones(2))
    assert _read_back("l.o_proj.weight", params, packed, numel) is None
    assert _read_back("l.up_proj.weight", params, packed, numel) is None


class _Lm(torch.nn.Module):
    """A bigram model: logits of the next token are a row of a table."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(table)

    def forward(self, input_ids, use_cache=False):
        return type("Out", (), {"logits": self.table[input_ids]})()


class _Engine:
    dtype_name = "float32"

    def __init__(self, lm: _Lm, bias: float = 0.0) -> None:
        self.lm, self.bias = lm, bias

    def infer(self, requests, config):
        prompt, ids, lps = [1, 2], [], []
        for _ in range(config.max_tokens):
            row = torch.log_softmax(self.lm.table.detach()[(prompt + ids)[-1]].double(), -1)
            ids.append(int(row.argmax()))
            lps.append(float(row.max()) + self.bias)
        choice = ChatCompletionResponseChoice(
            index=0,
            message={"role": "assistant", "content": ""},
            finish_reason="length",
            token_ids=ids,
            logprobs={"content": [{"token_id": t, "logprob": lp} for t, lp in zip(ids, lps, strict=True)]},
        )
        return [ChatCompletionResponse(choices=[choice], prompt_token_ids=prompt)]


def test_probe_logprobs_equal_a_float64_reference_and_a_gap_stops_the_run():
    lm = _Lm(torch.randn(6, 6, generator=torch.Generator().manual_seed(3)))
    ref = torch.log_softmax(lm.table.detach().double(), -1)
    got = trainer_logprobs(lm, [1, 2], [4, 0])
    assert got.tolist() == pytest.approx([float(ref[2, 4]), float(ref[4, 0])], abs=1e-6)
    gap, tolerance = run_probe(_Engine(lm), lm)
    assert gap < 1e-5 and tolerance == 0.02
    with pytest.raises(WeightSyncError, match=r"probe token 0 .*\|Δ\| 0\.05 > 0\.02"):
        run_probe(_Engine(lm, bias=0.05), lm)


def test_the_tolerance_is_the_less_precise_dtype_s():
    assert least_precise(torch.float32, torch.bfloat16) == torch.bfloat16
    assert least_precise(None, torch.float32) == torch.float32
    assert least_precise(torch.float16, torch.float32) == torch.float16


def test_an_overridden_sync_is_run_as_it_is_and_not_checked(caplog):
    from grpokit.engines.sync_check.probe import overrides_sync, sync

    calls = []

    class Engine:
        def sync_weights(self, model):
            calls.append("own")

        def sync_weights_checked(self, model):
            calls.append("checked")

    class Patched(Engine):
        def sync_weights(self, model):
            calls.append("patched")

    assert not overrides_sync(Engine()) and overrides_sync(Patched())

    class Monkeypatched(Engine):
        sync_weights_checked = Engine.sync_weights_checked

    Monkeypatched.sync_weights = lambda self, model: None
    Monkeypatched.sync_weights.__module__ = "a_test_module"  # as a function defined in a test
    assert overrides_sync(Monkeypatched())
    args = type("Rollout", (), {"check_weight_sync": True})()
    sync(Patched(), None, args, step=3)
    off = type("Rollout", (), {"check_weight_sync": False})()
    sync(Engine(), None, off, step=3)
    assert calls == ["patched", "own"]
    assert "Patched.sync_weights is overridden" in caplog.text


class _HeldEngine:
    """A served engine stand-in for POST /check_weights/: holds tensors by name, reads them back."""

    def __init__(self, held: dict[str, torch.Tensor]) -> None:
        self.held = held

    def tensor_count(self) -> int:
        return len(self.held)

    def weight_sums(self, names):
        return {n: (tensor_sums(self.held[n]).tolist(), self.held[n].dtype) for n in names if n in self.held}


def _check_client(held: dict[str, torch.Tensor] | None):
    from test_server_app import make_client

    client, state = make_client(max_body_mb=1.0)
    if held is not None:
        engine = _HeldEngine(held)
        state.engine.tensor_count, state.engine.weight_sums = engine.tensor_count, engine.weight_sums
    return client, state


def _body(tensors: dict[str, torch.Tensor], **extra) -> dict:
    return {
        "buckets": [[{"name": n, "dtype": "float32", "sums": tensor_sums(t).tolist()}] for n, t in tensors.items()],
        **extra,
    }


def test_check_weights_route_answers_matches_mismatches_and_refusals():
    w, v = torch.randn(4, 4), torch.randn(3)
    client, state = _check_client({"w": w, "v": v})
    answer = client.post("/check_weights/", json=_body({"w": w, "v": v})).json()
    assert answer == {"ok": True, "problems": [], "count": 0, "checked": 2, "unreadable": 0}
    answer = client.post("/check_weights/", json=_body({"w": w, "v": v * 2})).json()
    assert not answer["ok"] and answer["problems"][0].startswith("bucket 1 of 2: v (")
    answer = client.post("/check_weights/", json=_body({"w": w}, weight_version=state.weight_version + 1)).json()
    assert not answer["ok"] and "another sync" in answer["problems"][0]
    resp = client.post("/check_weights/", json=_body({"w": w, "v": v, "u": v}))  # more tensors than it holds
    assert resp.status_code == 422 and "3 tensors listed" in resp.json()["error"]
    resp = client.post("/check_weights/", json={"buckets": [[{"name": "w", "dtype": "float32", "sums": [1]}]]})
    assert resp.status_code == 422
    client, _ = _check_client(None)  # an engine that cannot read its weights back
    resp = client.post("/check_weights/", json=_body({"w": w}))
    assert resp.status_code == 501 and "--check_weight_sync false" in resp.json()["error"]


def test_probe_route_answers_the_prompt_greedily_and_bounds_its_body():
    from grpokit.engines.partial.pause import PROBING

    client, state = _check_client(None)
    seen = []
    infer = state.engine.infer
    state.engine.infer = lambda requests, config: seen.append((config, PROBING.get())) or infer(requests, config)
    answer = client.post("/probe/", json={"prompt": "abc", "max_tokens": 4})
    assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"] == "cba"
    config, probing = seen[0]
    assert probing and config.temperature == 0 and config.logprobs and config.max_tokens == 4  # runs while paused
    for body in ({"prompt": "abc", "max_tokens": 17}, {"prompt": "x" * 2001}, {"prompt": "a", "extra": 1}, {}):
        assert client.post("/probe/", json=body).status_code == 422, body
