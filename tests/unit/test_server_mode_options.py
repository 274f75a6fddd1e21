"""ms-swift's server-mode options on the trainer: multi-turn options checked against the server's, --loss_scale
last_round applied by the trainer, --vllm_server_pass_dataset, and /infer/ calls split under the body limit."""

from __future__ import annotations

import asyncio
import logging

import pytest

from grpokit.config.args import RolloutArguments
from grpokit.config.parse import parse_train_args
from grpokit.engines.client import split_by_size
from grpokit.errors import ConfigError, ServerError
from grpokit.protocol import ChatCompletionResponse, RequestConfig, RolloutInferRequest, RolloutOutput
from grpokit.rollout.remote import (
    RemoteScheduler,
    check_server_rollout,
    check_server_template,
    last_round_only,
    trainer_plays_turns,
)
from grpokit.server.cli import options_from_argv
from grpokit.server.state import build_state
from grpokit.testing import build_tiny_model

SERVER = ["--vllm_mode", "server", "--vllm_server_host", "127.0.0.1"]
MULTI = {
    "model": "m",
    "enable_multi_turn": True,
    "multi_turn_scheduler": "thinking_tips_scheduler",
    "max_turns": 3,
    "gym_env": None,
    "completion_length_limit_scope": "per_round",
    "loss_scale": "default",
}
SINGLE = {"model": "m", "enable_multi_turn": False, "multi_turn_scheduler": None, "max_turns": None}


def test_split_by_size_keeps_each_call_under_both_limits():
    # sizes 4+4 fit in 10, a third 4 would make 12 → new call; count 2 caps the second call too
    assert split_by_size([4, 4, 4, 1, 1], max_count=2, max_bytes=10) == [[0, 1], [2, 3], [4]]
    assert split_by_size([3, 3, 3, 3], max_count=100, max_bytes=6) == [[0, 1], [2, 3]]
    assert split_by_size([], 4, 10) == []
    with pytest.raises(ServerError, match="--max_body_mb"):
        split_by_size([1, 11], 4, 10)


def test_last_round_only_masks_earlier_rounds_and_their_logprobs():
    out = RolloutOutput(
        response=ChatCompletionResponse(choices=[]),
        messages=[],
        response_token_ids=[[1, 2], [3], [4, 5]],
        response_loss_mask=[[1, 1], [0], [1, 1]],
        rollout_logprobs=[[-0.1, -0.2], [], [-0.3, -0.4]],
    )
    trained = last_round_only(out)
    assert trained.response_loss_mask == [[0, 0], [0], [1, 1]]
    assert trained.rollout_logprobs == [[], [], [-0.3, -0.4]]  # one logprob per trained token, as colocate
    assert last_round_only(trained) == trained  # idempotent: a server that applied it already changes nothing
    assert out.response_loss_mask == [[1, 1], [0], [1, 1]]  # the input is not modified


def test_trainer_accepts_the_multi_turn_options_in_server_mode():
    cfg = parse_train_args(
        [
            "--dataset",
            "builtin:arithmetic",
            *SERVER,
            "--multi_turn_scheduler",
            "anything",
            "--max_turns",
            "3",
            "--loss_scale",
            "last_round",
            "--use_gym_env",
            "true",
            "--vllm_server_pass_dataset",
            "true",
        ]
    )
    r = cfg.rollout
    assert (r.multi_turn_scheduler, r.max_turns, r.loss_scale, r.use_gym_env, r.vllm_server_pass_dataset) == (
        "anything",
        3,
        "last_round",
        True,
        True,
    )
    # ms-swift's external thinking-tips script: --loss_scale on the trainer, the scheduler only on the server
    assert parse_train_args(["--dataset", "builtin:arithmetic", *SERVER, "--loss_scale", "last_round"])


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--vllm_server_pass_dataset", "true"], "--vllm_server_pass_dataset true sends"),
        (["--max_turns", "3"], "--max_turns acts on multi-turn rollouts"),
        (["--use_gym_env", "true"], "--use_gym_env acts on multi-turn rollouts"),
    ],
)
def test_colocate_refuses_what_only_server_or_multi_turn_means(flags, needle):
    with pytest.raises(ConfigError, match=needle):
        parse_train_args(["--dataset", "builtin:arithmetic", *flags])


