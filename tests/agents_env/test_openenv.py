"""An OpenEnv environment, defined here, trains 2 steps in process through ``--multi_turn_scheduler
OpenEnvScheduler`` (ms-swift's name) on the tiny model: reset's observation is the first user message, each reply
becomes the env's ``Action``, its observation the next user message, and the step rewards the ``gym_reward``.

Runs in the openenv environment (``bash scripts/test_agents.sh``; marker ``agents_env``, deselected by the main
suite): openenv is imported only inside the tests and the plugin file they write.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from support import flags, tiny_run_on_rows

pytestmark = [pytest.mark.agents_env, pytest.mark.slow]

PLUGIN = textwrap.dedent('''
    from openenv.core.env_server import Action, Environment, Observation, State


    class SayAction(Action):
        message: str


    class HeardObservation(Observation):
        heard: str


    class LengthEnv(Environment[SayAction, HeardObservation, State]):
        """Rewards long replies: min(len, 40) / 40 a step; done after two steps."""

        def __init__(self, goal: str = "Say something long."):
            super().__init__()
            self.goal, self._state = goal, State()

        def reset(self, seed=None, episode_id=None, **kwargs):
            self._state = State(episode_id=episode_id)
            return HeardObservation(heard=self.goal)

        def step(self, action, timeout_s=None, **kwargs):
            self._state.step_count += 1
            reward = min(len(action.message), 40) / 40
            return HeardObservation(heard=f"Heard {len(action.message)} characters. Longer!", reward=reward,
                                    done=self._state.step_count >= 2)

        @property
        def state(self):
            return self._state
''')


def _train(model_dir: Path, tmp_path: Path, rows: list[dict], extra: list[str]):
    mine = "--num_generations 2 --max_completion_length 12 --seed 0 --log_completions true"
    return tiny_run_on_rows(model_dir, rows, tmp_path, mine, *extra)


def test_an_openenv_environment_trains_in_process(tiny_model_dir, tmp_path):
    pytest.importorskip("openenv")
    plugin = tmp_path / "openenv_plugin.py"
    plugin.write_text(PLUGIN)
    rows = [{"messages": [{"role": "user", "content": "Play"}]} for _ in range(2)]
    rows.append(
        {
            "messages": [{"role": "user", "content": "Play"}],  # a row's env_config names class and kwargs
            "env_config": {"env": "openenv_plugin:LengthEnv", "kwargs": {"goal": "Write a long line."}},
        }
    )
    rows.append(rows[-1])
    trainer, logs, out = _train(
        tiny_model_dir,
        tmp_path,
        rows,
        flags(
            {"--external_plugins": plugin},
            "--multi_turn_scheduler OpenEnvScheduler --openenv_env openenv_plugin:LengthEnv --max_turns 3",
            "--reward_funcs format",
        ),
    )
    assert trainer.state.global_step == 2 and len(logs) == 2
    assert trainer.reward_names == ["format", "gym_reward"]
    for row in logs:
        assert row["rewards/gym_reward/mean"] > 0  # a random model's reply has characters: the env's signal
    completions = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert completions
    goals = {"Say something long.", "Write a long line."}
    for c in completions:
        text = json.dumps(c)
        assert any(g in text for g in goals)  # reset's observation replaced the row's placeholder prompt


def test_a_reply_fills_the_actions_one_text_field_and_json_fills_several():
    pytest.importorskip("openenv")
    from openenv.core.env_server import Action, Observation

    from grpokit.rollout.openenv_scheduler import OpenEnvScheduler, observation_text, text_field

    class Move(Action):
        row: int
        col: int

    class Say(Action):
        message: str

    class Board(Observation):
        board: str

    s = OpenEnvScheduler()
    assert text_field(Say) == "message" and text_field(Move) is None
    assert s.action_fields(s.parse_action("hello"), Say) == {"message": "hello"}
    assert s.action_fields(s.parse_action('{"row": 1, "col": 2}'), Move) == {"row": 1, "col": 2}
    with pytest.raises(ValueError, match="JSON object of its fields"):
        s.action_fields(s.parse_action("1 2"), Move)
    assert observation_text(Board(board="..x", reward=1.0, done=True)) == "..x"
