"""code_exec: pass rates, and hostile code that must fail without harming the host."""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import time
import uuid

import pytest

from grpokit.errors import ConfigError
from grpokit.rewards import isolation, orms
from grpokit.rewards.code_exec import CodeExecReward, extract_code, normalize_test_cases, same_output
from grpokit.rewards.sandbox import live_sandbox_processes, ready, run_python, sandbox_layers


def _isolation_missing() -> str | None:
    try:
        isolation.resolve("bwrap")
    except OSError as exc:
        return str(exc)
    return None


pytestmark = pytest.mark.skipif(_isolation_missing() is not None, reason=str(_isolation_missing()))

DOUBLE = [{"input": "2\n", "output": "4\n"}, {"input": "21\n", "output": "42"}]


def fenced(code: str) -> str:
    return f"Here is my solution:\n```python\n{code}\n```\nDone."


def sandbox_processes() -> list[int]:
    """Live processes of THIS test process's sandboxes (by slot uid as root, else by descent), so a second copy of
    the suite running on the same host neither shows up here nor hides a leak of ours."""
    return live_sandbox_processes()


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
    start = time.monotonic()
    out = reward([fenced("while True:\n    pass")], test_cases=[DOUBLE])
    elapsed = time.monotonic() - start
    assert out == [0.0]
    assert reward.last_failures["timeout"] == 1  # the second case is not run after a timeout
    assert elapsed < 1 + 0.5 + 2.0  # timeout + start-up allowance + slack for a loaded machine
    assert sandbox_processes() == []


def test_memory_bomb(reward):
    out = reward([fenced("x = bytearray(10**10)"), fenced("a = []\nwhile True:\n    a.append(' ' * 10**6)")],
                 test_cases=[[DOUBLE[0]]] * 2)  # fmt: skip
    assert out == [0.0, 0.0]
    assert reward.last_failures["memory"] == 1  # the one that grew; the other was refused before it held anything
    assert reward.last_failures["error"] == 1
    claims = fenced("import os, sys\nprint('MemoryError', file=sys.stderr)\nfor fd in range(3, 64):\n    try:\n"
                    "        os.write(fd, b'{\"exception\": \"MemoryError\"}\\n')\n    except OSError:\n        pass\n"
                    "raise MemoryError")  # fmt: skip
    assert reward([claims], test_cases=[[DOUBLE[0]]]) == [0.0]
    assert reward.last_failures["memory"] == 0 and reward.last_failures["error"] == 1


def test_fork_bomb_leaves_no_processes(reward):
    bombs = [
        fenced("import os\nwhile True:\n    os.fork()"),
        fenced("import subprocess\nsubprocess.Popen(['sleep', '60'])"),
        fenced("import os\nos.system('sleep 60 &')"),
        fenced("import multiprocessing as mp\nmp.Process(target=print).start()"),
    ]
    out = reward(bombs, test_cases=[[DOUBLE[0]]] * 4)
    assert out == [0.0] * 4
    assert sum(reward.last_failures.values()) == 4
    assert sandbox_processes() == []


def test_network_is_blocked(reward):
    code = "import socket\ns = socket.socket()\ns.connect(('127.0.0.1', 9))\nprint(4)"  # loopback only, ever
    sneaky = "import socket\ntry:\n    socket.getaddrinfo('localhost', 80)\nexcept Exception:\n    pass\nprint(4)"
    assert reward([fenced(code), fenced(sneaky)], test_cases=[[DOUBLE[0]]] * 2) == [0.0, 0.0]
    assert reward.last_failures["error"] + reward.last_failures["crash"] == 2  # a caught refusal still fails


def test_writes_stay_inside_the_sandbox(reward):
    # /tmp inside is a private tmpfs: the write "succeeds" there, and the host's /tmp never sees it
    target = os.path.join(tempfile.gettempdir(), f"grpokit-escape-{uuid.uuid4().hex}.txt")
    private = f"open({target!r}, 'w').write('pwned')\nprint(4)"
    read_only = "open('/usr/grpokit-escape.txt', 'w').write('pwned')\nprint(4)"
    via_symlink = "import os\nos.symlink('/etc/grpokit-escape', 'link')\nopen('link', 'w').write('pwned')\nprint(4)"
    inside = "open('scratch.txt', 'w').write('4')\nprint(open('scratch.txt').read())"
    out = reward([fenced(private), fenced(read_only), fenced(via_symlink), fenced(inside)],
                 test_cases=[[DOUBLE[0]]] * 4)  # fmt: skip
    assert out == [1.0, 0.0, 0.0, 1.0]
    assert not os.path.exists(target) and not os.path.exists("/usr/grpokit-escape.txt")
    assert not os.path.exists("/etc/grpokit-escape")
    assert reward.last_failures["error"] == 2  # read-only file system


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


