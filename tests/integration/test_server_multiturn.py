"""Multi-turn inside the server: a plugin scheduler loaded with --external_plugins runs every trajectory, reading
the row's data_dict; the trainer side only sees finished trajectories. The served model's chat template drops
earlier <think> blocks, and the training rows open each reply with one: the server samples every later turn from
the trajectory's own ids, so the trainer counts 0 token-in-token-out violations (grpokit/rollout/tito.py)."""

from __future__ import annotations

import json
import logging
import textwrap

import httpx
import pytest
from support import flags, server_flags, write_jsonl
from test_server_support import rollout_server

from grpokit.engines.client import RolloutClient
from grpokit.errors import ConfigError
from grpokit.protocol import RequestConfig, RolloutInferRequest
from grpokit.rollout.remote import RemoteScheduler
from grpokit.rollout.scheduler import run_trajectories
from grpokit.rollout.tito import RECORD_KEY
from grpokit.testing import THINK_DROPPING_TEMPLATE, build_tiny_model
from grpokit.trainers.factory import TrainerFactory
from grpokit.trainers.grpo_trainer import GRPOTrainer

pytestmark = pytest.mark.slow

PLUGIN = textwrap.dedent('''
    from grpokit.rollout.multi_turn import MultiTurnScheduler, multi_turns


    @multi_turns.register("label_turns")
    class LabelTurns(MultiTurnScheduler):
        """Plays exactly max_turns turns; each user follow-up names the row's label and the turn."""

        async def on_trajectory_start(self, requests):
            for r in requests:
                if r.data_dict.get("think"):  # the reply opens with a <think> block the template drops later
                    r.messages.append({"role": "assistant", "content": "<think>\\nI plan.\\n</think>\\n\\n"})

        def check_finished(self, infer_request, response_choice, current_turn):
            return current_turn >= self.max_turns

        def step(self, infer_request, response_choice, current_turn):
            label = infer_request.data_dict["label"]
            infer_request.messages.append({"role": "user", "content": f"{label} after turn {current_turn}"})
            return {"infer_request": infer_request}
''')


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("multiturn")
    tiny = build_tiny_model(root / "tiny", chat_template=THINK_DROPPING_TEMPLATE)
    plugin = root / "label_plugin.py"
    plugin.write_text(PLUGIN)
    with rollout_server(
        tiny,
        root,
        *flags(
            {"--external_plugins": plugin},
            "--multi_turn_scheduler label_turns --max_turns 3 --completion_length_limit_scope per_round",
        ),
    ) as s:
        s.model = tiny
        yield s


def test_server_runs_the_multi_turn_scheduler_with_the_rows_data(server):
    client = RolloutClient(base_urls=[server.url], timeout=60)
    try:
        info = client.engine_info()
        assert info["enable_multi_turn"] and info["multi_turn_scheduler"] == "label_turns"
        assert info["max_turns"] == 3 and info["completion_length_limit_scope"] == "per_round"
        requests = [
            RolloutInferRequest(
                messages=[{"role": "user", "content": f"question {i}"}],
                data_dict={"label": f"L{i}"},
                request_id=f"r{i}",
                prompt_id=f"p{i // 2}",
            )
            for i in range(4)
        ]
        outs = run_trajectories(RemoteScheduler(client), requests, RequestConfig(max_tokens=3))
        assert [o.request_id for o in outs] == ["r0", "r1", "r2", "r3"]
        for i, o in enumerate(outs):
            # user, assistant, user "Li after turn 1", assistant, user "Li after turn 2", assistant
            assert [m["role"] for m in o.messages] == ["user", "assistant"] * 3
            assert o.messages[2]["content"] == f"L{i} after turn 1" and o.messages[4]["content"] == f"L{i} after turn 2"
            assert len(o.response_token_ids) == 3 and o.rollout_infos["num_turns"] == 3
            assert [len(m) for m in o.response_loss_mask] == [len(t) for t in o.response_token_ids]
        assert requests[0].messages == [{"role": "user", "content": "question 0"}]  # the trainer's prompt untouched
    finally:
        client.close()


class _Recording(GRPOTrainer):
    outputs: list = []

    def _prepare_inputs(self, prompts, rollout=None):
        window = super()._prepare_inputs(prompts, rollout)
        _Recording.outputs.extend(window.outputs)
        return window


def _train_args(server, tmp_path, *extra):
    rows = [
        {"messages": [{"role": "user", "content": f"question {i}"}], "label": f"L{i}", "think": True} for i in range(4)
    ]
    data = write_jsonl(tmp_path / "data.jsonl", rows)
    return flags(
        {"--model": server.model, "--dataset": data, "--output_dir": tmp_path / "out"},
        server_flags(server.port, 60),
        "--tuner_type full --max_steps 2 --num_generations 2 --per_device_train_batch_size 4",
        "--max_completion_length 4 --beta 0 --reward_funcs format --disable_tqdm true --plots false",
        "--save_final_model false",
        *extra,
    )


