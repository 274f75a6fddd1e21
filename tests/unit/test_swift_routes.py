"""ms-swift's routes on grpokit's rollout server (grpokit/server/swift_routes.py), with bodies in the shape ms-swift
4.x's VLLMClient posts them (its RequestConfig and RolloutInferRequest through dataclasses.asdict, null for unset
sampling fields), on the echo engine of test_server_app; its weight routes driven over gloo as ms-swift's client
drives them (the trainer joins the group the server hosts, as the last rank)."""

from __future__ import annotations

import threading

import pytest
import torch
from test_server_app import KEY, EchoEngine

from grpokit.rollout.scheduler import RolloutScheduler
from grpokit.server.app import create_app
from grpokit.server.state import ServerOptions, ServerState
from grpokit.testing import free_port
from grpokit.wire.swift_group import broadcast, open_group

# ms-swift's RequestConfig() as asdict sends it: every field, unset ones null
SWIFT_CONFIG = {
    "max_tokens": None, "temperature": None, "top_k": None, "top_p": None, "min_p": None,
    "repetition_penalty": None, "num_beams": 1, "stop": [], "seed": None, "stream": False, "logprobs": False,
    "top_logprobs": None, "prompt_logprobs": None, "n": 1, "best_of": None, "presence_penalty": 0.0,
    "frequency_penalty": 0.0, "length_penalty": 1.0, "return_details": False, "structured_outputs_regex": None,
}  # fmt: skip


def swift_request(text: str, uuid: str | None = None, **extra) -> dict:
    """ms-swift 4.6's RolloutInferRequest(messages=...) through asdict."""
    return {
        "messages": [{"role": "user", "content": text}], "images": [], "audios": [], "videos": [], "tools": None,
        "objects": {}, "chat_template_kwargs": {}, "data_dict": {}, "uuid": uuid, "add_eos": None, **extra,
    }  # fmt: skip


def swift_body(*requests: dict, **config) -> dict:
    """VLLMClient.infer's JSON body."""
    return {
        "infer_requests": list(requests), "request_config": {**SWIFT_CONFIG, **config}, "metrics": None,
        "use_tqdm": None, "adapter_request": None,
    }  # fmt: skip


class WeightEngine(EchoEngine):
    """The echo engine holding two tensors that a weight sync replaces."""

    def __init__(self) -> None:
        super().__init__()
        self.params = {"w": torch.zeros(3, 4), "b": torch.zeros(5, dtype=torch.bfloat16)}

    def check_weights(self, metas):
        return [
            f"{m.name}: shape {m.shape}, the served model's is {list(self.params[m.name].shape)}"
            if m.name in self.params and list(self.params[m.name].shape) != m.shape
            else f"{m.name}: no such parameter in the served model"
            for m in metas
            if m.name not in self.params or list(self.params[m.name].shape) != m.shape
        ]

    def load_weights(self, named):
        for name, tensor in named:
            self.params[name].copy_(tensor)

    def state_keys(self):
        return list(self.params)


def make_client(**overrides):
    from fastapi.testclient import TestClient

    options = ServerOptions(model="echo", **{"max_batch_requests": 4, "max_sync_timeout_s": 30.0, **overrides})
    engine = WeightEngine()
    state = ServerState(options, engine, RolloutScheduler(engine))
    return TestClient(create_app(state), base_url="http://127.0.0.1"), state


@pytest.fixture()
def client():
    return make_client()[0]


def test_ms_swift_status_routes(client):
    assert client.get("/health").json() == {"status": "ok"} == client.get("/health/").json()
    assert client.post("/get_engine_type/").json() == {
        "engine_type": "LLMEngine", "enable_multi_turn": False, "use_gym_env": False, "enable_lora": False,
    }  # fmt: skip
    assert "max_batch_requests" in client.get("/get_engine_type/").json()  # grpokit's own answer stays on GET
    assert client.get("/get_world_size/").json() == {"world_size": 1}
    assert client.get("/get_model_state_keys/").json() == {"keys": ["w", "b"]}
    for cache in ("mm", "encoder", "prefix"):
        assert client.post(f"/reset_{cache}_cache/").status_code == 200


