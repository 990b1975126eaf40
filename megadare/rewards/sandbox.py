"""Run one untrusted Python program with limits: the execution layer of the code rewards.

``run_program(code, stdin)`` starts ``sys.executable -I -S -B`` (isolated mode, stdlib only unless
``allow_site_packages``) in a fresh subprocess, in a fresh temp dir as cwd, in its own session
(``start_new_session=True``), and returns a :class:`SandboxResult`. Layers, outermost first:

* parent side: scrubbed environment (minimal PATH, no proxies, HOME/TMPDIR = the temp dir), stdin from a file,
  stdout/stderr read with a size cap (default 1 MiB; an overflowing program is killed), a wall-clock deadline
  after which the whole process group gets SIGKILL (``os.killpg``), and the group is killed after every run;
* kernel side, set in ``preexec_fn`` before the interpreter starts: ``RLIMIT_AS`` (memory), ``RLIMIT_CPU``,
  ``RLIMIT_FSIZE``, ``RLIMIT_CORE=0``, ``RLIMIT_NOFILE``, ``RLIMIT_NPROC`` (non-root only: it counts every task
  of the user, so it is set to the current count + ``max_processes`` + slack; the kernel ignores it for root);
  a private network namespace (``unshare(CLONE_NEWNET)`` as root, ``CLONE_NEWUSER|CLONE_NEWNET`` otherwise),
  which leaves only a down loopback; as root, an empty capability bounding set (the program keeps uid 0 but
  loses every capability at exec); on x86-64 a seccomp filter: no new processes unless ``max_processes > 1``
  (fork/vfork/clone without CLONE_THREAD -> EPERM, clone3 -> ENOSYS so threads fall back to clone), no
  sockets except AF_UNIX, no ptrace/process_vm_*, mount/namespaces/chroot/mknod/modules/bpf/kexec/reboot,
  signals only to itself (any pid but -1 when ``max_processes > 1``);
* inside the child, a bootstrap passed with ``-c`` installs ``sys.addaudithook`` before the user code runs. It
  refuses sockets, ctypes, ``_posixsubprocess`` (stubbed out), process creation (fork, posix_spawn,
  subprocess, os.system, exec; counted when ``max_processes > 1``), writing/creating/removing/renaming/linking/
  chmod-ing paths outside the temp dir (paths resolved; no ``..`` in them, no new symlinks and no chdir out
  of it, so a racing thread cannot re-aim a checked path), opening directories outside it (no ``dir_fd``
  tricks), signals to other processes, and gc object walks (that could reach the hook). A refusal raises
  ``PermissionError``; when uncaught the program exits with status "refused".

Which layers really took effect is reported per run in ``SandboxResult.protections`` (the child reports the
kernel ones through a pipe it closes before the user code starts). Known gaps: as root the program keeps uid 0,
so the kernel does not stop it writing root-owned files, only the audit hook does; reads are not restricted;
with ``max_processes > 1`` as root only the audit-hook counter and the deadline bound process creation.
"""
from __future__ import annotations

import ctypes
import fcntl
import math
import os
import platform
import re
import resource
import secrets
import selectors
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Tuple

from megadare.rewards import sandbox_child
from megadare.rewards.sandbox_child import EXIT_MEMORY, EXIT_REFUSED

__all__ = ["SandboxResult", "run_program", "OUTPUT_LIMIT", "STATUSES"]

OUTPUT_LIMIT = 1 << 20          # bytes of stdout + stderr kept; beyond it the program is killed
STATUSES = ("ok", "error", "timeout", "memory", "refused")
_NPROC_SLACK = 64               # RLIMIT_NPROC headroom for threads of other processes of the same (non-root) user


@dataclass
class SandboxResult:
    """Outcome of one sandboxed run.

    ``status``: "ok" (exit 0), "error" (non-zero exit, crash, or output over the cap: ``truncated``),
    "timeout" (wall deadline or RLIMIT_CPU), "memory" (MemoryError / killed for memory), "refused" (an
    audit-hook refusal ended the program). ``protections`` names the layers that were active.
    """
    status: str
    returncode: Optional[int]
    stdout: str
    stderr: str
    wall_s: float
    protections: Tuple[str, ...] = ()
    truncated: bool = False
    tests_passed: Optional[bool] = None   # test mode: the tests ran to their end (token received); else None

    @property
    def ok(self) -> bool:
        return self.status == "ok"


