"""A later turn of an image trajectory through vLLM colocate (engines/vllm_mm.py, issue 21) on a tiny random
Idefics3: vLLM samples turn 2 from the trajectory's own ids (pinned by ``TrajectoryImages``, its images collapsed
back to slots for vLLM), not from a re-encoding of the conversation's text. Turn 1's reply is given as one token
per character, ids that do not re-tokenize to themselves, so a re-encoding would differ; vLLM's prompt ids are the
trajectory's and its turn-2 logprobs equal the trainer model's logps (renormalised over the tokens vLLM may
sample, as in test_vllm_images.py)."""

from __future__ import annotations

import pytest
import torch
from support import QUIET, flags

from grpokit.protocol import RequestConfig, RolloutInferRequest
from grpokit.rollout.multi_turn import StepResult
from grpokit.rollout.turn_images import TrajectoryImages
from grpokit.template.processor import collate_mm

pytestmark = pytest.mark.vllm

SAMPLED = RequestConfig(max_tokens=6, temperature=0.9, logprobs=True, seed=0)
LOGPROB_TOL = 1e-5  # float32
REPLY = "It is the colour red."


def _square(rgb):
    from PIL import Image

    return Image.new("RGB", (16, 16), rgb)


def test_turn_two_is_sampled_from_the_trajectory_ids(tmp_path):
    from transformers import AutoModelForImageTextToText

    from grpokit.engines.vllm_engine import VllmEngine, VllmSettings
    from grpokit.testing_vlm import build_tiny_vlm

    torch.set_num_threads(1)
    folder = build_tiny_vlm(tmp_path / "model", "idefics3", hidden_size=128)  # vLLM CPU attention: head size 32
    engine = VllmEngine(
        str(folder),
        VllmSettings(
            dtype="float32", max_model_len=512, enforce_eager=True, gpu_memory_utilization=0.3, max_num_seqs=4
        ),
    )
    try:
        template = engine.template
        tok = template.tokenizer
        first = RolloutInferRequest(
            messages=[{"role": "user", "content": "<image>What colour is this image?"}],
            data_dict={"images": [_square((220, 20, 20))]},
        )
        trajectory = TrajectoryImages(template, first)
        reply = [i for c in REPLY for i in tok(c, add_special_tokens=False)["input_ids"]]  # one token per character
        assert tok.decode(reply) == REPLY and tok(REPLY, add_special_tokens=False)["input_ids"] != reply
        messages = [
            *first.messages,
            {"role": "assistant", "content": REPLY},
            {"role": "user", "content": "<image>And this one?"},
        ]
        second = RolloutInferRequest(messages=messages, data_dict=dict(first.data_dict), request_id=first.request_id)
        step = StepResult(
            infer_request=second,
            token_ids=reply,
            loss_mask=[1] * len(reply),
            logprobs=[0.0] * len(reply),
            rollout_infos={},
            images=[_square((20, 200, 30))],
        )
        trajectory.commit(step, trajectory.between("step()", step, reply), {})
        ids, row = trajectory.ids, trajectory.row
        images = second.data_dict["images"]
        assert len(images) == 2 and template.encode_mm(messages, images)[0] != ids  # re-encoding would differ

        resp = engine.infer([second], SAMPLED)[0]
        assert resp.prompt_token_ids == ids  # sampled from the trajectory's own ids
        c = resp.choices[0]
        model = AutoModelForImageTextToText.from_pretrained(str(folder), dtype=torch.float32).eval()
        with torch.no_grad():
            logits = model(
                input_ids=torch.tensor([ids + c.token_ids]), **collate_mm([row], len(ids), len(c.token_ids))
            ).logits
        logits = logits[0, len(ids) - 1 : -1].float() / SAMPLED.temperature
        want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c.token_ids)[:, None]).squeeze(-1)
        allowed = logits.clone()
        allowed[:, template.blocked_token_ids] = float("-inf")
        log_allowed_mass = torch.logsumexp(allowed, -1) - torch.logsumexp(logits, -1)
        got = torch.tensor([x["logprob"] for x in c.logprobs["content"]])
        assert float((got - (want - log_allowed_mass)).abs().max()) < LOGPROB_TOL
        trajectory.close()
    finally:
        engine.close()


def test_colocate_training_adds_an_image_in_turn_two(tmp_path):
    """A colocate run (vLLM in process) with a scheduler appending an image after turn 1, as ms-swift's plugins
    do: every trajectory plays 2 turns through vLLM, rewards get both images, and the trainer's logps stay those
    vLLM sampled with (only the blocked special tokens' share separates them)."""
    import json

    from grpokit.config.parse import parse_train_args
    from grpokit.pipeline.train import run_train
    from grpokit.rewards import orms
    from grpokit.rollout.multi_turn import MultiTurnScheduler, multi_turns
    from grpokit.testing_vlm import build_tiny_vlm

    class AppendBlueImage(MultiTurnScheduler):
        def check_finished(self, infer_request, response_choice, current_turn):
            return current_turn >= self.max_turns

        def step(self, infer_request, response_choice, current_turn):
            infer_request.messages.append({"role": "user", "content": "<image>And this one?"})
            infer_request.images.append(_square((30, 40, 210)))
            return {"infer_request": infer_request}

    rewarded: list = []

    def two_images(completions, images, **kwargs):
        rewarded.append(images)
        return [len(c) / 20.0 for c in completions]

    torch.set_num_threads(1)
    folder = build_tiny_vlm(tmp_path / "model", "idefics3", hidden_size=128)
    orms["test_two_images"], multi_turns["test_append_blue"] = two_images, AppendBlueImage
    out = tmp_path / "out"
    try:
        trainer = run_train(
            parse_train_args(
                flags(
                    {"--model": folder, "--output_dir": out},
                    "--tuner_type full --dataset builtin:colours --reward_funcs test_two_images",
                    "--multi_turn_scheduler test_append_blue --max_turns 2 --torch_dtype float32 --beta 0",
                    "--num_generations 2 --per_device_train_batch_size 4 --max_completion_length 4 --max_steps 1",
                    "--rollout_importance_sampling_mode token_truncate --use_vllm true --vllm_mode colocate",
                    "--vllm_enforce_eager true --vllm_max_model_len 1024 --vllm_gpu_memory_utilization 0.3",
                    QUIET,
                )
            )
        )
        trainer.engine.close()
    finally:
        del orms["test_two_images"], multi_turns["test_append_blue"]
    assert trainer.state.global_step == 1 and len(rewarded) == 1
    assert all(len(images) == 2 for images in rewarded[0])  # the row's, then turn 2's
    rows = [r for r in map(json.loads, (out / "logging.jsonl").read_text().splitlines()) if "loss" in r]
    print("mismatch:", [(r["rollout_correction/kl"], r["rollout_correction/k3_kl"]) for r in rows])
    assert abs(rows[0]["rollout_correction/kl"]) < 5e-2 and rows[0]["rollout_correction/k3_kl"] < 5e-2
