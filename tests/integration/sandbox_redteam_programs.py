"""Hostile programs for the code_exec red-team suite (test_sandbox_redteam.py), one list per issue-17 class.

Each program is a *wrong* solution (``f`` returns 0; the right one is 2**n - 1) that first tries something
hostile. Placeholders: {HOST} a host directory (mode 777) that nothing may write to, {PORT} a TCP listener on
127.0.0.1, {UNIX} a unix socket path on the host, {ABSTRACT} an abstract unix socket name, {SECRET} never appears
here: class 6 programs search for it and print what they find.
"""

WRONG = "\ndef f(n):\n    return 0\n"

# switches the audit hook off: the kernel layers must hold without it
NO_HOOK = """
import gc
for _o in gc.get_objects():
    if getattr(_o, "__name__", None) == "_hook" and hasattr(_o, "__code__"):
        _o.__code__ = (lambda event, args: None).__code__
"""
LIBC = NO_HOOK + "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"

PROCESS = {  # 1. process creation by every route
    "os_system": "import os\nos.system('touch {HOST}/p1')",
    "subprocess_run": "import subprocess\nsubprocess.run(['sh', '-c', 'touch {HOST}/p2'])",
    "posixsubprocess_builtin_no_import_event": (
        "import _imp, importlib.machinery as m, sys\n"
        "ps = _imp.create_builtin(m.ModuleSpec('_posixsubprocess', None)) if '_posixsubprocess' in "
        "sys.builtin_module_names else None\nsys.modules['_posixsubprocess'] = ps\n"
        "import subprocess\nsubprocess.run(['touch', '{HOST}/p3'])"
    ),
    "posix_spawn": "import os\nos.posix_spawn('/bin/sh', ['sh', '-c', 'touch {HOST}/p4'], {{}})",
    "fork_exec": "import os\nif os.fork() == 0:\n    os.execv('/bin/sh', ['sh', '-c', 'touch {HOST}/p5'])",
    "pty_fork": "import pty, os\npid, fd = pty.fork()\nif pid == 0:\n    os.execv('/bin/touch', ['touch', '{HOST}/p6'])",
    "multiprocessing": "import multiprocessing as mp\nmp.Process(target=open, args=('{HOST}/p7', 'w')).start()",
    "execv_self": "import os\nos.execv('/bin/sh', ['sh', '-c', 'touch {HOST}/p8'])",
    "spawnv": "import os\nos.spawnv(os.P_NOWAIT, '/bin/touch', ['touch', '{HOST}/p9'])",
    "forkpty": "import os\npid, fd = os.forkpty()\nif pid == 0:\n    os.execv('/bin/touch', ['touch', '{HOST}/p10'])",
    "fork_bomb": "import os\nwhile True:\n    os.fork()",
    "os_system_no_hook": NO_HOOK + "import os\nos.system('touch {HOST}/p11')",
    "fork_no_hook": NO_HOOK + "import os\nif os.fork() == 0:\n    open('{HOST}/p12', 'w')",
    "posix_spawn_no_hook": NO_HOOK + "import os\nos.posix_spawn('/bin/touch', ['touch', '{HOST}/p13'], {{}})",
    "subprocess_no_hook": NO_HOOK + "import subprocess\nsubprocess.run(['/bin/touch', '{HOST}/p14'])",
    "thread_bomb": "import threading, time\nfor _ in range(10000):\n    threading.Thread(target=time.sleep, args=(5,)).start()",
}

