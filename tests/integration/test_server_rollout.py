"""A real rollout server (subprocess, tiny model): weight sync (full and LoRA merged), concurrent load, and
three training steps of `grpokit train --vllm_mode server` against it."""

from __future__ import annotations

import concurrent.futures
import copy

import httpx
import pytest
import torch
from support import flags, server_flags
from test_server_support import rollout_server

from grpokit.config.parse import parse_train_args
from grpokit.engines.client import RolloutClient
from grpokit.engines.transformers_engine import TransformersEngine
from grpokit.modeling import load_causal_lm, load_tokenizer
from grpokit.protocol import RequestConfig, RolloutInferRequest
from grpokit.rollout.remote import RemoteScheduler
from grpokit.rollout.scheduler import run_trajectories
from grpokit.template.encode import ChatTemplate
from grpokit.testing import build_tiny_model

pytestmark = pytest.mark.slow

# The tests compare the server's greedy completions with a float32 model in this process, so the server is float32
# too (its default `--torch_dtype auto` is bfloat16 on a CPU with AVX512-BF16/AMX), and the comparing tests pin this
# process to the server's one torch thread (`one_torch_thread`) so that both sum in the same order.
FLOAT32 = ("--torch_dtype", "float32")
PROMPT = [RolloutInferRequest(messages=[{"role": "user", "content": "What is 12 + 7?"}])]
GREEDY = RequestConfig(max_tokens=12, temperature=0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    with rollout_server(tiny, tmp_path_factory.mktemp("logs"), *FLOAT32) as s:
        yield s


@pytest.fixture()
def client(server):
    c = RolloutClient(base_urls=[server.url], timeout=60)
    yield c
    c.close()


def _greedy(engine) -> list[int]:
    return engine.infer(PROMPT, GREEDY)[0].choices[0].token_ids


def _local(model, tiny) -> TransformersEngine:
    return TransformersEngine(model, ChatTemplate(load_tokenizer(str(tiny))))


def test_full_sync_matches_a_local_engine_over_three_rounds(tiny, client, one_torch_thread):
    model = load_causal_lm(str(tiny), torch.float32)
    local = _local(model, tiny)
    client._sender.bucket_bytes = 64 * 1024  # several buckets (the embedding alone is 128 KB: it goes alone)
    client.sync_weights(model)  # the server may hold weights of another test: start from the file's
    before = _greedy(client)
    assert before == _greedy(local)
    for round_ in range(3):
        gen = torch.Generator().manual_seed(round_)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.3 * torch.randn(p.shape, generator=gen))
        client.sync_weights(model)
        after = _greedy(client)
        assert after == _greedy(local), f"round {round_}: server and local greedy completions differ"
        assert after != before, f"round {round_}: the update did not change the server's completion"
        before = after
    info = client.engine_info(refresh=True)
    assert info["communicator"] is True and info["weight_version"] >= 4


def test_lora_merged_sync_matches_the_merged_model(tiny, client, one_torch_thread):
    from peft import LoraConfig, get_peft_model

    base = load_causal_lm(str(tiny), torch.float32)
    original = {n: p.detach().clone() for n, p in base.named_parameters()}
    model = get_peft_model(
        base,
        LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"]),
    )
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:  # peft starts B at zero (no change); make the adapter matter
                p.copy_(torch.randn(p.shape, generator=gen))
    client.sync_weights(load_causal_lm(str(tiny), torch.float32))  # the server starts from the plain base
    before = _greedy(client)
    client.sync_weights(model)
    merged = copy.deepcopy(model).merge_and_unload()
    after = _greedy(client)
    assert after == _greedy(_local(merged, tiny))
    assert after != before
    unwrapped = model.get_base_model()  # the adapter was unmerged again: base weights as loaded
    for name, p in unwrapped.named_parameters():
        if "lora_" not in name:
            key = name.replace(".base_layer", "")
            assert torch.allclose(p, original[key], atol=1e-5), name


def test_three_training_steps_against_the_server(tiny, server, tmp_path, one_torch_thread):
    from grpokit.pipeline.train import run_train

    # the trainer keeps --torch_dtype auto (bf16 autocast where the CPU has it): the weights it syncs are float32
    version = httpx.get(server.url + "/get_engine_type/", timeout=10).json()["weight_version"]
    cfg = parse_train_args(
        flags(
            {"--model": tiny, "--output_dir": tmp_path / "out"},
            server_flags(server.port, 60),
            "--tuner_type full --dataset builtin:arithmetic --reward_funcs accuracy --max_steps 3",
            "--num_generations 4 --per_device_train_batch_size 8 --max_completion_length 8",
            "--save_final_model false",
        )
    )
    trainer = run_train(cfg)  # closes its client (and the server's sync group) at the end
    assert isinstance(trainer.engine, RolloutClient) and isinstance(trainer.scheduler, RemoteScheduler)
    check = RolloutClient(base_urls=[server.url], timeout=60)
    try:
        info = check.engine_info(refresh=True)
        assert info["weight_version"] >= version + 3  # one sync per optimizer step
        policy = trainer.accelerator.unwrap_model(trainer.model)
        assert _greedy(check) == _greedy(_local(policy, tiny))
    finally:
        check.close()


