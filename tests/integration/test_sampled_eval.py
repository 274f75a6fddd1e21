"""Sampled evaluation in a real run and from the command line: `--num_generations_eval 4` puts pass@1, pass@4,
mean@4 and greedy per reward (with their intervals) on the eval lines of logging.jsonl, and `grpokit eval` /
`grpokit infer --num_generations_eval` print and write the same table for a saved model."""

from __future__ import annotations

import json
import textwrap

import pytest
from support import flags

pytestmark = pytest.mark.slow

PLUGIN = textwrap.dedent("""
    from grpokit.rewards import orms

    def even_length(completions, **kwargs):
        '''A 0/1 reward a random model passes about half the time: the completion has an even length.'''
        return [float(len(c) % 2 == 0) for c in completions]

    orms['even_length'] = even_length
""")


@pytest.fixture(scope="module")
def run(tiny_model_dir, tmp_path_factory):
    """Three steps of the tiny model, evaluated at step 3 with 4 samples per prompt."""
    from grpokit.config.parse import parse_train_args
    from grpokit.pipeline.train import run_train

    tmp = tmp_path_factory.mktemp("sampled_eval")
    (tmp / "plugin.py").write_text(PLUGIN)
    data, val = tmp / "train.jsonl", tmp / "val.jsonl"
    data.write_text(
        "".join(
            json.dumps({"query": f"What is {a} + {b}?", "solution": str(a + b)}) + "\n"
            for a in range(1, 5)
            for b in range(1, 5)
        )
    )
    val.write_text(
        "".join(json.dumps({"query": f"What is {a} * 3?", "solution": str(3 * a)}) + "\n" for a in range(1, 6))
    )
    out = tmp / "run"
    run_train(
        parse_train_args(
            flags(
                {"--model": tiny_model_dir, "--dataset": data, "--val_dataset": val, "--output_dir": out},
                {"--external_plugins": tmp / "plugin.py"},
                "--tuner_type full --reward_funcs even_length accuracy --num_generations 4",
                "--per_device_train_batch_size 8 --max_completion_length 8 --learning_rate 1e-3",
                "--torch_dtype float32 --seed 0 --disable_tqdm true --max_steps 3 --eval_steps 3",
                "--num_generations_eval 4",
            )
        )
    )
    return tmp, out


def test_eval_lines_carry_pass_at_k_mean_and_greedy(run):
    _, out = run
    rows = [json.loads(line) for line in (out / "logging.jsonl").read_text().splitlines()]
    evals = [r for r in rows if any(k.startswith("eval/") for k in r)]
    assert [r["step"] for r in evals] == [3]
    for row in evals:
        for reward in ("even_length", "accuracy"):
            figures = ("greedy", "pass@1", "pass@2", "pass@4", "mean@4")
            assert {f"eval/{reward}/{f}" for f in figures} <= set(row)
            e = {f: row[f"eval/{reward}/{f}"] for f in figures}
            assert all(0.0 <= v <= 1.0 for v in e.values())
            for f in figures[1:]:  # five prompts: an interval around each sampled figure
                assert row[f"eval/{reward}/{f}_ci_low"] <= e[f] <= row[f"eval/{reward}/{f}_ci_high"]
            assert e["pass@1"] <= e["pass@2"] <= e["pass@4"]
            assert e["mean@4"] == pytest.approx(e["pass@1"])  # a 0/1 reward judged on every sample
    sampled = [evals[0][f"eval/even_length/{f}"] for f in ("pass@1", "pass@4")]
    assert 0.0 < sampled[0] < sampled[1]  # a random model: some samples pass, more prompts at 4 tries than at 1


def test_grpokit_eval_prints_and_writes_the_table(run, capsys):
    from grpokit.cli.main import main

    tmp, out = run
    table = tmp / "eval.jsonl"
    main(
        flags(
            "eval",
            {"--model": out / "final_model", "--dataset": tmp / "val.jsonl"},
            {"--external_plugins": tmp / "plugin.py"},
            "--reward_funcs even_length --max_new_tokens 8 --torch_dtype float32",
            {"--output": table},
        )
    )
    printed = capsys.readouterr().out
    summary, *rows = [json.loads(line) for line in table.read_text().splitlines()]
    assert summary["model"] == str(out / "final_model")
    assert len([r for r in rows if "sample" in r]) == 5 * 4 and len([r for r in rows if "sample" not in r]) == 5
    # the file's figures are the samples' own scores
    passes = [
        [r["even_length"] for r in rows if r.get("sample") is not None and r["prompt"] == p]
        for p in dict.fromkeys(r["prompt"] for r in rows)
    ]
    assert summary["even_length/pass@1"] == pytest.approx(sum(sum(p) / 4 for p in passes) / len(passes))
    assert summary["even_length/pass@4"] == pytest.approx(sum(max(p) for p in passes) / len(passes))
    assert "4 samples per prompt at temperature 1" in printed
    line = next(x for x in printed.splitlines() if x.strip().startswith("even_length"))
    assert f"pass@4 {summary['even_length/pass@4']:.3f} [" in line and "greedy " in line and "mean@4 " in line


def test_infer_samples_only_when_asked_and_never_at_temperature_0(run, capsys):
    from grpokit.cli.main import main

    tmp, out = run
    args = flags(
        "infer",
        {"--model": out / "final_model", "--dataset": tmp / "val.jsonl", "--external_plugins": tmp / "plugin.py"},
        "--reward_funcs even_length --max_new_tokens 8 --torch_dtype float32",
    )
    main([*args, "--num_generations_eval", "2", "--temperature", "1.0"])
    assert "pass@2 " in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main([*args, "--num_generations_eval", "2"])
    err = capsys.readouterr().err  # one line, before the model or the data loads
    assert len(err.strip().splitlines()) == 1 and "--num_generations_eval 2 samples at --temperature, which is 0" in err