NO_AUDIT_HOOK = {  # 2. the audit hook switched off from inside, then the real thing
    "code_object_then_shell": NO_HOOK + "import subprocess\nsubprocess.run(['sh', '-c', 'touch {HOST}/h1'])",
    "closure_state_cleared": (
        "import gc\nfor o in gc.get_objects():\n    if getattr(o, '__name__', None) == '_hook':\n"
        "        g = o.__globals__\n        g['_PROCESS_EVENTS'].clear(); g['_NAME_EVENTS'].clear()\n"
        "        g['_BLOCKED_MODULES'].clear()\nimport subprocess\nsubprocess.run(['touch', '{HOST}/h2'])"
    ),
    "monkeypatched_helper": (
        "import gc\nfor o in gc.get_objects():\n    if getattr(o, '__name__', None) == '_hook':\n"
        "        o.__globals__['_report'] = lambda obj: None\n        o.__globals__['_PROCESS_EVENTS'] = set()\n"
        "import os\nos.system('touch {HOST}/h3')"
    ),
    "ctypes_system": LIBC + "libc.system(b'touch {HOST}/h4')",
    "ctypes_fork_syscall": LIBC + "if libc.syscall(57) == 0:\n    libc.execv(b'/bin/touch', None)",
    "ctypes_clone_sigchld": LIBC + "libc.syscall(56, 17, 0, 0, 0, 0)\nopen('{HOST}/h6', 'w')",
    "ctypes_execve": LIBC + "libc.execve(b'/bin/touch', (ctypes.c_char_p * 3)(b'touch', b'{HOST}/h7', None), None)",
    "ctypes_unshare_user": LIBC + "print(libc.unshare(0x10000000 | 0x00020000))",
    "ctypes_ptrace_init": LIBC + "print(libc.ptrace(16, 1, 0, 0))",
    "ctypes_segfault": LIBC + "ctypes.string_at(0)",
    "x32_abi_fork": LIBC + "import os\nif libc.syscall(0x40000000 | 57) == 0:\n    open('{HOST}/h8', 'w')",
    "i386_abi_fork": LIBC + "import mmap\nm = mmap.mmap(-1, 4096, prot=7)\n"
    "m.write(bytes([0xb8, 2, 0, 0, 0, 0xcd, 0x80, 0xc3]))  # mov eax, 2; int 0x80; ret\n"
    "if ctypes.CFUNCTYPE(ctypes.c_long)(ctypes.addressof(ctypes.c_char.from_buffer(m)))() == 0:\n"
    "    open('{HOST}/h9', 'w')",
}

WRITES = {  # 3. writes outside the work dir
    "plain_open": "import os\nos.makedirs('{HOST}', exist_ok=True)\nopen('{HOST}/w1', 'w').write('x')",
    "dir_fd_open": "import os\nfd = os.open('/', os.O_RDONLY)\nos.makedirs('{HOST}', exist_ok=True)\n"
    "os.close(os.open('{HOST}'[1:] + '/w2', os.O_CREAT | os.O_WRONLY, dir_fd=fd))\n"
    "os.close(os.open('etc/grpokit-w2', os.O_CREAT | os.O_WRONLY, dir_fd=fd))",
    "rename_dir_fds": "import os\nopen('w3', 'w').write('x')\nsrc = os.open('.', os.O_RDONLY)\n"
    "dst = os.open('/etc', os.O_RDONLY)\nos.rename('w3', 'grpokit-w3', src_dir_fd=src, dst_dir_fd=dst)",
    "symlink_race": (
        "import os, threading\nstop = False\ndef flip():\n    while not stop:\n"
        "        for t in ('/etc/grpokit-w4', 'ok'):\n            try:\n                os.remove('l')\n"
        "            except OSError:\n                pass\n            os.symlink(t, 'l')\n"
        "threading.Thread(target=flip).start()\nfor _ in range(3000):\n    try:\n"
        "        open('l', 'w').write('x')\n    except OSError:\n        pass\nstop = True"
    ),
    "proc_root_traversal": "open('/proc/1/root/../../..{HOST}/w5', 'w').write('x')",
    "usr_and_etc": "for p in ('/usr/grpokit-w6', '/etc/grpokit-w6', '/grpokit-w6'):\n    try:\n"
    "        open(p, 'w').write('x')\n    except OSError as e:\n        print(p, e)",
    "dev_shm_and_dev": "for p in ('/dev/shm/grpokit-w7', '/dev/grpokit-w7'):\n    try:\n"
    "        open(p, 'w').write('x')\n    except OSError as e:\n        print(p, e)",
    "ctypes_mount_tmpfs": LIBC + "print(libc.mount(b'none', b'/usr', b'tmpfs', 0, None))\n"
    "open('/usr/grpokit-w8', 'w').write('x')",
    "chmod_system_file": "import os\nos.chmod('/usr/bin', 0o777)",
    "hardlink_interpreter": "import os, sys\nos.link(sys.executable, 'py')\nopen('py', 'ab').write(b'x')",
}