@pytest.mark.parametrize(
    "trainer, info, needle",
    [
        (dict(multi_turn_scheduler="gym_scheduler"), MULTI, "runs thinking_tips_scheduler"),
        (
            dict(max_turns=5),
            MULTI,
            "--max_turns 5: the rollout server (m) runs thinking_tips_scheduler with --max_turns 3",
        ),
        (dict(max_turns=5), SINGLE, "--max_turns 5: the rollout server (m) runs single-turn rollouts"),
        (dict(completion_length_limit_scope="total"), MULTI, "with --completion_length_limit_scope per_round"),
        (dict(gym_env="math_env"), MULTI, "--gym_env math_env"),
        (dict(use_gym_env=True), SINGLE, "give no environment reward"),
    ],
)
def test_a_trainer_option_the_server_does_not_use_stops_the_run(trainer, info, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")) as e:
        check_server_rollout(RolloutArguments(**trainer), info)
    assert "grpokit rollout" in str(e.value) and "\n" not in str(e.value)


def test_matching_or_default_trainer_options_pass():
    check_server_rollout(RolloutArguments(), MULTI)
    check_server_rollout(RolloutArguments(), SINGLE)
    check_server_rollout(
        RolloutArguments(
            multi_turn_scheduler="thinking_tips_scheduler", max_turns=3, loss_scale="last_round", use_gym_env=False
        ),
        MULTI,
    )
    check_server_rollout(RolloutArguments(loss_scale="last_round"), SINGLE)  # the trainer applies it itself
    # a scheduler on the trainer and a single-turn server: the trainer plays the turns (ms-swift's rule)
    local = RolloutArguments(multi_turn_scheduler="thinking_tips_scheduler", max_turns=5)
    check_server_rollout(local, SINGLE)
    assert trainer_plays_turns(local, SINGLE) and not trainer_plays_turns(local, MULTI)
    assert not trainer_plays_turns(RolloutArguments(), SINGLE)


class FakeClient:
    """Records what would go on the wire; answers one two-round trajectory per request."""

    def __init__(self, info):
        self.info, self.sent = info, []

    def engine_info(self):
        return self.info

    async def infer_trajectories_async(self, requests, config):
        self.sent.extend(requests)
        return [
            RolloutOutput(
                request_id=r.request_id,
                response=ChatCompletionResponse(choices=[]),
                messages=[],
                response_token_ids=[[1], [2]],
                response_loss_mask=[[1], [1]],
            )
            for r in requests
        ]


def _send(scheduler):
    req = RolloutInferRequest(messages=[{"role": "user", "content": "q"}], data_dict={"solution": "4", "images": ["x"]})
    outs = asyncio.run(scheduler.async_infer([req], RequestConfig()))
    return scheduler.infer_engine.sent[0], outs[0], req


def test_rows_columns_reach_the_server_only_when_asked(caplog):
    with caplog.at_level(logging.WARNING):
        quiet = RemoteScheduler.from_args(FakeClient(MULTI), RolloutArguments())
    assert "--vllm_server_pass_dataset true" in caplog.text  # a multi-turn server may need them: say so once
    sent, out, req = _send(quiet)
    assert sent.data_dict == {"images": ["x"]}  # a prompt's media travel always; the other columns stay here
    assert sent.request_id == req.request_id and req.data_dict == {"solution": "4", "images": ["x"]}
    assert out.response_loss_mask == [[1], [1]]
    for args in (
        RolloutArguments(vllm_server_pass_dataset=True),
        RolloutArguments(multi_turn_scheduler="thinking_tips_scheduler"),
    ):  # ms-swift: either one
        sent, _, _ = _send(RemoteScheduler.from_args(FakeClient(MULTI), args))
        assert sent.data_dict == {"solution": "4", "images": ["x"]}


def test_trainer_side_loss_scale_and_use_gym_env():
    scheduler = RemoteScheduler.from_args(
        FakeClient({**SINGLE, "uses_env_reward": True}), RolloutArguments(loss_scale="last_round", use_gym_env=False)
    )
    _, out, _ = _send(scheduler)
    assert out.response_loss_mask == [[0], [1]]
    assert scheduler.uses_env_reward is False  # explicit beats the server's report, as in ms-swift
    auto = RemoteScheduler.from_args(FakeClient({**SINGLE, "uses_env_reward": True}), RolloutArguments())
    assert auto.uses_env_reward is True


def test_rollout_takes_swift_rollouts_multi_turn_flags(monkeypatch, caplog):
    monkeypatch.setattr("grpokit.server.cli.vllm_installed", lambda: False)
    with caplog.at_level(logging.WARNING):
        opts = options_from_argv(
            [
                "--model",
                "m",
                "--multi_turn_scheduler",
                "gym_scheduler",
                "--use_gym_env",
                "true",
                "--vllm_use_async_engine",
                "true",
            ]
        )
    assert opts.use_gym_env is True and opts.vllm_use_async_engine
    assert caplog.text.count("--vllm_use_async_engine true: no effect") == 1
    with pytest.raises(ConfigError, match="--use_gym_env False needs --multi_turn_scheduler"):
        options_from_argv(["--model", "m", "--use_gym_env", "false"])


@pytest.mark.numerics  # the server loads its model with --torch_dtype auto
def test_rollout_enable_thinking_sets_the_servers_template_and_is_reported(monkeypatch, tmp_path):
    monkeypatch.setattr("grpokit.server.cli.vllm_installed", lambda: False)
    assert options_from_argv(["--model", "m"]).chat_template_kwargs() == {}
    opts = options_from_argv(["--model", str(build_tiny_model(tmp_path / "m")), "--enable_thinking", "false"])
    assert opts.enable_thinking is False and opts.chat_template_kwargs() == {"enable_thinking": False}
    state = build_state(opts)
    assert state.engine.template.chat_template_kwargs == {"enable_thinking": False}  # what the server renders with
    assert state.engine_info()["enable_thinking"] is False
    # a template that reads it (Qwen3's, shortened): the server's prompts get the empty think block ...
    state.engine.template.tokenizer.chat_template = (
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}"
        "assistant: {% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}{% endif %}"
    )
    msgs = [{"role": "user", "content": "hi"}]
    assert state.engine.template.render_prompt(msgs).endswith("assistant: <think></think>")
    # ... unless the trainer's own value travels with the prompt (grpokit.template.encode): it wins
    carried = [{**msgs[0], "chat_template_kwargs": '{"enable_thinking": true}'}]
    assert state.engine.template.render_prompt(carried).endswith("assistant: ")


