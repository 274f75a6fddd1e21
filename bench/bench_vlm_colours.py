"""examples/vlm/colours.yaml per seed: held-out greedy accuracy of a tiny random VLM before and during GRPO.

For each seed: build a tiny random model of the family as the example does (grpokit.testing_vlm, offline, the
aligner's output at zero so the untrained model answers every image alike), train it with the example's
settings, and every ``--eval_every`` optimizer steps answer the 60 held-out images greedily (constrained to the
three colour words, as in training) and score them. A run stops at ``--target`` accuracy or ``--max_minutes``.
Prints one JSON line per evaluation and one summary line per seed; docs/multimodal.md quotes the curves.

    python bench/bench_vlm_colours.py --seeds 0 1 2 --family qwen2_vl
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "vlm" / "colours.yaml"


class _Stop(Exception):
    pass


def held_out_accuracy(trainer, rows) -> float:
    from grpokit.protocol import RequestConfig, RolloutInferRequest

    config = RequestConfig(
        n=1, max_tokens=4, temperature=0.0, structured_outputs_regex=trainer.cfg.rollout.structured_outputs_regex
    )
    requests = [RolloutInferRequest(messages=r["messages"], data_dict={"images": r["images"]}) for r in rows]
    answers = [resp.choices[0].message["content"].strip() for resp in trainer.engine.infer(requests, config)]
    return sum(a == r["solution"] for a, r in zip(answers, rows)) / len(rows)


def run_seed(
    seed: int, family: str, eval_every: int, target: float, max_minutes: float, steps: int, zero_aligner: bool = True
) -> dict:
    from grpokit.config.parse import parse_train_args
    from grpokit.data.builtin import colours
    from grpokit.pipeline.train import run_train
    from grpokit.testing_vlm import build_tiny_vlm
    from grpokit.trainers.factory import TrainerFactory
    from grpokit.trainers.grpo_trainer import GRPOTrainer

    rows = colours("test")
    curve: list[dict] = []
    start = time.perf_counter()

    class Evaluated(GRPOTrainer):
        def _evaluate_now(self) -> None:
            acc = held_out_accuracy(self, rows)
            point = {
                "seed": seed,
                "step": self.state.global_step,
                "seconds": round(time.perf_counter() - start, 1),
                "accuracy": round(acc, 3),
            }
            curve.append(point)
            print(json.dumps(point), flush=True)
            if acc >= target or time.perf_counter() - start > 60 * max_minutes:
                raise _Stop

        def _next_window(self):
            if not curve:
                self._evaluate_now()
            return super()._next_window()

        def _on_optimizer_step(self, bar, values) -> None:
            super()._on_optimizer_step(bar, values)
            if self.state.global_step % eval_every == 0:
                self._evaluate_now()

    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_vlm(Path(tmp) / "model", family, seed=seed, zero_aligner=zero_aligner)
        saved = dict(TrainerFactory.TRAINER_MAPPING)
        TrainerFactory.TRAINER_MAPPING["grpo"] = Evaluated
        try:
            run_train(
                parse_train_args(
                    [
                        "--config",
                        str(EXAMPLE),
                        "--model",
                        str(model),
                        "--seed",
                        str(seed),
                        "--output_dir",
                        str(Path(tmp) / "out"),
                        "--max_steps",
                        str(steps),
                        "--disable_tqdm",
                        "true",
                    ]
                )
            )
        except _Stop:
            pass
        finally:
            TrainerFactory.TRAINER_MAPPING.clear()
            TrainerFactory.TRAINER_MAPPING.update(saved)
    return {
        "seed": seed,
        "family": family,
        "start": curve[0]["accuracy"],
        "best": max(p["accuracy"] for p in curve),
        "seconds": curve[-1]["seconds"],
        "steps": curve[-1]["step"],
        "curve": curve,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--family", default="qwen2_vl")
    p.add_argument("--eval_every", type=int, default=10)
    p.add_argument("--target", type=float, default=0.9)
    p.add_argument("--max_minutes", type=float, default=10.0)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument(
        "--random_aligner",
        action="store_true",
        help="build the model without --zero_aligner (random weights may tell colours apart untrained)",
    )
    a = p.parse_args(argv)
    for seed in a.seeds:
        summary = run_seed(seed, a.family, a.eval_every, a.target, a.max_minutes, a.steps, not a.random_aligner)
        print(json.dumps({k: v for k, v in summary.items() if k != "curve"}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
