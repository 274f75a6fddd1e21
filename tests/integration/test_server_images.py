"""Images through a real rollout server (subprocess, transformers engine, a tiny random Qwen2-VL): the trainer in
server mode trains 2 steps on builtin:colours (full weights and LoRA), after which the server's greedy answer to an
image prompt equals the trainer's own model's; hostile image bodies get one-line 4xx answers and the server
stays up."""

from __future__ import annotations

import base64
import io

import httpx
import pytest
from support import flags, server_flags
from test_server_support import rollout_server

from grpokit.protocol import RequestConfig, RolloutInferRequest

pytestmark = pytest.mark.slow

FLOAT32 = ("--torch_dtype", "float32")  # both sides sum in float32 on one thread: greedy tokens compare exactly
GREEDY = RequestConfig(max_tokens=6, temperature=0, logprobs=True)


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    from grpokit.testing_vlm import build_tiny_vlm

    return build_tiny_vlm(tmp_path_factory.mktemp("vlm") / "qwen2_vl", "qwen2_vl")


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    return tmp_path_factory.mktemp("media")


@pytest.fixture(scope="module")
def server(vlm, media, tmp_path_factory):
    limits = ("--media_root", str(media), "--max_images_per_request", "2", "--max_image_mb", "0.05")
    with rollout_server(vlm, tmp_path_factory.mktemp("logs"), *FLOAT32, *limits) as s:
        yield s


def _png(colour=(200, 30, 40), size=(16, 16), fmt="PNG") -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, fmt)
    return buf.getvalue()


def _prompts() -> list[RolloutInferRequest]:
    from grpokit.data.builtin import COLOURS_PROMPT

    return [
        RolloutInferRequest(messages=[{"role": "user", "content": COLOURS_PROMPT}], data_dict={"images": [png]})
        for png in (_png((200, 30, 40)), _png((20, 30, 220)))
    ]


def _greedy(engine) -> tuple[list[list[int]], list[float]]:
    """Greedy token ids and their logprobs (a tiny random model's greedy tokens may not move in 2 steps; their
    logprobs do)."""
    choices = [r.choices[0] for r in engine.infer(_prompts(), GREEDY)]
    return [c.token_ids for c in choices], [x["logprob"] for c in choices for x in c.logprobs["content"]]


def _local(model_dir):
    import torch
    from transformers import AutoModelForImageTextToText

    from grpokit.engines.transformers_engine import TransformersEngine
    from grpokit.modeling import load_tokenizer
    from grpokit.template.processor import load_processor, make_template

    model = AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=torch.float32)
    return TransformersEngine(model, make_template(load_processor(str(model_dir), load_tokenizer(str(model_dir)))))


@pytest.mark.parametrize("tuner", ["full", "lora"])
def test_server_mode_trains_on_images_and_the_server_holds_the_trained_weights(
    tuner, vlm, server, tmp_path, one_torch_thread
):
    from grpokit.config.parse import parse_train_args
    from grpokit.engines.client import RolloutClient
    from grpokit.pipeline.train import run_train

    before = httpx.get(server.url + "/get_engine_type/", timeout=10).json()
    assert before["multimodal"] is True
    out = tmp_path / "out"
    lora = (
        flags("--tuner_type lora --lora_rank 8 --learning_rate 5e-2")
        if tuner == "lora"
        else ["--tuner_type", "full", "--learning_rate", "3e-2"]
    )
    trainer = run_train(
        parse_train_args(
            flags(
                {"--model": vlm, "--output_dir": out},
                server_flags(server.port, 120),
                "--dataset builtin:colours --reward_funcs external_r1v_acc --max_steps 2 --num_generations 4",
                "--per_device_train_batch_size 8 --max_completion_length 4 --torch_dtype float32 --beta 0",
                "--save_steps 100 --disable_tqdm true --seed 1 --structured_outputs_regex (red|green|blue)",
                *lora,
            )
        )
    )  # answers at chance: rewards differ
    check = RolloutClient(base_urls=[server.url], timeout=120)
    try:
        assert check.engine_info(refresh=True)["weight_version"] >= before["weight_version"] + 2  # a sync per step
        if tuner == "full":  # the saved model folder, loaded afresh
            local = _greedy(_local(next(out.glob("**/config.json")).parent))
        else:  # the trainer's policy, its adapter merged for sampling as the sync merges it
            from grpokit.engines.transformers_engine import TransformersEngine

            local = _greedy(TransformersEngine(trainer.accelerator.unwrap_model(trainer.model), trainer.template))
        served, untrained = _greedy(check), _greedy(_local(vlm))
        assert served[0] == local[0]
        assert served[1] == pytest.approx(local[1], abs=1e-5)
        assert max(abs(a - b) for a, b in zip(local[1], untrained[1])) > 1e-3, "training changed nothing"
    finally:
        check.close()


def _infer(client: httpx.Client, refs: list[str], **data) -> httpx.Response:
    body = {
        "requests": [
            {"messages": [{"role": "user", "content": "<image>What colour?"}], "images": refs, "data_dict": data}
        ],
        "request_config": {"max_tokens": 2, "temperature": 0},
    }
    return client.post("/infer/", json=body)


