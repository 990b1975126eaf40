"""The code sandbox's OS isolation (rewards.code.isolation=namespaces): what a program sees from inside, the refusal
where the kernel refuses namespaces (simulated with a seccomp filter in a child process: the kernel's own EPERM),
the path a non-root trainer takes (a user namespace), the config key, and a root trainer's sandbox that other
sandboxes' threads (the same uid 65534) made refuse its exec (RLIMIT_NPROC counted before the jail)."""

import json
import os
import shutil
import platform
import subprocess
import sys
import textwrap

import pytest

from megadare.config import load_config
from megadare.errors import ConfigError
from megadare.rewards import runs_code, set_isolation
from megadare.rewards.sandbox import SandboxLimits, run_program

INSIDE = textwrap.dedent("""
    import json, os
    status = dict(line.split(':', 1) for line in open('/proc/self/status'))
    open('out', 'w').write('x')
    print(json.dumps({
        'uid': os.getuid(), 'gid': os.getgid(), 'groups': os.getgroups(), 'pid': os.getpid(),
        'ppid': os.getppid(), 'caps': [int(status[k], 16) for k in ('CapPrm', 'CapEff', 'CapBnd', 'CapAmb')],
        'no_new_privs': status['NoNewPrivs'].strip(), 'seccomp': status['Seccomp'].strip(),
        'root': sorted(os.listdir('/')), 'pids': sorted(p for p in os.listdir('/proc') if p.isdigit()),
        'host': os.uname().nodename, 'cwd': os.getcwd(), 'home': os.environ['HOME'],
        'cwd_files': sorted(os.listdir('.')),
        'repo_visible': os.path.exists(%r), 'writable': [p for p in ('/', '/tmp', '/usr', '/etc', '/dev/shm', %r)
                                                          if os.access(p, os.W_OK)],
    }))
""")


def test_what_a_program_sees_inside():
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = run_program(INSIDE % (os.path.join(repo, "megadare"), sys.prefix), limits=SandboxLimits(isolation="namespaces"))
    assert r.status == "ok", r
    seen = json.loads(r.stdout)
    root = os.geteuid() == 0
    assert (seen["uid"], seen["gid"]) == ((65534, 65534) if root else (os.geteuid(), os.getegid()))
    assert seen["groups"] in ([], [seen["gid"]]) and seen["caps"] == [0, 0, 0, 0], seen
    assert seen["no_new_privs"] == "1" and seen["seccomp"] == (
        "2" if platform.machine() in ("x86_64", "aarch64") else "0"
    )
    assert seen["pid"] == 1 and seen["ppid"] == 0 and seen["pids"] == ["1"], seen  # its own PID namespace
    assert seen["host"] == "sandbox" and seen["cwd"] == seen["home"] and seen["cwd_files"] == ["main.py", "out"]
    assert not seen["repo_visible"], "the repository (like the run directory) must be hidden"
    assert set(seen["root"]) <= {
        "bin",
        "dev",
        "etc",
        "lib",
        "lib32",
        "lib64",
        "libx32",
        "proc",
        "sbin",
        "usr",
        "tmp",
        "root",
        "home",
        "work",
        "opt",
        "srv",
        "var",
        "mnt",
        "data",
    }, seen["root"]
    assert seen["writable"] == [], seen["writable"]  # as seen by access(2); the cwd is the one writable place
    layers = set(r.protections)
    assert {
        "netns",
        "pidns",
        "mntns",
        "ipcns",
        "read_only_root",
        "private_tmpfs",
        "no_capabilities",
        "no_new_privs",
        "audit_hook",
    } <= layers, layers


def test_numpy_and_site_packages_stay_usable():
    """What humanevalplus needs: the venv's packages (numpy, preloaded) inside the read-only root."""
    pytest.importorskip("numpy")
    r = run_program(
        "import numpy as np\nprint(int(np.arange(5).sum()))",
        limits=SandboxLimits(allow_site_packages=True, preload=("numpy",), isolation="namespaces"),
    )
    assert r.status == "ok" and r.stdout == "10\n", r


_DENY = """
import ctypes, struct, sys
def bpf(code, k, jt=0, jf=0):
    return struct.pack("HBBI", code, jt, jf, k)
prog = bpf(0x20, 0) + bpf(0x15, {nr}, 0, 1) + bpf(0x06, 0x00050001) + bpf(0x06, 0x7FFF0000)   # nr -> EPERM
buf = ctypes.create_string_buffer(prog)
class Fprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
libc = ctypes.CDLL(None, use_errno=True)
fprog = Fprog(len(prog) // 8, ctypes.addressof(buf))
assert libc.prctl(38, 1, 0, 0, 0) == 0 and libc.prctl(22, 2, ctypes.byref(fprog), 0, 0) == 0
"""