# ---------------------------------------------------------------------------------------------- child bootstrap
_BOOTSTRAP = Path(sandbox_child.__file__).read_text(encoding="utf-8")


# ------------------------------------------------------------------------------------------------ kernel layers
_CLONE_NEWUSER = 0x10000000
_CLONE_NEWNET = 0x40000000
_CLONE_THREAD = 0x00010000
_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_SECCOMP = 22
_PR_CAPBSET_DROP = 24
_SECCOMP_MODE_FILTER = 2
_AUDIT_ARCH_X86_64 = 0xC000003E
_RET_ALLOW, _RET_ERRNO, _RET_KILL_PROCESS = 0x7FFF0000, 0x00050000, 0x80000000
_EPERM, _ENOSYS = 1, 38
# x86-64 syscall numbers
_NR = {"socket": 41, "clone": 56, "fork": 57, "vfork": 58, "kill": 62, "ptrace": 101, "mknod": 133,
       "pivot_root": 155, "chroot": 161, "mount": 165, "umount2": 166, "swapon": 167, "swapoff": 168,
       "reboot": 169, "init_module": 175, "delete_module": 176, "tkill": 200, "tgkill": 234,
       "kexec_load": 246, "add_key": 248,
       "request_key": 249, "keyctl": 250, "mknodat": 259, "unshare": 272, "perf_event_open": 298,
       "name_to_handle_at": 303, "open_by_handle_at": 304, "setns": 308, "process_vm_readv": 310,
       "process_vm_writev": 311, "finit_module": 313, "kexec_file_load": 320, "bpf": 321, "userfaultfd": 323,
       "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
       "clone3": 435}
_ALWAYS_DENIED = ("ptrace", "mknod", "mknodat", "pivot_root", "chroot", "mount", "umount2", "swapon", "swapoff",
                  "reboot", "init_module", "delete_module", "finit_module", "kexec_load", "kexec_file_load",
                  "add_key", "request_key", "keyctl", "unshare", "setns", "perf_event_open", "name_to_handle_at",
                  "open_by_handle_at", "process_vm_readv", "process_vm_writev", "bpf", "userfaultfd",
                  "open_tree", "move_mount", "fsopen", "fsconfig", "fsmount", "fspick")


