"""`grpokit infer`: scores of a model and of a trained LoRA adapter folder, as the README shows."""

from __future__ import annotations

import json
import os
import subprocess
import textwrap

import pytest
from cli_process import run_grpokit
from support import flags

pytestmark = pytest.mark.slow


def _infer(*args: str) -> subprocess.CompletedProcess:
    # a process forked from the test process's zygote (cli_process.py): no interpreter start-up
    return run_grpokit(["infer", *args], env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)


SCORING_PLUGIN = textwrap.dedent("""
    from grpokit.rewards import orms

    def solution_value(completions, solution, **kwargs):
        # the dataset's answer as the score: known without looking at the model
        return [float(s) for s in solution]

    def completion_chars(completions, **kwargs):
        return [float(len(c)) for c in completions]

    orms['solution_value'] = solution_value
    orms['completion_chars'] = completion_chars
""")


@pytest.fixture(scope="module")
def varied_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with its weights spread (seeded), so that greedy text varies with the prompt and no two
    tokens come near a tie for the top logit; saved with its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path_factory.mktemp("varied") / "model"
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=g) * 0.5)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(out)
    return out


def test_infer_scores_a_model_and_writes_completions(tiny_model_dir, math_jsonl, tmp_path):
    """Rewards whose values are known (the dataset's answer; the length of the completion written) come back per
    row and as their means, in the summary line and on stdout."""
    plugin = tmp_path / "scoring.py"
    plugin.write_text(SCORING_PLUGIN)
    out = tmp_path / "scores.jsonl"
    res = _infer(
        *flags(
            {"--model": tiny_model_dir, "--dataset": math_jsonl, "--output": out, "--external_plugins": plugin},
            "--limit 6 --max_new_tokens 6 --batch_size 4 --torch_dtype float32",
            "--reward_funcs solution_value completion_chars",
        ),
    )
    assert res.returncode == 0, res.stderr[-2000:]
    summary, *rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(rows) == 6
    solution_of = {r["query"]: float(r["solution"]) for r in map(json.loads, math_jsonl.read_text().splitlines())}
    for row in rows:
        assert set(row) == {"prompt", "completion", "solution_value", "completion_chars"}
        assert row["solution_value"] == solution_of[row["prompt"]]
        assert row["completion_chars"] == len(row["completion"])
    means = {name: sum(r[name] for r in rows) / len(rows) for name in ("solution_value", "completion_chars")}
    assert summary == {
        "model": str(tiny_model_dir),
        "dataset": str(math_jsonl),
        **{k: pytest.approx(v, rel=1e-6) for k, v in means.items()},
    }
    assert (
        f"(6 prompts, greedy): solution_value {means['solution_value']:.3f}, "
        f"completion_chars {means['completion_chars']:.3f}"
    ) in res.stdout
    progress = [line.split(" | ")[0] for line in res.stderr.splitlines() if line.startswith("eval: ")]
    assert progress == ["eval: greedy 0/6 prompts (0%)", "eval: greedy 6/6 prompts (100%)"], res.stderr


def _direct_greedy(model_dir, prompts: list[str], max_new_tokens: int) -> list[str]:
    """Each prompt alone (no padding) through the chat template and HF ``generate``, greedy, cut after eos."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    texts = []
    for prompt in prompts:
        text = tok.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            new = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=max_new_tokens,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id,
            )[0, ids.shape[1] :].tolist()
        if tok.eos_token_id in new:
            new = new[: new.index(tok.eos_token_id) + 1]
        texts.append(tok.decode(new, skip_special_tokens=True))
    return texts


@pytest.mark.parametrize("fast", ["true", "false"])
def test_infer_greedy_completions_equal_hf_generate_on_each_prompt_alone(varied_model_dir, math_jsonl, tmp_path, fast):
    """`grpokit infer` (batched, left-padded, with grpokit's decode loop or HF generate) writes, for each prompt,
    the text HF generate gives for that prompt alone with the same greedy settings."""
    out = tmp_path / "completions.jsonl"
    res = _infer(
        *flags(
            {"--model": varied_model_dir, "--dataset": math_jsonl, "--output": out, "--fast_decode": fast},
            "--limit 4 --max_new_tokens 8 --torch_dtype float32",
        ),
    )
    assert res.returncode == 0, res.stderr[-2000:]
    rows = [json.loads(x) for x in out.read_text().splitlines()][1:]
    assert len(rows) == 4
    expected = _direct_greedy(varied_model_dir, [r["prompt"] for r in rows], max_new_tokens=8)
    assert len(set(expected)) > 1 and all(expected)  # the reference varies with the prompt: a real comparison
    assert [r["completion"] for r in rows] == expected


def test_infer_loads_a_lora_adapter_folder(tiny_model_dir, math_jsonl, tmp_path):
    from grpokit.config.parse import parse_train_args
    from grpokit.pipeline.train import run_train

    run = tmp_path / "lora"
    run_train(
        parse_train_args(
            flags(
                {"--model": tiny_model_dir, "--dataset": math_jsonl, "--output_dir": run},
                "--tuner_type lora --num_generations 2 --per_device_train_batch_size 4 --max_completion_length 4",
                "--max_steps 1 --beta 0 --disable_tqdm true",
            )
        )
    )
    assert (run / "final_model" / "adapter_config.json").is_file()
    res = _infer(*flags({"--model": run / "final_model", "--dataset": math_jsonl}, "--limit 2 --max_new_tokens 4"))
    assert res.returncode == 0, res.stderr[-2000:]
    assert "2 prompts" in res.stdout


def test_infer_missing_model_is_one_line(tmp_path):
    res = _infer("--model", str(tmp_path / "nope"))
    assert res.returncode != 0 and len(res.stderr.strip().splitlines()) == 1 and "nope" in res.stderr


@pytest.mark.parametrize(
    "args, said",
    [
        (["--limit", "-3"], "--limit -3: must be 0 (every prompt) or a positive number"),
        (["--max_new_tokens", "0"], "--max_new_tokens 0: must be at least 1"),
        (["--output", "{tmp}"], "is a folder; give a file path"),
        (["--output", "{tmp}/a_file/results.jsonl"], "cannot write"),
        (["--reward_funcs", "no_such_reward"], "unknown reward function"),
        (["--top_p", "1.5"], "--top_p"),
    ],
)
def test_bad_options_and_outputs_are_one_line_before_the_model_loads(tmp_path, args, said):
    """Checked before any work: the model named does not exist, so an error about it would mean the check came
    after loading; and no output file is left behind."""
    (tmp_path / "a_file").write_text("x")
    res = _infer("--model", str(tmp_path / "nope"), *[a.format(tmp=tmp_path) for a in args])
    lines = res.stderr.strip().splitlines()
    assert res.returncode != 0 and len(lines) == 1 and said in lines[0] and "nope" not in lines[0], res.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]
