"""Weight sync without HTTP: bucket planning, byte packing, and a real gloo group between two threads."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from grpokit.engines.weight_sender import WeightSender
from grpokit.engines.weights import named_sync_tensors, plain_name
from grpokit.errors import ServerError
from grpokit.server.weight_sync import WeightReceiver
from grpokit.wire.bodies import InitCommunicatorBody, UpdateWeightsBody
from grpokit.wire.weights import pack, plan_buckets, unpack


def test_plan_buckets_aligns_and_splits():
    # a: 3 float32 = 12 B at 0; b: 5 bf16 = 10 B at align16(12) = 16 -> bucket 1 is 26 B (<= 40)
    # c: 4 float32 = 16 B would start at align16(26) = 32, end 48 > 40 -> bucket 2, offset 0
    # d: 20 float32 = 80 B > 40 on its own: bucket 3 (a tensor larger than the limit travels alone)
    specs = [
        ("a", (3,), torch.float32),
        ("b", (5,), torch.bfloat16),
        ("c", (2, 2), torch.float32),
        ("d", (20,), torch.float32),
    ]
    buckets = plan_buckets(specs, bucket_bytes=40)
    assert [b.nbytes for b in buckets] == [26, 16, 80]
    assert [(m.name, m.offset, m.nbytes) for m in buckets[0].tensors] == [("a", 0, 12), ("b", 16, 10)]
    assert buckets[1].tensors[0].shape == [2, 2] and buckets[2].tensors[0].dtype == "float32"


def test_pack_unpack_round_trip_mixed_dtypes():
    tensors = {
        "w": torch.randn(3, 5),
        "h": torch.randn(7).to(torch.bfloat16),
        "s": torch.tensor(2.5),
        "i": torch.arange(6, dtype=torch.int64).view(2, 3),
    }
    (bucket,) = plan_buckets([(k, tuple(v.shape), v.dtype) for k, v in tensors.items()], bucket_bytes=1 << 20)
    buf = torch.zeros(bucket.nbytes, dtype=torch.uint8)
    for meta in bucket.tensors:
        pack(buf, meta, tensors[meta.name])
    for meta in bucket.tensors:
        got = unpack(buf, meta)
        assert got.dtype == tensors[meta.name].dtype and torch.equal(got, tensors[meta.name])


def test_pack_casts_to_the_wire_dtype():
    (bucket,) = plan_buckets([("w", (2,), torch.bfloat16)], bucket_bytes=64)
    buf = torch.zeros(bucket.nbytes, dtype=torch.uint8)
    pack(buf, bucket.tensors[0], torch.tensor([1.0, 0.5]))  # float32 in, bf16 on the wire
    assert unpack(buf, bucket.tensors[0]).tolist() == [1.0, 0.5]


def test_plain_name_strips_peft_wrappers():
    assert (
        plain_name("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight")
        == "model.layers.0.self_attn.q_proj.weight"
    )
    assert plain_name("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight") is None
    assert plain_name("base_model.model.lm_head.modules_to_save.default.weight") == "lm_head.weight"
    assert plain_name("base_model.model.lm_head.original_module.weight") is None


def _tiny_net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3, bias=False))


def _loopback_post(receivers: list[WeightReceiver], targets: list[nn.Module]):
    """The HTTP calls of WeightSender answered in process, the way the server's endpoints answer them."""

    def post(i: int, path: str, body: dict, timeout: float):
        rec, params = receivers[i], dict(targets[i].named_parameters())
        if path == "/init_communicator/":
            rec.open(InitCommunicatorBody(**body), torch.device("cpu"))
            return {"ok": True}
        if path == "/update_weights/":
            upd = UpdateWeightsBody(**body)
            if upd.dry_run:
                return {"ok": True, "group": rec.group}
            return {"loaded": rec.receive(upd, lambda named: [params[n].data.copy_(t) for n, t in named])}
        if path == "/close_communicator/":
            rec.close()
            return {"ok": True}
        raise AssertionError(path)

    return post


def test_sender_receiver_over_gloo_two_servers_several_buckets():
    source, targets = _tiny_net(0), [_tiny_net(1), _tiny_net(2)]
    receivers = [WeightReceiver(), WeightReceiver()]
    sender = WeightSender(
        [("127.0.0.1", 1), ("127.0.0.1", 2)], _loopback_post(receivers, targets), bucket_mb=1, timeout_s=20
    )
    sender.bucket_bytes = 64  # force several buckets: 4x8 float32 = 128 B alone, then the rest
    try:
        for round_ in range(2):
            with torch.no_grad():
                for p in source.parameters():
                    p.add_(0.1 * (round_ + 1))
            assert sender.sync(source) == 3
            for target in targets:
                for (n, p), (_, q) in zip(source.named_parameters(), target.named_parameters()):
                    assert torch.equal(p, q), n
        first_group = sender.group
        receivers[1].close()  # a server that lost its group (e.g. restarted): the next sync builds a new one
        sender.sync(source)
        assert sender.group != first_group and receivers[1].group == sender.group
    finally:
        sender.close()
    assert all(not r.is_open for r in receivers)


def test_sender_reports_a_refused_update_without_waiting_for_the_timeout():
    source = _tiny_net(0)

    def post(i, path, body, timeout):
        raise ServerError("rollout server 127.0.0.1:9: refused POST /update_weights/: HTTP 422: no such parameter")

    sender = WeightSender([("127.0.0.1", 9)], post, bucket_mb=1, timeout_s=30)
    with pytest.raises(ServerError, match="127.0.0.1:9"):
        sender.sync(source)


