"""grpokit's trainer against a server that speaks only ms-swift's rollout protocol: grpokit rollout (in this process,
a tiny float32 model) behind ms-swift's route table, so that every call goes through ms-swift's routes and bodies
(grpokit/server/swift_routes.py) as it would to ``swift rollout``. The client detects the protocol at start-up
(grpokit/engines/swift_client.py), its answers equal grpokit's own protocol's, and 2 steps of ``grpokit train
--vllm_mode server`` push their weights over gloo into the server, whose greedy output after each sync is the
trainer's model's. tests/swift_env runs the same client against ms-swift's own route table."""

from __future__ import annotations

import contextlib
import copy
import json

import pytest
import torch

from grpokit.config.parse import parse_train_args
from grpokit.engines.client import RolloutClient
from grpokit.engines.swift_client import SwiftRolloutClient, connect
from grpokit.engines.transformers_engine import TransformersEngine
from grpokit.modeling import load_tokenizer
from grpokit.protocol import RequestConfig, RolloutInferRequest
from grpokit.server.app import create_app
from grpokit.server.state import ServerOptions, build_state
from grpokit.template.encode import ChatTemplate
from grpokit.testing import serve_in_thread

pytestmark = pytest.mark.slow

GREEDY = RequestConfig(max_tokens=8, temperature=0, logprobs=True)
PROMPTS = [RolloutInferRequest(messages=[{"role": "user", "content": f"What is {a} + 7?"}]) for a in (3, 12)]
# ms-swift 4.x's `swift rollout` route table (swift/pipelines/infer/rollout.py)
SWIFT_GET = {"/health/", "/get_world_size/", "/get_model_state_keys/"}
SWIFT_POST = {
    "/init_communicator/", "/update_named_param/", "/update_adapter_flattened_param/", "/update_adapter_param/",
    "/update_flattened_params/", "/process_weights_after_loading/", "/reset_prefix_cache/", "/reset_encoder_cache/",
    "/reset_mm_cache/", "/close_communicator/", "/infer/", "/get_engine_type/",
}  # fmt: skip


class SwiftRouteTable:
    """ASGI: only ms-swift's (method, path) pairs reach the app; others get FastAPI's 405 or 404, as from
    ``swift rollout``."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        method, path = scope.get("method"), scope.get("path")
        if scope["type"] != "http" or path in (SWIFT_GET if method == "GET" else SWIFT_POST):
            await self.app(scope, receive, send)
            return
        status = 405 if path in SWIFT_GET | SWIFT_POST else 404
        body = json.dumps({"detail": "Method Not Allowed" if status == 405 else "Not Found"}).encode()
        await send(
            {"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]}
        )
        await send({"type": "http.response.body", "body": body})


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    state = build_state(ServerOptions(model=str(tiny_model_dir), torch_dtype="float32", max_sync_timeout_s=60.0))
    app = create_app(state)
    with serve_in_thread(app) as (grpokit_url, _), serve_in_thread(SwiftRouteTable(app)) as (_, swift_port):
        yield state, grpokit_url, swift_port


def _args(port: int, **more):
    return parse_train_args(["--dataset", "builtin:arithmetic", "--vllm_mode", "server", "--vllm_server_host",
                             "127.0.0.1", "--vllm_server_port", str(port), "--vllm_server_timeout", "60",
                             *(str(x) for kv in more.items() for x in (f"--{kv[0]}", kv[1]))]).rollout  # fmt: skip


@contextlib.contextmanager
def _connected(port: int):
    client = connect(_args(port))
    try:
        yield client
    finally:
        client.close()


def test_the_client_detects_which_protocol_a_server_speaks(served):
    state, grpokit_url, swift_port = served
    grpokit_port = int(grpokit_url.rsplit(":", 1)[1])
    with _connected(grpokit_port) as plain, _connected(swift_port) as swift:
        assert type(plain) is RolloutClient and isinstance(swift, SwiftRolloutClient)
        info = swift.engine_info()
        assert info["protocol"] == "ms-swift" and info["enable_multi_turn"] is False


def test_answers_through_ms_swift_routes_equal_grpokit_routes(served, one_torch_thread):
    state, grpokit_url, swift_port = served
    grpokit_port = int(grpokit_url.rsplit(":", 1)[1])
    with _connected(grpokit_port) as plain, _connected(swift_port) as swift:
        ours = plain.infer_trajectories(PROMPTS, GREEDY)
        theirs = swift.infer_trajectories(PROMPTS, GREEDY)
    for a, b in zip(ours, theirs, strict=True):
        assert b.response.choices[0].token_ids == a.response.choices[0].token_ids
        assert b.response_token_ids == a.response_token_ids and b.response_loss_mask == a.response_loss_mask
        assert b.rollout_logprobs == a.rollout_logprobs  # the same engine and weights: the same numbers
        assert b.messages == a.messages and b.response.prompt_token_ids == a.response.prompt_token_ids


def test_two_training_steps_over_ms_swift_routes_keep_the_server_on_the_trainers_weights(
    served, tiny_model_dir, tmp_path, monkeypatch, one_torch_thread
):
    from grpokit.pipeline.train import run_train

    state, _, swift_port = served
    template = ChatTemplate(load_tokenizer(str(tiny_model_dir)))
    checked: list[int] = []
    push = SwiftRolloutClient._push

    def push_and_compare(self, model, sums):
        out = push(self, model, sums)
        held = state.engine._params
        for name, p in model.named_parameters():
            assert torch.equal(held[name], p.detach().float()), f"{name} differs on the server after the sync"
        local = TransformersEngine(copy.deepcopy(model).float().eval(), template)
        served_ids = [o.response.choices[0].token_ids for o in self.infer_trajectories(PROMPTS, GREEDY)]
        local_ids = [r.choices[0].token_ids for r in local.infer(PROMPTS, GREEDY)]
        assert served_ids == local_ids
        checked.append(state.weight_version)
        return out

    monkeypatch.setattr(SwiftRolloutClient, "_push", push_and_compare)
    argv = ["--model", str(tiny_model_dir), "--tuner_type", "full", "--dataset", "builtin:arithmetic",
            "--reward_funcs", "accuracy",
            "--vllm_mode", "server", "--vllm_server_host", "127.0.0.1", "--vllm_server_port", str(swift_port),
            "--max_steps", "2", "--num_generations", "4", "--per_device_train_batch_size", "8",
            "--max_completion_length", "8", "--torch_dtype", "float32", "--learning_rate", "1e-2",
            "--output_dir", str(tmp_path / "out"), "--save_final_model", "false"]  # fmt: skip
    trainer = run_train(parse_train_args(argv))
    assert trainer.state.global_step == 2
    assert len(checked) >= 2 and checked == sorted(set(checked))  # a sync per step, each a new weight version
