"""code_exec: pass rates, and hostile code that must fail without harming the host."""

from __future__ import annotations

import glob
import os
import resource
import shutil
import tempfile
import uuid

import pytest

from grpokit.errors import ConfigError
from grpokit.rewards import orms
from grpokit.rewards.code_exec import CodeExecReward, extract_code, normalize_test_cases, same_output
from grpokit.rewards.sandbox import STARTUP_ALLOWANCE_S, run_python, sandbox_layers

pytestmark = pytest.mark.skipif(os.name != "posix", reason="the sandbox needs Linux")

DOUBLE = [{"input": "2\n", "output": "4\n"}, {"input": "21\n", "output": "42"}]


def fenced(code: str) -> str:
    return f"Here is my solution:\n```python\n{code}\n```\nDone."


@pytest.fixture(scope="module", autouse=True)
def sandbox_temp_root(tmp_path_factory):
    """This module's sandboxes make their work folders in a folder of their own, whose path is therefore in their
    command lines (and in those of anything they fork, even once orphaned): `sandbox_processes` finds this test
    run's sandboxes by it, not those of another copy of the suite running on the same machine. World-writable
    and sticky like /tmp, so that a write outside a sandbox's work folder is refused by the sandbox, not by the
    folder's permissions."""
    tmp_path_factory.getbasetemp()  # pytest places its own temporary folders by tempfile too: settle it first
    root = tempfile.mkdtemp(prefix="grpokit-test-sandboxes-")
    os.chmod(root, 0o1777)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tempfile, "tempdir", root)
        yield root
    shutil.rmtree(root, ignore_errors=True)


def sandbox_processes() -> list[str]:
    """Command lines of live processes running the sandbox child script for this test run."""
    marker = os.path.join(tempfile.gettempdir(), "grpokit-sbx-")
    assert "grpokit-test-sandboxes-" in marker  # set by sandbox_temp_root
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "_sandbox_child.py" in cmd and marker in cmd:
            found.append(cmd)
    return found


@pytest.fixture(scope="module")
def reward():
    return CodeExecReward(code_exec_timeout=1, code_exec_memory_mb=128, code_exec_workers=2)


def test_stdin_cases_right_wrong_partial_empty(reward):
    completions = [
        fenced("print(int(input()) * 2)"),  # both cases -> 1.0
        fenced("print(int(input()) + 2)"),  # 2+2 = 4 passes, 21+2 fails -> 0.5
        fenced("print(int(input()) * 3)"),  # wrong -> 0.0
        fenced("print(int(input()) * 2"),  # syntax error -> 0.0
        "",  # empty -> 0.0
    ]
    assert reward(completions, test_cases=[DOUBLE] * 5) == [1.0, 0.5, 0.0, 0.0, 0.0]
    assert reward.last_failures["error"] == 2 * 1  # the syntax error fails both of its cases
    assert reward.last_failures["timeout"] == 0


def test_assert_cases_and_formats(reward):
    asserts = "assert square(2) == 4\nassert square(-3) == 9\nassert square(0) == 1"
    completions = [
        fenced("def square(x):\n    return x * x"),  # 2 of 3 asserts (the third is deliberately wrong) -> 2/3
        "def square(x): return x + 2",  # no fence: whole text; square(2) == 4 only -> 1/3
        fenced("import os\nos._exit(0)"),  # exits before the asserts run: cannot fake a pass -> 0
        fenced("print('x')"),  # 3 lines of stdin-style output mean nothing for asserts -> 0
        fenced("print(int(input()) * 2)"),
        fenced("print(1)"),
    ]
    test_cases = [asserts, asserts, asserts, asserts, '[{"input": "5", "output": "10"}]', None]  # JSON text; None
    out = reward(completions, test_cases=test_cases)
    assert out[:5] == pytest.approx([2 / 3, 1 / 3, 0.0, 0.0, 1.0])
    assert out[5] is None  # no tests: not scored


def test_infinite_loop_is_stopped_at_its_limit(reward):
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = reward([fenced("while True:\n    pass")], test_cases=[DOUBLE])
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert out == [0.0]
    assert reward.last_failures["timeout"] == 1  # the second case is not run after a timeout
    # the CPU time the loop got, not the wall time: a loaded machine gives it less of a core, never more than
    # its 1 s limit plus the interpreter's start-up
    used = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    assert used < 1 + STARTUP_ALLOWANCE_S
    assert sandbox_processes() == []


