"""Run one untrusted Python program with limits: the execution layer of the code rewards.

``run_program(code, stdin, limits)`` starts ``sys.executable -I -S -B`` (isolated mode, stdlib only unless
``limits.allow_site_packages``; :class:`SandboxLimits`: time, memory, processes, output, files, isolation) in a
fresh subprocess, in its own session (``start_new_session=True``), and returns a :class:`SandboxResult`. The
program and its tests reach the child as unlinked files (never as files it could read back: tests read by the
program would let it print their answers); stdin is a sealed memfd (readable, never writable: no file of the
trainer's changes, and the program gets no executable file it could fill). Two isolations
(``rewards.code.isolation``, :func:`set_isolation`):

``namespaces`` (default): isolation by the operating system (:mod:`.sandbox_jail`, run by the child before any
untrusted code). New mount, PID, network, IPC, UTS and cgroup namespaces (and a user namespace when the trainer is
not root); the program is PID 1 of its PID namespace (nothing outside it can be named, and every process it starts
dies with it); the root is a tmpfs holding read-only, nosuid binds of the system directories (/usr, /bin, /lib*),
of the few /etc entries a Python program uses (:data:`_ETC_ENTRIES`) and of this Python (its prefix, base prefix
and venv) only, a minimal /dev, a fresh read-only /proc; the only writable place is a private, size-limited,
``noexec`` tmpfs at the workdir path (its cwd, HOME and TMPDIR); homes, /root, the run directory, credentials
(the rest of /etc too) and the rest of /tmp do not exist in it. It runs as uid/gid 65534 (nobody) when the
trainer is root, with no capabilities (bounding set emptied, checked), not dumpable, ``no_new_privs``; no network (a
new network namespace: only a down loopback). The program's interpreter is a fresh one, exec'd after the jail from
a copy of the binary it may execute but not read (the jail's ctypes stays behind; the kernel keeps it not
dumpable). Where the kernel refuses any of this (unprivileged user namespaces disabled, a container that forbids
unshare or mount), code rewards are refused with
:class:`~megadare.rewards.errors.SandboxUnavailable`, naming ``rewards.code.isolation=process``: never a silent
fallback.

``process``: the weaker guard, a fresh temp dir as cwd in the machine's own filesystem, a private network
namespace when the kernel allows it and, as root, an empty capability bounding set (the program keeps uid 0).

Both keep the other layers, outermost first:

* parent side: scrubbed environment (minimal PATH, no proxies, HOME/TMPDIR = the temp dir), stdin from a memfd,
  stdout/stderr read with a size cap (default 1 MiB; an overflowing program is killed), a wall-clock deadline
  after which the whole process group gets SIGKILL (``os.killpg``), and the group is killed after every run; the
  child gets SIGKILL when the trainer's thread that started it dies (``PR_SET_PDEATHSIG``: a killed trainer leaves
  no program running);
  ``oom_score_adj`` 1000 (the OOM killer takes sandboxed programs before the trainer);
* kernel side: ``RLIMIT_AS`` (memory), ``RLIMIT_CPU``, ``RLIMIT_FSIZE``, ``RLIMIT_CORE=0``, ``RLIMIT_NOFILE``,
  ``RLIMIT_RTPRIO=0``, ``RLIMIT_NICE=0``, ``RLIMIT_MSGQUEUE=0``, ``RLIMIT_MEMLOCK=0`` (whatever the trainer's limits
  allowed), ``RLIMIT_NPROC`` (it counts every task, threads too, of the program's user, uid 65534 or the trainer's, so
  it is set to the current count + ``max_processes`` + slack; the kernel ignores it for a root program, ``process``
  isolation as root), set before exec; on x86-64 and aarch64 a seccomp filter: no new processes unless
  ``max_processes > 1`` (fork/vfork/clone without CLONE_THREAD -> EPERM, clone3 -> ENOSYS so threads fall back to
  clone; children allowed: clone into a new namespace -> EPERM), no sockets except AF_UNIX, no
  ptrace/process_vm_*/pidfd_getfd,
  mount/namespaces/chroot/mknod/modules/bpf/kexec/reboot, io_uring, memfd_create/memfd_secret, syslog,
  prctl(PR_SET_DUMPABLE / PR_SET_PDEATHSIG), SysV shared memory and message queues, sync/syncfs, signals only to
  itself (any pid but -1 when ``max_processes > 1``; never through pidfd_send_signal or rt_(tg)sigqueueinfo, whose
  target kill's check does not see);
* inside the child, a bootstrap passed with ``-c`` installs ``sys.addaudithook`` before the user code runs. It
  refuses sockets, ctypes, ``_posixsubprocess`` (stubbed out), process creation (fork, posix_spawn,
  subprocess, os.system, exec; counted when ``max_processes > 1``), writing/creating/removing/renaming/linking/
  chmod-ing paths outside the temp dir (paths resolved; no ``..`` in them, no new symlinks and no chdir out
  of it, so a racing thread cannot re-aim a checked path), opening directories outside it (no ``dir_fd``
  tricks), signals to other processes (with ``max_processes > 1``: outside its own process group), gc object
  walks (that could reach the hook), a refused module loaded under another name (``x._ctypes``),
  sub-interpreters (they have no audit hook) and native code from files outside this Python's directories (a
  shared object the program wrote; test mode closes more, see :mod:`.sandbox_child`). A refusal raises
  ``PermissionError``; when uncaught the program exits with status "refused". The hook sees only what Python
  reports: C libraries (readline, sqlite3) write files without an ``open`` event, which is why the namespaces
  exist.

Which layers really took effect is reported per run in ``SandboxResult.protections`` (the child reports them
through a pipe it closes before the user code starts); in ``namespaces`` mode a run whose report lacks one of them
raises instead of returning. Known gaps of ``process`` mode: the program keeps uid 0 as root and reads whatever
the trainer's user can; C-level writes outside the temp dir go through (and a ``str`` subclass shows the hook's path
checks another path than the syscall uses), so no file of the trainer's user is safe and a test verdict can be
forged; children that call ``setsid`` outlive the run.

The files: this one is the run API (limits, result, isolation mode, verdict); :mod:`.sandbox_start` the program's
inputs, the jail's plan and the child's start; :mod:`.sandbox_kernel` the layers set between fork and exec
(rlimits, seccomp, ``oom_score_adj``, ``process`` isolation's namespace and capabilities); :mod:`.sandbox_output`
reading the output under its cap and deadline, killing the group, reaping; :mod:`.sandbox_child` and
:mod:`.sandbox_jail` run inside the child.
"""

