"""Images in later turns (issue 21): a 2-turn environment whose observation is an image, on tiny random Qwen2-VL
and Idefics3 through the transformers engine. The row's image stays in every turn's prompt, the observation's
image joins the trajectory, the trainer's logps equal the engine's sampling logprobs on the tokens of both turns,
the observation image changes only the second turn's logps, and bad observations get one line."""

from __future__ import annotations

import json

import pytest
import torch
from support import flags, grpo_trainer_class

pytestmark = pytest.mark.slow

FAMILIES = ("qwen2_vl", "idefics3")
COLOURS = {"red": (220, 20, 30), "green": (20, 200, 40), "blue": (30, 40, 210), "grey": (128, 128, 128)}


@pytest.fixture(scope="module")
def vlm_dirs(tmp_path_factory):
    from grpokit.testing_vlm import build_tiny_vlm

    root = tmp_path_factory.mktemp("vlms")
    return {f: build_tiny_vlm(root / f, f) for f in FAMILIES}


def _square(colour: str):
    from PIL import Image

    return Image.new("RGB", (16, 16), COLOURS[colour])


def _colour_env_class():
    from grpokit.rollout.env import Env

    class ColourObservation(Env):
        async def reset(self, config):
            return "", {}, ""  # keep the row's prompt (and its image)

        async def step(self, action):
            if sum(m["role"] == "assistant" for m in action) == 1:
                n = int(self.env_config.get("placeholders", 1))
                return "<image>" * n + "And this one?", 0.0, False, {"images": [_square(self.env_config["colour"])]}
            return "", float(len(action[-1]["content"]) % 2), True, {}

    return ColourObservation


@pytest.fixture
def colour_env():
    """Turn 1's reply gets an image observation (the env_config's colour) with one placeholder per image; the
    episode ends after turn 2 with a reward that depends on the reply. ``test_reset_observation`` also starts
    with an image: its reset replaces the prompt with an observation holding a grey square."""
    from grpokit.rollout.env import envs

    base = _colour_env_class()

    class ResetObservation(base):
        async def reset(self, config):
            return "<image>Which colour is the second image?", {"images": [_square("grey")], "level": 1}, ""

    envs["test_colour_observation"] = base
    envs["test_reset_observation"] = ResetObservation
    yield
    del envs["test_colour_observation"], envs["test_reset_observation"]


def _dataset(tmp_path, placeholders: int = 1, env: str = "test_colour_observation"):
    names = list(COLOURS)
    lines = []
    for i in range(3):
        path = tmp_path / f"row{i}.png"
        _square(names[i]).save(path)
        lines.append(
            {
                "messages": [{"role": "user", "content": "<image>What colour is this image?"}],
                "images": [str(path)],
                "env_config": {"name": env, "colour": names[(i + 1) % 3], "placeholders": placeholders},
            }
        )
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    return path


def _train(model_dir, data, out, trainer_cls, steps: int = 2, extra: tuple = (), scheduler: str = "gym_scheduler"):
    from grpokit.config.parse import parse_train_args
    from grpokit.pipeline.train import run_train

    with grpo_trainer_class(trainer_cls):
        return run_train(
            parse_train_args(
                flags(
                    {"--model": model_dir, "--dataset": data, "--output_dir": out},
                    {"--multi_turn_scheduler": scheduler, "--max_steps": steps},
                    "--tuner_type full --max_turns 2 --num_generations 2 --per_device_train_batch_size 6",
                    "--generation_batch_size 6 --max_completion_length 5 --beta 0 --torch_dtype float32",
                    "--save_steps 100 --seed 0 --disable_tqdm true",
                    "--rollout_importance_sampling_mode token_truncate --loss_type grpo --learning_rate 1e-3",
                    *extra,
                )
            )
        )


def _image_count(row) -> int:
    if "image_grid_thw" in row.tensors:  # Qwen-VL: one grid per image
        return row.tensors["image_grid_thw"].shape[0]
    pv = row.tensors["pixel_values"]
    return pv.shape[1] if pv.dim() == 5 else pv.shape[0]  # Idefics3 keeps a per-row image axis


def _turn_runs(mask: torch.Tensor) -> int:
    """Runs of trained tokens in a completion mask (one per assistant turn)."""
    m = mask.int().tolist()
    return sum(1 for k, v in enumerate(m) if v and (k == 0 or not m[k - 1]))