def test_trainer_with_ms_swift_multi_turn_options_trains_through_the_server(server, tmp_path, caplog):
    """ms-swift's server-mode command shape: scheduler, max_turns and loss_scale on the trainer too, the rows'
    columns passed on; the server's scheduler reads them and the trainer trains only the last round, on the ids
    the server sampled (0 violations although the template drops the replies' <think> blocks)."""
    from grpokit.config.parse import parse_train_args
    from grpokit.pipeline.train import run_train

    caplog.set_level(logging.WARNING, logger="grpokit")

    saved, _Recording.outputs = TrainerFactory.TRAINER_MAPPING["grpo"], []
    TrainerFactory.TRAINER_MAPPING["grpo"] = _Recording
    try:
        trainer = run_train(
            parse_train_args(
                _train_args(
                    server,
                    tmp_path,
                    *flags(
                        "--multi_turn_scheduler label_turns --max_turns 3 --loss_scale last_round",
                        "--vllm_server_pass_dataset true",
                    ),
                )
            )
        )
    finally:
        TrainerFactory.TRAINER_MAPPING["grpo"] = saved
    assert trainer.state.global_step == 2 and _Recording.outputs
    for o in _Recording.outputs:
        label = o.messages[2]["content"].split()[0]  # the server's scheduler read data_dict["label"]
        assert label.startswith("L") and o.messages[4]["content"] == f"{label} after turn 2"
        assert [sum(m) for m in o.response_loss_mask[:-1]] == [0, 0]  # --loss_scale last_round, on the trainer
        assert o.prompt_messages[-1]["content"].startswith("<think>") and len(o.rollout_infos[RECORD_KEY]) == 3
    logs = [json.loads(line) for line in (tmp_path / "out" / "logging.jsonl").read_text().splitlines()]
    steps = [r for r in logs if "loss" in r]
    assert len(steps) == 2
    assert all(r["multi_turn/tito_violations"] == 0 and r["multi_turn/tito_unchecked"] == 0 for r in steps)
    assert any("not prefix-preserving" in r.getMessage() for r in caplog.records)  # the trainer's own audit


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--max_turns", "2"], "--max_turns 2: the rollout server"),
        (["--multi_turn_scheduler", "gym_scheduler"], "runs label_turns"),
    ],
)
def test_trainer_options_the_server_does_not_use_stop_the_run(server, tmp_path, extra, needle):
    from grpokit.config.parse import parse_train_args
    from grpokit.pipeline.train import run_train

    with pytest.raises(ConfigError, match=needle):
        run_train(parse_train_args(_train_args(server, tmp_path, *extra)))


def test_trainer_plays_the_turns_against_a_single_turn_server(tmp_path_factory, tmp_path):
    """ms-swift's rule: a scheduler on the trainer and a single-turn server → the trainer runs the scheduler, each
    turn one request; the rows' columns are read on the trainer side."""
    from grpokit.config.parse import parse_train_args
    from grpokit.pipeline.train import run_train

    root = tmp_path_factory.mktemp("single")
    tiny = build_tiny_model(root / "tiny")
    plugin = root / "label_plugin_trainer.py"
    plugin.write_text(PLUGIN.replace('"label_turns"', '"label_turns_trainer"'))
    saved, _Recording.outputs = TrainerFactory.TRAINER_MAPPING["grpo"], []
    TrainerFactory.TRAINER_MAPPING["grpo"] = _Recording
    try:
        with rollout_server(tiny, root) as plain:
            plain.model = tiny
            trainer = run_train(
                parse_train_args(
                    _train_args(
                        plain,
                        tmp_path,
                        "--external_plugins",
                        str(plugin),
                        "--multi_turn_scheduler",
                        "label_turns_trainer",
                        "--max_turns",
                        "2",
                    )
                )
            )
            served = httpx.get(plain.url + "/get_engine_type/", timeout=10).json()
    finally:
        TrainerFactory.TRAINER_MAPPING["grpo"] = saved
    assert not served["enable_multi_turn"] and served["weight_version"] >= 1  # the trainer's weights reached it
    # the server renders each turn from the messages (no pinned ids reach it), so the audit runs and reports what
    # it finds: on the tiny tokenizer a reply's text often re-tokenizes to other ids than were sampled
    logs = [json.loads(line) for line in (tmp_path / "out" / "logging.jsonl").read_text().splitlines()]
    assert all(r["multi_turn/tito_unchecked"] == 0 and "multi_turn/tito_violations" in r for r in logs if "loss" in r)
    assert trainer.state.global_step == 2 and _Recording.outputs
    for o in _Recording.outputs:
        assert [m["role"] for m in o.messages] == ["user", "assistant"] * 2
        assert o.messages[2]["content"].endswith("after turn 1") and len(o.response_token_ids) == 2