from __future__ import annotations

import errno
import math
import os
import re
import secrets
import shutil
import signal
import time
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from megadare.files import owned_tempdir
from megadare.rewards.sandbox_child import EXIT_MEMORY, EXIT_REFUSED, EXIT_SYSTEM_EXIT
from megadare.rewards.sandbox_kernel import rlimits, seccomp_denies_processes
from megadare.rewards.sandbox_output import SETUP_LIMIT_S, Collected, collect, drain, reap
from megadare.rewards.sandbox_start import program_uid, refused, required_layers, sealed, start_child, unlinked

__all__ = [
    "SandboxResult",
    "SandboxLimits",
    "run_program",
    "OUTPUT_LIMIT",
    "STATUSES",
    "ISOLATIONS",
    "set_isolation",
    "check_isolation",
]

OUTPUT_LIMIT = 1 << 20  # bytes of stdout + stderr kept; beyond it the program is killed
STATUSES = ("ok", "error", "timeout", "memory", "refused")


@dataclass
class SandboxResult:
    """Outcome of one sandboxed run.

    ``status``: "ok" (exit 0), "error" (non-zero exit, crash, or output over the cap: ``truncated``),
    "timeout" (wall deadline or RLIMIT_CPU), "memory" (MemoryError / killed for memory), "refused" (an
    audit-hook refusal ended the program). ``protections`` names the layers that were active. ``exited``: the
    program ended by its own ``SystemExit`` with a non-zero code (``sys.exit(1)``, ``exit("msg")``; status "error",
    returncode 120 whatever the code; never in test mode), not by a crash.
    """

    status: str
    returncode: Optional[int]
    stdout: str
    stderr: str
    wall_s: float
    protections: Tuple[str, ...] = ()
    truncated: bool = False
    tests_passed: Optional[bool] = None  # test mode: the tests ran to their end (token received); else None
    pgid: Optional[int] = None  # the run's process group on this machine (all of it is killed after)
    exited: bool = False

    @property
    def ok(self) -> bool:
        return self.status == "ok"


