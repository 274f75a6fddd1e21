"""Image rows through vLLM colocate (engines/vllm_mm.py) on a tiny random Idefics3: vLLM's prompt ids are the
processor's, its logprobs are the trainer's (renormalised over the tokens it may sample), and after every weight
sync its greedy completions equal the trainer model's own (Hugging Face generate with the same images)."""

from __future__ import annotations

import io
import json

import pytest
import torch
from support import QUIET, VLLM_COLOCATE, flags

from grpokit.config.parse import parse_train_args
from grpokit.engines.transformers_engine import TransformersEngine
from grpokit.protocol import RequestConfig, RolloutInferRequest
from grpokit.rewards import ORM, orms
from grpokit.template.processor import ProcessorTemplate, collate_mm

pytestmark = pytest.mark.vllm

QUESTION = [{"role": "user", "content": "<image>What colour is this image?"}]
GREEDY = RequestConfig(max_tokens=6, temperature=0)
SAMPLED = RequestConfig(max_tokens=6, temperature=0.9, logprobs=True, seed=0)
LOGPROB_TOL = 1e-5  # float32


def _png(rgb) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (16, 16), rgb).save(buf, format="PNG")
    return buf.getvalue()


REQUESTS = [
    RolloutInferRequest(messages=QUESTION, data_dict={"images": [_png(c)]})
    for c in ((220, 20, 20), (20, 200, 30), (30, 40, 210))
]
REQUESTS.append(
    RolloutInferRequest(
        messages=[{"role": "user", "content": "Two images: <image> and <image>?"}],
        data_dict={"images": [_png((200, 200, 0)), _png((0, 90, 90))]},
    )
)
REQUESTS.append(RolloutInferRequest(messages=[{"role": "user", "content": "No image here."}]))  # a text row


class LengthWithImages(ORM):
    """Longer is better (a reward that varies within every group, so each step moves the weights); it checks
    that every row's image reached it."""

    def __call__(self, completions, images, **kwargs):
        assert len(images) == len(completions) and all(len(i) == 1 for i in images)
        return [len(c) / 20.0 for c in completions]


@pytest.fixture(scope="module")
def idefics3(tmp_path_factory):
    from grpokit.testing_vlm import build_tiny_vlm

    # vLLM's CPU attention takes head sizes 32, 64, 80, …: hidden 128 with 4 heads
    return build_tiny_vlm(tmp_path_factory.mktemp("idefics3") / "model", "idefics3", hidden_size=128)


def _greedy(engine, pad: int) -> list[list[int]]:
    ids = [r.choices[0].token_ids for r in engine.infer(REQUESTS, GREEDY)]
    return [seq[: seq.index(pad)] if pad in seq else seq for seq in ids]


def greedy_pair(engine, model) -> tuple[list, list]:
    """(vLLM's greedy ids, the trainer model's greedy ids with HF generate) for REQUESTS."""
    reference = TransformersEngine(model, ProcessorTemplate(engine.template.processor))
    pad = reference.template.pad_token_id
    return _greedy(engine, pad), _greedy(reference, pad)


def logprob_gaps(engine, model) -> tuple[float, float]:
    """(worst |vLLM logprob - trainer logp renormalised over the allowed tokens|, worst raw gap) of sampled tokens;
    also checks that vLLM's prompt ids are the processor's and that no blocked token was sampled."""
    template = engine.template
    blocked = torch.tensor(template.blocked_token_ids)
    worst, raw = 0.0, 0.0
    for req, resp in zip(REQUESTS, engine.infer(REQUESTS, SAMPLED), strict=True):
        ids, row = template.encode_mm(req.messages, req.data_dict.get("images", []))
        assert resp.prompt_token_ids == ids
        c = resp.choices[0]
        assert not set(c.token_ids) & set(blocked.tolist())
        full = torch.tensor([ids + c.token_ids])
        with torch.no_grad():
            logits = model(input_ids=full, **collate_mm([row], len(ids), len(c.token_ids))).logits
        logits = logits[0, len(ids) - 1 : -1].float() / SAMPLED.temperature
        want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c.token_ids)[:, None]).squeeze(-1)
        allowed = logits.clone()
        allowed[:, blocked] = float("-inf")
        log_allowed_mass = torch.logsumexp(allowed, -1) - torch.logsumexp(logits, -1)  # log P(allowed tokens)
        got = torch.tensor([x["logprob"] for x in c.logprobs["content"]])
        worst = max(worst, float((got - (want - log_allowed_mass)).abs().max()))
        raw = max(raw, float((got - want).abs().max()))
    return worst, raw