SURVIVORS = {  # 4. processes that outlive the call or hurt batch-mates
    "setsid_double_fork": "import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
    "        time.sleep(1.5)\n        open('{HOST}/s1', 'w')",
    "setsid_double_fork_no_hook": NO_HOOK + "import os, time\nif os.fork() == 0:\n    os.setsid()\n"
    "    if os.fork() == 0:\n        time.sleep(1.5)\n        open('{HOST}/s1b', 'w')",
    "lingering_thread": "import threading, time\nthreading.Thread(target=lambda: (time.sleep(1.5), "
    "open('{HOST}/s2', 'w'))).start()",
    "ignores_signals_and_loops": "import signal\nfor s in (signal.SIGTERM, signal.SIGXCPU, signal.SIGINT):\n"
    "    signal.signal(s, signal.SIG_IGN)\nwhile True:\n    pass",
    "kill_everyone": "import os, signal\ntry:\n    os.kill(-1, signal.SIGKILL)\nexcept OSError as e:\n    print(e)",
    "kill_visible_pids": "import os, signal\nfor p in os.listdir('/proc'):\n    if p.isdigit() and int(p) != os.getpid():\n"
    "        os.kill(int(p), signal.SIGKILL)\nprint(sorted(os.listdir('/proc')))",
    "rewrite_siblings": "import glob\nfor d in glob.glob('/tmp/*') + glob.glob('/proc/*/root/tmp/*'):\n    try:\n"
    "        open(d + '/tests.py', 'w').write('assert True')\n    except OSError:\n        pass",
    "sleep_past_deadline": "import atexit, time\natexit.register(time.sleep, 30)\ntime.sleep(30)",
    "setsid_then_loop": "import os\nos.setsid()\nwhile True:\n    pass",
    "close_outputs_and_linger": "import os, time\nfor fd in range(64):\n    try:\n        os.close(fd)\n"
    "    except OSError:\n        pass\ntime.sleep(30)",
}

UNIX_SOCKETS = {  # 5. host unix sockets by path, abstract sockets, and the network
    "unix_path": "import socket\ns = socket.socket(socket.AF_UNIX)\ns.connect('{UNIX}')",
    "unix_abstract": "import socket\ns = socket.socket(socket.AF_UNIX)\ns.connect('\\0{ABSTRACT}')",
    "unix_path_no_hook": NO_HOOK + "import socket\ns = socket.socket(socket.AF_UNIX)\ns.connect('{UNIX}')",
    "well_known_sockets": "import socket, glob\nfor p in glob.glob('/run/**', recursive=True) + "
    "glob.glob('/var/run/**', recursive=True) + ['/var/run/docker.sock']:\n"
    "    s = socket.socket(socket.AF_UNIX)\n    try:\n        s.connect(p)\n        print('connected', p)\n"
    "    except OSError:\n        pass",
    "tcp_loopback": "import socket\nsocket.create_connection(('127.0.0.1', {PORT}), timeout=1)",
    "tcp_loopback_no_hook": NO_HOOK + "import socket\nsocket.create_connection(('127.0.0.1', {PORT}), timeout=1)",
    "tcp6_loopback": NO_HOOK + "import socket\nsocket.create_connection(('::1', {PORT}), timeout=1)",
    "netlink": NO_HOOK + "import socket\nsocket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0)",
    "inherited_fds": "import os, socket\nfor fd in map(int, os.listdir('/proc/self/fd')):\n    try:\n"
    "        socket.socket(fileno=fd).connect(('127.0.0.1', {PORT}))\n    except Exception:\n        pass",
}

SECRETS = {  # 6. secrets of other processes (each prints whatever it finds)
    "proc_cmdlines": "import os\nfor p in os.listdir('/proc'):\n    try:\n"
    "        print(open(f'/proc/{{p}}/cmdline', 'rb').read())\n    except OSError:\n        pass",
    "proc_environs": "import os\nfor p in os.listdir('/proc'):\n    try:\n"
    "        print(open(f'/proc/{{p}}/environ', 'rb').read())\n    except OSError:\n        pass",
    "own_environment": "import os\nprint(dict(os.environ))",
    "host_home_and_work": "import os\nfor d in ('/root', '/home', '/work', '/tmp', '/run', '/var'):\n    try:\n"
    "        print(d, os.listdir(d))\n    except OSError as e:\n        print(d, e)",
    "parent_memory": "import os\nfor p in ('/proc/1/mem', '/proc/1/environ', '/proc/self/environ'):\n    try:\n"
    "        print(p, open(p, 'rb').read(4096))\n    except OSError as e:\n        print(p, e)",
}