def test_async_generate_trains_one_step_off_policy(tiny, server, tmp_path):
    import json

    from grpokit.pipeline.train import run_train

    out = tmp_path / "async"
    cfg = parse_train_args(
        flags(
            {"--model": tiny, "--output_dir": out},
            server_flags(server.port, 60),
            "--tuner_type full --dataset builtin:arithmetic --reward_funcs accuracy --max_steps 4",
            "--num_generations 4 --per_device_train_batch_size 8 --max_completion_length 8",
            "--save_final_model false --save_steps 2 --async_generate true --log_completions true",
        )
    )
    trainer = run_train(cfg)
    rows = [json.loads(line) for line in (out / "logging.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[0]["async/staleness"] == 0  # the first window is generated before any update
    # later ones are rolled out while the step before trains: from weights one step old, or from the new ones when
    # the producer thread starts after that step's sync (a busy machine); never older
    assert all(r["async/staleness"] in (0, 1) for r in rows[1:])
    logged = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    for r in rows:  # the staleness logged is the one the completions' weight versions give
        versions = [c["weight_version"] for c in logged if c["step"] == r["step"]]
        assert versions and r["async/staleness"] == r["step"] - 1 - min(versions)
    assert all("async/time_saved_s" in r and "async/wait_s" in r for r in rows)
    # the window rolled out ahead but never trained on is pending in the checkpoint: drawn again first on resume
    state = json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())
    per = trainer.plan.prompts_per_rollout
    # (or, when the producer had not yet drawn window 3 as step 2 saved, nothing pending and two windows consumed)
    assert (state["prompts_consumed"], state["prompts_pending"]) in ((3 * per, [2 * per]), (2 * per, []))


def test_async_generate_refuses_the_live_weights_engine(tiny, tmp_path):
    """Refused when the options are checked, before any model loads (grpokit.config.validate)."""
    from grpokit.errors import ConfigError

    with pytest.raises(ConfigError, match="async_generate"):
        parse_train_args(
            flags(
                {"--model": tiny, "--output_dir": tmp_path / "o"},
                "--tuner_type full --dataset builtin:arithmetic --num_generations 4",
                "--per_device_train_batch_size 8 --max_steps 1 --async_generate true",
            )
        )


def test_remote_scheduler_returns_trajectories_in_order(client):
    requests = [
        RolloutInferRequest(
            messages=[{"role": "user", "content": f"What is {i} + 1?"}], request_id=f"r{i}", prompt_id=f"p{i // 2}"
        )
        for i in range(6)
    ]
    outs = run_trajectories(RemoteScheduler(client), requests, RequestConfig(max_tokens=4, logprobs=True))
    assert [o.request_id for o in outs] == [f"r{i}" for i in range(6)]
    # one logprob per completion token; a completion may be empty (the random model samples the pad token
    # <|endoftext|> first about once in 300 draws: the engine ends it there), and then it has no logprobs
    for o in outs:
        (tokens,) = o.response_token_ids
        assert [len(lps) for lps in o.rollout_logprobs] == ([len(tokens)] if tokens else [])
    assert any(o.response_token_ids[0] for o in outs)


def test_two_servers_split_requests_and_both_get_the_weights(tiny, server, tmp_path, one_torch_thread):
    model = load_causal_lm(str(tiny), torch.float32)
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen))
    expected = _greedy(_local(model, tiny))
    with rollout_server(tiny, tmp_path, *FLOAT32) as second:
        both = RolloutClient(base_urls=[server.url, second.url], timeout=60)
        try:
            both.sync_weights(model)  # one group of 3 ranks: the trainer and two servers
            for url in (server.url, second.url):
                single = RolloutClient(base_urls=[url], timeout=30)
                assert _greedy(single) == expected, url
                single._http.close()
            requests = [
                RolloutInferRequest(
                    messages=[{"role": "user", "content": f"q{i}"}], request_id=f"r{i}", prompt_id=f"p{i % 3}"
                )
                for i in range(12)
            ]
            outs = both.infer_trajectories(requests, RequestConfig(max_tokens=3))
            assert [o.request_id for o in outs] == [f"r{i}" for i in range(12)]
            assert second.healthy() and both.engine_info(refresh=True)["num_servers"] == 2
        finally:
            both.close()


def test_eight_concurrent_clients_fifty_requests_each(server):
    config = RequestConfig(max_tokens=4, temperature=1.0)

    def one_client(c: int) -> list[tuple[str, str]]:
        client = RolloutClient(base_urls=[server.url], timeout=120)
        got = []
        try:
            for batch in range(5):  # 5 calls x 10 requests = 50
                reqs = [
                    RolloutInferRequest(
                        messages=[{"role": "user", "content": f"client {c} item {batch}-{k}"}],
                        request_id=f"c{c}-{batch}-{k}",
                    )
                    for k in range(10)
                ]
                outs = client.infer_trajectories(reqs, config)
                got.extend((r.request_id, o.request_id) for r, o in zip(reqs, outs, strict=True))
                assert all(o.messages[0]["content"] == r.messages[0]["content"] for r, o in zip(reqs, outs))
        finally:
            client.close()
        return got

    with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(one_client, range(8)))
    pairs = [p for r in results for p in r]
    assert len(pairs) == 400 and all(a == b for a, b in pairs)
    assert len({a for a, _ in pairs}) == 400
    assert server.healthy()
