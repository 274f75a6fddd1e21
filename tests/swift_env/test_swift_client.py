"""ms-swift 4.6.0's own trainer client (``swift.rlhf_trainers.vllm_client.VLLMClient``) against ``grpokit rollout``
(in this process, a tiny float32 model): health, engine type, caches, single-turn and multi-turn ``infer`` whose
answers ms-swift restores with ``RolloutOutput.model_validate`` and merges with its trainer's own code
(``OnPolicySample.apply_rollout_output``) into what grpokit's client gets, and its weight routes over gloo.

Runs in the ms-swift environment (``bash scripts/test_swift.sh``; marker ``swift_env``, deselected by the main
suite). On CPU the weight group is grpokit's ``GlooCommunicator`` in place of vLLM's ``PyNcclCommunicator`` (the
same interface and message flow); ms-swift's ``get_torch_device()`` (torch's CPU module, which has no ``device``
context) gets a no-op one, and its ``synchronize()`` (``torch.cuda.synchronize`` whatever the device) is a no-op:
the three changes to ms-swift's code path, all for running without a GPU.
"""

from __future__ import annotations

import contextlib
import types

import pytest
import torch

from grpokit.engines.client import RolloutClient
from grpokit.protocol import RequestConfig as OurConfig
from grpokit.protocol import RolloutInferRequest as OurRequest
from grpokit.server.app import create_app
from grpokit.server.state import ServerOptions, build_state
from grpokit.testing import free_port, serve_in_thread
from grpokit.wire.swift_group import GlooCommunicator

pytestmark = [pytest.mark.swift_env, pytest.mark.slow]

QUESTIONS = ["What is 3 + 7?", "What is 12 + 7?"]


@pytest.fixture(scope="module")
def swift():
    """ms-swift's modules, imported here only (the main suite never imports ms-swift)."""
    from swift.infer_engine.protocol import RequestConfig, RolloutInferRequest, RolloutOutput
    from swift.rl_core.data import OnPolicySample
    from swift.rlhf_trainers import vllm_client
    from swift.rlhf_trainers.rollout_mixin import RolloutTrainerMixin
    from swift.rlhf_trainers.utils import FlattenedTensorBucket

    return types.SimpleNamespace(
        RequestConfig=RequestConfig, RolloutInferRequest=RolloutInferRequest, RolloutOutput=RolloutOutput,
        OnPolicySample=OnPolicySample, vllm_client=vllm_client, Mixin=RolloutTrainerMixin,
        Bucket=FlattenedTensorBucket,
    )  # fmt: skip


@contextlib.contextmanager
def _grpokit_rollout(model_dir, **options):
    state = build_state(ServerOptions(model=str(model_dir), torch_dtype="float32", **options))
    with serve_in_thread(create_app(state)) as (url, _):
        yield state, url


@pytest.fixture(scope="module")
def single(tiny_model_dir):
    with _grpokit_rollout(tiny_model_dir) as served:
        yield served


# a server-side scheduler that always plays two turns (the tiny model never answers anything a real one checks)
ASK_AGAIN = """
from grpokit.rollout.multi_turn import MultiTurnScheduler, multi_turns


class AskAgain(MultiTurnScheduler):
    def check_finished(self, infer_request, response_choice, current_turn):
        return current_turn >= self.max_turns

    def step(self, infer_request, response_choice, current_turn):
        infer_request.messages.append({"role": "user", "content": "Are you sure?"})
        return {"infer_request": infer_request}


multi_turns["ask_again"] = AskAgain
"""


@pytest.fixture(scope="module")
def multi(tiny_model_dir, tmp_path_factory):
    plugin = tmp_path_factory.mktemp("plugin") / "ask_again.py"
    plugin.write_text(ASK_AGAIN)
    options = {"multi_turn_scheduler": "ask_again", "max_turns": 2, "external_plugins": [str(plugin)]}
    with _grpokit_rollout(tiny_model_dir, **options) as served:
        yield served


def _client(swift, url):
    return swift.vllm_client.VLLMClient(base_urls=[url], group_ports=free_port(), connection_timeout=30)


