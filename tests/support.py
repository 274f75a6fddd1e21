"""Builders the test files share instead of copying: command lines of `grpokit train`, the blocks of options many
runs repeat (quiet output, colocated vLLM, a rollout server to train against), a short in-process run on the tiny
model, datasets and reward plugins written to disk, and a run's logged rows. Importable as ``support`` from every
test folder (tests/ is on ``sys.path`` because tests/conftest.py lives there)."""

from __future__ import annotations

import contextlib
import json
import textwrap
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import torch

# A short in-process run on the tiny model: two optimizer steps of one group of 4, 8 completion tokens, float32,
# nothing saved or plotted; a test overrides or extends it with its own options (a later option wins).
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
# a run that writes only its logs: no final model, no plots, no progress bar
QUIET = {"--save_final_model": "false", "--plots": "false", "--disable_tqdm": "true"}
# vLLM in the trainer's process on the CPU, sized for the tiny models
VLLM_COLOCATE = {
    "--use_vllm": "true",
    "--vllm_mode": "colocate",
    "--vllm_enforce_eager": "true",
    "--vllm_max_model_len": "512",
    "--vllm_gpu_memory_utilization": "0.3",
}


def flags(*parts) -> list[str]:
    """A command line from ``parts``, in order: a dict gives option, value pairs; a list or tuple its items; a string
    that starts with ``--`` and holds white space gives its words (``"--max_steps 2 --beta 0"``); anything else (a
    path, a number, a string with spaces that is one value) is one argument. A later option wins where the parser
    sees it twice."""
    out: list[str] = []
    for part in parts:
        if isinstance(part, dict):
            out += [str(x) for pair in part.items() for x in pair]
        elif isinstance(part, (list, tuple)):
            out += [str(x) for x in part]
        elif isinstance(part, str) and part.startswith("--") and part.split() != [part]:
            out += part.split()
        else:
            out.append(str(part))
    return out


def server_flags(port: int, timeout: int | None = None) -> dict:
    """Options that send a run's rollouts to a `grpokit rollout` server on 127.0.0.1:``port``."""
    found = {"--vllm_mode": "server", "--vllm_server_host": "127.0.0.1", "--vllm_server_port": str(port)}
    return found if timeout is None else {**found, "--vllm_server_timeout": str(timeout)}


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    """``rows`` as JSON lines at ``path``."""
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def sum_rows() -> list[dict]:
    """16 prompts "What is a + b?" (a, b from 1 to 4) with the sum as ``solution``."""
    return [{"query": f"What is {a} + {b}?", "solution": str(a + b)} for a in range(1, 5) for b in range(1, 5)]


def run_inputs(root: Path, model: Path, plugin_source: str, plugin_name: str) -> SimpleNamespace:
    """What a module's runs share, under ``root``: ``model``, ``sum_rows`` as math.jsonl and the plugin file."""
    data = write_jsonl(root / "math.jsonl", sum_rows())
    plugin = write_plugin(root / plugin_name, plugin_source)
    return SimpleNamespace(root=root, model=model, data=data, plugin=plugin)


def shorter_reward_plugin(name: str) -> str:
    """Source of a plugin module that registers ``orms[name]``: varied scores from a random model, shorter
    completions scoring higher (1 / (1 + characters))."""
    return textwrap.dedent(f"""
        from grpokit.rewards import ORM, orms

        class ShorterIsBetter(ORM):
            '''Varied scores from a random model: shorter completions score higher.'''
            def __call__(self, completions, **kwargs):
                return [1.0 / (1 + len(c)) for c in completions]

        orms[{name!r}] = ShorterIsBetter
    """)


def write_plugin(path: Path, source: str) -> Path:
    """A plugin module (``--external_plugins``) with ``source``, dedented, at ``path``."""
    path.write_text(textwrap.dedent(source))
    return path


def logged_rows(out: Path) -> list[dict]:
    """Every row of a run's logging.jsonl."""
    return [json.loads(line) for line in (out / "logging.jsonl").read_text().splitlines()]


def logged_steps(out: Path) -> list[dict]:
    """The optimizer steps' rows of a run's logging.jsonl (those with a loss)."""
    return [r for r in logged_rows(out) if "loss" in r]


