"""Rewards (and a grader) that tests run in worker processes: a module that imports no torch, so that a worker,
which imports the module of its function, starts in a fraction of a second."""

from __future__ import annotations

import ctypes
import os
import pickle
import re
import subprocess
import threading
from pathlib import Path


def length_reward(completions, **kwargs):
    return [float(len(c)) for c in completions]


def hanging_sync(completions, **kwargs):
    threading.Event().wait(30)  # longer than any test waits: only the timeout ends the call
    return [0.0] * len(completions)


def where_it_runs(completions, **kwargs):
    return [float(os.getpid() if threading.current_thread() is threading.main_thread() else -1)] * len(completions)


def sleeps_in_c_holding_the_gil(completions, **kwargs):
    ctypes.PyDLL(None).sleep(120)  # PyDLL keeps the GIL for the whole foreign call
    return [1.0] * len(completions)


def backtracking_regex(completions, **kwargs):
    return [float(bool(re.match(r"(a*)*b", "a" * 40)))] * len(completions)  # one C call, hours long, with the GIL


def starts_a_server_and_hangs(completions, pid_file, **kwargs):
    for session in (False, True):  # in the worker's process group, and in a session of its own
        proc = subprocess.Popen(["sleep", "300"], start_new_session=session)
        with open(pid_file[0], "a") as f:
            f.write(f"{proc.pid}\n")
    threading.Event().wait(120)
    return [0.0] * len(completions)


def raises_on_bad(completions, calls, **kwargs):
    with open(calls[0], "a") as f:
        f.write(f"{len(completions)}\n")
    if any(c == "bad" for c in completions):
        raise ValueError("cannot score bad")
    return [1.0] * len(completions)


def grader_that_hangs_in_c(conn):
    """A grader process stuck in C holding its GIL, with a child of its own (stands for any grading that overruns:
    hashing colliding values, big-integer math, a regex over a completion)."""
    from grpokit.rewards import processes

    processes.detach()
    conn.send("ready")
    pid_file = pickle.loads(conn.recv_bytes())[0]
    child = subprocess.Popen(["sleep", "300"])
    Path(pid_file).write_text(f"{os.getpid()} {child.pid}")
    ctypes.PyDLL(None).sleep(300)