def test_the_trainer_must_render_as_the_server_does(caplog):
    info = {"model": "m", "enable_thinking": False}
    check_server_template(None, {"model": "m", "enable_thinking": None})  # server unset: the trainer's kwargs rule
    check_server_template(False, info)
    with pytest.raises(
        ConfigError, match="renders prompts with --enable_thinking false.*give the trainer --enable_thinking false too"
    ):
        check_server_template(None, info)
    with caplog.at_level(logging.WARNING):
        check_server_template(True, info)
    assert "--enable_thinking true: the rollout server's false is overridden" in caplog.text


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--header_timeout_s", "0"], "--header_timeout_s 0.0: must be in"),
        (["--body_timeout_s", "1e9"], "--body_timeout_s"),
        (["--max_json_items", "0"], "--max_json_items 0"),
        (["--max_connections", "-1"], "--max_connections -1"),
        (["--max_images_pixels", "0"], "--max_images_pixels 0"),
        (["--allowed_hosts", "a b/c"], "--allowed_hosts"),
    ],
)
def test_rollout_transport_and_guard_options_are_checked(flags, needle):
    from grpokit.server.cli import options_from_argv

    with pytest.raises(ConfigError, match=needle):
        options_from_argv(["--model", "m", "--engine", "transformers", *flags])


def test_rollout_transport_options_reach_the_transport():
    from grpokit.server.cli import options_from_argv

    o = options_from_argv(
        [
            "--model",
            "m",
            "--engine",
            "transformers",
            "--header_timeout_s",
            "3",
            "--body_idle_s",
            "2",
            "--allowed_hosts",
            "trainer-box",
            "--max_images_pixels",
            "1000",
        ]
    )
    limits = o.transport_limits(50)
    assert (limits.header_timeout_s, limits.body_idle_s, limits.max_connections) == (3.0, 2.0, 50)
    assert o.allowed_hosts == ["trainer-box"] and o.image_limits().max_call_pixels == 1000
