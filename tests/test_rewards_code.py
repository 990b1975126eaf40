"""Code rewards and the sandbox: correct/wrong programs, and hostile ones (loops, memory, fork bombs, file
escapes, network, output floods) that must be stopped without harming the test process or the machine."""

import os
import signal
import socket
import textwrap
import time
import uuid

import pytest

from megadare.rewards.code import code_reward, extract_code, run_tests
from megadare.rewards.registry import RewardSpecError, combine, load_reward
from megadare.rewards.scoring import score_batch
from megadare.rewards.sandbox import OUTPUT_LIMIT, SandboxLimits, run_program


def _prog(src: str) -> str:
    return textwrap.dedent(src).strip() + "\n"


@pytest.fixture(scope="module")
def layers():
    """The protections this machine really gives (reported by the child itself)."""
    r = run_program("print('probe')")
    assert r.status == "ok" and r.stdout == "probe\n", r
    return set(r.protections)


def _alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/status") as f:
            state = next(line for line in f if line.startswith("State:"))
    except (OSError, StopIteration):
        return False
    return "Z" not in state.split(":", 1)[1].split()[0]


def _group_members(pgid: int) -> list:
    """Live (non-zombie) processes in process group ``pgid``."""
    members = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(d))
    return members


# ----------------------------------------------------------------------------------------------- normal programs
SUM_PROG = _prog("""
    import sys
    a, b = map(int, sys.stdin.read().split())
    print(a + b)
""")
IO_TESTS = {"inputs": ["1 2\n", "10 -3\n", "0 0\n"], "outputs": ["3\n", "7", "0\n\n"]}


def test_protections_reported(layers):
    for must in ("audit_hook", "rlimit_as", "rlimit_cpu", "rlimit_fsize", "new_session", "output_cap"):
        assert must in layers, layers
    print("active sandbox protections:", sorted(layers))


def test_extract_code():
    assert extract_code("text\n```python\nprint(1)\n```\nmore\n```python\nprint(2)\n```\n") == "print(2)\n"
    assert extract_code("```py\nx=1\n```\n```\nplain\n```") == "x=1\n"
    assert extract_code("```\nplain\n```") == "plain\n"
    assert extract_code("```python\nprint(3)\n") == "print(3)\n"  # unclosed fence (truncated)
    assert extract_code("print(4)") == "print(4)"


def test_correct_program_stdin_stdout():
    response = f"Here you go:\n```python\n{SUM_PROG}```"
    assert code_reward(response, IO_TESTS) == 1.0