def test_os_layers():
    layers = sandbox_layers()
    assert layers["isolation"] == "bwrap" and layers["seccomp"] and layers["network_namespace"]
    res = run_python(
        "import os\nprint(open('/proc/self/uid_map').read().split()[1])\n"
        "print(sorted([l.split(':')[0].strip() for l in open('/proc/net/dev') if ':' in l]))\n"
        "print(sorted(p for p in os.listdir('/proc') if p.isdigit()))"
    )
    assert res.status == "ok", res.stderr
    uid_line, interfaces, pids = res.stdout.splitlines()
    if os.geteuid() == 0:  # uid 0 of its own user namespace, without capabilities, is a slot uid of the host
        assert int(uid_line) in isolation.resolve("bwrap").slot_uids()  # its own uid, not root, not nobody
    assert interfaces == "['lo']"  # an empty network namespace
    assert pids == "['1']"  # a fresh /proc: the program is pid 1 of its own namespace, nothing of the host


def test_isolation_refuses_without_bwrap(monkeypatch, caplog):
    monkeypatch.setattr(isolation.shutil, "which", lambda name: None)
    monkeypatch.setattr(isolation.os.path, "exists", lambda p: False if p == "/usr/bin/bwrap" else os.path.lexists(p))
    isolation.resolve.cache_clear()
    ready.cache_clear()
    try:
        with pytest.raises(ConfigError, match=r"bubblewrap is missing; install it with `apt-get install bubblewrap`"):
            CodeExecReward(code_exec_isolation="bwrap")
        with pytest.raises(ConfigError, match="choose one of bwrap, none"):
            CodeExecReward(code_exec_isolation="docker")
        caplog.set_level("WARNING")
        unsafe = CodeExecReward(code_exec_isolation="none", code_exec_timeout=2)
        assert "WITHOUT isolation" in caplog.text
        assert unsafe([fenced("print(int(input()) * 2)")], test_cases=[DOUBLE]) == [1.0]
    finally:
        isolation.resolve.cache_clear()
        ready.cache_clear()


def test_refuses_in_one_line_when_bwrap_cannot_build_the_sandbox(monkeypatch):
    folder = tempfile.mkdtemp(prefix="grpokit-fake-bwrap-")
    try:
        os.chmod(folder, 0o755)
        fake = os.path.join(folder, "bwrap")
        with open(fake, "w") as f:
            f.write("#!/bin/sh\necho 'bwrap: No permissions to creating new namespace' >&2\nexit 1\n")
        os.chmod(fake, 0o755)
        real = isolation.resolve("bwrap")
        monkeypatch.setattr(isolation, "resolve", lambda mode="bwrap": dataclasses.replace(real, bwrap=fake))
        ready.cache_clear()
        with pytest.raises(ConfigError) as err:
            CodeExecReward()
        msg = str(err.value)
        assert "\n" not in msg and "does not start on this host: bwrap: No permissions" in msg
        assert "unprivileged user namespaces" in msg
    finally:
        ready.cache_clear()
        shutil.rmtree(folder, ignore_errors=True)


def test_assert_grading_happens_in_the_parent(reward):
    tests = "expected = 8191\nassert f(13) == expected\nassert abs(g(1) - 0.25) < 1e-9\nassert h() == 3"
    liar = (
        "import builtins\nclass Yes:\n    def __eq__(self, o): return True\n    def __lt__(self, o): return True\n"
        "builtins.abs = lambda x: Yes()\ndef f(n): return Yes()\ndef g(n): return 7\ndef h(): return 3"
    )
    right = "def f(n): return 2 ** n - 1\ndef g(n): return 0.25\ndef h(): return 3"
    assert reward([fenced(liar), fenced(right)], test_cases=[tests, tests]) == pytest.approx([1 / 3, 1.0])