def _bpf(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("HBBI", code, jt, jf, k & 0xFFFFFFFF)


def _seccomp_program(deny_processes: bool, pid: int) -> bytes:
    """Classic-BPF seccomp filter for x86-64 (see the module docstring for what it refuses); ``pid`` is the
    sandboxed process itself, the only target it may signal when ``deny_processes``."""
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    errno = _RET_ERRNO | _EPERM
    p = [_bpf(ld, 4),                                       # A = arch
         _bpf(jeq, _AUDIT_ARCH_X86_64, 1, 0), _bpf(ret, _RET_KILL_PROCESS),   # i386 ABI: kill
         _bpf(ld, 0),                                       # A = syscall nr
         _bpf(jge, 0x40000000, 0, 1), _bpf(ret, errno)]     # x32 ABI: refuse
    for name in _ALWAYS_DENIED:
        p += [_bpf(jeq, _NR[name], 0, 1), _bpf(ret, errno)]
    p += [_bpf(jeq, _NR["clone3"], 0, 1), _bpf(ret, _RET_ERRNO | _ENOSYS)]   # glibc falls back to clone
    p += [_bpf(jeq, _NR["socket"], 0, 4), _bpf(ld, 16),    # socket(family, ...): AF_UNIX only
          _bpf(jeq, 1, 0, 1), _bpf(ret, _RET_ALLOW), _bpf(ret, errno)]
    if deny_processes:  # signals only to itself / its own group
        p += [_bpf(jeq, _NR["kill"], 0, 6), _bpf(ld, 16),
              _bpf(jeq, 0, 3, 0), _bpf(jeq, pid, 2, 0), _bpf(jeq, -pid, 1, 0), _bpf(ret, errno),
              _bpf(ret, _RET_ALLOW)]
        p += [_bpf(jeq, _NR["tgkill"], 0, 4), _bpf(ld, 16),
              _bpf(jeq, pid, 0, 1), _bpf(ret, _RET_ALLOW), _bpf(ret, errno)]
        p += [_bpf(jeq, _NR["tkill"], 0, 1), _bpf(ret, errno)]
    else:  # children exist and may be signalled; only kill(-1, sig) is refused
        p += [_bpf(jeq, _NR["kill"], 0, 4), _bpf(ld, 16),
              _bpf(jeq, 0xFFFFFFFF, 0, 1), _bpf(ret, errno), _bpf(ret, _RET_ALLOW)]
    if deny_processes:
        p += [_bpf(jeq, _NR["fork"], 0, 1), _bpf(ret, errno),
              _bpf(jeq, _NR["vfork"], 0, 1), _bpf(ret, errno),
              _bpf(jeq, _NR["clone"], 0, 4), _bpf(ld, 16),  # clone(flags, ...): threads only
              _bpf(jset, _CLONE_THREAD, 0, 1), _bpf(ret, _RET_ALLOW), _bpf(ret, errno)]
    p.append(_bpf(ret, _RET_ALLOW))
    return b"".join(p)


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def _libc() -> Optional[ctypes.CDLL]:
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


_LIBC = _libc()


def _user_task_count(uid: int) -> int:
    """Tasks (processes + threads) of ``uid``: what RLIMIT_NPROC is checked against."""
    n = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            if int(fields["Uid"].split()[0]) == uid:
                n += int(fields.get("Threads", "1"))
        except (OSError, KeyError, ValueError):
            continue
    return n


def _make_preexec(report_fd: int, limits: List[Tuple[str, int, Tuple[int, int]]], root: bool,
                  seccomp_deny_processes: Optional[bool]) -> Callable[[], None]:
    """The function run in the child between fork and exec: limits, namespaces, capabilities, seccomp.

    It never raises (a failing layer is simply not reported) and touches no locks a parent thread could hold:
    setrlimit, unshare, prctl, and building the seccomp program (which needs the child's own pid).
    """
    libc = _LIBC
    unshare = getattr(os, "unshare", None)
    flags = _CLONE_NEWNET if root else (_CLONE_NEWUSER | _CLONE_NEWNET)

    def preexec() -> None:
        done = []
        for name, res, val in limits:
            try:
                resource.setrlimit(res, val)
                done.append(name)
            except (ValueError, OSError):
                pass
        try:
            if unshare is not None:
                unshare(flags)
                done.append("netns")
            elif libc is not None and libc.unshare(flags) == 0:
                done.append("netns")
        except OSError:
            pass
        if root and libc is not None:
            ok = True
            for cap in range(64):
                if libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 and ctypes.get_errno() != 22:  # EINVAL: no cap
                    ok = False
            if ok:
                done.append("no_capabilities")
        if seccomp_deny_processes is not None and libc is not None:
            code = _seccomp_program(seccomp_deny_processes, os.getpid())
            buf = ctypes.create_string_buffer(code)  # referenced until the prctl below has copied it
            prog = _SockFprog(len(code) // 8, ctypes.addressof(buf))
            if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0 and \
                    libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) == 0:
                done.append("seccomp")
        try:
            os.write(report_fd, ("\n".join(done) + "\n").encode())
        except OSError:
            pass
    return preexec


# ------------------------------------------------------------------------------------------------------- runner
def _env(workdir: str) -> dict:
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1", "PYTHONIOENCODING": "utf-8"}


def _exited(pid: int) -> bool:
    """Has ``pid`` exited? (without reaping it, so its process group id cannot be reused before killpg)"""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _killpg(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _rmtree(path: str) -> None:
    def onerror(func, p, _exc):  # a program may leave read-only dirs behind
        try:
            os.chmod(os.path.dirname(p), 0o700)
            os.chmod(p, 0o700)
            func(p)
        except OSError:
            pass
    shutil.rmtree(path, onerror=onerror)


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


def _limits(memory_mb: int, cpu: int, file_size_mb: int, max_open_files: int, max_processes: int,
            is_root: bool) -> List[Tuple[str, int, Tuple[int, int]]]:
    mem, fsize = int(memory_mb) * 2**20, int(file_size_mb) * 2**20
    limits = [("rlimit_as", resource.RLIMIT_AS, (mem, mem)),
              ("rlimit_cpu", resource.RLIMIT_CPU, (cpu, cpu + 1)),
              ("rlimit_fsize", resource.RLIMIT_FSIZE, (fsize, fsize)),
              ("rlimit_core", resource.RLIMIT_CORE, (0, 0)),
              ("rlimit_nofile", resource.RLIMIT_NOFILE, (max_open_files, max_open_files))]
    if not is_root:  # the kernel ignores RLIMIT_NPROC for uid 0
        nproc = _user_task_count(os.getuid()) + max(1, max_processes) + _NPROC_SLACK
        limits.append(("rlimit_nproc", resource.RLIMIT_NPROC, (nproc, nproc)))
    return limits


def _write(path: str, text: str) -> str:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return path


def run_program(code: str, stdin: str = "", timeout_s: float = 5.0, memory_mb: int = 512,
                max_processes: int = 1, cpu_s: Optional[float] = None, *, tests: Optional[str] = None,
                preload: Sequence[str] = (),
                output_limit: int = OUTPUT_LIMIT, file_size_mb: int = 16, max_open_files: int = 256,
                allow_site_packages: bool = False, audit_hook: bool = True) -> SandboxResult:
    """Run the Python program ``code`` with ``stdin`` in a fresh sandbox (see the module docstring).

    ``tests``: Python test code run after the program, in test mode (:mod:`.sandbox_child`); the result's
    ``tests_passed`` is True only when the tests ran to their end (proven with a one-time token), never from the
    exit status or the output alone. ``preload``: modules imported before the audit hook is installed (trusted
    packages the tests need whose import the hook would refuse: numpy loads ctypes). ``max_processes`` counts the program itself: 1 (default) forbids child
    processes; more allows that many (audit-hook counter, plus RLIMIT_NPROC when not root). ``cpu_s`` defaults to
    ``timeout_s + 1``. ``audit_hook=False`` leaves only the OS layers: for testing them, never for real use.
    Raises RuntimeError when the sandbox itself cannot start (that is no verdict on the program).
    """
    if tests is not None and not audit_hook:
        raise ValueError("test mode needs the audit hook (it carries the proof that the tests ran)")
    if not all(re.fullmatch(r"[A-Za-z_][\w.]*", m) for m in preload):
        raise ValueError(f"preload={list(preload)!r}: module names only")
    t0 = time.monotonic()
    workdir = os.path.realpath(tempfile.mkdtemp(prefix="megadare_sbx_"))
    fds = list(os.pipe()) + list(os.pipe()) + list(os.pipe())   # report, token, proof (read, write each)
    is_root = os.geteuid() == 0
    token = secrets.token_hex(16).encode()
    try:
        main = _write(os.path.join(workdir, "main.py"), code)
        tests_path = _write(os.path.join(workdir, "tests.py"), tests) if tests is not None else ""
        os.write(fds[3], token)
        cpu = max(1, math.ceil(cpu_s if cpu_s is not None else timeout_s + 1))
        limits = _limits(memory_mb, cpu, file_size_mb, max_open_files, max_processes, is_root)
        seccomp = (max_processes <= 1) if platform.machine() == "x86_64" and _LIBC else None
        argv = [sys.executable, "-I", "-B", "-X", "utf8"] + ([] if allow_site_packages else ["-S"])
        argv += ["-c", _BOOTSTRAP, str(fds[1]), main, workdir, str(max(0, max_processes - 1)),
                 "1" if audit_hook else "0", tests_path, str(fds[2]), str(fds[5]), ",".join(preload)]
        with tempfile.TemporaryFile() as stdin_file:
            stdin_file.write(stdin.encode("utf-8"))
            stdin_file.seek(0)
            try:
                proc = subprocess.Popen(argv, stdin=stdin_file, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        cwd=workdir, env=_env(workdir), start_new_session=True, close_fds=True,
                                        pass_fds=(fds[1], fds[2], fds[5]),
                                        preexec_fn=_make_preexec(fds[1], limits, is_root, seccomp))
            except (OSError, subprocess.SubprocessError) as e:
                raise RuntimeError(f"sandbox: could not start the program: {e}") from e
        for k in (1, 2, 3, 5):  # the child's ends, and the token (written)
            os.close(fds[k])
            fds[k] = -1
        out, err, timed_out, truncated = _collect(proc, t0 + timeout_s, output_limit)
        rc, cpu_used = _reap(proc)
        protections = ["new_session", "scrubbed_env", "wall_timeout", "output_cap", "fresh_tmpdir"]
        protections += _read_report(fds[0])
        stdout = out.decode("utf-8", errors="replace")
        stderr = err.decode("utf-8", errors="replace")
        if truncated:
            stderr += f"\n[sandbox] output over {output_limit} bytes; program killed"
        if timed_out:
            stderr += f"\n[sandbox] wall-clock timeout after {timeout_s:g}s; process group killed"
        status = _classify(rc, timed_out, truncated, stderr, cpu_used >= cpu)
        passed = None if tests is None else (status == "ok" and _drain(fds[4]) == token)
        return SandboxResult(status, rc, stdout, stderr, time.monotonic() - t0, tuple(protections), truncated,
                             passed)
    finally:
        for fd in fds:
            if fd >= 0:
                os.close(fd)
        _rmtree(workdir)


def _collect(proc: subprocess.Popen, deadline: float, limit: int) -> Tuple[bytes, bytes, bool, bool]:
    """Read stdout/stderr until exit, deadline or ``limit`` bytes; then kill the process group and drain."""
    assert proc.stdout is not None and proc.stderr is not None
    out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
    bufs = {out_fd: bytearray(), err_fd: bytearray()}
    sel = selectors.DefaultSelector()
    for fd in bufs:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    total, timed_out, truncated = 0, False, False
    try:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = not _exited(proc.pid)
                break
            if not sel.get_map():
                if _exited(proc.pid):
                    break
                time.sleep(min(0.005, remaining))
                continue
            events = sel.select(timeout=min(0.05, remaining))
            for key, _ in events:
                chunk = _read(key.fd)
                if chunk is None:
                    continue
                if not chunk:
                    sel.unregister(key.fd)
                    continue
                total += len(chunk)
                bufs[key.fd] += chunk
                if total > limit:
                    truncated = True
            if truncated:
                break
            if not events and _exited(proc.pid):  # exited, but something still holds the pipes
                break
        _killpg(proc.pid)
        drain_until = time.monotonic() + 0.5
        while sel.get_map() and time.monotonic() < drain_until and not truncated:
            for key, _ in sel.select(timeout=0.05):
                chunk = _read(key.fd)
                if chunk == b"":
                    sel.unregister(key.fd)
                elif chunk:
                    bufs[key.fd] += chunk
                    total += len(chunk)
                    truncated = total > limit
    finally:
        sel.close()
        proc.stdout.close()
        proc.stderr.close()
    out_b, err_b = bufs[out_fd], bufs[err_fd]
    if truncated:
        out_b, err_b = out_b[:limit], err_b[:limit]
    return bytes(out_b), bytes(err_b), timed_out, truncated


def _reap(proc: subprocess.Popen) -> Tuple[int, float]:
    """Wait for the (already killed or exited) program: its exit code and the CPU seconds it used."""
    try:
        _, status, usage = os.wait4(proc.pid, 0)
    except ChildProcessError:
        return proc.wait(), 0.0
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, usage.ru_utime + usage.ru_stime


def _read(fd: int) -> Optional[bytes]:
    try:
        return os.read(fd, 1 << 16)
    except BlockingIOError:
        return None
    except OSError:
        return b""


def _drain(fd: int, limit: int = 4096) -> bytes:
    """What the (exited) child wrote to a pipe, up to ``limit`` bytes, without blocking."""
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_NONBLOCK)
    data = b""
    try:
        while len(data) < limit:
            chunk = os.read(fd, limit)
            if not chunk:
                break
            data += chunk
    except BlockingIOError:
        pass
    return data


def _read_report(fd: int) -> List[str]:
    """Names of the layers the child reported (nothing if it died before reporting)."""
    return [line for line in _drain(fd).decode(errors="replace").split() if line]