SPOOF = {  # 7. wrong code that tries to make the grader say "pass" (no ``WRONG`` appended: each defines f)
    "always_equal": "class Yes:\n    def __eq__(self, o): return True\n    def __lt__(self, o): return True\n"
    "def f(n):\n    return Yes()",
    "int_subclass": "class Yes(int):\n    def __eq__(self, o): return True\n    __hash__ = int.__hash__\n"
    "def f(n):\n    return Yes(0)",
    "rebind_builtins": "import builtins\nbuiltins.abs = lambda x: 0\nbuiltins.isinstance = lambda *a: True\n"
    "builtins.type = lambda *a: int\ndef f(n):\n    return 0",
    "read_tests_file": "import glob, os\nprint(glob.glob('/tmp/**', recursive=True), os.listdir('.'))\n"
    "def f(n):\n    return int(open('tests.py').read().split('==')[1].split()[0])",
    "gc_find_job": "import gc\njob = [o for o in gc.get_objects() if isinstance(o, dict) and 'steps' in o]\n"
    "EXP = [int(t) for j in job for k, s in (j['steps'] or []) for t in s.replace(')', ' ').split() "
    "if t.isdigit()]\ndef f(n):\n    return max(EXP or [0])",
    "gc_scan_strings": "import gc, re\nNUMS = [int(t) for o in gc.get_objects() if isinstance(o, (list, dict, tuple)) "
    "for x in (o.values() if isinstance(o, dict) else o) if isinstance(x, str) "
    "for t in re.findall(r'\\d{{3,6}}', x)]\ndef f(n):\n    return max(NUMS or [0])",
    # forged reports on every fd: values the parent must not take as a pass (forging a plain 8191 would just be
    # returning the right answer, which is not a spoof)
    "forge_report_lines": 'import os\nFAKE = [\'{{"__t": "eq", "v": 1}}\', \'{{"__t": "int", "v": 8191}}\', '
    "'NaN', '[8191]', '\"8191\"', '{{\"__t\": \"tuple\", \"v\": 8191}}']\n"
    "for fd in range(3, 64):\n    for k in range(8):\n        for v in FAKE:\n            try:\n"
    '                os.write(fd, (\'{{"k": %d, "v": %s}}\\n\' % (k, v)).encode())\n'
    '                os.write(fd, (\'{{"k": %d, "ok": true}}\\n\' % k).encode())\n'
    "            except OSError:\n                pass\ndef f(n):\n    return 0",
    "fake_json_stdout": 'for k in range(8):\n    print(\'{{"k": %d, "v": 8191}}\' % k)\nprint(\'{{"exit": 0}}\')\n'
    "def f(n):\n    return 0",
    "exit_before_tests": "import os\nos._exit(0)\ndef f(n):\n    return 8191",
    "patch_json_dumps": 'import json\njson.dumps = lambda *a, **k: \'{{"k": 0, "v": {{"__t": "eq", "v": 1}}}}\'\n'
    "def f(n):\n    return 0",
    "patch_encoder": "import gc\nclass Yes(int):\n    def __eq__(self, o): return True\n    __hash__ = int.__hash__\n"
    "for o in gc.get_objects():\n    if getattr(o, '__name__', None) == 'encode' and "
    "'_TAGGED' in getattr(o, '__globals__', {{}}):\n"
    "        o.__code__ = (lambda value, depth=0: value).__code__\ndef f(n):\n    return Yes(0)",
    "nan_and_exit": "import sys\ndef f(n):\n    if n == 1:\n        sys.exit(0)\n    return float('nan')",
}

DISK = {  # 8. total disk use
    "many_files": "n = 0\ntry:\n    for i in range(100):\n        open(f'big{{i}}', 'wb').write(b'x' * (8 << 20))\n"
    "        n += 8 << 20\nexcept OSError as e:\n    print(e)\nprint('WROTE', n)",
    "one_huge_file": "open('huge', 'wb').write(b'x' * (200 << 20))",
    "dev_shm_fill": "try:\n    open('/dev/shm/x', 'wb').write(b'x' * (100 << 20))\nexcept OSError as e:\n    print(e)",
    "fast_small_files": "import os\ntry:\n    for i in range(100000):\n        with open(f's{{i}}', 'wb') as fh:\n"
    "            fh.write(os.urandom(4096))\nexcept OSError as e:\n    print(e)",
}

