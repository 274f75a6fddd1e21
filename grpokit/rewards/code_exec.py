"""``code_exec``: run the completion's Python against the row's test cases in a local sandbox; score = pass rate.

ms-swift's code rewards call a cloud service (E2B, Judge0); this one runs locally, each program in its own
bubblewrap sandbox (``isolation.py``: namespaces, seccomp, rlimits, a private tmpfs; docs/rewards.md lists the
guarantees). Without bubblewrap it refuses to start unless ``--code_exec_isolation none`` (unsafe) is given.

The code is the completion's last fenced ``python`` block (``py``, ``python3`` or a bare fence also count), or
the whole text when it has none. The ``test_cases`` column holds, per row, either

- a list of ``{"input": stdin, "output": expected stdout}`` (each case runs in its own process; outputs are
  compared by the grader process, line by line, ignoring trailing whitespace and blank lines at the end), also
  accepted as ``{"inputs": [...], "outputs": [...]}`` or as the JSON text of either; or
- Python test code in any style ``test_convert`` knows (asserts, ``check(candidate)``, test functions, pytest,
  unittest, EvalPlus helpers). It runs in a grader process (``grading_pool``, ``grader.py``), never in the
  trainer; the program runs once in the sandbox and only answers the calls the tests make on it. A file the
  grader cannot run that way is refused when the rows load (``check_rows``), never scored.

A sample has one time budget, ``code_exec_timeout`` (+ 0.5 s to start), across all its cases. A case that times
out, runs out of memory, floods its output or fails scores 0; these are counted per call in ``last_failures``
(kinds decided by the parent, see ``sandbox_result``) for the trainer to log.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from grpokit.errors import ConfigError
from grpokit.rewards import grader, isolation
from grpokit.rewards.base import ORM, orms
from grpokit.rewards.grading_pool import GraderPool
from grpokit.rewards.sandbox import STARTUP_ALLOWANCE_S, Session, ready, run_job
from grpokit.rewards.sandbox_result import FAILURE_KINDS, SandboxLimits, log_safe

logger = logging.getLogger(__name__)

_FENCE_RE = re.compile(r"```[ \t]*(python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def extract_code(completion: str) -> str:
    """The last fenced python (or bare) code block of the completion, else the whole completion."""
    blocks = _FENCE_RE.findall(completion)
    return blocks[-1][1] if blocks else completion


@functools.lru_cache(maxsize=4096)
def _program(text: str) -> grader.Program:
    return grader.prepare(text)  # rows repeat num_generations times: convert each test file once


def normalize_test_cases(value: Any, index: int) -> list[tuple[str, str]] | grader.Program | None:
    """Stdin cases as (input, output) pairs, test code as a converted ``grader.Program``, or None (no tests);
    ValueError (one line naming the row) for test code the grader cannot run in the trainer."""
    if value is None:
        return None
    if isinstance(value, str):
        text = value.strip()
        if text[:1] in "[{":
            try:
                return normalize_test_cases(json.loads(text), index)
            except json.JSONDecodeError:
                pass  # not JSON: Python statements (a dict/list literal would fail the assert check below too)
        if not text:
            return None
        try:
            return _program(text)
        except grader.Unconvertible as exc:
            raise ValueError(f"test_cases[{index}]: {exc}") from None
    if isinstance(value, dict) and "inputs" in value and "outputs" in value:
        value = [{"input": i, "output": o} for i, o in zip(value["inputs"], value["outputs"], strict=True)]
    elif isinstance(value, dict):
        value = [value]
    if isinstance(value, (list, tuple)):
        cases = []
        for k, case in enumerate(value):
            if not isinstance(case, dict) or "input" not in case or "output" not in case:
                raise ValueError(f"test_cases[{index}][{k}]: need a dict with 'input' and 'output', got {case!r:.80}")
            cases.append((str(case["input"]), str(case["output"])))
        return cases or None
    raise ValueError(
        f"test_cases[{index}]: need a list of {{'input', 'output'}} dicts or assert statements, "
        f"got {type(value).__name__}"
    )


def same_output(actual: str, expected: str) -> bool:
    """Line-by-line equality, ignoring trailing spaces on each line and blank lines at either end."""

    def norm(s: str) -> list[str]:
        return [line.rstrip() for line in s.replace("\r\n", "\n").strip("\n").split("\n")]

    return norm(actual) == norm(expected)


class CodeExecReward(ORM):
    """Pass rate of the completion's code on the row's ``test_cases``, run in a local sandbox."""

    def __init__(
        self, code_exec_timeout: float = 5.0, code_exec_memory_mb: int = 512, code_exec_workers: int | None = None,
        code_exec_isolation: str = "bwrap",
    ) -> None:  # fmt: skip
        super().__init__()
        if not float(code_exec_timeout) > 0:
            raise ConfigError(f"--code_exec_timeout {code_exec_timeout}: must be > 0 seconds")
        if int(code_exec_memory_mb) < 32:
            raise ConfigError(f"--code_exec_memory_mb {code_exec_memory_mb}: must be ≥ 32 (Python itself needs ~20 MB)")
        workers = min(4, os.cpu_count() or 1) if code_exec_workers is None else int(code_exec_workers)
        if workers < 1:
            raise ConfigError(f"--code_exec_workers {code_exec_workers}: must be ≥ 1")
        try:
            self.runtime = ready(str(code_exec_isolation))
        except isolation.IsolationUnavailable as exc:
            raise ConfigError(str(exc)) from None
        if self.runtime.mode == "none":
            logger.warning(
                "code_exec: --code_exec_isolation none: untrusted code runs WITHOUT isolation (no "
                "namespaces, no seccomp); it can read and write what this user can and reach the network"
            )
        self.sandbox = isolation.describe(self.runtime)  # which protections are active (for logs)
        self.limits = SandboxLimits(timeout_s=float(code_exec_timeout), memory_mb=int(code_exec_memory_mb))
        self.workers = workers
        self.graders = GraderPool(workers, score_sample)
        self.last_failures: dict[str, int] = dict.fromkeys(FAILURE_KINDS, 0)

    def check_rows(self, rows: Any) -> None:
        """Refuse, before training, a row whose tests the grader cannot run in the trainer (one line, the row)."""
        if "test_cases" not in getattr(rows, "column_names", ["test_cases"]):
            return
        for i, row in enumerate(rows):
            try:
                normalize_test_cases(row.get("test_cases"), i)
            except ValueError as exc:
                raise ConfigError(f"--reward_funcs code_exec: dataset row {i}: {exc}; fix or drop the row") from None

    def __call__(self, completions: list[str], test_cases: list[Any], **kwargs: Any) -> list[float | None]:
        normalized = [normalize_test_cases(v, i) for i, v in enumerate(test_cases)]
        if len(normalized) != len(completions):
            raise ValueError(f"test_cases has {len(normalized)} rows for {len(completions)} completions")
        jobs = [(i, c, t) for i, (c, t) in enumerate(zip(completions, normalized)) if t is not None]
        scores: list[float | None] = [None] * len(completions)
        total: Counter = Counter()

        def grade(job: tuple) -> tuple[float, Counter]:  # one budget per sample, from when its grading starts
            budget = self.limits.timeout_s + STARTUP_ALLOWANCE_S
            return self.graders.grade(job[1], job[2], self.limits, self.runtime, budget)

        with ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="code-exec") as pool:
            for (i, _, _), (score, failures) in zip(jobs, pool.map(grade, jobs)):
                scores[i] = score
                total.update(failures)
        self.last_failures = {k: total.get(k, 0) for k in FAILURE_KINDS}
        return scores

    def close(self) -> None:
        """Stop the grader processes (the run's end kills them otherwise)."""
        self.graders.close()

    def __getstate__(self) -> dict:  # a copy (a reward worker's) starts graders of its own
        return {**self.__dict__, "graders": GraderPool(self.workers, score_sample)}

    @property
    def last_metrics(self) -> dict[str, int]:
        """Logged by the trainer as rewards/code_exec/sandbox_<kind> each step."""
        return {f"sandbox_{k}": v for k, v in self.last_failures.items()}


def score_sample(completion: str, cases: list[tuple[str, str]] | grader.Program, limits: SandboxLimits,
                 runtime: isolation.Runtime, deadline: float) -> tuple[float, Counter]:  # fmt: skip
    """One sample's (score, failure counts), by the deadline (run in a grader process, ``grading_pool``). A
    sample that breaks the grading (an OSError of the host, a bug) scores 0 and is counted."""
    try:
        return _score(extract_code(completion), cases, limits, runtime, deadline)
    except Exception as exc:  # noqa: BLE001
        logger.warning(
            "code_exec: a sample could not be graded (%s: %s); it scores 0", type(exc).__name__, log_safe(exc)
        )
        return 0.0, Counter(error=1)


def _score(code: str, cases: list[tuple[str, str]] | grader.Program, limits: SandboxLimits, runtime: isolation.Runtime,
           deadline: float) -> tuple[float, Counter]:  # fmt: skip
    failures: Counter = Counter()
    if isinstance(cases, grader.Program):
        with Session(code, limits, runtime, serve=True, deadline=deadline) as session:
            served = session.ready  # the program ran to its end; else it failed (or exited) before the tests
            result = grader.grade(cases, session.call, deadline) if served else grader.Grade(0, 1)
        res = session.result()
        if res.status != "ok" or not served:
            failures[res.status if res.status != "ok" else "error"] += 1
        return result.score, failures
    passed = 0
    for stdin, expected in cases:
        if time.monotonic() >= deadline:
            failures["timeout"] += 1
            break
        res = run_job(code, stdin=stdin, limits=limits, rt=runtime, deadline=deadline)
        if res.status != "ok":
            failures[res.status] += 1
            if res.status == "timeout":
                break
        elif same_output(res.stdout, expected):
            passed += 1
    return passed / len(cases), failures


orms["code_exec"] = CodeExecReward