def tiny_run_args(model: Path, data: Path | str, out: Path, *extra) -> list[str]:
    """``TINY_RUN``'s options for ``model`` on ``data`` into ``out``, then ``extra`` (``flags`` parts; a later option
    wins)."""
    return flags({"--model": model, "--dataset": data, "--output_dir": out}, TINY_RUN, *extra)


def tiny_run(model: Path, data: Path | str, out: Path, *extra):
    """(trainer, logged rows of logging.jsonl) of the run ``tiny_run_args`` describes."""
    from grpokit.config.parse import parse_train_args  # not at the top: collection stays free of torch
    from grpokit.pipeline.train import run_train

    trainer = run_train(parse_train_args(tiny_run_args(model, data, out, *extra)))
    return trainer, logged_rows(out)


def tiny_run_on_rows(model: Path, rows: list[dict], folder: Path, *extra):
    """``tiny_run`` on ``rows`` written to ``folder``/data.jsonl, into ``folder``/out: (trainer, optimizer steps' logged
    rows, the output folder)."""
    out = folder / "out"
    trainer, _ = tiny_run(model, write_jsonl(folder / "data.jsonl", rows), out, *extra)
    return trainer, logged_steps(out), out


@contextlib.contextmanager
def grpo_trainer_class(cls):
    """Runs started inside build their trainer from ``cls`` (TrainerFactory's "grpo" entry), put back after."""
    from grpokit.trainers.factory import TrainerFactory  # not at the top: conftest imports this module

    saved = TrainerFactory.TRAINER_MAPPING["grpo"]
    TrainerFactory.TRAINER_MAPPING["grpo"] = cls
    try:
        yield cls
    finally:
        TrainerFactory.TRAINER_MAPPING["grpo"] = saved


def padded_batch(vocab: int = 97) -> tuple[dict, int]:
    """A logps forward's inputs of 6 rows, random ids from 3 up: two prompts (left-padded, 5 and 3 tokens), three
    completions each (right-padded, 4, 2, 3 / 4, 1, 3 tokens); and the completion width, 4."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (5,), generator=g), torch.randint(3, vocab, (3,), generator=g)]
    p, c = 5, 4
    ids, att = torch.zeros(6, p + c, dtype=torch.long), torch.zeros(6, p + c, dtype=torch.long)
    for row, n in enumerate((4, 2, 3, 4, 1, 3)):
        pr = prompts[row // 3]
        ids[row, p - len(pr) : p], att[row, p - len(pr) : p + n] = pr, 1
        ids[row, p : p + n] = torch.randint(3, vocab, (n,), generator=g)
    return {"input_ids": ids, "attention_mask": att, "position_ids": (att.cumsum(-1) - 1).clamp(min=0)}, c


# -- LoRA policies for the adapter-only sync tests (tests/unit, tests/integration, tests/vllm) --------------------
def lora_policy(model_dir: Path, seed: int | None = None):
    """``model_dir``'s model in float32 with a LoRA adapter (r 4, alpha 8, every linear layer, no dropout) whose
    factors are all random (``shake_lora``): an adapter that changes the model's tokens."""
    from peft import LoraConfig, get_peft_model  # not at the top: only the LoRA tests need peft

    from grpokit.modeling import load_causal_lm

    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear")
    model = get_peft_model(load_causal_lm(str(model_dir), torch.float32), config)
    if seed is not None:
        torch.manual_seed(seed)
    shake_lora(model)
    return model


def shake_lora(model) -> None:
    """Every LoRA factor of ``model`` gets new random values (B starts at zero in peft: the delta would be nothing)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.1)


def token_logps(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """``model``'s logprob of each of ``tokens`` after ``prompt`` and the tokens before it."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
    return logits.log_softmax(-1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


def while_generating(server_url: str, generate, then, timeout_s: float = 60) -> None:
    """Run ``generate`` in a thread, and ``then`` once the server at ``server_url`` has requests in flight (a weight
    update landing mid-rollout); wait for ``generate`` to end."""
    worker = threading.Thread(target=generate)
    worker.start()
    deadline = time.monotonic() + timeout_s
    while httpx.get(server_url + "/get_engine_type/", timeout=5).json()["inflight_requests"] == 0:
        assert time.monotonic() < deadline, "the rollout never reached the server"
        time.sleep(0.01)
    time.sleep(0.05)
    then()
    worker.join(120)
