"""Built-in tasks, generated in code: ``--dataset builtin:<name>`` (train split) or ``builtin:<name>:test``.

Each task is a function ``(split, seed) -> list[dict]`` returning rows in the normalised form (``messages`` plus
the columns its reward reads). The *content* of each split is fixed (drawn with a constant seed), so a held-out
score means the same thing in every run; ``seed`` only decides the order of the rows.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable

from grpokit.errors import DataError
from grpokit.registry import Registry

SPLITS = ("train", "test")
_CONTENT_SEED = 1234  # fixes which items land in which split; never tied to --seed

BUILTIN_TASKS = Registry("built-in task", "--dataset builtin:<name>")

Row = dict


def _user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def _check_split(task: str, split: str) -> None:
    if split not in SPLITS:
        raise DataError(
            f"builtin:{task}:{split}: unknown split {split!r}; use builtin:{task} (train) or builtin:{task}:test"
        )


def _ordered(rows: list[Row], seed: int) -> list[Row]:
    random.Random(seed).shuffle(rows)
    return rows


# ---------------------------------------------------------------- arithmetic, subtraction

ARITHMETIC_RANGE = (1, 20)
ARITHMETIC_TEST_SIZE = 100  # of the 20 x 20 = 400 ordered pairs; the other 300 train
SUBTRACTION_MAX = 40
SUBTRACTION_TEST_SIZE = 100  # of the 780 pairs 1 <= b < a <= 40; the other 680 train


def _pair_rows(pairs: list[tuple[int, int]], split: str, test_size: int, op: str) -> list[Row]:
    """Split ``pairs`` (shuffled with the content seed: test first) into rows asking for ``a op b``."""
    random.Random(_CONTENT_SEED).shuffle(pairs)
    chosen = pairs[:test_size] if split == "test" else pairs[test_size:]
    value = {"+": int.__add__, "-": int.__sub__}[op]
    return [
        {"messages": _user(f"What is {a} {op} {b}? Answer with just the number."), "solution": str(value(a, b))}
        for a, b in chosen
    ]


@BUILTIN_TASKS.register("arithmetic")
def arithmetic(split: str = "train", seed: int = 42) -> list[Row]:
    """``What is a + b?`` with a, b in 1..20; column ``solution`` = str(a + b). 300 train / 100 test pairs."""
    _check_split("arithmetic", split)
    lo, hi = ARITHMETIC_RANGE
    pairs = [(a, b) for a in range(lo, hi + 1) for b in range(lo, hi + 1)]
    return _ordered(_pair_rows(pairs, split, ARITHMETIC_TEST_SIZE, "+"), seed)


@BUILTIN_TASKS.register("subtraction")
def subtraction(split: str = "train", seed: int = 42) -> list[Row]:
    """``What is a - b?`` with 1 <= b < a <= 40; column ``solution`` = str(a - b). 680 train / 100 test pairs.

    The harder demo (``grpokit/config/demo_subtraction.yaml``): SmolLM2-135M-Instruct answers about one in five
    of these right before training, against two in five on ``arithmetic``.
    """
    _check_split("subtraction", split)
    pairs = [(a, b) for a in range(2, SUBTRACTION_MAX + 1) for b in range(1, a)]
    return _ordered(_pair_rows(pairs, split, SUBTRACTION_TEST_SIZE, "-"), seed)


# ---------------------------------------------------------------- countdown

COUNTDOWN_SIZES = {"train": 2000, "test": 200}
COUNTDOWN_NUM_RANGE = (1, 25)
COUNTDOWN_TARGET_RANGE = (1, 100)
_OPS = ("+", "-", "*", "/")


def _combine(x: tuple[int, str], y: tuple[int, str], op: str) -> tuple[int, str] | None:
    """Apply ``op`` to two (value, expression) items; None when the result is not a positive integer."""
    (a, ea), (b, eb) = x, y
    if op == "+":
        value = a + b
    elif op == "*":
        value = a * b
    elif op == "-":
        if a <= b:
            return None
        value = a - b
    else:
        if b <= 1 or a % b:
            return None
        value = a // b
    return value, f"({ea} {op} {eb})"


def _countdown_problem(rng: random.Random) -> tuple[list[int], int, str] | None:
    """Draw 3-4 numbers and combine them all in random order into one expression; None if out of range."""
    nums = [rng.randint(*COUNTDOWN_NUM_RANGE) for _ in range(rng.choice((3, 4)))]
    pool = [(n, str(n)) for n in nums]
    while len(pool) > 1:
        i, j = rng.sample(range(len(pool)), 2)
        made = _combine(pool[i], pool[j], rng.choice(_OPS))
        if made is None:
            return None
        pool = [p for k, p in enumerate(pool) if k not in (i, j)] + [made]
    target, expr = pool[0]
    if not COUNTDOWN_TARGET_RANGE[0] <= target <= COUNTDOWN_TARGET_RANGE[1]:
        return None
    return nums, target, expr[1:-1]  # drop the outermost parentheses


def countdown_prompt(nums: list[int], target: int) -> str:
    """The user message of a countdown row."""
    listed = ", ".join(str(n) for n in nums)
    return (
        f"Using the numbers [{listed}], write an equation whose value is {target}. "
        "Use every number exactly once, with + - * / and parentheses. "
        "Think it through, then give only the equation inside <answer></answer>, "
        "for example <answer>(4 + 2) * 3</answer>."
    )


@functools.lru_cache(maxsize=1)
def _countdown_pool() -> tuple[tuple[tuple[int, ...], int, str], ...]:
    """All countdown problems, test ones first; distinct by (sorted numbers, target). Cached: ~0.25 s to draw."""
    rng = random.Random(_CONTENT_SEED)
    wanted = COUNTDOWN_SIZES["train"] + COUNTDOWN_SIZES["test"]
    seen: set[tuple[tuple[int, ...], int]] = set()
    problems: list[tuple[tuple[int, ...], int, str]] = []
    while len(problems) < wanted:
        drawn = _countdown_problem(rng)
        if drawn is None:
            continue
        key = (tuple(sorted(drawn[0])), drawn[1])  # same multiset and target = same problem
        if key in seen:
            continue
        seen.add(key)
        problems.append((tuple(drawn[0]), drawn[1], drawn[2]))
    return tuple(problems)


@BUILTIN_TASKS.register("countdown")
def countdown(split: str = "train", seed: int = 42) -> list[Row]:
    """Reach ``target`` from ``nums`` (3-4 ints in 1..25, target 1..100); 2000 train / 200 test, no overlap."""
    _check_split("countdown", split)
    problems = _countdown_pool()
    n_test = COUNTDOWN_SIZES["test"]
    chosen = problems[:n_test] if split == "test" else problems[n_test:]
    rows = [
        {
            "messages": _user(countdown_prompt(list(nums), target)),
            "nums": list(nums),
            "target": target,
            "solution": expr,
        }
        for nums, target, expr in chosen
    ]
    return _ordered(rows, seed)


# ---------------------------------------------------------------- guess_number

GUESS_NUMBER_MAX = 16
GUESS_NUMBER_TRAIN_REPEATS = 8


@BUILTIN_TASKS.register("guess_number")
def guess_number(split: str = "train", seed: int = 42) -> list[Row]:
    """Multi-turn guessing game; ``env_config`` = {"name": "guess_number", "secret": k}.

    Every row shows the same prompt (the secret lives only in ``env_config``), so the splits cannot be disjoint
    in text: train holds each secret 1..16 eight times (128 rows), test each secret once (16 rows).
    """
    _check_split("guess_number", split)
    repeats = GUESS_NUMBER_TRAIN_REPEATS if split == "train" else 1
    prompt = f"I am thinking of a number between 1 and {GUESS_NUMBER_MAX}. Guess it; reply with just the number."
    rows = [
        {"messages": _user(prompt), "env_config": {"name": "guess_number", "secret": k}}
        for _ in range(repeats)
        for k in range(1, GUESS_NUMBER_MAX + 1)
    ]
    return _ordered(rows, seed)


# ---------------------------------------------------------------- colours (images)

COLOURS = ("red", "green", "blue")
COLOURS_SIZES = {"train": 240, "test": 60}
COLOURS_PROMPT = "<image>What colour is this image? Answer red, green or blue."


def _colour_png(rng: random.Random, colour: str, size: int = 16) -> bytes:
    """A solid image of a random shade of ``colour``: its channel high (150-255), the others low (0-90)."""
    import io

    from PIL import Image  # Pillow comes with transformers' image processors; only this task needs it here

    shade = [rng.randint(0, 90) for _ in range(3)]
    shade[COLOURS.index(colour)] = rng.randint(150, 255)
    buf = io.BytesIO()
    Image.new("RGB", (size, size), tuple(shade)).save(buf, format="PNG")
    return buf.getvalue()


@BUILTIN_TASKS.register("colours")
def colours(split: str = "train", seed: int = 42) -> list[Row]:
    """A multimodal task: one solid image (PNG bytes in ``images``) of a random shade of red, green or blue, the
    same question for every image; column ``solution`` = the colour. 240 train / 60 test images, disjoint draws."""
    _check_split("colours", split)
    rng = random.Random(_CONTENT_SEED + (split == "test"))
    rows = []
    for i in range(COLOURS_SIZES[split]):
        colour = COLOURS[i % 3]
        rows.append({"messages": _user(COLOURS_PROMPT), "images": [_colour_png(rng, colour)], "solution": colour})
    return _ordered(rows, seed)


def builtin_rows(name: str, split: str, seed: int) -> list[Row]:
    """Rows of built-in task ``name``; DataError naming the registered tasks when it is unknown."""
    if name not in BUILTIN_TASKS:
        known = ", ".join(f"builtin:{n}" for n in sorted(BUILTIN_TASKS))
        raise DataError(f"--dataset builtin:{name}: unknown built-in task; available: {known}")
    task: Callable[[str, int], list[Row]] = BUILTIN_TASKS[name]
    return task(split, seed)