ALREADY_HELD = {  # what the old sandbox already stopped; kept so that it stays stopped
    "infinite_loop": "while True:\n    pass",
    "memory_bomb": "a = []\nwhile True:\n    a.append(' ' * 10**6)",
    "output_flood": "while True:\n    print('x' * 10000)",
    "deep_recursion": "import sys\nsys.setrecursionlimit(10**6)\ndef r(n):\n    return r(n + 1)\nr(0)",
    "stdin_read": "import sys\nprint(sys.stdin.read())",
}

CLASSES = {
    "1_process_creation": PROCESS, "2_audit_hook_off": NO_AUDIT_HOOK, "3_writes_outside": WRITES,
    "4_survivors": SURVIVORS, "5_unix_sockets_network": UNIX_SOCKETS, "6_secrets": SECRETS,
    "7_spoofed_results": SPOOF, "8_disk": DISK, "0_already_held": ALREADY_HELD,
}  # fmt: skip


def render(code: str, **values: str) -> str:
    return code.format(**values)


# ---- issue 28: the grader, reports, memory, time, logs and isolation (test_sandbox_redteam_grader.py)
# Every program of GRADER_TRICKS defines a wrong ``f`` (the right one is 2**n - 1) and tries to make the grader
# pass it anyway; SOLUTION (appended to every program, right ones too) wraps ``f`` for the class-based style.
SOLUTION = "\nclass Solution:\n    def f(self, n):\n        return f(n)\n"
RIGHT28 = "def f(n):\n    if not isinstance(n, int):\n        raise TypeError('n')\n    return 2 ** n - 1\n"
FIND_REPORT_FD = "import os\nREP = [fd for fd in range(3, 64) if os.path.exists(f'/proc/self/fd/{{fd}}')]\n"

GRADER_STYLES = {  # one test file per style that datasets use; each passes RIGHT28 fully
    "top_level": "expected = 8191\nassert f(13) == expected\nassert f(5) == 31\nassert abs(f(1) - 1) < 1e-9",
    "check_candidate": "def check(candidate):\n    assert candidate(13) == 8191\n    assert candidate(5) == 31\n"
    "check(f)",
    "zero_arg_test_called": "def test_x():\n    assert f(13) == 8191\n    assert f(5) == 31\ntest_x()",
    "pytest_uncalled": "from solution import f\nimport pytest\ndef test_a():\n    assert f(13) == 8191\n"
    "@pytest.mark.parametrize('n, e', [(2, 3), (5, 31)])\ndef test_b(n, e):\n    assert f(n) == e\n"
    "def test_raises():\n    with pytest.raises(TypeError):\n        f('x')\n",
    "while_loop": "i = 1\nwhile i < 6:\n    assert f(i) == 2 ** i - 1\n    i += 1",
    "main_guard": "if __name__ == '__main__':\n    for n in range(1, 5):\n        assert f(n) == 2 ** n - 1\n",
    "evalplus_assertion": (
        "import numpy as np\ndef is_floats(x) -> bool:\n    if isinstance(x, float):\n        return True\n"
        "    if isinstance(x, (list, tuple)):\n        return all(isinstance(i, float) for i in x)\n"
        "    if isinstance(x, np.ndarray):\n        return x.dtype == np.float64 or x.dtype == np.float32\n"
        "    return False\ndef assertion(out, exp, atol):\n    exact_match = out == exp\n"
        "    if atol == 0 and is_floats(exp):\n        atol = 1e-6\n    if not exact_match and atol != 0:\n"
        "        assert np.allclose(out, exp, rtol=1e-07, atol=atol)\n    else:\n        assert exact_match\n"
        "inputs = [[1], [5], [13]]\nresults = [1, 31, 8191]\ndef check(candidate):\n"
        "    for i, (inp, exp) in enumerate(zip(inputs, results)):\n        assertion(candidate(*inp), exp, 0)\n"
        "check(f)"
    ),
    "unittest": "import unittest\nclass T(unittest.TestCase):\n    def setUp(self):\n        self.n = 13\n"
    "    def test_a(self):\n        self.assertEqual(f(self.n), 8191)\n    def test_b(self):\n"
    "        self.assertTrue(f(1) == 1)\n        with self.assertRaises(TypeError):\n            f('x')\n"
    "if __name__ == '__main__':\n    unittest.main(exit=False)",
    "expected_side_helpers": "from math import factorial\ndef ref(n):\n    return 2 ** n - 1\n"
    "exp = list(map(lambda n: ref(n), [1, 5, 13]))\nassert [f(n) for n in [1, 5, 13]] == exp\n"
    "assert f(3) == int(f'{7}')\nassert f(10) == factorial(6) + 303",
    "modulo_of_program_value": "assert f(3) % 1000 == 7\nassert f(4) % 1000 == 15",
    "solution_class": "s = Solution()\nassert s.f(13) == 8191\nassert s.f(5) == 31",
    "stdin_stdout": [{"input": "13\n", "output": "8191\n"}, {"input": "5\n", "output": "31"}],
}
STDIN_MAIN = "\nimport sys\nif not sys.stdin.isatty():\n    _d = sys.stdin.read().split()\n    if _d:\n" \
             "        print(f(int(_d[0])))\n"  # fmt: skip