def test_api_keys_on_the_command_line_warn(caplog, tmp_path):
    # issue 17, class 6: a key in argv is readable by every process on the host through /proc/PID/cmdline
    from grpokit.config.parse import parse_train_args
    from grpokit.server.cli import options_from_argv

    caplog.set_level("WARNING")
    with pytest.raises(ConfigError):  # the model folder is missing; the warning comes first
        parse_train_args(["--model", str(tmp_path / "none"), "--vllm_server_api_key", "k"])
    assert "--vllm_server_api_key on the command line" in caplog.text and "GRPOKIT_API_KEY" in caplog.text
    caplog.clear()
    assert options_from_argv(["--model", "m", "--api_key", "k"]).api_key == "k"
    assert "--api_key on the command line" in caplog.text
    caplog.clear()
    options_from_argv(["--model", "m"])
    assert "command line" not in caplog.text


def test_many_slots_at_once():
    # 8 threads share the parent's fd table: each run must close exactly its own pipes
    from concurrent.futures import ThreadPoolExecutor

    from grpokit.rewards.sandbox import SandboxLimits, run_job

    lim = SandboxLimits(timeout_s=5, memory_mb=128)
    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda i: run_job(f"print({i} * 2)", limits=lim).stdout, range(24)))
    assert outs == [f"{i * 2}\n" for i in range(24)]
    assert sandbox_processes() == []


@pytest.mark.skipif(os.geteuid() != 0, reason="the fallback is for root")
def test_root_falls_back_when_user_namespaces_are_off(monkeypatch, caplog):
    from grpokit.rewards import sandbox

    real = sandbox._trial
    monkeypatch.setattr(sandbox, "_trial", lambda rt: real(rt) if rt.privileged else "bwrap: setting up uid map")
    sandbox.ready.cache_clear()
    caplog.set_level("INFO")
    try:
        rt = sandbox.ready("bwrap")
        assert rt.privileged and "bubblewrap runs as root" in caplog.text
        res = sandbox.run_job("import os\nprint(os.getuid())", rt=rt)
        assert int(res.stdout) in rt.slot_uids()
    finally:
        sandbox.ready.cache_clear()


def test_one_time_budget_per_sample(reward):
    """Ten stdin cases that each take most of the limit: the sample stops at its budget, not at ten limits."""
    slow = fenced("import time\ntime.sleep(0.6)\nprint(int(input()) * 3)")
    start = time.monotonic()
    assert reward([slow], test_cases=[[DOUBLE[0]] * 10]) == [0.0]
    assert time.monotonic() - start < 1 + 0.5 + 1.0  # timeout + start-up allowance + slack
    assert reward.last_failures["timeout"] == 1


def test_the_program_cannot_pick_its_failure_kind(reward):
    codes = [fenced(f"import os\nos._exit({rc})") for rc in (137, 152, 159, 153)]
    assert reward(codes, test_cases=[[DOUBLE[0]]] * 4) == [0.0] * 4
    assert reward.last_failures["timeout"] == 0 and reward.last_failures["output_limit"] == 0
    assert reward.last_failures["crash"] == 4


def test_rows_with_tests_the_grader_cannot_run_are_refused(reward):
    rows = [{"test_cases": "assert f(1) == 1"}, {"test_cases": DOUBLE}, {"test_cases": "import os\nassert f(1)"}]
    with pytest.raises(ConfigError, match=r"code_exec: dataset row 2: test_cases\[2\]: import of 'os'") as err:
        reward.check_rows(rows)
    assert "\n" not in str(err.value)
    reward.check_rows(rows[:2])


def test_test_code_imports_the_program_so_its_main_guard_does_not_run(reward):
    program = fenced("def f(n):\n    return n + 1\nif __name__ == '__main__':\n    print(f(int(input())))")
    assert reward([program], test_cases=["from solution import f\nassert f(1) == 2"]) == [1.0]


def test_graders_killed_at_the_end_of_a_run_are_replaced():
    from grpokit.rewards.descendants import descendants, kill_new

    before = descendants()
    reward = orms["code_exec"](code_exec_timeout=5)
    code = fenced("def f(n):\n    return 2 ** n - 1")
    assert reward([code], test_cases=["assert f(13) == 8191"]) == [1.0]
    assert kill_new(before) >= 1  # what the end of a run does to the processes it started: the grader goes too
    assert reward([code], test_cases=["assert f(13) == 8191"]) == [1.0]  # a fresh grader takes its place
    reward.close()