@pytest.fixture
def rewarded():
    """The ``images`` each call of the reward ``test_record_images`` got (registered for the test)."""
    from grpokit.rewards import orms

    calls: list = []

    def record_images(completions, images, **kwargs):
        calls.append(images)
        return [0.0] * len(completions)

    orms["test_record_images"] = record_images
    yield calls
    del orms["test_record_images"]


def _recording(seen: list):
    """A GRPOTrainer that keeps each window's outputs, the training forward's logps and the batch."""
    from grpokit.trainers.grpo_trainer import GRPOTrainer

    class Recording(GRPOTrainer):
        def _prepare_inputs(self, prompts, rollout=None):
            window = super()._prepare_inputs(prompts, rollout)
            seen.append([window.outputs])
            return window

        def _compute_loss_and_metrics(self, model, inputs):
            logps, _ = self._get_per_token_logps_and_entropies(model, inputs.to(self.accelerator.device))
            seen[-1] += [logps.detach(), inputs]
            return super()._compute_loss_and_metrics(model, inputs)

    return Recording


def _check_logps_equal_the_engine(batch, logps) -> None:
    assert all(_turn_runs(m) == 2 for m in batch.completion_mask)  # both turns train, the observation not
    mask = batch.completion_mask.bool()
    assert not torch.isnan(batch.rollout_logps[mask]).any()
    torch.testing.assert_close(logps[mask], batch.rollout_logps[mask], atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_image_observation_trains_and_logps_equal_the_engine_on_every_turn(family, vlm_dirs, colour_env, tmp_path):
    from grpokit.trainers.batch import collate

    seen: list = []
    Recording = _recording(seen)
    trainer = _train(vlm_dirs[family], _dataset(tmp_path), tmp_path / "out", Recording)
    assert trainer.state.global_step == 2 and len(seen) == 2
    for outputs, logps, batch in seen:
        assert all(o.rollout_infos["num_turns"] == 2 and len(o.rollout_infos["images"]) == 2 for o in outputs)
        assert [_image_count(r) for r in batch.mm_inputs] == [2] * 6  # the row's image and the observation's
        _check_logps_equal_the_engine(batch, logps)
    if family == "qwen2_vl":  # the observation's image tokens are marked as such over the completion
        assert all(r.completion["mm_token_type_ids"].sum() > 0 for r in seen[0][2].mm_inputs)

    # the same trajectory with only the observation image changed: turn 1's logps stay, turn 2's move
    output = seen[-1][0][0]
    images = output.rollout_infos["images"]
    other = _square("blue" if images[1].getpixel((0, 0)) != COLOURS["blue"] else "green")
    samples = [
        trainer.template.encode_output(output.prompt_messages, output, images=imgs)
        for imgs in (images, [images[0], other])
    ]
    assert samples[0].prompt_ids == samples[1].prompt_ids and samples[0].completion_ids == samples[1].completion_ids
    pair = collate(samples, trainer.template.pad_token_id, [False, False])
    trainer.model.eval()
    with torch.no_grad():
        lp, _ = trainer._get_per_token_logps_and_entropies(trainer.model, pair)
    first = len(output.response_token_ids[0])
    second = pair.completion_mask[0].bool() & (torch.arange(pair.completion_mask.shape[1]) >= first)
    torch.testing.assert_close(lp[0, :first], lp[1, :first], atol=1e-6, rtol=0)
    assert (lp[0][second] - lp[1][second]).abs().max() > 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_images_from_reset_train_and_every_image_reaches_the_rewards(family, vlm_dirs, colour_env, rewarded, tmp_path):
    """reset's observation (one image) replaces the prompt; the trajectory's images are the row's, reset's, then
    the step's, in the trainer's batch and in the rewards' ``images``; logps equal the engine's on both turns."""
    seen: list = []
    _train(
        vlm_dirs[family],
        _dataset(tmp_path, env="test_reset_observation"),
        tmp_path / "out",
        _recording(seen),
        extra=("--reward_funcs", "test_record_images"),
    )
    assert len(seen) == 2 and len(rewarded) == 2
    for (outputs, logps, batch), images in zip(seen, rewarded):
        for o, imgs in zip(outputs, images):
            assert o.prompt_messages[-1] == {"role": "user", "content": "<image>Which colour is the second image?"}
            assert o.rollout_infos["reset_info"] == {"level": 1}
            row_image, reset_image, step_image = o.rollout_infos["images"]
            assert isinstance(row_image, str) and row_image.endswith(".png")
            assert reset_image.getpixel((0, 0)) == COLOURS["grey"] and step_image.getpixel((0, 0)) != COLOURS["grey"]
            assert imgs == o.rollout_infos["images"]
        assert [_image_count(r) for r in batch.mm_inputs] == [3] * 6
        _check_logps_equal_the_engine(batch, logps)


def _engine_and_scheduler(model_dir):
    from grpokit.config.args import ModelArguments
    from grpokit.engines.transformers_engine import TransformersEngine
    from grpokit.pipeline.models import load_policy
    from grpokit.rollout.builtin_schedulers import GYMScheduler
    from grpokit.template.processor import make_template

    model, processor, _ = load_policy(
        ModelArguments(model=str(model_dir), torch_dtype="float32", tuner_type="full"), 0.0
    )
    engine = TransformersEngine(model, make_template(processor))
    return GYMScheduler(infer_engine=engine, max_turns=2, tokenizer=engine.tokenizer)


def _run(scheduler, row: dict):
    from grpokit.protocol import RequestConfig, RolloutInferRequest
    from grpokit.rollout.scheduler import run_trajectories

    request = RolloutInferRequest(messages=row["messages"], data_dict={k: v for k, v in row.items() if k != "messages"})
    return run_trajectories(scheduler, [request], RequestConfig(max_tokens=3, temperature=1.0))


def test_an_observation_with_more_placeholders_than_images_is_one_line(vlm_dirs, colour_env, tmp_path):
    from grpokit.errors import RolloutError

    row = json.loads(_dataset(tmp_path, placeholders=2).read_text().splitlines()[0])
    with pytest.raises(RolloutError) as e:
        _run(_engine_and_scheduler(vlm_dirs["idefics3"]), row)
    assert "step() at turn 1: the new message(s) hold 2 <image> placeholder(s) but 1 image(s)" in str(e.value)
    assert "\n" not in str(e.value)


def test_a_text_only_model_given_an_image_observation_is_one_line(colour_env, tmp_path):
    from grpokit.errors import RolloutError
    from grpokit.testing import build_tiny_model

    row = {
        "messages": [{"role": "user", "content": "Say something."}],
        "env_config": {"name": "test_colour_observation", "colour": "red"},
    }
    with pytest.raises(RolloutError) as e:
        _run(_engine_and_scheduler(build_tiny_model(tmp_path / "text")), row)
    assert "returned 1 image(s) but the model is text-only; use a vision-language model" in str(e.value)
    assert "\n" not in str(e.value)


def test_a_reply_that_writes_the_placeholder_text_is_not_an_image_slot(vlm_dirs):
    """The text between turns is rendered with the observation's image expanded; a reply's literal "<image>"
    stays text (it has no image) and the observation's one image fills the observation's one slot."""
    from grpokit.config.args import ModelArguments
    from grpokit.pipeline.models import load_policy
    from grpokit.template.processor import ProcessorTemplate

    _, processor, _ = load_policy(
        ModelArguments(model=str(vlm_dirs["qwen2_vl"]), torch_dtype="float32", tuner_type="full"), 0.0
    )
    template = ProcessorTemplate(processor)
    full = [
        {"role": "user", "content": "<image>What colour?"},
        {"role": "assistant", "content": "a <image> b"},
        {"role": "user", "content": "<image>And this one?"},
    ]
    seg = template.tokenize("a <image> b")
    ids, row = template.encode_between_mm(full, 1, 3, seg, [_square("red")])
    pad = template.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    grid = row.tensors["image_grid_thw"]
    assert grid.shape[0] == 1 and ids.count(pad) == int(grid.prod()) // 4  # 2x2 patches merge into one token
    assert row.tensors["mm_token_type_ids"].sum() == ids.count(pad)


def test_bad_reset_images_and_missing_step_images_are_one_line(tmp_path):
    """reset's images need one placeholder each and a multimodal model: the reset fails with a line saying so; a
    step() image that does not exist is named with the scheduler and the turn."""
    import asyncio

    from grpokit.errors import RolloutError
    from grpokit.protocol import ChatCompletionResponseChoice, RolloutInferRequest
    from grpokit.rollout.builtin_schedulers import GYMScheduler
    from grpokit.rollout.env import Env, envs
    from grpokit.rollout.multi_turn import MultiTurnScheduler

    class ResetImages(Env):
        async def reset(self, config):
            return self.env_config["observation"], {"images": [_square("red")]}, ""

        async def step(self, action):
            return "", 0.0, True, {}

    def reset(observation: str):
        request = RolloutInferRequest(
            messages=[{"role": "user", "content": "hi"}],
            data_dict={"env_config": {"name": "test_reset_images", "observation": observation}},
        )
        with pytest.raises(RolloutError) as e:
            asyncio.run(GYMScheduler(max_turns=2).on_trajectory_start([request]))
        assert "\n" not in str(e.value)
        return str(e.value), request

    envs["test_reset_images"] = ResetImages
    try:
        message, _ = reset("Look.")
        assert (
            "env 'test_reset_images' reset failed: ValueError: env 'test_reset_images': reset returned 1 image(s) "
            "but its observation holds 0 <image> placeholder(s); put one <image> per image"
        ) in message
        message, request = reset("<image>Look.")  # no engine, no processor: a text-only model
        assert "reset returned 1 image(s) but the model is text-only; use a vision-language model" in message
    finally:
        del envs["test_reset_images"]
    choice = ChatCompletionResponseChoice(
        message={"role": "assistant", "content": "x"}, finish_reason="stop", token_ids=[1]
    )
    step = {"infer_request": request, "images": [str(tmp_path / "gone.png")]}
    with pytest.raises(
        RolloutError,
        match=r"MultiTurnScheduler.step\(\) at turn 1: image 0: image file .*gone.png"
        r"' does not exist",
    ):
        MultiTurnScheduler(max_turns=2)._check_step(step, choice, 1)


def _data_uri(image) -> str:
    import base64
    import io

    buf = io.BytesIO()
    image.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _append_image_scheduler(placeholder: str = "<image>"):
    """A ported ms-swift scheduler (DeepEyes' pattern): it reads the row's image from ``infer_request.images[0]``,
    appends the observation's image there as a base64 data URI and hands the list back as ``rollout_infos['images']``;
    two turns always."""
    from grpokit.rollout.multi_turn import MultiTurnScheduler

    class AppendImage(MultiTurnScheduler):
        def check_finished(self, infer_request, response_choice, current_turn):
            return current_turn >= self.max_turns

        def step(self, infer_request, response_choice, current_turn):
            assert infer_request.images[0].endswith(".png")  # the row's image, shown on ms-swift's field
            infer_request.messages.append({"role": "user", "content": placeholder + "And this one?"})
            infer_request.images.append(_data_uri(_square(infer_request.data_dict["env_config"]["colour"])))
            return {"infer_request": infer_request, "rollout_infos": {"images": infer_request.images}}

    return AppendImage


def test_a_scheduler_appending_to_infer_request_images_trains_and_the_image_reaches_the_rewards(
    vlm_dirs, rewarded, tmp_path
):
    """In process, an image a scheduler appends to ``infer_request.images`` joins the trajectory: the trainer's batch
    holds both images, its logps equal the engine's on both turns, and rewards get the row's and the new image."""
    import io

    from PIL import Image

    from grpokit.rollout.multi_turn import multi_turns

    seen: list = []
    multi_turns["test_append_image"] = _append_image_scheduler()
    try:
        trainer = _train(
            vlm_dirs["qwen2_vl"],
            _dataset(tmp_path),
            tmp_path / "out",
            _recording(seen),
            extra=("--reward_funcs", "test_record_images"),
            scheduler="test_append_image",
        )
    finally:
        del multi_turns["test_append_image"]
    assert trainer.state.global_step == 2 and len(seen) == 2 and len(rewarded) == 2
    for (outputs, logps, batch), images in zip(seen, rewarded):
        for o, imgs in zip(outputs, images):
            assert o.rollout_infos["num_turns"] == 2 and imgs == o.rollout_infos["images"]
            row_image, added = imgs
            assert isinstance(row_image, str) and row_image.endswith(".png")
            colour = COLOURS[
                json.loads((tmp_path / "rows.jsonl").read_text().splitlines()[int(row_image[-5])])["env_config"][
                    "colour"
                ]
            ]
            assert Image.open(io.BytesIO(added)).convert("RGB").getpixel((0, 0)) == colour  # decoded from base64
        assert [_image_count(r) for r in batch.mm_inputs] == [2] * 6
        _check_logps_equal_the_engine(batch, logps)


def test_an_image_appended_without_a_placeholder_is_one_line(vlm_dirs, tmp_path):
    from grpokit.errors import RolloutError

    scheduler = _engine_and_scheduler(vlm_dirs["idefics3"])
    scheduler = _append_image_scheduler(placeholder="")(infer_engine=scheduler.infer_engine, max_turns=2)
    row = json.loads(_dataset(tmp_path).read_text().splitlines()[0])
    with pytest.raises(RolloutError) as e:
        _run(scheduler, row)
    assert (
        "AppendImage.step() at turn 1: the new message(s) hold 0 <image> placeholder(s) but 1 image(s) came with them"
    ) in str(e.value)
    assert "appended to infer_request.images" in str(e.value) and "\n" not in str(e.value)


def test_infer_request_images_in_process_entry_and_edits(tmp_path):
    """A request entering with ms-swift's ``images`` (base64, a path) gets them as its data_dict images; a hook may
    only append to the trajectory's images; a bad base64 data URI or a missing file is one line."""
    from grpokit.errors import RolloutError
    from grpokit.protocol import RolloutInferRequest
    from grpokit.rollout.turn_images import take_appended, take_entry_images

    path = tmp_path / "red.png"
    _square("red").save(path)
    uri = _data_uri(_square("green"))
    request = RolloutInferRequest(messages=[{"role": "user", "content": "<image><image>Two?"}], images=[uri, str(path)])
    take_entry_images(request, "S")
    assert request.images == [] and request.data_dict["images"][1] == str(path)
    assert request.data_dict["images"][0].startswith(b"\x89PNG")
    known = list(request.data_dict["images"])
    request.images = [*known, uri.split(",", 1)[1]]  # raw base64 appended
    assert take_appended(request, known, "S.step() at turn 1")[0].startswith(b"\x89PNG")
    request.images = []  # a request built anew: nothing appended
    assert take_appended(request, known, "w") == []
    for images, message in (
        ([known[1]], "S.step() at turn 1: infer_request.images no longer starts with the trajectory's 2 image(s)"),
        ([*known, "data:image/png;base64,@@"], "infer_request.images[2]: the data URI's base64 is not valid"),
        ([*known, str(tmp_path / "gone.png")], "infer_request.images[2]: image file"),
    ):
        request.images = images
        with pytest.raises(RolloutError) as e:
            take_appended(request, known, "S.step() at turn 1")
        assert message in str(e.value) and "\n" not in str(e.value)
    both = RolloutInferRequest(
        messages=[{"role": "user", "content": "hi"}], images=[uri], data_dict={"images": [str(path)]}
    )
    with pytest.raises(
        RolloutError,
        match="1 image\\(s\\) in infer_request.images and 1 other\\(s\\) in "
        "data_dict\\['images'\\]; give a request's images in one of them",
    ):
        take_entry_images(both, "S")


@pytest.mark.parametrize("turns", [1, 2])
def test_images_appended_in_on_trajectory_start_join_the_prompt(turns, vlm_dirs, tmp_path):
    """A hook that appends an image to ``infer_request.images`` before the first turn (single-turn scheduler, and a
    multi-turn one) adds it to the prompt: the engine samples with both images and the output records them."""
    from grpokit.rollout.multi_turn import MultiTurnScheduler
    from grpokit.rollout.scheduler import RolloutScheduler

    class StartWithGrey(MultiTurnScheduler if turns == 2 else RolloutScheduler):
        async def on_trajectory_start(self, requests):
            for r in requests:
                r.messages[-1] = {**r.messages[-1], "content": r.messages[-1]["content"] + " And <image>?"}
                r.images.append(_square("grey"))

        def check_finished(self, infer_request, response_choice, current_turn):
            return True

    engine = _engine_and_scheduler(vlm_dirs["idefics3"]).infer_engine
    row = json.loads(_dataset(tmp_path).read_text().splitlines()[0])
    [output] = _run(StartWithGrey(infer_engine=engine, max_turns=2), row)
    row_image, grey = output.rollout_infos["images"]
    assert row_image == row["images"][0] and grey.getpixel((0, 0)) == COLOURS["grey"]
    assert output.prompt_messages[-1]["content"].endswith(" And <image>?") and output.response_token_ids[0]
