"""`grpokit train` fails on bad plugins, rewards and registry names with one line on stderr, no traceback.

Each case is a real `python -m grpokit train` process (forked from a zygote that imported grpokit once:
cli_process.py) on the tiny model with max_steps 1; the runtime ones (a reward that breaks its contract) fail
during the first rollout, after the progress bar has started.
"""

from __future__ import annotations

import os
import subprocess
import textwrap
from pathlib import Path

import pytest
from cli_process import run_grpokit
from support import flags

pytestmark = pytest.mark.slow

BAD_PLUGIN = textwrap.dedent("""
    from grpokit.rewards import ORM, orms

    class ShortReward(ORM):
        def __call__(self, completions, **kwargs):
            return [1.0] * (len(completions) - 1)      # one score too few

    class RaisingReward(ORM):
        def __call__(self, completions, **kwargs):
            raise ValueError("cannot parse the answer\\nsecond line of the message")

    class NeedsDifficulty(ORM):
        def __call__(self, completions, difficulty, **kwargs):
            return [0.0 for _ in completions]

    orms["short"] = ShortReward
    orms["raising"] = RaisingReward
    orms["needs_difficulty"] = NeedsDifficulty
""")


@pytest.fixture(scope="module")
def plugins(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("cli_plugins")
    files = {
        "bad_rewards": BAD_PLUGIN,
        "raises_on_import": "import os\nraise RuntimeError('GRPOKIT_DEMO_KEY is not set')\n",
        "bad_trainer": "from grpokit.trainers.factory import TrainerFactory\n"
        "TrainerFactory.TRAINER_MAPPING['grpo'] = 'no_such_module.Trainer'\n",
        "own_loss": "from grpokit.algorithms import LOSS_NORMALIZERS, POLICY_LOSSES, TokenLoss\n"
        "from grpokit.algorithms.losses import token_mean\n"
        "POLICY_LOSSES['gk_cli_pg'] = lambda ratio, logps, adv, cfg: TokenLoss(-ratio * adv, {})\n"
        "LOSS_NORMALIZERS['gk_cli_pg'] = token_mean\n",
    }
    out = {}
    for name, code in files.items():
        out[name] = folder / f"{name}.py"
        out[name].write_text(code)
    return out


def visible_lines(stderr: str) -> list[str]:
    """The non-empty lines a terminal would show: within a line, a carriage return overwrites what came before."""
    return [line.rsplit("\r", 1)[-1].strip() for line in stderr.split("\n") if line.rsplit("\r", 1)[-1].strip()]


def run_train_cli(model_dir: Path, out: Path, extra: list[str]) -> subprocess.CompletedProcess:
    args = flags(
        "--model",
        str(model_dir),
        "--tuner_type full --dataset builtin:countdown#8",
        "--output_dir",
        str(out),
        "--num_generations 2 --per_device_train_batch_size 2 --max_completion_length 4",
        "--max_steps 1 --beta 0 --torch_dtype float32 --save_final_model false",
        "--plots false",
        *extra,
    )
    return run_grpokit(["train", *args], env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=240)


CASES = {
    "plugin file missing": (
        lambda p, tmp: ["--external_plugins", str(tmp / "missing_plugin.py")],
        lambda p, tmp: [f"--external_plugins {tmp / 'missing_plugin.py'}: file not found"],
    ),
    "plugin raises on import": (
        lambda p, tmp: ["--external_plugins", str(p["raises_on_import"])],
        lambda p, tmp: [
            str(p["raises_on_import"]),
            "import failed at line 2",
            "RuntimeError: GRPOKIT_DEMO_KEY is not set",
        ],
    ),
    "unknown reward name": (
        lambda p, tmp: ["--external_plugins", str(p["bad_rewards"]), "--reward_funcs", "acuracy"],
        lambda p, tmp: [
            "--reward_funcs 'acuracy': unknown reward function",
            "registered: accuracy, arithmetic_steps,",
            "needs_difficulty",
            "raising",
            "short",
        ],
    ),
    "reward needs a missing column": (
        lambda p, tmp: ["--external_plugins", str(p["bad_rewards"]), "--reward_funcs", "needs_difficulty"],
        lambda p, tmp: [
            "--reward_funcs needs_difficulty: needs dataset column(s) difficulty",
            "dataset columns: messages, nums, solution, target",
        ],
    ),
    "reward returns too few scores": (
        lambda p, tmp: ["--external_plugins", str(p["bad_rewards"]), "--reward_funcs", "short"],
        lambda p, tmp: ["reward 'short' returned 1 scores for 2 completions; first sample without a score: 1"],
    ),
    "reward raises": (
        lambda p, tmp: ["--external_plugins", str(p["bad_rewards"]), "--reward_funcs", "raising"],
        lambda p, tmp: ["reward 'raising' raised ValueError: cannot parse the answer (first failing sample 0 "],
    ),
    "reward model path missing": (
        lambda p, tmp: ["--reward_model", str(tmp / "no_rm")],
        lambda p, tmp: [f"--reward_model {tmp / 'no_rm'}: not found"],
    ),
    "unknown optimizer": (
        lambda p, tmp: ["--reward_funcs", "format", "--optimizer", "adam_w"],
        lambda p, tmp: ["--optimizer 'adam_w': unknown optimizer; registered: adamw, sgd"],
    ),
    "unknown callback": (
        lambda p, tmp: ["--reward_funcs", "format", "--callbacks", "early_stop"],
        lambda p, tmp: ["--callbacks 'early_stop': unknown callback"],
    ),
    "unknown loss type, with a plugin's": (
        lambda p, tmp: ["--external_plugins", str(p["own_loss"]), "--loss_type", "vanila_pg"],
        lambda p, tmp: [
            "--loss_type 'vanila_pg': unknown loss type; registered: ",
            "dr_grpo, ",
            ", grpo, ",
            "gk_cli_pg",
        ],
    ),
    "unknown advantage estimator": (
        lambda p, tmp: ["--advantage_estimator", "rlo"],
        lambda p, tmp: ["--advantage_estimator 'rlo': unknown advantage estimator; registered: ", "rloo"],
    ),
    "trainer mapping not importable": (
        lambda p, tmp: ["--external_plugins", str(p["bad_trainer"]), "--reward_funcs", "format"],
        lambda p, tmp: ["TRAINER_MAPPING['grpo'] = 'no_such_module.Trainer' cannot be imported", "--external_plugins"],
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_plugin_or_reward_fails_with_one_line(case, tiny_model_dir, plugins, tmp_path):
    make_args, make_needles = CASES[case]
    res = run_train_cli(tiny_model_dir, tmp_path / "out", make_args(plugins, tmp_path))
    assert res.returncode != 0, res.stdout[-2000:]
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    lines = visible_lines(res.stderr)
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("grpokit: error: "), lines[0]
    for needle in make_needles(plugins, tmp_path):
        assert needle in lines[0], (needle, lines[0])
