"""--fsdp and --deepspeed zero3 with --vllm_mode server: 2 gloo processes train 3 steps against a real rollout
server (tiny model); the weight push gathers the FSDP2 shards or ZeRO-3 partitions tensor by tensor (every rank
takes part, rank 0 sends). After the run the
server's seeded completion and its logprobs equal those of the model the trainer saved, for full weights and for
LoRA (merged per layer from the gathered base weight and adapters, under FSDP2 and ZeRO-3 alike)."""

from __future__ import annotations

import importlib.util

import httpx
import pytest
from support import flags
from test_distributed import _torchrun
from test_server_support import rollout_server

from grpokit.engines.client import RolloutClient
from grpokit.engines.transformers_engine import TransformersEngine
from grpokit.modeling import load_tokenizer
from grpokit.pipeline.models import load_for_inference
from grpokit.protocol import RequestConfig, RolloutInferRequest, choice_logprobs
from grpokit.template.encode import ChatTemplate
from grpokit.testing import build_tiny_model

pytestmark = pytest.mark.slow
PROMPT = [RolloutInferRequest(messages=[{"role": "user", "content": "What is 12 + 7?"}])]
# seeded sampling at temperature 1: the same weights give the same tokens and logprobs on the server and here, and
# the logprobs are the model's own (greedy ones are 0 after processing)
SAMPLE = RequestConfig(max_tokens=12, temperature=1.0, seed=3, logprobs=True)
# a reward that varies with the sampled tokens, so that the tiny model gets a gradient
REWARD_PLUGIN = """
from grpokit.rewards import ORM, orms


class TokenSum(ORM):
    def __call__(self, completions, completion_ids, **kwargs):
        return [float(sum(ids) % 11) / 11 for ids in completion_ids]


orms["token_sum"] = TokenSum
"""


def _sample(engine) -> tuple[list[int], list[float]]:
    choice = engine.infer(PROMPT, SAMPLE)[0].choices[0]
    return choice.token_ids, choice_logprobs(choice)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    with rollout_server(tiny, tmp_path_factory.mktemp("logs"), "--torch_dtype", "float32") as s:
        yield s


@pytest.mark.parametrize(
    ("sharding", "tuner"),
    [
        (("--fsdp", "true"), "full"),
        (("--fsdp", "true"), "lora"),
        (("--deepspeed", "zero3"), "full"),
        (("--deepspeed", "zero3"), "lora"),
    ],
    ids=["fsdp-full", "fsdp-lora", "zero3-full", "zero3-lora"],
)
def test_sharded_training_against_a_server_leaves_the_trained_weights_there(
    tiny, server, tmp_path, one_torch_thread, sharding, tuner
):
    if sharding[0] == "--deepspeed" and importlib.util.find_spec("deepspeed") is None:
        pytest.skip("needs the deepspeed extra (pip install 'grpokit[deepspeed]')")
    version = httpx.get(server.url + "/get_engine_type/", timeout=10).json()["weight_version"]
    lora = (
        flags("--tuner_type lora --lora_rank 4 --target_modules all-linear --learning_rate 1e-2")
        if tuner == "lora"
        else ["--tuner_type", "full", "--learning_rate", "1e-3"]
    )
    out, plugin = tmp_path / "out", tmp_path / "token_sum.py"
    plugin.write_text(REWARD_PLUGIN)
    _torchrun(
        flags(
            {"--model": tiny, "--external_plugins": plugin},
            "--tuner_type full --dataset builtin:arithmetic --reward_funcs token_sum",
            *sharding,
            "--vllm_mode server --vllm_server_host 127.0.0.1",
            {"--vllm_server_port": server.port},
            "--vllm_server_timeout 60 --max_steps 3 --num_generations 4 --per_device_train_batch_size 4",
            "--max_completion_length 8 --torch_dtype float32",
            {"--output_dir": out},
            "--disable_tqdm true --plots false --save_steps 100",
            *lora,
        ),
        tmp_path / "dump",
    )
    check = RolloutClient(base_urls=[server.url], timeout=60)
    try:
        assert check.engine_info(refresh=True)["weight_version"] >= version + 3  # a push per optimizer step
        trained, _ = load_for_inference(str(out / "final_model"), "float32")
        local = TransformersEngine(trained, ChatTemplate(load_tokenizer(str(tiny))))
        initial, _ = load_for_inference(str(tiny), "float32")
        before = TransformersEngine(initial, ChatTemplate(load_tokenizer(str(tiny))))
        (ids, logps), (local_ids, local_logps) = _sample(check), _sample(local)
        assert ids == local_ids and logps == pytest.approx(local_logps, abs=1e-5)
        before_ids, before_logps = _sample(before)  # training moved the weights the server samples from
        assert ids != before_ids or max(abs(a - b) for a, b in zip(logps, before_logps, strict=True)) > 1e-4
    finally:
        check.close()