def test_engine_takes_images_and_follows_a_weight_sync(idefics3):
    from transformers import AutoModelForImageTextToText

    from grpokit.engines.vllm_engine import VllmEngine, VllmSettings

    torch.set_num_threads(1)
    engine = VllmEngine(
        str(idefics3),
        VllmSettings(
            dtype="float32", max_model_len=512, enforce_eager=True, gpu_memory_utilization=0.3, max_num_seqs=32
        ),
    )
    try:
        assert isinstance(engine.template, ProcessorTemplate)
        model = AutoModelForImageTextToText.from_pretrained(str(idefics3), dtype=torch.float32).eval()
        worst, raw = logprob_gaps(engine, model)
        print("logprob gaps (renormalised, raw):", worst, raw)
        assert worst < LOGPROB_TOL
        got, want = greedy_pair(engine, model)
        assert got == want
        torch.manual_seed(1)
        with torch.no_grad():  # every part moves: language model, connector and vision tower
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        engine.sync_weights(model)
        synced, want = greedy_pair(engine, model)
        assert synced == want and synced != got
        assert logprob_gaps(engine, model)[0] < LOGPROB_TOL
    finally:
        engine.close()


@pytest.mark.parametrize(
    "tuner",
    [["--tuner_type", "full", "--learning_rate", "1e-2"], ["--tuner_type", "lora", "--learning_rate", "5e-2"]],
    ids=["full", "lora"],
)
def test_colocate_training_with_images(idefics3, tmp_path, monkeypatch, tuner):
    """Full fine-tuning and LoRA (merged into vLLM's weights at each sync), the vision tower frozen (the default)."""
    from grpokit.engines.vllm_engine import VllmEngine
    from grpokit.pipeline.train import run_train

    torch.set_num_threads(1)
    checks: list[tuple] = []
    original = VllmEngine.sync_weights

    def checked_sync(self, model):
        original(self, model)
        checks.append(greedy_pair(self, model))

    monkeypatch.setattr(VllmEngine, "sync_weights", checked_sync)
    if "test_length_with_images" not in orms:
        orms["test_length_with_images"] = LengthWithImages
    out = tmp_path / "colocate"
    cfg = parse_train_args(
        flags(
            {"--model": idefics3},
            "--dataset builtin:colours --reward_funcs test_length_with_images",
            *tuner,
            "--torch_dtype float32 --beta 0 --num_generations 4 --per_device_train_batch_size 8",
            "--max_completion_length 8 --temperature 1.0 --max_steps 2",
            "--rollout_importance_sampling_mode token_truncate",
            VLLM_COLOCATE,
            {"--output_dir": out},
            QUIET,
        )
    )
    trainer = run_train(cfg)
    try:
        assert isinstance(trainer.engine, VllmEngine)
        assert len(checks) == 2  # one sync per optimizer step
        assert all(got == want for got, want in checks)
        assert checks[0][0] != checks[1][0]  # the weights did move
        rows = [r for r in map(json.loads, (out / "logging.jsonl").read_text().splitlines()) if "loss" in r]
        assert [r["step"] for r in rows] == [1, 2]
        print("mismatch per step:", [(r["rollout_correction/kl"], r["rollout_correction/k3_kl"]) for r in rows])
        for r in rows:  # only the blocked special tokens' share separates vLLM's distribution from the trainer's
            assert abs(r["rollout_correction/kl"]) < 5e-2 and r["rollout_correction/k3_kl"] < 5e-2, r
    finally:
        trainer.engine.close()
