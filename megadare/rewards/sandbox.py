"""Run one untrusted Python program with limits: the execution layer of the code rewards.

``run_program(code, stdin)`` starts ``sys.executable -I -S -B`` (isolated mode, stdlib only unless
``allow_site_packages``) in a fresh subprocess, in its own session (``start_new_session=True``), and returns a
:class:`SandboxResult`. The program and its tests reach the child as unlinked files (never as files it could
read back: tests read by the program would let it print their answers); stdin is a sealed memfd (readable, never
writable: no file of the trainer's changes, and the program gets no executable file it could fill). Two isolations
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
new network namespace: only a down loopback). Where the kernel refuses any of this (unprivileged user namespaces
disabled, a container that forbids unshare or mount), code rewards are refused with
:class:`~megadare.rewards.errors.SandboxUnavailable`, naming ``rewards.code.isolation=process``: never a silent
fallback.

``process``: the weaker guard, a fresh temp dir as cwd in the machine's own filesystem, a private network
namespace when the kernel allows it and, as root, an empty capability bounding set (the program keeps uid 0).

Both keep the other layers, outermost first:

* parent side: scrubbed environment (minimal PATH, no proxies, HOME/TMPDIR = the temp dir), stdin from a memfd,
  stdout/stderr read with a size cap (default 1 MiB; an overflowing program is killed), a wall-clock deadline
  after which the whole process group gets SIGKILL (``os.killpg``), and the group is killed after every run;
  ``oom_score_adj`` 1000 (the OOM killer takes sandboxed programs before the trainer);
* kernel side: ``RLIMIT_AS`` (memory), ``RLIMIT_CPU``, ``RLIMIT_FSIZE``, ``RLIMIT_CORE=0``, ``RLIMIT_NOFILE``,
  ``RLIMIT_NPROC`` (non-root only: it counts every task of the user, so it is set to the current count +
  ``max_processes`` + slack; the kernel ignores it for root), set before exec; on x86-64 a seccomp filter: no new
  processes unless ``max_processes > 1`` (fork/vfork/clone without CLONE_THREAD -> EPERM, clone3 -> ENOSYS so
  threads fall back to clone), no sockets except AF_UNIX, no ptrace/process_vm_*/pidfd_getfd,
  mount/namespaces/chroot/mknod/modules/bpf/kexec/reboot, io_uring, memfd_create/memfd_secret, syslog,
  prctl(PR_SET_DUMPABLE), signals only to itself (any pid but -1 when ``max_processes > 1``; never through
  pidfd_send_signal or rt_(tg)sigqueueinfo, whose target kill's check does not see);
* inside the child, a bootstrap passed with ``-c`` installs ``sys.addaudithook`` before the user code runs. It
  refuses sockets, ctypes, ``_posixsubprocess`` (stubbed out), process creation (fork, posix_spawn,
  subprocess, os.system, exec; counted when ``max_processes > 1``), writing/creating/removing/renaming/linking/
  chmod-ing paths outside the temp dir (paths resolved; no ``..`` in them, no new symlinks and no chdir out
  of it, so a racing thread cannot re-aim a checked path), opening directories outside it (no ``dir_fd``
  tricks), signals to other processes (with ``max_processes > 1``: outside its own process group), gc object
  walks (that could reach the hook), sub-interpreters (they have no audit hook) and native code from files outside
  this Python's directories (a shared object the program wrote; test mode closes more, see
  :mod:`.sandbox_child`). A refusal raises
  ``PermissionError``; when uncaught the program exits with status "refused". The hook sees only what Python
  reports: C libraries (readline, sqlite3) write files without an ``open`` event, which is why the namespaces
  exist.

Which layers really took effect is reported per run in ``SandboxResult.protections`` (the child reports them
through a pipe it closes before the user code starts); in ``namespaces`` mode a run whose report lacks one of them
raises instead of returning. Known gaps of ``process`` mode: the program keeps uid 0 as root and reads whatever
the trainer's user can; C-level writes outside the temp dir go through (and a ``str`` subclass shows the hook's path
checks another path than the syscall uses), so no file of the trainer's user is safe and a test verdict can be
forged; children that call ``setsid`` outlive the run.
"""

