"""Reward and plugin code written the way other projects' users write it, for the porting tests: a ms-swift GRPO
plugin file (``swift_style_plugin.py`` beside this file, ``from swift.…`` imports) and reward functions in TRL's
documented conventions (``TRL_EXAMPLES`` below). Both are grpokit's own text, kept in this repository: no test reads
another project's files, so nothing here depends on a download or a folder of one machine.

The porting steps are the ones a user makes: the plugin's imports are renamed (``swift.`` → ``grpokit.swift.``);
the TRL-style functions are either registered in ``orms`` by a plugin (``trl_convention(f)`` where the signature
alone reads as ms-swift's: ``TRL_MARKED``) or named by import path, ``--reward_funcs module.function`` (TRL's CLI),
each in a module of its own with no grpokit line in it (``trl_reward_modules``).
"""

from __future__ import annotations

import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
SWIFT_STYLE_PLUGIN = HERE / "swift_style_plugin.py"

# One module's text per example: the imports and functions a TRL user writes for GRPOTrainer(reward_funcs=[...]).
# Each covers one convention of TRL's reward-function interface (which keyword carries what).
TRL_EXAMPLES: dict[str, str] = {
    # completion_ids by keyword: one score per completion from its token count
    "trl_doc_ex1": '''
def reward_func(completion_ids, **kwargs):
    """Longer is better: the number of tokens generated."""
    return [float(len(ids)) for ids in completion_ids]
''',
    # completions by keyword only (the signature ms-swift also uses): character counts of the texts
    "trl_doc_ex1_1": '''
def reward_func(completions, **kwargs):
    """Longer is better: the number of characters written."""
    return [float(len(text)) for text in completions]
''',
    # conversational completions: each a list of messages, the reply's text in completion[0]["content"]
    "trl_doc_ex2": '''
import re


def format_reward_func(completions, **kwargs):
    """1.0 for a reply shaped <think>...</think><answer>...</answer>."""
    shape = re.compile(r"^<think>.*?</think>\\s*<answer>.*?</answer>$", re.S)
    return [1.0 if shape.match(completion[0]["content"]) else 0.0 for completion in completions]
''',
    # a dataset column (ground_truth) by keyword
    "trl_doc_ex3": '''
import re


def reward_func(completions, ground_truth, **kwargs):
    """1.0 when the last \\\\boxed{...} of the completion holds the reference answer."""
    scores = []
    for text, truth in zip(completions, ground_truth):
        boxed = re.findall(r"\\\\boxed\\{(.*?)\\}", text)
        scores.append(1.0 if boxed and boxed[-1].strip() == str(truth) else 0.0)
    return scores
''',
    # None for the rows a function does not judge (the task column routes each row to one function)
    "trl_doc_ex4": '''
def math_reward_func(prompts, completions, task, **kwargs):
    """Math rows only: 1.0 when the completion contains a digit, -1.0 otherwise; None for other tasks."""
    return [None if kind != "math" else (1.0 if any(ch.isdigit() for ch in text) else -1.0)
            for text, kind in zip(completions, task)]


def coding_reward_func(prompts, completions, task, **kwargs):
    """Coding rows only: 1.0 when the completion defines a function, -1.0 otherwise; None for other tasks."""
    return [None if kind != "coding" else (1.0 if "def " in text else -1.0)
            for text, kind in zip(completions, task)]
''',
    # an async function, awaited by the trainer
    "trl_doc_ex5": '''
import asyncio


async def async_reward_func(completions, **kwargs):
    """1.0 for every non-empty completion, after yielding to the event loop once."""
    await asyncio.sleep(0)
    return [1.0 if completion else 0.0 for completion in completions]
''',
    # log_extra (a column per completion in the completions table) and log_metric (a scalar in the logs)
    "trl_doc_ex6": '''
import re


def reward_func(completions, ground_truth, log_extra=None, log_metric=None, **kwargs):
    """Exact match of the last number written; logs what was extracted and the batch accuracy."""
    extracted = []
    for text in completions:
        numbers = re.findall(r"-?\\d+", text)
        extracted.append(numbers[-1] if numbers else "")
    scores = [1.0 if got == str(truth) else 0.0 for got, truth in zip(extracted, ground_truth)]
    if log_extra is not None:
        log_extra("golden_answer", [str(truth) for truth in ground_truth])
        log_extra("extracted_answer", extracted)
    if log_metric is not None:
        log_metric("accuracy", sum(scores) / len(scores))
    return scores
''',
}
# module → {function: registered name}
TRL_NAMES = {
    "trl_doc_ex1": {"reward_func": "trl_ex1_token_length"},
    "trl_doc_ex1_1": {"reward_func": "trl_ex1_1_char_length"},
    "trl_doc_ex2": {"format_reward_func": "trl_ex2_format"},
    "trl_doc_ex3": {"reward_func": "trl_ex3_reference"},
    "trl_doc_ex4": {"math_reward_func": "trl_ex4_math", "coding_reward_func": "trl_ex4_coding"},
    "trl_doc_ex5": {"async_reward_func": "trl_ex5_async"},
    "trl_doc_ex6": {"reward_func": "trl_ex6_logging"},
}
# Registered with trl_convention(f): Example 2's signature, format_reward_func(completions, **kwargs), is also
# ms-swift's, which grpokit calls with completion texts; the mark says "TRL's way". The format (strings or message
# lists) still comes from each dataset row, as in TRL. Every other example is registered plainly.
TRL_MARKED = {"trl_ex2_format"}


def swift_plugin(dest: Path) -> Path:
    """swift_style_plugin.py with its imports renamed (``swift.`` → ``grpokit.swift.``), written to ``dest``."""
    text = SWIFT_STYLE_PLUGIN.read_text()
    dest.write_text(re.sub(r"\bfrom swift\.", "from grpokit.swift.", text))
    return dest


def trl_reward_examples(dest: Path) -> Path:
    """A plugin file: each example's code as written, each followed by the lines that register its functions
    (``TRL_NAMES``); the examples' function names repeat, so each registration follows its own definitions."""
    parts = ["from grpokit.rewards import orms, trl_convention\n"]
    for module, code in TRL_EXAMPLES.items():
        parts.append(f"# --- {module} ---\n{code.strip()}\n")
        for func, name in TRL_NAMES[module].items():
            parts.append(
                f"orms[{name!r}] = trl_convention({func})" if name in TRL_MARKED else f"orms[{name!r}] = {func}"
            )
    dest.write_text("\n\n".join(parts) + "\n")
    return dest


def trl_reward_modules(folder: Path) -> dict[str, str]:
    """Each example as a module of its own in ``folder`` (its code as written, nothing added);
    {registered name in TRL_NAMES: "module.function"}."""
    paths = {}
    for module, code in TRL_EXAMPLES.items():
        (folder / f"{module}.py").write_text(code.lstrip())
        paths.update({name: f"{module}.{func}" for func, name in TRL_NAMES[module].items()})
    return paths
