"""tests/conftest.py's promise: a test starts from the same process state whatever ran before it. Checked in a
pytest session of its own, with this conftest: the first test changes everything the conftest restores, the
second (run after it, in file order) finds none of it."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"

TESTS = textwrap.dedent("""
    import logging
    import os
    import random
    import sys
    from pathlib import Path

    import numpy as np
    import torch

    START = {}


    def _state():
        from grpokit.rewards.base import orms
        from grpokit.trainers.factory import TrainerFactory

        return {"threads": torch.get_num_threads(), "dtype": torch.get_default_dtype(),
                "grad": torch.is_grad_enabled(), "deterministic": torch.are_deterministic_algorithms_enabled(),
                "torch_rng": torch.get_rng_state().tolist(), "random": random.getstate(),
                "numpy": np.random.get_state()[1].tolist(), "env": os.environ.get("GRPOKIT_ISOLATION"),
                "path": list(sys.path), "grpokit_level": logging.getLogger("grpokit").level,
                "orm": "isolation_probe" in orms, "trainer": TrainerFactory.TRAINER_MAPPING["grpo"],
                "cwd_empty": not any(Path.cwd().iterdir())}


    def test_a_changes_everything():
        from accelerate import Accelerator

        from grpokit.rewards.base import orms
        from grpokit.trainers.factory import TrainerFactory

        START.update(_state())
        torch.set_num_threads(START["threads"] + 1)
        torch.set_default_dtype(torch.float64)
        torch.use_deterministic_algorithms(True)
        torch.rand(3), random.random(), np.random.rand()
        os.environ["GRPOKIT_ISOLATION"] = "leaked"
        sys.path.insert(0, "/leaked")
        logging.getLogger("grpokit").setLevel(logging.CRITICAL)
        orms["isolation_probe"] = object
        TrainerFactory.TRAINER_MAPPING["grpo"] = "leaked.Trainer"
        Accelerator(cpu=True, mixed_precision="bf16")  # a later Accelerator without bf16 would raise
        Path("output/demo/checkpoint-1").mkdir(parents=True)
        torch.set_grad_enabled(False)


    def test_b_finds_none_of_it():
        from accelerate.state import AcceleratorState, GradientState, PartialState

        assert START and _state() == START
        assert AcceleratorState._shared_state == PartialState._shared_state == GradientState._shared_state == {}
        from grpokit.config.parse import parse_train_args

        assert parse_train_args([]).training.output_dir == os.path.abspath("output/demo")  # no earlier checkpoint
""")


def test_a_test_finds_no_trace_of_the_test_before_it(tmp_path):
    shutil.copy(CONFTEST, tmp_path / "conftest.py")
    (tmp_path / "test_pair.py").write_text(TESTS)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", "test_pair.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "2 passed" in proc.stdout
