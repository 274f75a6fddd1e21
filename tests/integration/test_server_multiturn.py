"""Multi-turn inside the server: a plugin scheduler loaded with --external_plugins runs every trajectory, reading
the row's data_dict; the trainer side only sees finished trajectories."""

from __future__ import annotations

import textwrap

import pytest
from test_server_support import rollout_server

from grpokit.engines.client import RolloutClient
from grpokit.rollout.remote import RemoteScheduler
from grpokit.protocol import RequestConfig, RolloutInferRequest
from grpokit.rollout.scheduler import run_trajectories
from grpokit.testing import build_tiny_model

pytestmark = pytest.mark.slow

PLUGIN = textwrap.dedent('''
    from grpokit.rollout.multi_turn import MultiTurnScheduler, multi_turns


    @multi_turns.register("label_turns")
    class LabelTurns(MultiTurnScheduler):
        """Plays exactly max_turns turns; each user follow-up names the row's label and the turn."""

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
    tiny = build_tiny_model(root / "tiny")
    plugin = root / "label_plugin.py"
    plugin.write_text(PLUGIN)
    with rollout_server(tiny, root, "--external_plugins", str(plugin), "--multi_turn_scheduler", "label_turns",
                        "--max_turns", "3", "--completion_length_limit_scope", "per_round") as s:
        yield s


def test_server_runs_the_multi_turn_scheduler_with_the_rows_data(server):
    client = RolloutClient(base_urls=[server.url], timeout=60)
    try:
        info = client.engine_info()
        assert info["enable_multi_turn"] and info["multi_turn_scheduler"] == "label_turns"
        assert info["max_turns"] == 3 and info["completion_length_limit_scope"] == "per_round"
        requests = [RolloutInferRequest(messages=[{"role": "user", "content": f"question {i}"}],
                                        data_dict={"label": f"L{i}"}, request_id=f"r{i}", prompt_id=f"p{i // 2}")
                    for i in range(4)]
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