from __future__ import annotations

import contextlib
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
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, NamedTuple, Optional, Sequence, Tuple

from megadare.rewards import sandbox_child, sandbox_jail
from megadare.rewards.errors import SandboxUnavailable
from megadare.rewards.sandbox_child import EXIT_MEMORY, EXIT_REFUSED

__all__ = ["SandboxResult", "run_program", "OUTPUT_LIMIT", "STATUSES", "ISOLATIONS", "set_isolation", "check_isolation"]

OUTPUT_LIMIT = 1 << 20  # bytes of stdout + stderr kept; beyond it the program is killed
STATUSES = ("ok", "error", "timeout", "memory", "refused")
_NPROC_SLACK = 64  # RLIMIT_NPROC headroom for threads of other processes of the same (non-root) user
SETUP_LIMIT_S = 60.0  # the sandbox's own start (before the program's timeout_s begins), however loaded


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
    tests_passed: Optional[bool] = None  # test mode: the tests ran to their end (token received); else None
    pgid: Optional[int] = None  # the run's process group on this machine (all of it is killed after)

    @property
    def ok(self) -> bool:
        return self.status == "ok"


# ---------------------------------------------------------------------------------------------- child bootstrap
_BOOTSTRAP = Path(sandbox_child.__file__).read_text(encoding="utf-8")
_JAIL = Path(sandbox_jail.__file__).read_text(encoding="utf-8")


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
_NR = {
    "socket": 41,
    "clone": 56,
    "fork": 57,
    "vfork": 58,
    "kill": 62,
    "ptrace": 101,
    "syslog": 103,
    "rt_sigqueueinfo": 129,
    "mknod": 133,
    "prctl": 157,
    "pivot_root": 155,
    "chroot": 161,
    "mount": 165,
    "umount2": 166,
    "swapon": 167,
    "swapoff": 168,
    "reboot": 169,
    "init_module": 175,
    "delete_module": 176,
    "tkill": 200,
    "tgkill": 234,
    "kexec_load": 246,
    "add_key": 248,
    "request_key": 249,
    "keyctl": 250,
    "mknodat": 259,
    "unshare": 272,
    "perf_event_open": 298,
    "name_to_handle_at": 303,
    "open_by_handle_at": 304,
    "setns": 308,
    "process_vm_readv": 310,
    "process_vm_writev": 311,
    "finit_module": 313,
    "kexec_file_load": 320,
    "bpf": 321,
    "userfaultfd": 323,
    "open_tree": 428,
    "move_mount": 429,
    "fsopen": 430,
    "fsconfig": 431,
    "fsmount": 432,
    "fspick": 433,
    "clone3": 435,
    "rt_tgsigqueueinfo": 297,
    "memfd_create": 319,
    "pidfd_send_signal": 424,
    "io_uring_setup": 425,
    "io_uring_enter": 426,
    "io_uring_register": 427,
    "pidfd_getfd": 438,
    "memfd_secret": 447,
}
_ALWAYS_DENIED = (
    "ptrace",
    "mknod",
    "mknodat",
    "pivot_root",
    "chroot",
    "mount",
    "umount2",
    "swapon",
    "swapoff",
    "reboot",
    "init_module",
    "delete_module",
    "finit_module",
    "kexec_load",
    "kexec_file_load",
    "add_key",
    "request_key",
    "keyctl",
    "unshare",
    "setns",
    "perf_event_open",
    "name_to_handle_at",
    "open_by_handle_at",
    "process_vm_readv",
    "process_vm_writev",
    "bpf",
    "userfaultfd",
    "open_tree",
    "move_mount",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    # signals that bypass kill's target check; fds of other processes
    "pidfd_send_signal",
    "pidfd_getfd",
    "rt_sigqueueinfo",
    "rt_tgsigqueueinfo",
    # an executable file of the program's own making (native code: no audit hook, no proof)
    "memfd_create",
    "memfd_secret",
    # io_uring (a second syscall interface seccomp does not see into), the kernel log
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "syslog",
)
_PR_SET_DUMPABLE = 4