def _theirs(swift, client, data_dict=None):
    """ms-swift's client infers; its trainer's code merges each answer into a sample (as _postprocess_rollout)."""
    requests = [
        swift.RolloutInferRequest(messages=[{"role": "user", "content": q}], data_dict=data_dict or {}, uuid=f"u{i}")
        for i, q in enumerate(QUESTIONS)
    ]
    config = swift.RequestConfig(max_tokens=8, temperature=0.0, logprobs=True, return_details=True)
    outputs = client.infer(requests, config)
    assert all(isinstance(o, swift.RolloutOutput) for o in outputs)  # model_validate took every answer
    assert [o.response.id for o in outputs] == ["u0", "u1"]
    samples = []
    for q, o in zip(QUESTIONS, outputs, strict=True):
        sample = swift.OnPolicySample.from_row({"messages": [{"role": "user", "content": q}]})
        sample.apply_rollout_output(rollout_output=o)
        samples.append(sample)
    return outputs, samples


def _ours(url, data_dict=None):
    client = RolloutClient(base_urls=[url], timeout=60)
    try:
        requests = [OurRequest(messages=[{"role": "user", "content": q}], data_dict=data_dict or {}) for q in QUESTIONS]
        return client.infer_trajectories(requests, OurConfig(max_tokens=8, temperature=0, logprobs=True))
    finally:
        client.close()


def test_health_engine_type_caches_and_state_keys(swift, single):
    state, url = single
    client = _client(swift, url)  # its constructor polls GET /health
    assert client.get_engine_type()["engine_type"] == "LLMEngine"
    # enable_lora: a transformers-engine server takes adapter-only syncs by default (--vllm_enable_lora)
    assert (client.use_async_engine, client.enable_multi_turn, client.use_gym_env, client.enable_lora) == (
        False, False, False, True,
    )  # fmt: skip
    client.reset_prefix_cache()
    client.reset_mm_cache()
    client.reset_encoder_cache()
    assert client.get_model_state_keys() == state.engine.state_keys()


def test_single_turn_infer_with_logprobs_and_data_dict_equals_grpokits_client(swift, single, one_torch_thread):
    _, url = single
    outputs, samples = _theirs(swift, _client(swift, url), data_dict={"solution": "10"})
    for o, sample, ours in zip(outputs, samples, _ours(url), strict=True):
        choice = o.response.choices[0]
        assert choice.token_ids == ours.response.choices[0].token_ids
        assert swift.Mixin._extract_logprobs_from_choice(choice) == ours.rollout_logprobs[0]
        assert o.response.usage.completion_tokens == len(choice.token_ids)
        assert sample.messages == ours.messages  # prompt + the reply ms-swift's trainer appended
        assert sample.response_token_ids == ours.response_token_ids
        assert sample.rollout_logprobs == ours.rollout_logprobs


def test_multi_turn_infer_against_a_server_scheduler_equals_grpokits_client(swift, multi, one_torch_thread):
    _, url = multi
    client = _client(swift, url)
    assert client.get_engine_type()["enable_multi_turn"] is True
    outputs, samples = _theirs(swift, client)
    for o, sample, ours in zip(outputs, samples, _ours(url), strict=True):
        assert len(o.messages) == 4 and len(o.response_token_ids) == 2  # two turns: the whole conversation
        assert sample.messages == ours.messages
        assert sample.response_token_ids == ours.response_token_ids
        assert sample.response_loss_mask == ours.response_loss_mask
        assert sample.rollout_logprobs == ours.rollout_logprobs


def test_weight_routes_over_gloo_load_what_was_sent(swift, single, monkeypatch):
    state, url = single
    monkeypatch.setattr(swift.vllm_client, "PyNcclCommunicator", lambda pg, device: GlooCommunicator(pg, device))
    cpu = types.SimpleNamespace(device=lambda _d: contextlib.nullcontext(), current_stream=lambda: None)
    monkeypatch.setattr(swift.vllm_client, "get_torch_device", lambda: cpu)
    monkeypatch.setattr(swift.vllm_client, "synchronize", lambda *device: None)  # it calls torch.cuda.synchronize
    client = _client(swift, url)
    client.init_communicator(device="cpu")
    params = state.engine._params
    names = list({p.data_ptr(): n for n, p in reversed(params.items())}.values())[::-1]  # tied weights once
    gen = torch.Generator().manual_seed(0)
    sent = {n: torch.randn(params[n].shape, generator=gen) for n in names}
    client.update_named_param(names[0], sent[names[0]])  # one tensor
    bucket = swift.Bucket(named_tensors=[(n, sent[n]) for n in names[1:]])  # the rest in one flat bucket
    client.update_flattened_params(bucket.get_metadata(), bucket.get_flattened_tensor())
    version = state.weight_version
    client.process_weights_after_loading()
    assert state.weight_version == version + 1
    for n in names:
        assert torch.equal(params[n], sent[n]), n
    client.close_communicator()