# ----------------------------------------------------------------------------------------------------- isolation
ISOLATIONS = ("namespaces", "process")
_isolation = ["namespaces"]  # rewards.code.isolation, set by the run's entry point (set_isolation)
_refusal: List[str] = []  # why the kernel refused the namespaces, once it did (it will again)
# a step refused for want of a resource another moment may have (memory, tasks, a count of namespaces under load), not
# by a policy: such a start is tried again and never remembered as the machine refusing the sandbox
TRANSIENT_ERRNOS = frozenset((errno.EAGAIN, errno.ENOMEM, errno.EINTR, errno.ENOSPC, errno.EBUSY))
START_ATTEMPTS = 4
_BACKOFF_S = 0.25


class _Transient(Exception):
    """The kernel refused a start of the sandbox for a while (an errno of :data:`TRANSIENT_ERRNOS`)."""


def _transient(detail: str) -> bool:
    """Does a refusal's text (``... [Errno N] ...``, as the jail and OSError write it) name a transient errno?"""
    found = re.search(r"\[Errno (\d+)\]", detail)
    return found is not None and int(found.group(1)) in TRANSIENT_ERRNOS


def set_isolation(mode: str) -> None:
    """Set ``rewards.code.isolation`` for this process's code rewards: "namespaces" (default) or "process"."""
    if mode not in ISOLATIONS:
        raise ValueError(f"rewards.code.isolation={mode!r} is not one of {', '.join(ISOLATIONS)}")
    _isolation[0] = mode


def check_isolation(mode: Optional[str] = None) -> Tuple[str, ...]:
    """Run a trivial program under ``mode`` (default: the configured one): the layers it got. Raises
    :class:`SandboxUnavailable` where the kernel refuses the namespaces (a pre-flight check)."""
    r = run_program("print('ok')", limits=SandboxLimits(timeout_s=30, isolation=mode))
    if r.stdout != "ok\n":
        raise RuntimeError(f"sandbox: a trivial program failed ({r.status}): {r.stderr[-500:]}")
    return r.protections


def _rmtree(path: str) -> None:
    """Remove a run's temp dir, whatever the program left in it: read-only dirs, and (``process`` isolation, where
    the dir is on the machine's disk) a tree deeper than Python's recursion limit, which made shutil.rmtree raise
    RecursionError out of run_program (a reward error) and leave the tree behind: it is flattened first."""

    def onerror(func, p, _exc):  # a program may leave read-only dirs behind
        try:
            os.chmod(os.path.dirname(p), 0o700)
            os.chmod(p, 0o700)
            func(p)
        except OSError:
            pass

    try:
        shutil.rmtree(path, onerror=onerror)
    except RecursionError:
        _flatten(path)
        shutil.rmtree(path, onerror=onerror)


def _flatten(path: str) -> None:
    """Move every directory below ``path`` up into ``path`` (fresh names): no tree left deeper than two levels."""
    todo, prefix, k = [path], os.path.join(path, f".flat-{secrets.token_hex(8)}-"), 0
    while todo:
        d = todo.pop()
        try:
            os.chmod(d, 0o700)
            subdirs = [e.path for e in os.scandir(d) if e.is_dir(follow_symlinks=False)]
        except OSError:
            continue
        for sub in subdirs:
            k += 1
            try:
                os.rename(sub, prefix + str(k))
                todo.append(prefix + str(k))
            except OSError:
                pass


def _classify(rc: Optional[int], timed_out: bool, truncated: bool, stderr: str, cpu_over: bool) -> str:
    if truncated:
        return "error"
    if timed_out or rc == -signal.SIGXCPU or (rc == -signal.SIGKILL and cpu_over):  # SIGKILL: hard CPU limit
        return "timeout"
    if rc == 0:
        return "ok"
    if rc == EXIT_REFUSED:
        return "refused"
    if rc == EXIT_MEMORY or rc == -signal.SIGKILL or "MemoryError" in stderr[-2000:]:
        return "memory"  # an unexplained SIGKILL is the OOM killer (our own kills are timeouts)
    return "error"


