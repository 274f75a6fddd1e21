"""One builder for a short in-process `grpokit train` run on the tiny model: the options every such test shares
(two optimizer steps of one group of 4, 8 completion tokens, float32, nothing saved or plotted), overridden or
extended by the test's own; the run's logged rows come back with the trainer."""

from __future__ import annotations

import json
from pathlib import Path

TINY_RUN = {
    "--tuner_type": "full",  # the tests' runs train the whole tiny model (grpokit's default is lora, as ms-swift's)
    "--num_generations": "4",
    "--per_device_train_batch_size": "4",
    "--max_completion_length": "8",
    "--max_steps": "2",
    "--learning_rate": "1e-3",
    "--torch_dtype": "float32",
    "--beta": "0",
    "--disable_tqdm": "true",
    "--plots": "false",
    "--save_final_model": "false",
    "--seed": "1",
}


def tiny_run_args(model: Path, data: Path | str, out: Path, *extra: str) -> list[str]:
    """``TINY_RUN``'s options for ``model`` on ``data`` into ``out``, then ``extra`` (a later flag wins)."""
    base = [x for pair in TINY_RUN.items() for x in pair]
    return ["--model", str(model), "--dataset", str(data), "--output_dir", str(out), *base, *extra]


def tiny_run(model: Path, data: Path | str, out: Path, *extra: str):
    """(trainer, logged rows of logging.jsonl) of the run ``tiny_run_args`` describes."""
    from grpokit.config.parse import parse_train_args  # not at the top: collection stays free of torch
    from grpokit.pipeline.train import run_train

    trainer = run_train(parse_train_args(tiny_run_args(model, data, out, *extra)))
    return trainer, [json.loads(line) for line in (out / "logging.jsonl").read_text().splitlines()]