def test_infer_answers_in_ms_swift_shape_with_the_uuid_as_id(client):
    body = swift_body(swift_request("abc", "u-1"), swift_request("xyz", "u-2", data_dict={"solution": "1"}))
    answer = client.post("/infer/", json=body)
    assert answer.status_code == 200, answer.text
    first, second = answer.json()
    assert [first["response"]["id"], second["response"]["id"]] == ["u-1", "u-2"]
    assert first["response"]["choices"] == [
        {"index": 0, "message": {"role": "assistant", "content": "cba"}, "finish_reason": "stop", "logprobs": None,
         "token_ids": [1, 2, 3]}
    ]  # fmt: skip
    usage = first["response"]["usage"]
    assert usage["completion_tokens"] == 3 and usage["total_tokens"] == usage["prompt_tokens"] + 3
    assert first["messages"] is None  # a single-turn server: ms-swift's trainer appends the reply itself
    assert first["response_token_ids"] == [[1, 2, 3]] and first["response_loss_mask"] == [[1, 1, 1]]
    assert "request_id" not in first and "weight_versions" not in first  # grpokit's own fields stay off


def test_a_request_without_uuid_gets_an_id_and_tools_are_not_echoed():
    client, _ = make_client(multi_turn_scheduler="thinking_tips_scheduler", max_turns=1)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    out = client.post("/infer/", json=swift_body(swift_request("abc", tools=tools))).json()[0]
    assert out["response"]["id"]
    assert out["messages"][0] == {"role": "user", "content": "abc"}  # the carried tools are taken off


@pytest.mark.parametrize(
    "change, named",
    [
        ({"min_p": 0.1}, "request_config.min_p 0.1: min-p sampling is not implemented"),
        ({"num_beams": 2}, "request_config.num_beams 2: beam search"),
        ({"stream": True}, "request_config.stream True"),
        ({"n": 4}, "request_config.n 4: one trajectory per request"),
        ({"top_logprobs": 5}, "request_config.top_logprobs 5"),
        ({"prompt_logprobs": 0}, "request_config.prompt_logprobs 0"),
        ({"presence_penalty": 0.5}, "request_config.presence_penalty 0.5"),
        ({"best_of": 3}, "request_config.best_of 3"),
        ({"temperature": 0.001}, "request_config: "),
    ],
)
def test_infer_refuses_what_grpokit_lacks_naming_the_field(client, change, named):
    answer = client.post("/infer/", json=swift_body(swift_request("abc"), **change))
    assert answer.status_code == 400 and answer.json()["error"].startswith(named), answer.text


@pytest.mark.parametrize(
    "extra, named",
    [
        ({"audios": ["a.wav"]}, "infer_requests[0].audios"),
        ({"videos": ["v.mp4"]}, "infer_requests[0].videos"),
        ({"objects": {"bbox": [1]}}, "infer_requests[0].objects"),
        ({"add_eos": "auto"}, "infer_requests[0].add_eos 'auto'"),
    ],
)
def test_infer_refuses_inputs_grpokit_lacks(client, extra, named):
    answer = client.post("/infer/", json=swift_body(swift_request("abc", **extra)))
    assert answer.status_code == 400 and answer.json()["error"].startswith(named), answer.text


def test_null_sampling_fields_are_unset_and_unknown_ones_refused(client):
    body = swift_body(swift_request("abc"), max_tokens=None, num_beams=None, stop=None, n=None, logprobs=None)
    assert client.post("/infer/", json=body).status_code == 200
    bad = swift_body(swift_request("abc"))
    bad["request_config"]["beam_width"] = 3
    answer = client.post("/infer/", json=bad)
    assert answer.status_code == 422 and "beam_width" in answer.json()["error"]


def test_ms_swift_routes_take_the_api_key_and_the_error_shape():
    client, _ = make_client(api_key=KEY)
    assert client.post("/get_engine_type/").status_code == 401
    assert client.post("/infer/", json=swift_body(swift_request("a"))).status_code == 401
    ok = client.post("/get_engine_type/", headers={"Authorization": f"Bearer {KEY}"})
    assert ok.status_code == 200
    broken = client.post("/infer/", content=b'{"infer_requests": [', headers={"Authorization": f"Bearer {KEY}"})
    assert broken.status_code in (400, 422) and set(broken.json()) >= {"error"}


