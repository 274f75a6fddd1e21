"""grpokit's trainer client against ms-swift 4.6.0's own ``swift rollout`` route table: its FastAPI app
(``SwiftRolloutDeploy._register_rl_rollout_app``) built without starting vLLM workers, since ``swift rollout``
refuses a machine without a GPU. Behind the app's pipe sits a stand-in for the vLLM worker: ms-swift's own
``WeightSyncWorkerExtension`` receives the weights (its ``init_communicator`` and ``update_flattened_params``, over
gloo here), loaded into a grpokit engine that also answers ``infer`` (it cannot generate with vLLM on CPU). grpokit's
client detects the protocol, reads engine type and answers, and pushes weights that arrive equal; the server's
greedy output after the sync is the pushed model's.

Runs in the ms-swift environment (``bash scripts/test_swift.sh``; marker ``swift_env``). ms-swift's server code
runs with three changes for CPU: ``GlooCommunicator`` for vLLM's ``PyNcclCommunicator``, a one-rank stand-in for
vLLM's ``get_world_group()`` (no vLLM worker), and ``synchronize()`` (``torch.cuda.synchronize``) a no-op.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing
import threading
import types

import pytest
import torch

from grpokit.config.parse import parse_train_args
from grpokit.engines.swift_client import SwiftRolloutClient, connect
from grpokit.engines.swift_protocol import grpokit_config, grpokit_request, swift_answer
from grpokit.engines.transformers_engine import TransformersEngine
from grpokit.modeling import load_causal_lm, load_tokenizer
from grpokit.protocol import RequestConfig, RolloutInferRequest
from grpokit.server.media import output_to_wire
from grpokit.server.state import ServerOptions, build_state
from grpokit.template.encode import ChatTemplate
from grpokit.testing import serve_in_thread
from grpokit.wire.swift import SwiftInferRequest, SwiftRequestConfig
from grpokit.wire.swift_group import GlooCommunicator

pytestmark = [pytest.mark.swift_env, pytest.mark.slow]
logger = logging.getLogger(__name__)

GREEDY = RequestConfig(max_tokens=8, temperature=0, logprobs=True)
PROMPTS = [RolloutInferRequest(messages=[{"role": "user", "content": f"What is {a} + 7?"}]) for a in (3, 12)]


class Worker:
    """The vLLM worker's side of ``swift rollout``'s pipe (its ``llm_worker`` loop): ``infer`` from a grpokit
    engine, the weight methods from ms-swift's ``WeightSyncWorkerExtension`` loading into that engine."""

    def __init__(self, rollout_module, state) -> None:
        self.state, self.swift = state, rollout_module
        self.ext = object.__new__(rollout_module.WeightSyncWorkerExtension)  # its __new__ sets a death signal
        self.ext.device = torch.device("cpu")
        self.ext.model_runner = types.SimpleNamespace(model=types.SimpleNamespace(
            _swift_moe_weight_loader_patched=True, load_weights=self._load))  # fmt: skip
        self.server_end, self.end = multiprocessing.Pipe()
        threading.Thread(target=self._loop, daemon=True).start()

    def _load(self, weights):
        with self.state.engine.lock:
            self.state.engine.load_weights(list(weights))

    def _infer(self, infer_requests, request_config, use_tqdm=None):
        requests = [
            grpokit_request(SwiftInferRequest.model_validate(r if isinstance(r, dict) else dataclasses.asdict(r)), "")
            for r in infer_requests
        ]
        config = None if request_config is None else dataclasses.asdict(request_config)
        outputs = asyncio.run(
            self.state.scheduler.async_infer(requests, grpokit_config(SwiftRequestConfig.model_validate(config)))
        )
        from swift.infer_engine.protocol import RolloutOutput

        return [RolloutOutput.model_validate(swift_answer(output_to_wire(o), "tiny", False)) for o in outputs]

    def _loop(self) -> None:
        while True:
            command = self.end.recv()
            kwargs = command.get("kwargs", {})
            try:
                if command["method"] == "infer":
                    result = self._infer(**kwargs)
                elif command["method"] == "collective_rpc" and kwargs["method"] != "process_weights_after_loading":
                    result = getattr(self.ext, kwargs["method"])(*kwargs.get("args", ()))
                else:  # process_weights_after_loading, reset_*_cache: nothing to do for a grpokit engine
                    result = True
            except Exception:  # as ms-swift's llm_worker: logged, answered None
                logger.exception("worker: %s failed", kwargs.get("method", command["method"]))
                result = None
            if command["type"] == "call":
                self.end.send(result)


