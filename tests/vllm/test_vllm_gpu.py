"""VllmEngine checks that need CUDA: sleep levels 1 and 2 (memory freed, weights right after a sync) and bfloat16.
Run by bench/gpu_check.sh; deselected on CPU (marker `gpu`)."""

from __future__ import annotations

import pytest
import torch

from grpokit.engines.transformers_engine import TransformersEngine
from grpokit.errors import RolloutError
from grpokit.modeling import load_causal_lm, load_tokenizer
from grpokit.protocol import RequestConfig, RolloutInferRequest
from grpokit.template.encode import ChatTemplate

pytestmark = [pytest.mark.vllm, pytest.mark.gpu]

PROMPTS = [RolloutInferRequest(messages=[{"role": "user", "content": f"What is {i} + 9?"}]) for i in range(3)]
GREEDY = RequestConfig(max_tokens=12, temperature=0, logprobs=True)


def _free_bytes() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def _perturbed(tiny128, dtype):
    model = load_causal_lm(str(tiny128), dtype).to("cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen, device="cuda", dtype=p.dtype))
    return model


def _greedy(engine) -> list[list[int]]:
    return [r.choices[0].token_ids for r in engine.infer(PROMPTS, GREEDY)]


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_frees_memory_and_a_sync_restores_the_policy(tiny128, level):
    from grpokit.engines.vllm_engine import VllmEngine, VllmSettings

    settings = VllmSettings(
        dtype="float32", gpu_memory_utilization=0.2, sleep_level=level, enforce_eager=True, max_model_len=512
    )
    engine = VllmEngine(str(tiny128), settings)
    try:
        assert engine.sleep_supported
        awake = _free_bytes()
        engine.infer(PROMPTS, GREEDY)  # sleeps right after generating
        assert engine._asleep
        freed = _free_bytes() - awake
        print(f"sleep level {level}: {freed / 2**30:.2f} GiB freed")
        assert freed > 2**30  # the KV cache (0.2 of the GPU) at least
        if level == 2:
            with pytest.raises(RolloutError, match="sleep_level 2 dropped"):
                engine.infer(PROMPTS, GREEDY)
        model = _perturbed(tiny128, torch.float32)
        engine.sync_weights(model)
        reference = TransformersEngine(model, ChatTemplate(load_tokenizer(str(tiny128))))
        assert _greedy(engine) == _greedy(reference)
    finally:
        engine.close()


def test_bfloat16_logprobs_stay_close(tiny128):
    from grpokit.engines.vllm_engine import VllmEngine, VllmSettings

    engine = VllmEngine(
        str(tiny128), VllmSettings(dtype="bfloat16", gpu_memory_utilization=0.2, max_model_len=512, enforce_eager=True)
    )
    try:
        model = _perturbed(tiny128, torch.float32)
        engine.sync_weights(model)  # float32 trainer weights into a bfloat16 engine
        worst = 0.0
        for resp in engine.infer(PROMPTS, RequestConfig(max_tokens=12, temperature=1.0, logprobs=True, seed=0)):
            c = resp.choices[0]
            ids = torch.tensor([resp.prompt_token_ids + c.token_ids], device="cuda")
            with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(ids).logits[0, len(resp.prompt_token_ids) - 1 : -1].float()
            want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c.token_ids, device="cuda")[:, None])
            got = torch.tensor([x["logprob"] for x in c.logprobs["content"]], device="cuda")
            worst = max(worst, float((got - want.squeeze(-1)).abs().max()))
        print(f"bfloat16: max token logprob gap {worst:.4f}")
        assert worst < 0.1
    finally:
        engine.close()