_REFUSAL = """
import time
from megadare.rewards import SandboxUnavailable, code_reward, score_batch
from megadare.rewards.sandbox import SandboxLimits, run_program
try:
    run_program("print(1)")
    raise SystemExit("no refusal")
except SandboxUnavailable as e:
    print("REFUSED", str(e))
t0 = time.monotonic()
try:
    run_program("print(1)")
except SandboxUnavailable:
    print("AGAIN", time.monotonic() - t0 < 0.05)
try:
    score_batch("code", ["```python\\nprint(1)\\n```"] * 3, [{{"tests": {{"inputs": [""], "outputs": ["1"]}}}}] * 3)
except SandboxUnavailable:
    print("BATCH raised")
print("PROCESS", code_reward("```python\\nprint(1)\\n```", {{"inputs": [""], "outputs": ["1"]}}, limits=SandboxLimits(isolation="process")))
"""


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the simulated refusal is an x86-64 seccomp filter")
@pytest.mark.parametrize("syscall,nr", [("unshare", 272), ("mount", 165)])
def test_refuses_code_rewards_where_the_kernel_refuses_namespaces(syscall, nr):
    script = _DENY.format(nr=nr) + _REFUSAL.format()
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    refused = next(line for line in lines if line.startswith("REFUSED"))
    assert syscall in refused and "rewards.code.isolation=process" in refused, refused
    assert "Operation not permitted" in refused
    assert "AGAIN True" in lines  # remembered: no second child
    assert "BATCH raised" in lines  # never counted as a wrong answer, whatever the tolerance
    assert "PROCESS 1.0" in lines  # the weaker guard runs when asked for


_NON_ROOT = """
import ctypes, json, os
libc = ctypes.CDLL(None, use_errno=True)
uid, gid = os.geteuid(), os.getegid()
assert libc.unshare(0x10000000) == 0, ctypes.get_errno()        # a user namespace where this process is uid 1000
for name, text in (("setgroups", "deny"), ("uid_map", f"1000 {uid} 1"), ("gid_map", f"1000 {gid} 1")):
    with open(f"/proc/self/{name}", "w") as f:
        f.write(text)
from megadare.rewards.sandbox import SandboxLimits, run_program
target = os.path.join(os.path.dirname(os.__file__), "megadare_escape_nonroot")
r = run_program(f"import os, sqlite3\\nprint(os.getuid())\\nsqlite3.connect({target!r}).execute('create table t(x)')")
print(json.dumps({"uid": os.geteuid(), "protections": r.protections, "stdout": r.stdout, "status": r.status,
                  "escaped": os.path.exists(target)}))
"""


def test_a_non_root_trainer_gets_a_user_namespace():
    """The path a non-root trainer takes (user namespace, its own uid mapped, capabilities dropped): here as uid
    1000 of a user namespace this test makes (mapped to the real uid, so it still reads the venv)."""
    out = subprocess.run([sys.executable, "-c", _NON_ROOT], capture_output=True, text=True, timeout=120)
    if out.returncode != 0 and "assert" in out.stderr and "unshare" in out.stderr:
        pytest.skip(f"this kernel refuses user namespaces: {out.stderr[-300:]}")
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.splitlines()[-1])
    assert got["uid"] == 1000 and got["stdout"] == "1000\n" and got["status"] == "error", got
    assert not got["escaped"]
    assert {"userns", "read_only_root", "no_capabilities", "no_new_privs"} <= set(got["protections"]), got


def test_isolation_setting():
    assert load_config(None, ["rewards.code.isolation=process"]).rewards.code.isolation == "process"
    assert load_config(None, []).rewards.code.isolation == "namespaces"
    with pytest.raises(ConfigError, match="rewards.code.isolation='chroot' is not one of namespaces, process"):
        load_config(None, ["rewards.code.isolation=chroot"])
    with pytest.raises(ValueError, match="rewards.code.isolation"):
        set_isolation("none")
    r = run_program("import os\nprint(os.getpid() == 1)", limits=SandboxLimits(isolation="process"))
    assert r.stdout == "False\n" and "read_only_root" not in r.protections
    assert runs_code("code", []) and runs_code("auto", [{"data_source": "mbpp"}, {"data_source": "weird"}])
    assert not runs_code("auto", [{"data_source": "gsm8k"}]) and not runs_code("math", [{"tests": []}])


def test_a_refused_exec_of_the_interpreter_copy_refuses_code_rewards(monkeypatch):
    """After the jail the program's interpreter is exec'd from a copy of the binary (executable, not readable). Where
    that exec fails (an LSM refusing a tmpfs file; here a truncated copy), code rewards stop with the one-line
    refusal naming the weaker isolation, not a per-run error."""
    from megadare.rewards import SandboxUnavailable, sandbox, sandbox_start

    monkeypatch.setattr(sandbox, "_refusal", [])
    monkeypatch.setattr(sandbox_start, "_JAIL", sandbox_start._JAIL.replace("data = f.read()", "data = f.read(64)"))
    with pytest.raises(SandboxUnavailable, match="exec of the interpreter's copy.*rewards.code.isolation=process"):
        run_program("print(1)")