def test_hostile_image_bodies_get_one_line_4xx(server, media, tmp_path):
    from PIL import Image

    uri = "data:image/png;base64," + base64.b64encode(_png()).decode()
    (media / "ok.png").write_bytes(_png())
    (tmp_path / "secret.png").write_bytes(_png())
    bomb = io.BytesIO()
    Image.new("1", (8000, 8000)).save(bomb, "PNG")  # 64M pixels in a few KB
    big = io.BytesIO()
    Image.effect_noise((256, 256), 80).convert("RGB").save(big, "PNG")  # ~190 KB > --max_image_mb 0.05
    cases = {
        "bad base64": (["data:image/png;base64,***"], 400, "not valid base64"),
        "outside the media root": ([str(tmp_path / "secret.png")], 403, "not a readable file under"),
        "missing, as outside": ([str(tmp_path / "missing.png")], 403, "not a readable file under"),
        "climbing out": (["../" * 8 + str(tmp_path / "secret.png")], 403, "not a readable file under"),
        "a NUL byte": (["ok\u0000.png"], 400, "control character"),
        "a URL": (["http://example.com/x.png"], 400, "refused"),
        "too many images": ([uri] * 3, 413, "--max_images_per_request 2"),
        "oversized": (["data:image/png;base64," + base64.b64encode(big.getvalue()).decode()], 413, "--max_image_mb"),
        "decompression bomb": ([base64.b64encode(bomb.getvalue()).decode()], 413, "--max_image_pixels"),
        "not an image": ([base64.b64encode(b"GIF89a" + b"\0" * 30).decode()], 400, "image"),
    }
    with httpx.Client(base_url=server.url, timeout=60) as client:
        for name, (images, status, words) in cases.items():
            resp = _infer(client, images)
            error = resp.json()["error"]
            assert resp.status_code == status, (name, resp.status_code, error)
            assert words in error and "\n" not in error, (name, error)
        resp = _infer(client, [], images=["/etc/passwd"])  # images hidden in data_dict would skip every check
        assert resp.status_code == 422 and "'images' field" in resp.json()["error"]
        ok = _infer(client, ["ok.png", uri])  # a path under the root, and base64
        assert ok.status_code == 200, ok.text
        assert len(ok.json()[0]["response"]["prompt_token_ids"]) > 20  # two images' tokens expanded
        assert client.get("/health/").status_code == 200


PLUGIN = '''
from PIL import Image

from grpokit.rollout.env import Env, envs


class ColourObservation(Env):
    """Turn 1's reply gets a blue image observation; the episode ends after turn 2."""

    async def reset(self, config):
        return "", {}, ""  # keep the row's prompt and image

    async def step(self, action):
        if sum(m["role"] == "assistant" for m in action) == 1:
            return "<image>And this one?", 0.0, False, {"images": [Image.new("RGB", (16, 16), (30, 40, 210))]}
        return "", 1.0, True, {}


envs["server_colour_observation"] = ColourObservation
'''


def test_an_image_observation_on_a_multi_turn_server_trains_on_the_servers_tokens(vlm, tmp_path, one_torch_thread):
    """The server's environment adds an image in turn 2; it comes back as base64, and the trainer's logps on both
    turns equal the server's sampling logprobs (float32)."""
    import torch

    from grpokit.config.parse import parse_train_args
    from grpokit.pipeline.train import run_train
    from grpokit.trainers.factory import TrainerFactory
    from grpokit.trainers.grpo_trainer import GRPOTrainer

    plugin = tmp_path / "colour_env.py"
    plugin.write_text(PLUGIN)
    seen: list = []

    class Recording(GRPOTrainer):
        def _compute_loss_and_metrics(self, model, inputs):
            logps, _ = self._get_per_token_logps_and_entropies(model, inputs.to(self.accelerator.device))
            seen.append((logps.detach(), inputs))
            return super()._compute_loss_and_metrics(model, inputs)

    saved = dict(TrainerFactory.TRAINER_MAPPING)
    TrainerFactory.TRAINER_MAPPING["grpo"] = Recording
    turns = (
        "--external_plugins",
        str(plugin),
        "--multi_turn_scheduler",
        "gym_scheduler",
        "--max_turns",
        "2",
        "--gym_env",
        "server_colour_observation",
    )
    try:
        with rollout_server(vlm, tmp_path, *FLOAT32, *turns) as server:
            run_train(
                parse_train_args(
                    flags(
                        {"--model": vlm, "--output_dir": tmp_path / "out"},
                        server_flags(server.port, 120),
                        "--dataset builtin:colours --max_steps 1 --num_generations 2",
                        "--per_device_train_batch_size 4 --max_completion_length 4 --torch_dtype float32 --beta 0",
                        "--save_steps 100 --save_final_model false --disable_tqdm true",
                        "--rollout_importance_sampling_mode token_truncate",
                    )
                )
            )
    finally:
        TrainerFactory.TRAINER_MAPPING.clear()
        TrainerFactory.TRAINER_MAPPING.update(saved)
    logps, batch = seen[0]
    assert [r.tensors["image_grid_thw"].shape[0] for r in batch.mm_inputs] == [2] * 4  # the row's + the observation's
    mask = batch.completion_mask.bool()
    assert not torch.isnan(batch.rollout_logps[mask]).any()
    torch.testing.assert_close(logps[mask], batch.rollout_logps[mask], atol=1e-5, rtol=0)