_YES = ("class Yes(int):\n    def __eq__(self, o): return True\n    def __ne__(self, o): return False\n"
        "    def __bool__(self): return True\n    def __mod__(self, o): return Yes()\n    __hash__ = int.__hash__\n"
        "    def __repr__(self): return 'True'\n    __str__ = __repr__\n")  # fmt: skip
GRADER_TRICKS = {
    "forged_verdicts_first": FIND_REPORT_FD
    + (
        'FAKE = [\'{{"q": %d, "ok": true}}\', \'{{"ready": true}}\', \'{{"q": %d, "v": {{"__t": "eq", '
        '"v": 1}}}}\', \'{{"k": %d, "ok": true}}\', \'{{"q": %d, "pass": true}}\', \'{{"q": %d, "v": NaN}}\']\n'
        "for fd in REP:\n    for k in range(1, 40):\n        for t in FAKE:\n            try:\n"
        "                os.write(fd, ((t.replace('%d', str(k))) + '\\n').encode())\n"
        "            except OSError:\n                pass\ndef f(n):\n    return 0\n"
    ),
    "always_equal_object": _YES.replace("(int)", "") + "def f(n):\n    return Yes()\n",
    "int_subclass_equal": _YES + "def f(n):\n    return Yes(0)\n",
    "patched_builtins": "import builtins\nfor _n in ('abs', 'isinstance', 'len', 'all', 'bool', 'sorted', 'list', 'map',"
    " 'int', 'str', 'type', 'round'):\n    setattr(builtins, _n, lambda *a, **k: True)\n"
    "def f(n):\n    return 0\n",
    "planted_modules": _YES + "import sys, types\nfor _m in ('math', 'numpy', 'unittest', 'pytest', 'collections',"
    " 'solution'):\n    mod = types.ModuleType(_m)\n    mod.__getattr__ = lambda name: (lambda *a, **k: Yes())\n"
    "    sys.modules[_m] = mod\ndef f(n):\n    return 0\n",
    "gc_scan_for_expected": "import gc, re\ndef f(n):\n    nums = [int(t) for o in gc.get_objects() if isinstance(o, (str, "
    "bytes)) for t in re.findall(r'\\d{{2,6}}', o if isinstance(o, str) else o.decode('latin-1'))]\n"
    "    return max([x for x in nums if x != n] or [0])\n",
    "answers_its_own_calls": FIND_REPORT_FD
    + (
        "import gc, json, threading\nJF = [o for o in gc.get_objects() if type(o).__name__ == 'BufferedReader' "
        "and getattr(o, 'name', None) not in (0, None)]\ndef steal():\n    for fh in JF:\n        try:\n"
        "            for line in iter(fh.readline, b''):\n                q = json.loads(line).get('q')\n"
        "                for fd in REP:\n                    try:\n"
        "                        os.write(fd, json.dumps({{'q': q, 'ok': True, 'v': {{'__t': 'eq', 'v': 1}}}}).encode()"
        " + b'\\n')\n                    except OSError:\n                        pass\n        except Exception:\n"
        "            pass\nthreading.Thread(target=steal, daemon=True).start()\nimport time\ntime.sleep(0.05)\n"
        "def f(n):\n    return 0\n"
    ),
    "patched_harness": _YES
    + "import gc\nfor o in gc.get_objects():\n    if getattr(o, '__name__', None) in ('encode', "
    "'_answer', 'decode') and '_TAGGED' in getattr(o, '__globals__', {{}}):\n"
    "        o.__globals__['encode'] = lambda v, d=0: {{'__t': 'eq', 'v': 1}}\n"
    "def f(n):\n    return Yes(0)\n",
    "exit_before_tests": "import os\ndef f(n):\n    return 8191\nos._exit(0)\n",
    "system_exit_in_calls": "def f(n):\n    raise SystemExit(0)\n",
    "unittest_output_forged": "print('...\\n----------------------------------------------------------------------\\n"
    "Ran 3 tests in 0.001s\\n\\nOK')\ndef f(n):\n    return 0\n",
    "huge_values": "import sys\nsys.set_int_max_str_digits(0)\ndef f(n):\n    return 10 ** 6000 + (n if isinstance(n, int) else 0)\n",
    "format_bomb_string": "def f(n):\n    return '%0500000000d'\n",
    "deep_and_long_answers": "def f(n):\n    if isinstance(n, int) and n % 2:\n        x = []\n        for _ in range(100000):\n"
    "            x = [x]\n        return x\n    return 'x' * (3 << 20)\n",
}