@dataclass(frozen=True)
class SandboxLimits:
    """What one sandboxed run may use, and how it is isolated.

    Time: ``timeout_s`` (wall clock, counted from when the program starts: the sandbox's own start does not eat it),
    ``cpu_s`` (RLIMIT_CPU; default ``timeout_s + 1``). Memory: ``memory_mb`` (RLIMIT_AS). Processes:
    ``max_processes`` counts the program itself: 1 (default) forbids child processes; more allows that many
    (audit-hook counter, plus RLIMIT_NPROC, which also bounds threads). Output: ``output_limit`` bytes of stdout +
    stderr (beyond it the program is killed). Files: ``file_size_mb`` (RLIMIT_FSIZE; the private tmpfs holds 4x
    that, at least 64 MiB), ``max_open_files`` (RLIMIT_NOFILE). Isolation: ``isolation`` "namespaces" | "process"
    (default: the one :func:`set_isolation` set); ``audit_hook=False`` leaves only the OS layers: for testing them,
    never for real use; ``allow_site_packages`` shows the interpreter's site-packages (else stdlib only);
    ``preload``: modules imported before the audit hook is installed (trusted packages the tests need whose import
    the hook would refuse: numpy loads ctypes).
    """

    timeout_s: float = 5.0
    memory_mb: int = 512
    max_processes: int = 1
    cpu_s: Optional[float] = None
    output_limit: int = OUTPUT_LIMIT
    file_size_mb: int = 16
    max_open_files: int = 256
    isolation: Optional[str] = None
    audit_hook: bool = True
    allow_site_packages: bool = False
    preload: Sequence[str] = ()

    @property
    def cpu(self) -> int:
        """RLIMIT_CPU in whole seconds."""
        return max(1, math.ceil(self.cpu_s if self.cpu_s is not None else self.timeout_s + 1))


def run_program(
    code: str,
    stdin: str = "",
    limits: SandboxLimits = SandboxLimits(),
    *,
    tests: Optional[str] = None,
    tested: Sequence[str] = (),
) -> SandboxResult:
    """Run the Python program ``code`` with ``stdin`` in a fresh sandbox (see the module docstring) under
    ``limits`` (:class:`SandboxLimits`).

    ``tests``: Python test code run after the program, in test mode (:mod:`.sandbox_child`); the result's
    ``tests_passed`` is True only when the tests ran to their end (proven with a one-time token), never from the
    exit status or the output alone. ``tested``: builtin names the tests test (a task's ``def sorted``): the tests
    see the program's definitions of them (of every other builtin name, the true builtin). Raises
    :class:`SandboxUnavailable` where the kernel refuses the namespaces, and RuntimeError when the sandbox itself
    cannot start (neither is a verdict on the program).

    A start the kernel refused for want of a resource (:data:`TRANSIENT_ERRNOS`: memory, tasks, a namespace count;
    the program never ran) is tried again, :data:`START_ATTEMPTS` times in all with a doubling back-off, then
    raises RuntimeError; only the other refusals (EPERM, an unsupported namespace, ...) are remembered as the
    machine's (every later run refused at once).
    """
    if not all(re.fullmatch(r"[A-Za-z_]\w*", n) for n in tested):
        raise ValueError(f"tested={list(tested)!r}: names only")
    why = ""
    for attempt in range(START_ATTEMPTS):
        if attempt:
            time.sleep(_BACKOFF_S * 2 ** (attempt - 1))
        try:
            return _run_once(code, stdin, limits, tests, tested)
        except _Transient as e:
            why = str(e)
    raise RuntimeError(
        f"sandbox: the kernel refused to start the sandbox {START_ATTEMPTS} times in a row for want of a resource "
        f"({why}): this machine is short of memory or tasks (or user namespaces: sysctl user.max_user_namespaces); "
        "not a verdict on the program, and not remembered"
    )