def _bpf(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("HBBI", code, jt, jf, k & 0xFFFFFFFF)


def _seccomp_program(deny_processes: bool, pid: int, own_group: bool = True) -> bytes:
    """Classic-BPF seccomp filter for x86-64 (see the module docstring for what it refuses); ``pid`` is the
    sandboxed process itself, the only target it may signal when ``deny_processes`` (with its own process group,
    kill(0) / kill(-pid), when ``own_group``: in a PID namespace the group is the keeper's, and -1 is everyone)."""
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    errno = _RET_ERRNO | _EPERM
    p = [
        _bpf(ld, 4),  # A = arch
        _bpf(jeq, _AUDIT_ARCH_X86_64, 1, 0),
        _bpf(ret, _RET_KILL_PROCESS),  # i386 ABI: kill
        _bpf(ld, 0),  # A = syscall nr
        _bpf(jge, 0x40000000, 0, 1),
        _bpf(ret, errno),
    ]  # x32 ABI: refuse
    for name in _ALWAYS_DENIED:
        p += [_bpf(jeq, _NR[name], 0, 1), _bpf(ret, errno)]
    p += [_bpf(jeq, _NR["clone3"], 0, 1), _bpf(ret, _RET_ERRNO | _ENOSYS)]  # glibc falls back to clone
    p += [
        _bpf(jeq, _NR["socket"], 0, 4),
        _bpf(ld, 16),  # socket(family, ...): AF_UNIX only
        _bpf(jeq, 1, 0, 1),
        _bpf(ret, _RET_ALLOW),
        _bpf(ret, errno),
    ]
    p += [
        _bpf(jeq, _NR["prctl"], 0, 4),
        _bpf(ld, 16),  # prctl(PR_SET_DUMPABLE, ...): no core dumps
        _bpf(jeq, _PR_SET_DUMPABLE, 0, 1),
        _bpf(ret, errno),
        _bpf(ret, _RET_ALLOW),
    ]
    if deny_processes and own_group:  # signals only to itself / its own group
        p += [
            _bpf(jeq, _NR["kill"], 0, 6),
            _bpf(ld, 16),
            _bpf(jeq, 0, 3, 0),
            _bpf(jeq, pid, 2, 0),
            _bpf(jeq, -pid, 1, 0),
            _bpf(ret, errno),
            _bpf(ret, _RET_ALLOW),
        ]
    if deny_processes and not own_group:  # signals only to itself
        p += [_bpf(jeq, _NR["kill"], 0, 4), _bpf(ld, 16), _bpf(jeq, pid, 0, 1), _bpf(ret, _RET_ALLOW), _bpf(ret, errno)]
    if deny_processes:
        p += [
            _bpf(jeq, _NR["tgkill"], 0, 4),
            _bpf(ld, 16),
            _bpf(jeq, pid, 0, 1),
            _bpf(ret, _RET_ALLOW),
            _bpf(ret, errno),
        ]
        p += [_bpf(jeq, _NR["tkill"], 0, 1), _bpf(ret, errno)]
    else:  # children exist and may be signalled; only kill(-1, sig) is refused
        p += [
            _bpf(jeq, _NR["kill"], 0, 4),
            _bpf(ld, 16),
            _bpf(jeq, 0xFFFFFFFF, 0, 1),
            _bpf(ret, errno),
            _bpf(ret, _RET_ALLOW),
        ]
    if deny_processes:
        p += [
            _bpf(jeq, _NR["fork"], 0, 1),
            _bpf(ret, errno),
            _bpf(jeq, _NR["vfork"], 0, 1),
            _bpf(ret, errno),
            _bpf(jeq, _NR["clone"], 0, 4),
            _bpf(ld, 16),  # clone(flags, ...): threads only
            _bpf(jset, _CLONE_THREAD, 0, 1),
            _bpf(ret, _RET_ALLOW),
            _bpf(ret, errno),
        ]
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


def _make_preexec(
    report_fd: int,
    limits: List[Tuple[str, int, Tuple[int, int]]],
    root: bool,
    seccomp_deny_processes: Optional[bool],
    namespaces: bool,
) -> Callable[[], None]:
    """The function run in the child between fork and exec: the limits and, in ``process`` isolation, a network
    namespace, an empty capability bounding set and seccomp (``namespaces`` isolation sets those up in the
    child's bootstrap, :mod:`.sandbox_jail`, where they must come after the mounts).

    It never raises (a failing layer is simply not reported) and touches no locks a parent thread could hold:
    setrlimit, unshare, prctl, and building the seccomp program (which needs the child's own pid).
    """

    def preexec() -> None:
        done = []
        for name, res, val in limits:
            try:
                resource.setrlimit(res, val)
                done.append(name)
            except (ValueError, OSError):
                pass
        if _oom_first():
            done.append("oom_first")
        if not namespaces:
            done += _process_layers(root, seccomp_deny_processes)
        try:
            os.write(report_fd, ("\n".join(done) + "\n").encode())
        except OSError:
            pass

    return preexec


def _oom_first() -> bool:
    """Make this process (and all it starts) the OOM killer's first choice, so a program's memory never gets the
    trainer killed (raising ``oom_score_adj`` needs no privilege; as root it also cannot be lowered again)."""
    try:
        fd = os.open("/proc/self/oom_score_adj", os.O_WRONLY)
        try:
            os.write(fd, b"1000")
        finally:
            os.close(fd)
        return True
    except OSError:
        return False


def _process_layers(root: bool, seccomp_deny_processes: Optional[bool]) -> List[str]:
    """``process`` isolation's kernel layers, in the child before exec; the names of those that took effect."""
    libc, done = _LIBC, []
    flags = _CLONE_NEWNET if root else (_CLONE_NEWUSER | _CLONE_NEWNET)
    if libc is not None and libc.unshare(flags) == 0:
        done.append("netns")
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
        if (
            libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0
            and libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) == 0
        ):
            done.append("seccomp")
    return done