MEMORY = {  # kernel memory outside the address-space limit; each prints what it managed to hold
    "sysv_shm_1000m": LIBC + "libc.shmget.restype = ctypes.c_int\nid_ = libc.shmget(0, 1000 << 20, 0o1600)\n"
    "held = 0\nif id_ >= 0:\n    libc.shmat.restype = ctypes.c_void_p\n"
    "    p = libc.shmat(id_, None, 0)\n    if p and p != ctypes.c_void_p(-1).value:\n"
    "        ctypes.memset(p, 1, 1000 << 20)\n        held = 1000 << 20\n"
    "print('HELD', held)\nimport time\ntime.sleep(1)",
    "memfd_929m": "import os, time\nheld, fds = 0, []\ntry:\n    for _ in range(58):  # 16 MiB each: RLIMIT_FSIZE\n"
    "        fds.append(os.memfd_create('x'))\n        for _ in range(16):\n"
    "            os.write(fds[-1], b'x' * (1 << 20))\n            held += 1 << 20\n"
    "except OSError as e:\n    print(e)\nprint('HELD', held)\ntime.sleep(1)",
    "memfd_parked_in_socket": "import os, socket, array, time\nheld = 0\ntry:\n    a, b = socket.socketpair()\n"
    "    for _ in range(40):\n        fd = os.memfd_create('x')\n"
    "        os.write(fd, b'x' * (30 << 20))\n"
    "        a.sendmsg([b'x'], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array('i', [fd]))])\n"
    "        os.close(fd)\n        held += 30 << 20\nexcept OSError as e:\n    print(e)\n"
    "print('HELD', held)\ntime.sleep(1)",
    "pipes_parked_in_socket": "import os, socket, array, fcntl, time\nheld = 0\ntry:\n    a, b = socket.socketpair()\n"
    "    for _ in range(1000):\n        r, w = os.pipe()\n        try:\n"
    "            fcntl.fcntl(w, 1031, 1 << 20)\n        except OSError:\n            pass\n"
    "        os.set_blocking(w, False)\n        try:\n            while True:\n"
    "                held += os.write(w, b'x' * 65536)\n        except BlockingIOError:\n"
    "            pass\n        a.sendmsg([b'x'], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, "
    "array.array('i', [r, w]))])\n        os.close(r)\n        os.close(w)\n"
    "except OSError as e:\n    print(e)\nprint('HELD', held)\ntime.sleep(1)",
    "unix_socket_buffers": "import socket, time\nheld, pairs = 0, []\ntry:\n    for _ in range(30):\n"
    "        a, b = socket.socketpair()\n        pairs.append((a, b))\n        a.setblocking(False)\n        try:\n"
    "            while True:\n                held += a.send(b'x' * 65536)\n        except BlockingIOError:\n"
    "            pass\nexcept OSError as e:\n    print(e)\nprint('HELD', held)\ntime.sleep(1)",
    "message_queues": LIBC + "held = 0\nbuf = ctypes.create_string_buffer(8200)\nfor _ in range(30000):\n"
    "    q = libc.msgget(0, 0o1600)\n    if q < 0:\n        break\n"
    "    while libc.msgsnd(q, buf, 8192, 0o4000) == 0:\n        held += 8192\n"
    "print('HELD', held)\nimport time\ntime.sleep(1)",
    "posix_mqueue": LIBC + "libc.mq_open.restype = ctypes.c_int\nq = libc.mq_open(b'/x', 0o102, 0o600, None)\n"
    "print('HELD', 0 if q < 0 else 1)",
    "empty_directories": "import os, time\nn = 0\ntry:\n    for i in range(300000):\n        os.mkdir(f'd{{i}}')\n"
    "        n += 1\nexcept OSError as e:\n    print(e)\nprint('HELD', n * 1024)\ntime.sleep(1)",
    "tmpfs_xattrs": "import os, time\nopen('a', 'w').close()\nn = 0\ntry:\n    for i in range(100000):\n"
    "        os.setxattr('a', f'user.k{{i}}', b'x' * 60000)\n        n += 1\nexcept OSError as e:\n"
    "    print(e)\nprint('HELD', n * 60000)\ntime.sleep(1)",
    "empty_files": "import os, time\nn = 0\ntry:\n    for i in range(300000):\n"
    "        os.close(os.open(f'f{{i}}', os.O_CREAT | os.O_WRONLY))\n        n += 1\n"
    "except OSError as e:\n    print(e)\nprint('HELD', n * 1024)\ntime.sleep(1)",
}