_EXEC = "os.execv(sys.executable, "  # the exec of the interpreter's copy, after the jail (sandbox_child._jail)


def test_a_transient_refusal_is_tried_again_and_not_remembered(monkeypatch):
    """Any refused step of the jail, the exec of the interpreter's copy included, was remembered as the machine
    refusing the sandbox: one ENOMEM / EAGAIN under load stopped every later code reward of the run. A refusal for
    want of a resource is tried again (with back-off) and never remembered; EPERM still is. Here the child's exec
    fails with the errno the test names (the bootstrap's exec call replaced for the next starts)."""
    import errno

    from megadare.rewards import SandboxUnavailable, sandbox, sandbox_start

    monkeypatch.setattr(sandbox, "_refusal", [])
    monkeypatch.setattr(sandbox, "_BACKOFF_S", 0.01)
    real_boot, real_start = sandbox_start._BOOTSTRAP, sandbox.start_child
    assert real_boot.count(_EXEC) == 1
    plan, starts = [], []  # the errnos of the next starts' exec (then the real exec); the starts made

    def start(*args, **kwargs):
        err = plan.pop(0) if plan else None
        failing = real_boot.replace(_EXEC, f"os.execv((_ for _ in ()).throw(OSError({err}, os.strerror({err}))), ")
        monkeypatch.setattr(sandbox_start, "_BOOTSTRAP", real_boot if err is None else failing)
        starts.append(err)
        return real_start(*args, **kwargs)

    monkeypatch.setattr(sandbox, "start_child", start)
    plan[:] = [errno.ENOMEM, errno.EAGAIN]
    assert run_program("print(1)").stdout == "1\n" and starts == [errno.ENOMEM, errno.EAGAIN, None]
    plan[:] = [errno.ENOMEM] * sandbox.START_ATTEMPTS
    with pytest.raises(RuntimeError, match="4 times in a row.*Cannot allocate memory.*not remembered"):
        run_program("print(1)")
    assert sandbox._refusal == [] and run_program("print(2)").stdout == "2\n"
    plan[:], starts[:] = [errno.EPERM], []
    with pytest.raises(SandboxUnavailable, match="exec of the interpreter's copy.*Operation not permitted"):
        run_program("print(1)")
    with pytest.raises(SandboxUnavailable):  # remembered: refused at once, no second start
        run_program("print(1)")
    assert starts == [errno.EPERM]


def test_other_sandboxes_tasks_do_not_refuse_the_sandbox(monkeypatch):
    """A root trainer's jail drops to uid 65534, whose tasks (every sandbox's threads) RLIMIT_NPROC counts; the kernel
    fails the execve of a process whose new uid has more tasks than that limit. Threads of other sandboxes started
    after a run's limit was counted (6 programs each starting threads, beside trivial ones: 106 of 114 runs) made
    its exec fail with EAGAIN, read as the machine refusing the sandbox: every later code reward refused, the run
    stopped. Here a stale count (0, no slack) with processes of uid 65534 running; the limit is set after the exec."""
    from megadare.rewards import sandbox, sandbox_kernel

    if os.geteuid() != 0:
        pytest.skip("only a root trainer's sandbox runs as another uid (uid 65534); this test runs as a non-root user")
    monkeypatch.setattr(sandbox, "_refusal", [])
    monkeypatch.setattr(sandbox_kernel, "_user_task_count", lambda uid: 0)
    monkeypatch.setattr(sandbox_kernel, "_NPROC_SLACK", 0)
    others = [subprocess.Popen(["sleep", "30"], user=65534) for _ in range(3)]
    try:
        r = run_program("import threading\nprint('ran', flush=True)\nthreading.Thread(target=print).start()")
    finally:
        for p in others:
            p.kill()
            p.wait()
    assert r.stdout.startswith("ran") and "can't start new thread" in r.stderr, r
    assert "rlimit_nproc" in r.protections, r.protections


_UNPRIVILEGED = """
import json, os, subprocess
from megadare.rewards import SandboxUnavailable, sandbox_kernel
from megadare.rewards.sandbox import run_program
sandbox_kernel._user_task_count = lambda uid: 0  # a stale count and no slack: this uid's other tasks are past it
sandbox_kernel._NPROC_SLACK = 0
others = [subprocess.Popen(["sleep", "30"]) for _ in range(3)]
try:
    r = run_program("import threading\\nprint('ran', flush=True)\\nthreading.Thread(target=print).start()")
    out = {"stdout": r.stdout, "stderr": r.stderr[-300:], "protections": r.protections}
except SandboxUnavailable as e:
    out = {"unavailable": str(e)}
finally:
    for p in others:
        p.kill()
        p.wait()
print(json.dumps(dict(out, uid=os.getuid())))
"""