# ----------------------------------------------------------------------------------------------------- isolation
ISOLATIONS = ("namespaces", "process")
_isolation = ["namespaces"]  # rewards.code.isolation, set by the run's entry point (set_isolation)
_refusal: List[str] = []  # why the kernel refused the namespaces, once it did (it will again)
_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32")
# what of /etc a Python program uses (dynamic loader, users, time zone, MIME types, terminfo, services, locale
# aliases, alternatives, a distribution's python3.X config); the rest of /etc (pip.conf, gitconfig, npmrc,
# environment, apt sources, ... where credentials can live) does not exist in the sandbox
_ETC_ENTRIES = (
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "nsswitch.conf",
    "passwd",
    "group",
    "hosts",
    "host.conf",
    "protocols",
    "services",
    "localtime",
    "timezone",
    "mime.types",
    "inputrc",
    "terminfo",
    "os-release",
    "locale.alias",
    "alternatives",
    "mtab",
)
_PIVOT_ROOT_NR = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}
_NOBODY = 65534
_TMPFS_INODES = 4096


def set_isolation(mode: str) -> None:
    """Set ``rewards.code.isolation`` for this process's code rewards: "namespaces" (default) or "process"."""
    if mode not in ISOLATIONS:
        raise ValueError(f"rewards.code.isolation={mode!r} is not one of {', '.join(ISOLATIONS)}")
    _isolation[0] = mode


def check_isolation(mode: Optional[str] = None) -> Tuple[str, ...]:
    """Run a trivial program under ``mode`` (default: the configured one): the layers it got. Raises
    :class:`SandboxUnavailable` where the kernel refuses the namespaces (a pre-flight check)."""
    r = run_program("print('ok')", timeout_s=30, isolation=mode)
    if r.stdout != "ok\n":
        raise RuntimeError(f"sandbox: a trivial program failed ({r.status}): {r.stderr[-500:]}")
    return r.protections