def test_correct_program_assert_tests():
    code = "```python\ndef add(a, b):\n    return a + b\n```"
    assert code_reward(code, ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"]) == 1.0
    assert code_reward(code, "assert add(2, 2) == 4\nassert add(0, 0) == 0") == 1.0
    assert code_reward(code, {"test_code": ["assert add(1, 1) == 2", "assert add(1, 1) == 3"]}) == 0.5


def test_wrong_answer_scores_zero_and_partial():
    wrong = "```python\nprint(42)\n```"
    assert code_reward(wrong, IO_TESTS) == 0.0
    off_by_one = "```python\nimport sys\na, b = map(int, sys.stdin.read().split())\nprint(a + b if a else 1)\n```"
    assert code_reward(off_by_one, IO_TESTS) == pytest.approx(2 / 3)
    assert code_reward(off_by_one, IO_TESTS, all_or_nothing=True) == 0.0
    assert code_reward("```python\ndef add(a, b):\n    return a - b\n```", ["assert add(1, 2) == 3"]) == 0.0
    assert code_reward("```python\nraise SystemExit(3)\n```", {"inputs": [""], "outputs": [""]}) == 0.0


def test_large_stdin_no_deadlock():
    data = "x" * (2 * 2**20)
    r = run_program("import sys\nprint(len(sys.stdin.read()))", stdin=data, limits=SandboxLimits(timeout_s=10))
    assert r.status == "ok" and r.stdout.strip() == str(len(data))


# ----------------------------------------------------------------------------------------------- hostile programs
def test_infinite_loop_times_out_and_group_is_killed():
    prog = _prog("""
        import subprocess
        child = subprocess.Popen(["sleep", "300"])
        print(child.pid, flush=True)
        while True:
            pass
    """)
    t0 = time.monotonic()
    # room to start and print the child's pid under load
    r = run_program(prog, limits=SandboxLimits(timeout_s=4.0, max_processes=2))
    assert time.monotonic() - t0 < 4.0 + 5.0
    assert r.status == "timeout", r
    assert int(r.stdout.split()[0]) > 0  # the grandchild started (its pid in the sandbox's PID namespace)
    deadline = time.monotonic() + 3.0  # found here by its process group: the run's, on this machine
    while _group_members(r.pgid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _group_members(r.pgid) == [], f"the grandchild in group {r.pgid} survived the sandbox"


def test_cpu_limit():
    # the CPU limit (1 s) ends it, not the wall deadline: the deadline is far enough that a loaded machine
    # cannot reach it first, and the returncode is the CPU limit's signal
    r = run_program("while True:\n    pass", limits=SandboxLimits(timeout_s=300, cpu_s=1))
    assert r.status == "timeout" and r.returncode in (-signal.SIGXCPU, -signal.SIGKILL) and r.wall_s < 300, r


def test_huge_allocation_is_stopped():
    r = run_program("x = bytearray(100 * 2**30)\nprint('allocated')", limits=SandboxLimits(timeout_s=10))
    assert r.status in ("memory", "refused"), r
    assert "allocated" not in r.stdout


def test_fork_bomb_is_refused(layers):
    # never run a fork bomb unless the refusal is in place before the user code starts
    assert "audit_hook" in layers
    r = run_program("import os\nwhile True:\n    os.fork()", limits=SandboxLimits(timeout_s=15))
    assert r.status == "refused", r  # ended by the refusal, not by the deadline
    assert _group_members(r.pgid) == []  # nothing of the bomb is left running
    r2 = run_program("import subprocess\nsubprocess.run(['true'])", limits=SandboxLimits(timeout_s=5))
    assert r2.status == "refused", r2
    r3 = run_program("import _posixsubprocess\n_posixsubprocess.fork_exec()", limits=SandboxLimits(timeout_s=5))
    assert r3.status == "refused", r3
    assert run_program("print('still fine')").stdout == "still fine\n"


def test_fork_denied_by_kernel_layer(layers):
    """Without the audit hook, seccomp alone refuses process creation (a single fork attempt, never a loop)."""
    if "seccomp" not in layers:
        pytest.skip("seccomp filter not available here")
    prog = _prog("""
        import os
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        print("forked", pid)
    """)
    r = run_program(prog, limits=SandboxLimits(timeout_s=5, audit_hook=False))
    assert r.status == "error" and "forked" not in r.stdout, r
    assert "Operation not permitted" in r.stderr
    threads = run_program(
        "import threading\nt = threading.Thread(target=print, args=('t',))\nt.start()\nt.join()",
        limits=SandboxLimits(audit_hook=False),
    )
    assert threads.status == "ok" and threads.stdout == "t\n", threads


@pytest.mark.parametrize("hook", [True, False])
def test_signals_to_other_processes_are_refused(layers, hook):
    """Signal 0 only checks existence, so this is harmless even if a layer failed."""
    if not hook and "seccomp" not in layers:
        pytest.skip("seccomp filter not available here")
    for target in ("os.kill(os.getppid(), 0)", "os.killpg(os.getpgid(os.getppid()), 0)", "os.kill(-1, 0)"):
        r = run_program(f"import os\n{target}\nprint('sent')", limits=SandboxLimits(audit_hook=hook))
        assert r.status == ("refused" if hook else "error") and "sent" not in r.stdout, (target, r)
    own = run_program(
        "import os, signal\nsignal.signal(signal.SIGUSR1, lambda *a: print('got'))\n"
        "signal.raise_signal(signal.SIGUSR1)\nos.kill(os.getpid(), signal.SIGUSR1)\n"
        "print('self ok')",
        limits=SandboxLimits(audit_hook=hook),
    )
    assert own.status == "ok" and own.stdout == "got\ngot\nself ok\n", own


@pytest.mark.parametrize("how", ["open", "os_open", "symlink", "rename", "dir_fd", "dotdot", "chdir"])
def test_write_outside_tmpdir_is_refused(how):
    target = f"/tmp/megadare_escape_{uuid.uuid4().hex}"
    progs = {
        "open": f"open({target!r}, 'w').write('escaped')",
        "os_open": f"import os\nfd = os.open({target!r}, os.O_WRONLY | os.O_CREAT)\nos.write(fd, b'escaped')",
        "symlink": f"import os\nos.symlink({target!r}, 'link')\nopen('link', 'w').write('escaped')",
        "rename": f"open('inside', 'w').write('escaped')\nimport os\nos.rename('inside', {target!r})",
        "dir_fd": "import os\nd = os.open('/tmp', os.O_RDONLY)\n"
        f"fd = os.open({os.path.basename(target)!r}, os.O_WRONLY | os.O_CREAT, dir_fd=d)",
        "dotdot": f"import os\nos.mkdir('a')\nopen('a/../../{os.path.basename(target)}', 'w').write('escaped')",
        "chdir": f"import os\nos.chdir('/tmp')\nopen({os.path.basename(target)!r}, 'w').write('escaped')",
    }
    try:
        r = run_program(progs[how])
        assert r.status == "refused", r
        assert not os.path.exists(target)
    finally:
        if os.path.exists(target):
            os.remove(target)


def test_file_work_inside_tmpdir_is_allowed():
    prog = _prog("""
        import os, shutil, tempfile
        open('out.txt', 'w').write('hi')
        print(open('out.txt').read())
        os.makedirs('a/b')
        os.chdir('a')
        open('b/c', 'w').write('1')
        os.rename('b/c', 'd')
        os.chmod('d', 0o600)
        os.remove('d')
        os.chdir(os.path.dirname(os.getcwd()))
        shutil.rmtree('a')
        with tempfile.NamedTemporaryFile('w') as f:
            f.write('x')
        print(sorted(os.listdir('.')))
    """)
    r = run_program(prog)
    assert r.status == "ok" and r.stdout == "hi\n['main.py', 'out.txt']\n", r


@pytest.fixture
def listener():
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    srv.settimeout(0.5)
    yield srv
    srv.close()


def _got_connection(srv) -> bool:
    try:
        conn, _ = srv.accept()
    except socket.timeout:
        return False
    conn.close()
    return True


def test_socket_is_refused(listener):
    port = listener.getsockname()[1]
    prog = f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')"
    r = run_program(prog)
    assert r.status == "refused", r
    assert "connected" not in r.stdout
    assert not _got_connection(listener)


def test_socket_blocked_by_kernel_layers(layers, listener):
    if not {"netns", "seccomp"} & layers:
        pytest.skip("no network namespace and no seccomp here")
    port = listener.getsockname()[1]
    prog = f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')"
    r = run_program(prog, limits=SandboxLimits(audit_hook=False))
    assert r.status == "error" and "connected" not in r.stdout, r
    assert not _got_connection(listener)


def test_output_flood_is_capped():
    t0 = time.monotonic()
    r = run_program("while True:\n    print('x' * 4096)", limits=SandboxLimits(timeout_s=20))
    assert time.monotonic() - t0 < 15
    assert r.truncated and r.status == "error", r.status
    assert len(r.stdout) <= OUTPUT_LIMIT


def test_reward_worker_survives_hostile_cases():
    hostile = [
        "import os\nwhile True:\n    os.fork()",
        "x = bytearray(100 * 2**30)",
        "while True:\n    pass",
        "while True:\n    print('y' * 4096)",
        "import os\nos.kill(os.getppid(), 9)",
        "import socket\nsocket.socket()",
    ]
    for src in hostile:
        assert (
            code_reward(
                f"```python\n{src}\n```", {"inputs": [""], "outputs": ["1"]}, limits=SandboxLimits(timeout_s=1.0)
            )
            == 0.0
        )
    assert code_reward(f"```python\n{SUM_PROG}```", IO_TESTS) == 1.0
    results = run_tests(SUM_PROG, IO_TESTS)
    assert [c.passed for c in results] == [True, True, True]


# ----------------------------------------------------------------------------------------------------- registry
@pytest.fixture
def reward_module(tmp_path, monkeypatch):
    name = f"my_rewards_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(
        "def length_reward(response, record):\n    return len(response) / 10\n"
        "def boom(response, record):\n    raise RuntimeError('bad reward')\n"
        "def slow(response, record):\n    import time\n    time.sleep(float(record.get('sleep', 0)))\n    return 1.0\n"
        "NOT_CALLABLE = 3\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_load_reward_import_path_and_errors(reward_module):
    fn = load_reward(f"{reward_module}:length_reward")
    assert fn("abcde", {}) == 0.5
    with pytest.raises(RewardSpecError, match="no_such_module_xyz.*not found"):
        load_reward("no_such_module_xyz:f")
    with pytest.raises(RewardSpecError, match=f"{reward_module}:missing.*no attribute 'missing'"):
        load_reward(f"{reward_module}:missing")
    with pytest.raises(RewardSpecError, match="NOT_CALLABLE.*not callable"):
        load_reward(f"{reward_module}:NOT_CALLABLE")
    with pytest.raises(RewardSpecError, match="unknown reward 'nonsense'"):
        load_reward("nonsense")
    assert load_reward("exact_match")(" 4 ", {"answer": "4"}) == 1.0


def test_combine_and_score_batch_stats(reward_module):
    both = combine([("code", 2.0), ("boxed_format", 0.5)])
    rec = {"tests": ["assert f() == 1"]}
    assert both("```python\ndef f():\n    return 1\n```\n\\boxed{done}", rec) == 2.5
    assert both("```python\ndef f():\n    return 2\n```", rec) == 0.0
    mixed = combine({f"{reward_module}:length_reward": 1.0, f"{reward_module}:boom": 1.0})
    scores, stats = score_batch(mixed, ["abc"], [{}])
    assert scores == [0.0] and stats.errors == 1 and "bad reward" in stats.first_error

    slow = f"{reward_module}:slow"
    t0 = time.monotonic()
    scores, stats = score_batch(slow, ["a", "b", "c"], [{"sleep": 120}, {}, {"sleep": 0.05}], workers=1, timeout_s=0.5)
    assert time.monotonic() - t0 < 60.0  # the 120 s call was abandoned, not waited for (generous on a loaded CPU)
    assert scores == [0.0, 1.0, 1.0] and stats.timeouts == 1 and stats.errors == 0 and stats.n == 3


def test_score_batch_code_builtin():
    good = f"```python\n{SUM_PROG}```"
    scores, stats = score_batch("code", [good, "```python\nprint(-1)\n```", good], [{"tests": IO_TESTS}] * 3, workers=2)
    assert scores == [1.0, 0.0, 1.0] and stats.errors == 0
    scores, stats = score_batch("code", [good], [{}])
    assert scores == [0.0] and stats.errors == 1


def test_extract_code_is_linear_and_matches_the_regexes_it_replaced():
    """The fence regexes scanned the rest of the text from every opening fence with no line break after it: three
    backticks x 16,000 took 29 s, past score_batch's 60 s per call with a little more (a reward error any response
    could cause). The linear scan gives the regexes' program on 20,000 random responses of their tokens, and such a
    response is a 0."""
    import random
    import re

    fence = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)
    tail_re = re.compile(r"```[ \t]*(?:python|py|python3|py3)[ \t]*\n((?:(?!```).)*)$", re.DOTALL)

    def regex_extract(response):
        blocks = [(m.group(1).lower(), m.group(2)) for m in fence.finditer(response)]
        py = [body for tag, body in blocks if tag in {"python", "py", "python3", "py3"}]
        tail = tail_re.search(response)
        return py[-1] if py else tail.group(1) if tail else blocks[-1][1] if blocks else response

    tokens = ["```", "python", "py3", "PY", "js", " ", "\t", "\n", "x", "`", "3", "-"]
    rng = random.Random(0)
    for _ in range(20_000):
        text = "".join(rng.choice(tokens) for _ in range(rng.randint(0, 14)))
        assert extract_code(text) == regex_extract(text), repr(text)
    scores, stats = score_batch("code", ["```" * 30_000], [{"tests": {"inputs": ["1"], "outputs": ["1"]}}])
    assert scores == [0.0] and stats.failures == 0, stats


SCORER = """
import sys
from megadare.rewards.sandbox import SandboxLimits, run_program
run_program("import time; time.sleep(60)", limits=SandboxLimits(timeout_s=120.0))
"""


def test_a_killed_scorers_sandbox_dir_goes_at_the_next_run(tmp_path, monkeypatch):
    """A scorer SIGKILLed while its program ran left its /tmp/megadare_sbx_* directory for good, one more per kill.
    The directory is now named by its owner's ``<pid>@<host>`` (megadare/files.py) and the next sandbox run on this
    host removes those whose owner is gone."""
    import subprocess
    import sys
    import tempfile

    scorer = subprocess.Popen([sys.executable, "-c", SCORER], env=dict(os.environ, TMPDIR=str(tmp_path)))
    deadline = time.monotonic() + 30
    while not os.listdir(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = os.listdir(tmp_path)
    assert len(left) == 1 and left[0].startswith("megadare_sbx_"), left
    scorer.kill()
    scorer.wait()
    assert os.listdir(tmp_path) == left  # no clean-up ran
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    r = run_program("print('next')")
    assert r.status == "ok" and r.stdout == "next\n", r
    assert os.listdir(tmp_path) == []
