"""The trip of one window: the grpokit files and functions a text-only single-turn window enters.

A tiny model trains one step (one window: rollout, rewards, advantages, old logps, the training step, the
optimizer step and its logging); ``sys.setprofile`` records every Python function called between the callbacks
``on_train_begin`` and ``on_step_end``, and the script prints how many distinct grpokit source files and functions
that is (and, with ``--list``, which), and how many attributes the trainer holds at the step's end
(``vars(trainer)``). docs/design.md ("One window's path") quotes the figures.

    PYTHONPATH=$PWD python bench/bench_trip.py [--list]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path


def measure(workdir: Path) -> tuple[set[str], set[tuple[str, str]], int]:
    import grpokit
    from grpokit.config.parse import parse_train_args
    from grpokit.pipeline.train import run_train
    from grpokit.testing import build_tiny_model
    from grpokit.trainers.callbacks import TrainerCallback, callbacks_map

    root = str(Path(grpokit.__file__).resolve().parent)
    files: set[str] = set()
    funcs: set[tuple[str, str]] = set()
    attributes: list[int] = []

    def profile(frame, event, _arg):
        if event == "call":
            code = frame.f_code
            if code.co_filename.startswith(root):
                rel = code.co_filename[len(root) + 1 :]
                files.add(rel)
                funcs.add((rel, getattr(code, "co_qualname", code.co_name)))

    class Trip(TrainerCallback):
        """Every hook defined here, so that the measurement does not enter the base class's no-op hooks."""

        def on_train_begin(self, trainer):
            sys.setprofile(profile)

        def on_step_end(self, trainer):
            sys.setprofile(None)
            attributes.append(len(vars(trainer)))

        def on_log(self, trainer, logs):
            pass

        def on_save(self, trainer, checkpoint_dir):
            pass

        def on_train_end(self, trainer):
            pass

    callbacks_map["bench_trip"] = Trip
    model = build_tiny_model(workdir / "tiny")
    run_train(
        parse_train_args(
            [
                "--model",
                str(model),
                "--dataset",
                "builtin:arithmetic#16",
                "--reward_funcs",
                "accuracy",
                "--num_generations",
                "4",
                "--per_device_train_batch_size",
                "8",
                "--max_completion_length",
                "8",
                "--max_steps",
                "1",
                "--beta",
                "0",
                "--torch_dtype",
                "float32",
                "--output_dir",
                str(workdir / "out"),
                "--save_final_model",
                "false",
                "--plots",
                "false",
                "--disable_tqdm",
                "true",
                "--callbacks",
                "bench_trip",
                "--logging_steps",
                "1",
                "--seed",
                "0",
            ]
        )
    )
    sys.setprofile(None)
    return files, funcs, attributes[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--list", action="store_true", help="print every file and function")
    a = p.parse_args()
    files, funcs, attributes = measure(Path(tempfile.mkdtemp(prefix="grpokit-trip-")))
    if a.list:
        for f in sorted(funcs):
            print(f"{f[0]}: {f[1]}")
    print(
        f"one text-only single-turn window: {len(files)} grpokit files, {len(funcs)} functions; "
        f"the trainer holds {attributes} attributes"
    )


if __name__ == "__main__":
    main()