def _refused(detail: str) -> SandboxUnavailable:
    return SandboxUnavailable(
        f"sandbox: this machine refused the OS isolation code rewards run in ({detail}), so no code reward runs. "
        "Set rewards.code.isolation=process to accept the weaker guard (rlimits, seccomp and an audit hook in a "
        "temp dir: the filesystem stays writable to C code and the home and run directory readable), or allow "
        "namespaces here (for a non-root trainer, unprivileged user namespaces: sysctl user.max_user_namespaces > 0, "
        "kernel.unprivileged_userns_clone=1 on Debian, kernel.apparmor_restrict_unprivileged_userns=0 on Ubuntu; in a "
        "container: run it with CAP_SYS_ADMIN, or without its seccomp / AppArmor profile)"
    )


def _python_dirs(site_packages: bool) -> List[str]:
    """The directories this interpreter needs: prefixes (venv and base), where the executable really lives, and
    with ``site_packages`` the site-packages directories on ``sys.path`` (a ``.pth`` may add another venv's; never
    the source trees of editable installs)."""
    exe = os.path.realpath(sys.executable)
    dirs = {sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix, os.path.dirname(os.path.dirname(exe))}
    if site_packages:
        dirs |= {p for p in sys.path if os.path.basename(p.rstrip("/")) in ("site-packages", "dist-packages")}
    return sorted({os.path.normpath(d) for d in dirs} | {os.path.realpath(d) for d in dirs})


def _under(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


def _etc_python() -> List[str]:
    try:
        return [e for e in os.listdir("/etc") if e.startswith("python")]
    except OSError:
        return []


def _visible_paths(site_packages: bool) -> Tuple[List[List[str]], List[List[str]]]:
    """``(symlinks, binds)`` that show the system directories and this Python in the sandbox's root, and nothing
    else. A directory under another bind or a symlink of the list is visible already (the prefixes are listed as
    spelled and as real paths); parents come first, so no directory is ever made through a bind."""
    etc = [os.path.join("/etc", e) for e in _ETC_ENTRIES + tuple(sorted(_etc_python()))]
    links = [[os.readlink(d), d] for d in _SYSTEM_DIRS + tuple(etc) if os.path.islink(d)]
    binds = [[d, d] for d in _SYSTEM_DIRS if os.path.isdir(d) and not os.path.islink(d)]
    binds += [[e, e] for e in etc if os.path.exists(e) and not os.path.islink(e)]
    for d in _python_dirs(site_packages):
        if d != "/" and os.path.isdir(d) and not any(_under(d, dst) for _, dst in binds + links):
            binds.append([d, d])
    return links, binds


def _jail_plan(workdir: str, is_root: bool, tmpfs_mb: int, seccomp: Optional[bytes], site_packages: bool) -> dict:
    """What :mod:`.sandbox_jail` builds for one run (see there)."""
    nr = _PIVOT_ROOT_NR.get(platform.machine())
    if nr is None:
        raise _refused(f"no pivot_root syscall number known for {platform.machine()}")
    links, binds = _visible_paths(site_packages)
    inside = [dst for _, dst in binds + links if _under(workdir, dst)]
    if inside:
        raise RuntimeError(
            f"sandbox: the temp dir {workdir} lies inside {inside[0]}, which the sandbox shows "
            "read-only; point TMPDIR elsewhere"
        )
    uid, gid = (_NOBODY, _NOBODY) if is_root else (os.geteuid(), os.getegid())
    paths = sysconfig.get_paths()
    return {
        "workdir": workdir,
        "symlinks": links,
        "binds": binds,
        "uid": uid,
        "gid": gid,
        "tmpfs_mb": tmpfs_mb,
        "tmpfs_inodes": _TMPFS_INODES,
        "seccomp": seccomp.hex() if seccomp else "",
        "pivot_root_nr": nr,
        "must_see": sorted({paths["stdlib"], paths["platstdlib"], paths["purelib"], os.path.dirname(os.__file__)}),
    }


def _required_layers(seccomp: bool) -> frozenset:
    """The isolation layers a ``namespaces`` run must report (the rlimits are best effort, as in ``process``: a
    trainer's own lower hard limit stands)."""
    return frozenset(
        ("netns", "pidns", "mntns", "ipcns", "read_only_root", "private_tmpfs", "no_capabilities", "no_new_privs")
        + (("seccomp",) if seccomp else ())
    )


# ------------------------------------------------------------------------------------------------------- runner
def _env(workdir: str) -> dict:
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": workdir,
        "TMPDIR": workdir,
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONIOENCODING": "utf-8",
    }


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