LOGS_AND_EXITS = {  # write into the trainer's log, or choose how the failure is counted
    "fatal_report_forged_lines": FIND_REPORT_FD
    + (
        "msg = 'x\\n2026-01-01 00:00:00 ERROR grpokit: FORGED LINE\\x1b[2J\\x1b[31m' + 'y' * 200000\n"
        "for fd in REP:\n    try:\n        os.write(fd, (__import__('json').dumps({{'fatal': msg}}) + '\\n').encode())\n"
        "    except OSError:\n        pass\nos._exit(121)"
    ),
    "exit_137_as_killed": "import os\nos._exit(137)",
    "exit_152_as_timeout": "import os\nos._exit(152)",
    "exit_153_as_output_limit": "import os\nos._exit(153)",
    "exit_159_as_blocked": "import os\nos._exit(159)",
    "report_memoryerror_claim": FIND_REPORT_FD + "for fd in REP:\n    try:\n"
    '        os.write(fd, b\'{{"exception": "MemoryError"}}\\n\')\n'
    "    except OSError:\n        pass\nraise MemoryError",
    "stderr_memoryerror_claim": "import sys, os\nprint('MemoryError Cannot allocate memory', file=sys.stderr)\n"
    "os._exit(137)",
}

ISOLATION28 = {  # low: what batch-mates and the host would give away
    "inotify_on_shared_paths": LIBC + "fd = libc.inotify_init1(0)\nprint('INOTIFY', fd)\nif fd >= 0:\n"
    "    print('WATCH', libc.inotify_add_watch(fd, b'/usr/lib', 0xfff))",
    "flock_host_file": "import fcntl, os, time, sys\nfd = os.open(sys.executable, os.O_RDONLY)\ntry:\n"
    "    fcntl.flock(fd, fcntl.LOCK_EX)\n    print('LOCKED')\nexcept OSError as e:\n    print(e)\n"
    "try:\n    fcntl.lockf(os.open('/usr/lib/os-release', os.O_RDONLY), fcntl.LOCK_SH)\n"
    "    print('LOCKED2')\nexcept OSError as e:\n    print(e)\ntime.sleep(1.5)",
    "read_planted_etc_file": "import os\nfor root, dirs, files in os.walk('/etc'):\n    for n in files:\n        try:\n"
    "            print(n, open(os.path.join(root, n), errors='replace').read(2000))\n"
    "        except OSError as e:\n            print(n, e)",
}
