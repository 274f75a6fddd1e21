"""One trainer per rollout server (grpokit/server/claim.py) on the fake-engine app: the claim, the refusal of a
second trainer and of unclaimed callers while it is held, renewal, release, and the lease of a trainer that died."""

from __future__ import annotations

from test_server_app import _req, make_client

from grpokit.server.claim import ClaimBody, Claims

A, B = "run-aaaaaaaaaaaa", "run-bbbbbbbbbbbb"
INFER = {"requests": [_req("abc")], "request_config": {"max_tokens": 3}}


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_claim_is_refused_to_a_second_trainer_until_released_or_expired():
    clock = Clock()
    claims = Claims(lease_s=30, clock=clock)
    assert claims.claim(ClaimBody(trainer=A, pid=11, host="node1")) is None
    refusal = claims.claim(ClaimBody(trainer=B, pid=22, host="node2"))
    assert "claimed by another trainer (pid 11 on node1" in refusal["error"] and "30 s after" in refusal["error"]
    assert refusal["holder"] == {"trainer": A, "pid": 11, "host": "node1", "idle_s": 0.0}
    clock.now += 25
    assert claims.admit(A) is None  # the holder's call renews its lease
    clock.now += 25
    assert claims.claim(ClaimBody(trainer=B)) is not None  # 25 s since A's last call: still A's
    assert "belongs to another trainer" in claims.admit(None)  # an unclaimed caller is refused too
    clock.now += 6  # 31 s since A's last call: A died; its claim expired
    assert claims.claim(ClaimBody(trainer=B)) is None
    assert claims.claim(ClaimBody(trainer=A, replaces="run-someone-else")) is not None
    assert claims.claim(ClaimBody(trainer=A, replaces=B)) is None  # B's pid found gone on its host: taken over
    assert not claims.release(B) and claims.release(A)
    assert claims.admit(None) is None  # no claim: everyone is served


def test_the_app_refuses_sampling_and_weight_calls_to_all_but_the_holder():
    client, _ = make_client(max_body_mb=1)
    assert client.post("/infer/", json=INFER).status_code == 200  # unclaimed: served as before
    assert client.post("/claim/", json={"trainer": A, "pid": 7, "host": "h"}).json()["lease_s"] == 30
    for headers in ({}, {"X-Grpokit-Trainer": B}):
        for path, body in [("/infer/", INFER), ("/reset_prefix_cache/", None), ("/close_communicator/", None)]:
            r = client.post(path, json=body, headers=headers)
            assert r.status_code == 409 and "belongs to another trainer (pid 7 on h" in r.json()["error"], path
    assert client.post("/infer/", json=INFER, headers={"X-Grpokit-Trainer": A}).status_code == 200
    assert client.get("/health/").status_code == 200  # health and engine info stay open
    r = client.post("/claim/", json={"trainer": B})
    assert r.status_code == 409 and "one trainer per rollout server" in r.json()["error"]
    assert client.post("/release/", json={"trainer": A}).json() == {"released": True}
    assert client.post("/claim/", json={"trainer": B}).status_code == 200


def test_hostile_claim_bodies_are_one_line_4xx():
    client, _ = make_client(max_body_mb=1)
    for body in [
        {"trainer": "x"},
        {"trainer": "a" * 65},
        {"trainer": "run-ok-12345", "pid": -1},
        {"trainer": "bad id!"},
    ]:
        r = client.post("/claim/", json=body)
        assert r.status_code == 422 and "\n" not in r.json()["error"], body