@pytest.fixture(scope="module")
def swift_rollout(tiny_model_dir):
    """ms-swift's app on a free port, its worker backed by grpokit's engine for ``tiny_model_dir``."""
    from fastapi import FastAPI
    from swift.pipelines.infer import rollout

    patch = pytest.MonkeyPatch()
    patch.setattr(rollout, "PyNcclCommunicator", lambda pg, device: GlooCommunicator(pg, device))
    patch.setattr(rollout, "get_world_group", lambda: types.SimpleNamespace(rank=0, local_rank=0))
    patch.setattr(rollout, "synchronize", lambda *device: None)
    state = build_state(ServerOptions(model=str(tiny_model_dir), torch_dtype="float32"))
    worker = Worker(rollout, state)
    deploy = object.__new__(rollout.SwiftRolloutDeploy)  # its __init__ starts vLLM workers
    deploy.args = types.SimpleNamespace(
        api_key=None, vllm_tensor_parallel_size=1, vllm_data_parallel_size=1, multi_turn_scheduler=None,
        vllm_enable_lora=False, use_gym_env=False,
    )  # fmt: skip
    deploy.use_gym_env, deploy.use_async_engine, deploy.num_connections = False, False, 1
    deploy.connections = [worker.server_end]
    deploy.app = FastAPI()
    deploy._register_rl_rollout_app()
    with serve_in_thread(deploy.app) as (_, port):
        yield state, port
    patch.undo()


def _client(port: int) -> SwiftRolloutClient:
    args = parse_train_args(["--dataset", "builtin:arithmetic", "--vllm_mode", "server", "--vllm_server_host",
                             "127.0.0.1", "--vllm_server_port", str(port), "--vllm_server_timeout", "60"])  # fmt: skip
    client = connect(args.rollout)
    assert isinstance(client, SwiftRolloutClient)  # detected: GET /get_engine_type/ is 405 there
    return client


def _greedy(engine) -> list[list[int]]:
    return [r.choices[0].token_ids for r in engine.infer(PROMPTS, GREEDY)]


def test_engine_type_and_infer_through_ms_swifts_routes(swift_rollout, tiny_model_dir, one_torch_thread):
    _, port = swift_rollout
    client = _client(port)
    try:
        info = client.engine_info()
        assert info["protocol"] == "ms-swift" and info["engine_type"] == "swift LLMEngine"
        outputs = client.infer_trajectories(PROMPTS, GREEDY)
    finally:
        client.close()
    local = TransformersEngine(
        load_causal_lm(str(tiny_model_dir), torch.float32), ChatTemplate(load_tokenizer(str(tiny_model_dir)))
    )
    assert [o.response.choices[0].token_ids for o in outputs] == _greedy(local)
    for o, prompt in zip(outputs, PROMPTS, strict=True):
        assert o.request_id == prompt.request_id and o.messages[0] == prompt.messages[0]
        assert o.response_token_ids == [o.response.choices[0].token_ids] and len(o.rollout_logprobs[0]) == 8


def test_a_weight_push_over_gloo_arrives_equal(swift_rollout, tiny_model_dir, one_torch_thread):
    state, port = swift_rollout
    model = load_causal_lm(str(tiny_model_dir), torch.float32)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen))
    client = _client(port)
    try:
        client._sender.bucket_bytes = 64 * 1024  # several buckets
        client.sync_weights(model)
        held = state.engine._params
        for name, p in model.named_parameters():
            assert torch.equal(held[name], p), name
        served = [o.response.choices[0].token_ids for o in client.infer_trajectories(PROMPTS, GREEDY)]
    finally:
        client.close()
    assert served == _greedy(TransformersEngine(model, ChatTemplate(load_tokenizer(str(tiny_model_dir)))))