# the sandbox starts sys.executable again: setpriv's own exec of it is checked while it is still root
_PROBE = "import subprocess, sys, megadare.rewards.sandbox\nsubprocess.run([sys.executable, '-c', ''], check=True)"


def _as_nobody() -> list:
    """The argv prefix that runs a Python as uid 65534 (a non-root trainer) importing this checkout's megadare; skips
    the test, saying why, where this machine cannot."""
    if os.geteuid() != 0:
        pytest.skip(f"this test runs as uid {os.geteuid()}: starting a process as uid 65534 needs root")
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("no setpriv (util-linux) on this machine to start a process as uid 65534")
    drop = [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all"]
    why = []
    for python in dict.fromkeys((sys.executable, "/usr/bin/python3")):
        probe = subprocess.run(drop + [python, "-c", _PROBE], env=_nobody_env(), cwd="/", capture_output=True)
        if probe.returncode == 0:
            return drop + [python]
        why.append(f"{python}: {probe.stderr.decode(errors='replace').strip()[-160:]}")
    pytest.skip(f"uid 65534 can run no Python that imports this checkout's megadare ({'; '.join(why)})")


def _nobody_env() -> dict:
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": repo, "HOME": "/tmp", "LANG": "C.UTF-8"}


def test_other_tasks_of_a_non_root_trainer_do_not_refuse_the_sandbox():
    """A non-root trainer (here uid 65534, dropped to with setpriv): RLIMIT_NPROC was set before the exec, so the
    jail's user namespace took it as the bound of the uid's tasks on the machine, and the jail's fork of PID 1 failed
    (EAGAIN) once other tasks of the uid (other sandboxes' threads, started after a run's limit was counted) passed
    it: a reward error (8 concurrent sandboxes, half starting 60 threads: 2 of 24 runs raised, 9 of 12 threaded
    programs could not start their threads). Here a stale count (0, no slack) with other processes of the uid
    running; the limit is set after the exec now, and still stops the program's own threads."""
    out = subprocess.run(_as_nobody() + ["-c", _UNPRIVILEGED], env=_nobody_env(), cwd="/", capture_output=True)
    assert out.returncode == 0, out.stderr.decode(errors="replace")[-2000:]
    got = json.loads(out.stdout.decode().splitlines()[-1])
    if "unavailable" in got:
        pytest.skip(f"this kernel refuses uid 65534 the user namespaces: {got['unavailable'][:300]}")
    assert got["uid"] == 65534 and got["stdout"].startswith("ran"), got
    assert "can't start new thread" in got["stderr"], got  # the program's own limit holds
    assert {"userns", "rlimit_nproc"} <= set(got["protections"]), got


def test_a_sandbox_without_its_seccomp_filter_says_so(monkeypatch):
    """The seccomp filter exists for x86-64 and aarch64 only: elsewhere (riscv64, ppc64le) code rewards ran without
    it and without a word. The run's start (reward_notes, printed by RL and evaluation) names what the sandbox lacks
    there; x86-64 and aarch64 say nothing, nor does a reward that runs no code."""
    from megadare.rewards import registry

    row = {"data_source": "humaneval", "prompt": "def f():\n", "answer": "def check(c):\n    assert c()\n"}
    if platform.machine() in ("x86_64", "aarch64"):
        assert registry.reward_notes("auto", [row]) == []
    monkeypatch.setattr(registry, "seccomp_denies_processes", lambda max_processes: None)
    notes = registry.reward_notes("auto", [row])
    assert len(notes) == 1 and "no seccomp filter" in notes[0] and "README" in notes[0], notes
    assert registry.reward_notes("code", []) == notes
    assert registry.reward_notes("dare_math", [row]) == registry.reward_notes("auto", [{"answer": "5"}]) == []


def test_humanevalplus_rows_no_longer_say_their_pass_can_be_faked():
    """DARE's humanevalplus harness preloads numpy: a wrong program read the one-time token through numpy's
    ``__array_interface__`` and scored 1.0, and the run's start said so for those rows. Their harness is judged
    outside the program's process now (tests/test_code_harness.py), so no line says it."""
    from megadare.rewards import registry

    plus = {"data_source": "humanevalplus", "prompt": "def f():\n", "answer": "def check(c):\n    assert c()\n"}
    other = dict(plus, data_source="humaneval")
    assert [n for n in registry.reward_notes("auto", [plus, other]) if "numpy" in n or "humanevalplus" in n] == []