def test_named_sync_tensors_plain_model_keeps_names():
    net = _tiny_net(0)
    assert [n for n, _ in named_sync_tensors(net)] == ["0.weight", "0.bias", "2.weight"]


def test_failed_rendezvous_names_the_store_within_its_timeout():
    import socket
    import time

    from grpokit.wire.group import Communicator

    with socket.socket() as s:  # a port where nothing listens
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    with pytest.raises(ServerError, match=f"store at 127.0.0.1:{port} failed after 0.5s as rank 1"):
        Communicator.create(
            store_host="127.0.0.1",
            store_port=port,
            rank=1,
            world_size=2,
            backend="gloo",
            group="g",
            timeout_s=0.5,
            local_host="127.0.0.1",
        )
    assert time.monotonic() - t0 < 10


def test_stuck_rendezvous_are_bounded_and_closed_when_they_return(monkeypatch):
    import threading

    from grpokit.server import weight_sync
    from grpokit.server.weight_sync import RendezvousBusy

    release, closed = threading.Event(), []

    class FakeComm:
        def close(self):
            closed.append(self)

    def create(**kwargs):
        release.wait(30)  # a peer that never answers, until the test lets go
        return FakeComm()

    monkeypatch.setattr(weight_sync.Communicator, "create", staticmethod(create))
    monkeypatch.setattr(weight_sync, "local_address_towards", lambda host, port: "127.0.0.1")
    receiver = WeightReceiver(max_timeout_s=0.1)
    receiver.GRACE_S = 0.0
    body = InitCommunicatorBody(host="127.0.0.1", port=1, rank=1, world_size=2, group="g", timeout_s=60)
    # these fakes hold no socket that could be shut, so their threads stay: past MAX_STUCK of them, 429
    for _ in range(WeightReceiver.MAX_STUCK):
        with pytest.raises(ServerError, match="did not finish within 0.1s"):
            receiver.open(body, torch.device("cpu"))
    with pytest.raises(RendezvousBusy, match="earlier rendezvous"):
        receiver.open(body, torch.device("cpu"))
    receiver.close()  # answers at once although the rendezvous are still running
    release.set()
    for _ in range(200):
        if len(closed) == WeightReceiver.MAX_STUCK:
            break
        threading.Event().wait(0.05)
    assert len(closed) == WeightReceiver.MAX_STUCK and not receiver.is_open  # abandoned groups closed themselves


def test_a_silent_store_holds_no_rendezvous_slot_and_a_new_init_wins():
    """Real c10d against a listener that accepts and never answers: at the deadline the attempt's connection is
    shut down, so its thread ends; and with MAX_PENDING attempts under way a new init gives up the oldest."""
    import socket
    import threading

    receiver = WeightReceiver(max_timeout_s=0.5)
    receiver.GRACE_S = 0.5
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        port = silent.getsockname()[1]
        body = InitCommunicatorBody(host="127.0.0.1", port=port, rank=1, world_size=2, group="g", timeout_s=60)
        for _ in range(3):  # more than MAX_PENDING, one after the other: never 429
            with pytest.raises(ServerError, match="did not finish within 0.5s"):
                receiver.open(body, torch.device("cpu"))
        for _ in range(40):
            if not receiver._pending:
                break
            threading.Event().wait(0.05)
        assert not receiver._pending  # every stuck thread ended
        stale = InitCommunicatorBody(**{**body.model_dump(), "timeout_s": 60})
        long_wait = WeightReceiver(max_timeout_s=30)
        answers = []

        def init() -> None:
            try:
                long_wait.open(stale, torch.device("cpu"))
            except ServerError as e:
                answers.append(str(e))

        holders = [threading.Thread(target=init) for _ in range(WeightReceiver.MAX_PENDING)]
        for t in holders:
            t.start()
        while len(long_wait._pending) < WeightReceiver.MAX_PENDING:
            threading.Event().wait(0.01)
        long_wait.max_timeout_s = 0.5  # the trainer's own init: it must not get 429 behind the stale ones
        with pytest.raises(ServerError, match="did not finish within 0.5s"):
            long_wait.open(body, torch.device("cpu"))
        for _ in range(100):
            if answers:
                break
            threading.Event().wait(0.05)
        assert answers and all("given up for a newer" in a for a in answers), answers
        long_wait.MAX_PENDING = 1  # one more init gives up the other stale one too, so the test ends
        with pytest.raises(ServerError, match="did not finish within 0.5s"):
            long_wait.open(body, torch.device("cpu"))
        for t in holders:
            t.join(5)
        assert not any(t.is_alive() for t in holders) and len(answers) == 2


def test_close_during_a_sync_leaves_the_group_to_the_sync(monkeypatch):
    receiver = WeightReceiver()
    closed = []

    class FakeComm:
        device = torch.device("cpu")

        def broadcast(self, buf):
            receiver.close()  # /close_communicator/ arrives mid-sync: it must not close the group under us
            assert not closed

        def close(self):
            closed.append(True)

    receiver.comm, receiver.group = FakeComm(), "g"
    (bucket,) = plan_buckets([("w", (2,), torch.float32)], bucket_bytes=64)
    assert receiver.receive(UpdateWeightsBody(buckets=[bucket]), lambda named: None) == 1
    assert closed == [True] and not receiver.is_open