def test_sandbox_processes_sees_this_runs_sandboxes_and_no_others(tmp_path):
    import subprocess
    import sys

    # stand-ins whose command lines look like a sandbox's: one of this run, one of another copy of the suite
    ours = os.path.join(tempfile.gettempdir(), "grpokit-sbx-leaked")
    theirs = os.path.join(str(tmp_path), "grpokit-sbx-other-run")
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "_sandbox_child.py", work])
             for work in (ours, theirs)]
    try:
        assert [cmd.split()[-1] for cmd in sandbox_processes()] == [ours]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert sandbox_processes() == []


def test_memory_bomb(reward):
    out = reward([fenced("x = bytearray(10**10)"), fenced("a = []\nwhile True:\n    a.append(' ' * 10**6)")],
                 test_cases=[[DOUBLE[0]]] * 2)  # fmt: skip
    assert out == [0.0, 0.0]
    assert reward.last_failures["memory"] == 2


def test_fork_bomb_leaves_no_processes(reward):
    bombs = [
        fenced("import os\nwhile True:\n    os.fork()"),
        fenced("import subprocess\nsubprocess.Popen(['sleep', '60'])"),
        fenced("import os\nos.system('sleep 60 &')"),
        fenced("import multiprocessing as mp\nmp.Process(target=print).start()"),
    ]
    out = reward(bombs, test_cases=[[DOUBLE[0]]] * 4)
    assert out == [0.0] * 4
    assert reward.last_failures["blocked"] == 4
    assert sandbox_processes() == []


def test_network_is_blocked(reward):
    code = "import socket\ns = socket.socket()\ns.connect(('1.1.1.1', 80))\nprint(4)"
    sneaky = "import socket\ntry:\n    socket.getaddrinfo('example.com', 80)\nexcept Exception:\n    pass\nprint(4)"
    assert reward([fenced(code), fenced(sneaky)], test_cases=[[DOUBLE[0]]] * 2) == [0.0, 0.0]
    assert reward.last_failures["blocked"] == 2  # a caught refusal still fails the case


def test_writes_outside_the_workdir_fail_and_inside_work(reward):
    target = os.path.join(tempfile.gettempdir(), f"grpokit-escape-{uuid.uuid4().hex}.txt")
    escape = f"open({target!r}, 'w').write('pwned')\nprint(4)"
    via_symlink = f"import os\nos.symlink({target!r}, 'link')\nopen('link', 'w').write('pwned')\nprint(4)"
    inside = "open('scratch.txt', 'w').write('4')\nprint(open('scratch.txt').read())"
    before = set(glob.glob(os.path.join(tempfile.gettempdir(), "grpokit-sbx-*")))
    out = reward([fenced(escape), fenced(via_symlink), fenced(inside)], test_cases=[[DOUBLE[0]]] * 3)
    assert out == [0.0, 0.0, 1.0]
    assert not os.path.exists(target)
    assert reward.last_failures["blocked"] == 2
    assert set(glob.glob(os.path.join(tempfile.gettempdir(), "grpokit-sbx-*"))) == before  # work dirs removed


def test_output_flood_is_capped(reward):
    assert reward([fenced("while True:\n    print('x' * 10000)")], test_cases=[[DOUBLE[0]]]) == [0.0]
    assert reward.last_failures["output_limit"] == 1


def test_helpers_and_bad_input():
    assert extract_code("```py\na = 1\n```\n```python\nb = 2\n```") == "b = 2\n"
    assert extract_code("plain") == "plain"
    assert same_output("4  \n\n", "4") and not same_output("4", "5")
    assert normalize_test_cases({"inputs": ["1"], "outputs": ["2"]}, 0) == [("1", "2")]
    assert normalize_test_cases([], 0) is None
    with pytest.raises(ValueError, match=r"test_cases\[3\]: not valid Python"):
        normalize_test_cases("assert (", 3)
    with pytest.raises(ValueError, match=r"test_cases\[0\]\[0\]"):
        normalize_test_cases([{"in": "1"}], 0)
    with pytest.raises(ConfigError, match="code_exec_memory_mb"):
        CodeExecReward(code_exec_memory_mb=1)
    assert orms["code_exec"] is CodeExecReward


def test_os_layers_when_available():
    # Below the audit hook: with root, the child runs as nobody in an empty network namespace.
    layers = sandbox_layers()
    res = run_python("import os\nprint(os.getuid())\nprint(open('/proc/net/dev').read())")
    assert res.status == "ok"
    uid_line, net_dev = res.stdout.split("\n", 1)
    assert int(uid_line) == layers["uid"]
    interfaces = [line.split(":")[0].strip() for line in net_dev.splitlines() if ":" in line]
    if layers["network_namespace"]:
        assert interfaces == ["lo"]  # no route out even for code that got past the hook