def _run_once(
    code: str, stdin: str, limits: SandboxLimits, tests: Optional[str], tested: Sequence[str]
) -> SandboxResult:
    """One try of :func:`run_program`; raises :class:`_Transient` where the kernel refused the start for a while."""
    mode = _checked_mode(tests is not None, limits)
    t0 = time.monotonic()
    workdir = os.path.realpath(owned_tempdir("megadare_sbx_"))  # a SIGKILLed scorer's dir goes at the next run
    fds = list(os.pipe()) + list(os.pipe()) + list(os.pipe())  # report, token, proof (read, write each)
    token = secrets.token_hex(16).encode()
    try:
        os.write(fds[3], token)
        lim, cpu = limits, limits.cpu
        with unlinked(code) as code_f, unlinked(tests) as tests_f, sealed(stdin) as stdin_f:
            boot = [
                fds[1],
                code_f.fileno(),
                tests_f.fileno() if tests_f else -1,
                workdir,
                max(0, lim.max_processes - 1),
                int(lim.audit_hook),
                fds[2] if tests is not None else -1,  # the token and proof pipes: test mode only
                fds[5] if tests is not None else -1,
                ",".join(lim.preload),
                ",".join(tested),
            ]
            try:
                proc = start_child(
                    mode,
                    boot,
                    stdin_f,
                    lim.allow_site_packages,
                    rlimits(
                        lim.memory_mb, cpu, lim.file_size_mb, lim.max_open_files, lim.max_processes, program_uid(mode)
                    ),
                    lim.file_size_mb,
                )
            except RuntimeError as e:  # fork / exec of the child refused (ENOMEM, EAGAIN): transient
                if _transient(str(e)):
                    raise _Transient(str(e)) from e
                raise
        for k in (1, 2, 3, 5):  # the child's ends, and the token (written)
            os.close(fds[k])
            fds[k] = -1
        got = collect(proc, lim.timeout_s, lim.output_limit, fds[0])
        rc, cpu_used = reap(proc)
        _check_report(mode, got, lim.max_processes)
        stdout = got.stdout.decode("utf-8", errors="replace")
        stderr = got.stderr.decode("utf-8", errors="replace")
        if got.truncated:
            stderr += f"\n[sandbox] output over {lim.output_limit} bytes; program killed"
        if got.timed_out:
            stderr += f"\n[sandbox] wall-clock timeout after {lim.timeout_s:g}s; process group killed"
        status = _classify(rc, got.timed_out, got.truncated, stderr, cpu_used >= cpu)
        passed = None if tests is None else (status == "ok" and drain(fds[4]) == token)
        protections = ("new_session", "scrubbed_env", "wall_timeout", "output_cap", "fresh_tmpdir", *got.report)
        exited = status == "error" and rc == EXIT_SYSTEM_EXIT and tests is None and not got.truncated
        return SandboxResult(
            status, rc, stdout, stderr, time.monotonic() - t0, protections, got.truncated, passed, proc.pid, exited
        )
    finally:
        for fd in fds:
            if fd >= 0:
                os.close(fd)
        _rmtree(workdir)


def _checked_mode(test_mode: bool, limits: SandboxLimits) -> str:
    """run_program's arguments checked; the isolation mode it runs in."""
    if not isinstance(limits, SandboxLimits):
        raise TypeError(f"run_program: limits={limits!r:.80} is not a SandboxLimits; pass SandboxLimits(timeout_s=...)")
    preload, isolation = limits.preload, limits.isolation
    if test_mode and not limits.audit_hook:
        raise ValueError("test mode needs the audit hook (it carries the proof that the tests ran)")
    if not all(re.fullmatch(r"[A-Za-z_][\w.]*", m) for m in preload):
        raise ValueError(f"preload={list(preload)!r}: module names only")
    mode = isolation or _isolation[0]
    if mode not in ISOLATIONS:
        raise ValueError(f"isolation={mode!r} is not one of {', '.join(ISOLATIONS)}")
    if mode == "namespaces" and _refusal:
        raise refused(_refusal[0])
    return mode


def _check_report(mode: str, got: Collected, max_processes: int) -> None:
    """Refuse a run whose sandbox did not start: RuntimeError when the child was not ready in
    :data:`SETUP_LIMIT_S`; in ``namespaces`` mode :class:`SandboxUnavailable` when the jail says the kernel refused
    a step (remembered: it will refuse again), RuntimeError when a layer is missing from a program's report."""
    report = got.report
    if not got.started and got.timed_out:
        raise RuntimeError(
            f"sandbox: the child was not ready to run the program after {SETUP_LIMIT_S:g}s "
            f"(reported: {', '.join(report) or 'nothing'}); the machine is overloaded"
        )
    if mode != "namespaces":
        return
    refusal = next((line[len("unavailable ") :] for line in report if line.startswith("unavailable ")), None)
    if refusal is not None:
        if _transient(refusal):
            raise _Transient(refusal)
        _refusal[:] = [refusal]
        raise refused(refusal)
    missing = required_layers(seccomp_denies_processes(max_processes) is not None) - set(report)
    if missing and got.started:
        raise RuntimeError(
            f"sandbox: the program started without {', '.join(sorted(missing))} (reported: "
            f"{', '.join(report) or 'nothing'})"
        )