@pytest.mark.parametrize(
    "path, body, status, said",
    [
        ("/init_communicator/", {"host": "0.0.0.0", "port": 29999, "world_size": 3}, 400, "world_size 3"),
        ("/init_communicator/", {"host": "10.1.2.3", "port": 29999, "world_size": 2}, 400, "host 10.1.2.3"),
        ("/update_named_param/", {"name": "w", "dtype": "torch.float32", "shape": [3, 4]}, 409, "no weight-sync"),
        ("/update_adapter_flattened_param/", {"peft_config": {}, "metadatas": []}, 501, "/update_adapter_flattened"),
        ("/update_adapter_param/", {"peft_config": {}, "lora_tensors_metadata": []}, 501, "/update_adapter_param/"),
        ("/update_named_param/", {"name": "w", "dtype": "torch.complex64", "shape": [1]}, 422, "dtype"),
    ],
)
def test_weight_routes_refuse_before_any_broadcast(client, path, body, status, said):
    answer = client.post(path, json=body)
    assert answer.status_code == status and said in answer.json()["error"], answer.text


def test_weights_pushed_over_gloo_arrive_equal():
    """ms-swift's order: init_communicator, then per tensor or bucket a POST and the trainer's broadcast (as the
    last rank), then process_weights_after_loading; a wrong shape is refused with 422 and breaks nothing."""
    client, state = make_client()
    port = free_port()
    init = client.post("/init_communicator/", json={"host": "0.0.0.0", "port": port, "world_size": 2})
    assert init.status_code == 200
    comm = open_group("127.0.0.1", port, 1, 2, "gloo", 30.0)  # the trainer joins as the last rank
    w = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    assert client.post("/update_named_param/", json={"name": "w", "dtype": "torch.float32", "shape": [3, 4]}).json()
    broadcast(comm, w.clone(), src=1)
    b = torch.linspace(-1, 1, 5, dtype=torch.bfloat16)
    bad = {"metadatas": [{"name": "b", "shape": [4], "dtype": "torch.bfloat16", "start_idx": 0, "end_idx": 8,
                          "numel": 8}]}  # fmt: skip
    assert client.post("/update_flattened_params/", json=bad).status_code == 422
    flat = torch.cat([(w + 1).reshape(-1).view(torch.uint8), b.view(torch.uint8)])
    metas = [
        {"name": "w", "shape": [3, 4], "dtype": "torch.float32", "start_idx": 0, "end_idx": 48, "numel": 48},
        {"name": "b", "shape": [5], "dtype": "torch.bfloat16", "start_idx": 48, "end_idx": 58, "numel": 10},
    ]
    assert client.post("/update_flattened_params/", json={"metadatas": metas}).status_code == 200
    broadcast(comm, flat, src=1)
    done = client.post("/process_weights_after_loading/")
    assert done.status_code == 200, done.text
    assert torch.equal(state.engine.params["w"], w + 1) and torch.equal(state.engine.params["b"], b)
    assert state.weight_version == 1 and state.engine.resets == 1
    assert client.post("/close_communicator/").status_code == 200
    comm.close()


def test_a_trainer_that_never_joins_is_reported_by_process_weights_after_loading():
    client, _ = make_client(max_sync_timeout_s=1.0)
    port = free_port()
    client.post("/init_communicator/", json={"host": "127.0.0.1", "port": port, "world_size": 2})
    answer = client.post("/process_weights_after_loading/")
    assert answer.status_code == 424 and "POST /init_communicator/ again" in answer.json()["error"], answer.text
    assert threading.active_count() < 50  # the worker is one thread, not one per call


def test_weight_steps_queued_past_the_bound_are_answered_429():
    """A client that announces tensors and never broadcasts cannot grow the server's queue without bound."""
    client, _ = make_client(max_sync_timeout_s=1.0)
    layer = client.app
    while not hasattr(layer, "group"):  # the ASGI layers down to SwiftDispatch, which holds the weight group
        layer = layer.app
    layer.group.max_queued = 3
    client.post("/init_communicator/", json={"host": "127.0.0.1", "port": free_port(), "world_size": 2})
    body = {"name": "w", "dtype": "torch.float32", "shape": [3, 4]}
    answers = [client.post("/update_named_param/", json=body) for _ in range(6)]
    assert {a.status_code for a in answers} == {200, 429}
    assert "waiting for the trainer's broadcasts" in answers[-1].json()["error"]