def _limits(
    memory_mb: int, cpu: int, file_size_mb: int, max_open_files: int, max_processes: int, is_root: bool
) -> List[Tuple[str, int, Tuple[int, int]]]:
    mem, fsize = int(memory_mb) * 2**20, int(file_size_mb) * 2**20
    limits = [
        ("rlimit_as", resource.RLIMIT_AS, (mem, mem)),
        ("rlimit_cpu", resource.RLIMIT_CPU, (cpu, cpu + 1)),
        ("rlimit_fsize", resource.RLIMIT_FSIZE, (fsize, fsize)),
        ("rlimit_core", resource.RLIMIT_CORE, (0, 0)),
        ("rlimit_nofile", resource.RLIMIT_NOFILE, (max_open_files, max_open_files)),
    ]
    if not is_root:  # the kernel ignores RLIMIT_NPROC for uid 0
        nproc = _user_task_count(os.getuid()) + max(1, max_processes) + _NPROC_SLACK
        limits.append(("rlimit_nproc", resource.RLIMIT_NPROC, (nproc, nproc)))
    return limits


@contextlib.contextmanager
def _sealed(text: str):
    """``text`` in a sealed memfd at offset 0: the program's stdin, which it can read but never write (no file of the
    trainer's changed, and no executable file of the program's own making: a writable inherited file would be one)."""
    fd = os.memfd_create("megadare_stdin", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        view = memoryview(text.encode("utf-8"))
        while view:
            view = view[os.write(fd, view) :]
        os.lseek(fd, 0, os.SEEK_SET)
        fcntl.fcntl(
            fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE
        )
        yield fd
    finally:
        os.close(fd)


@contextlib.contextmanager
def _unlinked(text: Optional[str]):
    """``text`` in an unlinked temp file (rewound), or None: what the child reads from an inherited fd."""
    if text is None:
        yield None
        return
    with tempfile.TemporaryFile() as f:
        f.write(text.encode("utf-8"))
        f.seek(0)
        yield f


def run_program(
    code: str,
    stdin: str = "",
    timeout_s: float = 5.0,
    memory_mb: int = 512,
    max_processes: int = 1,
    cpu_s: Optional[float] = None,
    *,
    tests: Optional[str] = None,
    preload: Sequence[str] = (),
    output_limit: int = OUTPUT_LIMIT,
    file_size_mb: int = 16,
    max_open_files: int = 256,
    allow_site_packages: bool = False,
    audit_hook: bool = True,
    isolation: Optional[str] = None,
) -> SandboxResult:
    """Run the Python program ``code`` with ``stdin`` in a fresh sandbox (see the module docstring).

    ``tests``: Python test code run after the program, in test mode (:mod:`.sandbox_child`); the result's
    ``tests_passed`` is True only when the tests ran to their end (proven with a one-time token), never from the
    exit status or the output alone. ``preload``: modules imported before the audit hook is installed (trusted
    packages the tests need whose import the hook would refuse: numpy loads ctypes). ``max_processes`` counts
    the program itself: 1 (default) forbids child processes; more allows that many (audit-hook counter, plus
    RLIMIT_NPROC when not root). ``cpu_s`` defaults to ``timeout_s + 1``. ``audit_hook=False`` leaves only the OS
    layers: for testing them, never for real use. ``isolation``: "namespaces" | "process" (default: the one
    :func:`set_isolation` set). Raises :class:`SandboxUnavailable` where the kernel refuses the namespaces, and
    RuntimeError when the sandbox itself cannot start (neither is a verdict on the program).
    """
    mode = _checked_mode(tests is not None, audit_hook, preload, isolation)
    t0 = time.monotonic()
    workdir = os.path.realpath(tempfile.mkdtemp(prefix="megadare_sbx_"))
    fds = list(os.pipe()) + list(os.pipe()) + list(os.pipe())  # report, token, proof (read, write each)
    token = secrets.token_hex(16).encode()
    try:
        os.write(fds[3], token)
        cpu = max(1, math.ceil(cpu_s if cpu_s is not None else timeout_s + 1))
        with _unlinked(code) as code_f, _unlinked(tests) as tests_f, _sealed(stdin) as stdin_f:
            boot = [
                fds[1],
                code_f.fileno(),
                tests_f.fileno() if tests_f else -1,
                workdir,
                max(0, max_processes - 1),
                int(audit_hook),
                fds[2],
                fds[5],
                ",".join(preload),
            ]
            proc = _start(
                mode,
                boot,
                stdin_f,
                allow_site_packages,
                _limits(memory_mb, cpu, file_size_mb, max_open_files, max_processes, os.geteuid() == 0),
                file_size_mb,
            )
        for k in (1, 2, 3, 5):  # the child's ends, and the token (written)
            os.close(fds[k])
            fds[k] = -1
        got = _collect(proc, timeout_s, output_limit, fds[0])
        rc, cpu_used = _reap(proc)
        _check_report(mode, got, max_processes)
        stdout = got.stdout.decode("utf-8", errors="replace")
        stderr = got.stderr.decode("utf-8", errors="replace")
        if got.truncated:
            stderr += f"\n[sandbox] output over {output_limit} bytes; program killed"
        if got.timed_out:
            stderr += f"\n[sandbox] wall-clock timeout after {timeout_s:g}s; process group killed"
        status = _classify(rc, got.timed_out, got.truncated, stderr, cpu_used >= cpu)
        passed = None if tests is None else (status == "ok" and _drain(fds[4]) == token)
        protections = ("new_session", "scrubbed_env", "wall_timeout", "output_cap", "fresh_tmpdir", *got.report)
        return SandboxResult(
            status, rc, stdout, stderr, time.monotonic() - t0, protections, got.truncated, passed, proc.pid
        )
    finally:
        for fd in fds:
            if fd >= 0:
                os.close(fd)
        _rmtree(workdir)


def _checked_mode(test_mode: bool, audit_hook: bool, preload: Sequence[str], isolation: Optional[str]) -> str:
    """run_program's arguments checked; the isolation mode it runs in."""
    if test_mode and not audit_hook:
        raise ValueError("test mode needs the audit hook (it carries the proof that the tests ran)")
    if not all(re.fullmatch(r"[A-Za-z_][\w.]*", m) for m in preload):
        raise ValueError(f"preload={list(preload)!r}: module names only")
    mode = isolation or _isolation[0]
    if mode not in ISOLATIONS:
        raise ValueError(f"isolation={mode!r} is not one of {', '.join(ISOLATIONS)}")
    if mode == "namespaces" and _refusal:
        raise _refused(_refusal[0])
    return mode


def _seccomp_denies_processes(max_processes: int) -> Optional[bool]:
    """The seccomp filter's ``deny_processes``, or None where the filter is not available (not x86-64)."""
    return (max_processes <= 1) if platform.machine() == "x86_64" and _LIBC else None


def _start(
    mode: str, boot: list, stdin_f, allow_site_packages: bool, limits: list, file_size_mb: int
) -> subprocess.Popen:
    """Start the child: ``boot`` = the bootstrap's arguments (report fd, code fd, tests fd, workdir, children
    allowed, audit hook, token fd, proof fd, preload); in ``namespaces`` mode the jail's plan and source follow."""
    is_root, workdir, deny = os.geteuid() == 0, boot[3], _seccomp_denies_processes(boot[4] + 1)
    jail = ["", ""]
    if mode == "namespaces":
        seccomp = _seccomp_program(deny, 1, own_group=False) if deny is not None else None
        plan = _jail_plan(workdir, is_root, max(64, 4 * file_size_mb), seccomp, allow_site_packages)
        jail = [repr(plan), _JAIL]
    argv = [sys.executable, "-I", "-B", "-X", "utf8"] + ([] if allow_site_packages else ["-S"])
    argv += ["-c", _BOOTSTRAP] + [str(a) for a in boot] + jail
    passed = tuple(fd for fd in (boot[0], boot[1], boot[2], boot[6], boot[7]) if fd >= 0)
    try:
        return subprocess.Popen(
            argv,
            stdin=stdin_f,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=workdir,
            env=_env(workdir),
            start_new_session=True,
            close_fds=True,
            pass_fds=passed,
            preexec_fn=_make_preexec(boot[0], limits, is_root, deny, mode == "namespaces"),
        )
    except (OSError, subprocess.SubprocessError) as e:
        raise RuntimeError(f"sandbox: could not start the program: {e}") from e


def _check_report(mode: str, got: _Collected, max_processes: int) -> None:
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
        _refusal[:] = [refusal]
        raise _refused(refusal)
    missing = _required_layers(_seccomp_denies_processes(max_processes) is not None) - set(report)
    if missing and got.started:
        raise RuntimeError(
            f"sandbox: the program started without {', '.join(sorted(missing))} (reported: "
            f"{', '.join(report) or 'nothing'})"
        )


class _Collected(NamedTuple):
    stdout: bytes
    stderr: bytes
    report: List[str]  # the lines the child reported: layers in place, or the jail's "unavailable <why>"
    timed_out: bool
    truncated: bool
    started: bool  # the child closed its report pipe: the program itself ran


def _collect(proc: subprocess.Popen, timeout_s: float, limit: int, report_fd: int) -> _Collected:
    """Read stdout/stderr until exit, deadline or ``limit`` bytes; then kill the process group and drain.

    The program's ``timeout_s`` counts from the moment the child closes its report pipe (just before the user code
    runs): the sandbox's own start (namespaces, mounts, interpreter) never eats a program's time, however loaded
    the machine; that start has :data:`SETUP_LIMIT_S` of its own.
    """
    assert proc.stdout is not None and proc.stderr is not None
    out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
    bufs = {out_fd: bytearray(), err_fd: bytearray(), report_fd: bytearray()}
    sel = selectors.DefaultSelector()
    for fd in bufs:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    total, timed_out, truncated, started = 0, False, False, False
    deadline = time.monotonic() + SETUP_LIMIT_S
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
                    if key.fd == report_fd:
                        started, deadline = True, time.monotonic() + timeout_s
                    continue
                bufs[key.fd] += chunk
                if key.fd != report_fd:
                    total += len(chunk)
                    truncated = truncated or total > limit
            if truncated:
                break
            if not events and _exited(proc.pid):  # exited, but something still holds the pipes
                break
        _killpg(proc.pid)
        total += _drain_pipes(sel, bufs, limit - total if not truncated else -1, report_fd)
        truncated = truncated or total > limit
    finally:
        sel.close()
        proc.stdout.close()
        proc.stderr.close()
    out_b, err_b = bufs[out_fd], bufs[err_fd]
    if truncated:
        out_b, err_b = out_b[:limit], err_b[:limit]
    report = [line for line in bufs[report_fd].decode(errors="replace").splitlines() if line]
    return _Collected(bytes(out_b), bytes(err_b), report, timed_out, truncated, started)


def _drain_pipes(sel: selectors.BaseSelector, bufs: dict, room: int, report_fd: int) -> int:
    """After the kill: what is left in the pipes (half a second at most; nothing when ``room`` < 0, and no more
    once the output took more than ``room`` bytes); the bytes added to stdout and stderr."""
    added, until = 0, time.monotonic() + 0.5
    while sel.get_map() and time.monotonic() < until and 0 <= room and added <= room:
        for key, _ in sel.select(timeout=0.05):
            chunk = _read(key.fd)
            if chunk == b"":
                sel.unregister(key.fd)
            elif chunk:
                bufs[key.fd] += chunk
                added += 0 if key.fd == report_fd else len(chunk)
    return added


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
