"""The sandbox's kernel layers, set in the child between fork and exec (:func:`make_preexec`): the rlimits
(:func:`rlimits`), ``oom_score_adj`` and, in ``process`` isolation, a network namespace, an empty capability
bounding set and the seccomp filter of x86-64 and aarch64 (:func:`seccomp_program`; ``namespaces`` isolation
installs the same filter from its jail, :mod:`.sandbox_jail`, after the mounts). What each layer refuses:
:mod:`.sandbox`'s docstring.
"""

from __future__ import annotations

import ctypes
import os
import platform
import resource
import struct
from typing import Callable, Dict, List, Optional, Tuple

from megadare.lifetime import PR_SET_PDEATHSIG, die_with_parent

__all__ = ["make_preexec", "rlimits", "seccomp_program", "seccomp_denies_processes"]

_NPROC_SLACK = 64  # RLIMIT_NPROC headroom for threads of other processes of the same (non-root) user

_CLONE_NEWUSER = 0x10000000
_CLONE_NEWNET = 0x40000000
_CLONE_THREAD = 0x00010000
_CLONE_NEW_NAMESPACES = 0x7E020000  # CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET
_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_SECCOMP = 22
_PR_CAPBSET_DROP = 24
_SECCOMP_MODE_FILTER = 2
_AUDIT_ARCH_X86_64 = 0xC000003E  # EM_X86_64 (62) | __AUDIT_ARCH_64BIT | __AUDIT_ARCH_LE (linux/audit.h)
_AUDIT_ARCH_AARCH64 = 0xC00000B7  # EM_AARCH64 (183) | __AUDIT_ARCH_64BIT | __AUDIT_ARCH_LE
_X32_SYSCALL_BIT = 0x40000000
_RET_ALLOW, _RET_ERRNO, _RET_KILL_PROCESS = 0x7FFF0000, 0x00050000, 0x80000000
_EPERM, _ENOSYS = 1, 38
# syscalls added since Linux 5.1 (424 on) have one number on every architecture
_NR_SINCE_5_1 = {
    "pidfd_send_signal": 424,
    "io_uring_setup": 425,
    "io_uring_enter": 426,
    "io_uring_register": 427,
    "open_tree": 428,
    "move_mount": 429,
    "fsopen": 430,
    "fsconfig": 431,
    "fsmount": 432,
    "fspick": 433,
    "clone3": 435,
    "pidfd_getfd": 438,
    "memfd_secret": 447,
}
# x86-64 syscall numbers (asm/unistd_64.h)
_NR_X86_64 = {
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
    "rt_tgsigqueueinfo": 297,
    "memfd_create": 319,
    "shmget": 29,
    "msgget": 68,
    "sync": 162,
    "syncfs": 306,
    **_NR_SINCE_5_1,
}
# aarch64 syscall numbers: the asm-generic table (asm-generic/unistd.h). It has no fork, vfork or mknod (glibc's
# fork is clone, mknod is mknodat): no rule for those, the clone and mknodat rules cover them.
_NR_AARCH64 = {
    "socket": 198,
    "clone": 220,
    "kill": 129,
    "ptrace": 117,
    "syslog": 116,
    "rt_sigqueueinfo": 138,
    "prctl": 167,
    "pivot_root": 41,
    "chroot": 51,
    "mount": 40,
    "umount2": 39,
    "swapon": 224,
    "swapoff": 225,
    "reboot": 142,
    "init_module": 105,
    "delete_module": 106,
    "tkill": 130,
    "tgkill": 131,
    "kexec_load": 104,
    "add_key": 217,
    "request_key": 218,
    "keyctl": 219,
    "mknodat": 33,
    "unshare": 97,
    "perf_event_open": 241,
    "name_to_handle_at": 264,
    "open_by_handle_at": 265,
    "setns": 268,
    "process_vm_readv": 270,
    "process_vm_writev": 271,
    "finit_module": 273,
    "kexec_file_load": 294,
    "bpf": 280,
    "userfaultfd": 282,
    "rt_tgsigqueueinfo": 240,
    "memfd_create": 279,
    "shmget": 194,
    "msgget": 186,
    "sync": 81,
    "syncfs": 267,
    **_NR_SINCE_5_1,
}
# per platform.machine(): (the one audit arch allowed (any other, the i386 / arm32 compat ABI, is killed), the
# syscall numbers, the x32 bit whose numbers are refused (aarch64 has no such range))
_ARCHES = {
    "x86_64": (_AUDIT_ARCH_X86_64, _NR_X86_64, _X32_SYSCALL_BIT),
    "aarch64": (_AUDIT_ARCH_AARCH64, _NR_AARCH64, None),
}
_ALWAYS_DENIED = (
    "ptrace",
    "mknod",  # x86-64 only
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
    # SysV shared memory and message queues: memory outside the address space (RLIMIT_AS) until the IPC namespace
    # goes, so any amount of it (attach, fill, detach, again)
    "shmget",
    "msgget",
    # flushing every filesystem of the machine (syncfs of a read-only bind flushes the host's): an I/O storm
    "sync",
    "syncfs",
)
_PR_SET_DUMPABLE = 4


def _bpf(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("HBBI", code, jt, jf, k & 0xFFFFFFFF)


def seccomp_program(deny_processes: bool, pid: int, own_group: bool = True, machine: Optional[str] = None) -> bytes:
    """Classic-BPF seccomp filter for ``machine`` (default: this one's; x86-64 or aarch64, see the module docstring
    for what it refuses); ``pid`` is the sandboxed process itself, the only target it may signal when
    ``deny_processes`` (with its own process group, kill(0) / kill(-pid), when ``own_group``: in a PID namespace the
    group is the keeper's, and -1 is everyone)."""
    machine = machine or platform.machine()
    if machine not in _ARCHES:
        raise ValueError(f"sandbox_kernel: no seccomp filter for machine {machine!r} (only {', '.join(_ARCHES)})")
    audit_arch, nr, x32_bit = _ARCHES[machine]
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    errno = _RET_ERRNO | _EPERM
    p = [
        _bpf(ld, 4),  # A = arch
        _bpf(jeq, audit_arch, 1, 0),
        _bpf(ret, _RET_KILL_PROCESS),  # another ABI (i386 on x86-64, arm32 compat on aarch64): kill
        _bpf(ld, 0),  # A = syscall nr
    ]
    if x32_bit is not None:
        p += [_bpf(jge, x32_bit, 0, 1), _bpf(ret, errno)]  # x32 ABI: refuse
    for name in _ALWAYS_DENIED:
        if name in nr:  # absent from this arch's table: no such syscall there
            p += [_bpf(jeq, nr[name], 0, 1), _bpf(ret, errno)]
    p += [_bpf(jeq, nr["clone3"], 0, 1), _bpf(ret, _RET_ERRNO | _ENOSYS)]  # glibc falls back to clone
    p += [
        _bpf(jeq, nr["socket"], 0, 4),
        _bpf(ld, 16),  # socket(family, ...): AF_UNIX only
        _bpf(jeq, 1, 0, 1),
        _bpf(ret, _RET_ALLOW),
        _bpf(ret, errno),
    ]
    p += [
        _bpf(jeq, nr["prctl"], 0, 5),
        _bpf(ld, 16),  # prctl(option, ...): no core dumps (PR_SET_DUMPABLE), dies with the keeper (PR_SET_PDEATHSIG)
        _bpf(jeq, _PR_SET_DUMPABLE, 1, 0),
        _bpf(jeq, PR_SET_PDEATHSIG, 0, 1),
        _bpf(ret, errno),
        _bpf(ret, _RET_ALLOW),
    ]
    p += _signal_rules(nr, deny_processes, pid, own_group)
    if deny_processes:
        for name in ("fork", "vfork"):  # x86-64 only: aarch64 forks through clone
            if name in nr:
                p += [_bpf(jeq, nr[name], 0, 1), _bpf(ret, errno)]
        p += [
            _bpf(jeq, nr["clone"], 0, 4),
            _bpf(ld, 16),  # clone(flags, ...): threads only
            _bpf(jset, _CLONE_THREAD, 0, 1),
            _bpf(ret, _RET_ALLOW),
            _bpf(ret, errno),
        ]
    else:  # children, in no new namespace (the capabilities of a user namespace reach much more of the kernel)
        p += [_bpf(jeq, nr["clone"], 0, 3), _bpf(ld, 16), _bpf(jset, _CLONE_NEW_NAMESPACES, 0, 1), _bpf(ret, errno)]
    p.append(_bpf(ret, _RET_ALLOW))
    return b"".join(p)


def _signal_rules(nr: Dict[str, int], deny_processes: bool, pid: int, own_group: bool) -> List[bytes]:
    """:func:`seccomp_program`'s rules for kill, tgkill and tkill."""
    ld, jeq, ret = 0x20, 0x15, 0x06
    errno = _RET_ERRNO | _EPERM
    p = []
    if deny_processes and own_group:  # signals only to itself / its own group
        p += [
            _bpf(jeq, nr["kill"], 0, 6),
            _bpf(ld, 16),
            _bpf(jeq, 0, 3, 0),
            _bpf(jeq, pid, 2, 0),
            _bpf(jeq, -pid, 1, 0),
            _bpf(ret, errno),
            _bpf(ret, _RET_ALLOW),
        ]
    if deny_processes and not own_group:  # signals only to itself
        p += [_bpf(jeq, nr["kill"], 0, 4), _bpf(ld, 16), _bpf(jeq, pid, 0, 1), _bpf(ret, _RET_ALLOW), _bpf(ret, errno)]
    if deny_processes:
        p += [
            _bpf(jeq, nr["tgkill"], 0, 4),
            _bpf(ld, 16),
            _bpf(jeq, pid, 0, 1),
            _bpf(ret, _RET_ALLOW),
            _bpf(ret, errno),
        ]
        p += [_bpf(jeq, nr["tkill"], 0, 1), _bpf(ret, errno)]
    else:  # children exist and may be signalled; only kill(-1, sig) is refused
        p += [
            _bpf(jeq, nr["kill"], 0, 4),
            _bpf(ld, 16),
            _bpf(jeq, 0xFFFFFFFF, 0, 1),
            _bpf(ret, errno),
            _bpf(ret, _RET_ALLOW),
        ]
    return p


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


def make_preexec(
    report_fd: int,
    limits: List[Tuple[str, int, Tuple[int, int]]],
    root: bool,
    seccomp_deny_processes: Optional[bool],
    namespaces: bool,
) -> Callable[[], None]:
    """The function run in the child between fork and exec: the limits, death with the trainer
    (``PR_SET_PDEATHSIG``) and, in ``process`` isolation, a network
    namespace, an empty capability bounding set and seccomp (``namespaces`` isolation sets those up in the
    child's bootstrap, :mod:`.sandbox_jail`, where they must come after the mounts).

    It never raises (a failing layer is simply not reported) and touches no locks a parent thread could hold:
    setrlimit, unshare, prctl, and building the seccomp program (which needs the child's own pid).
    """

    trainer = os.getpid()

    def preexec() -> None:
        done = ["dies_with_trainer"] if _die_with(trainer) else []
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


def _die_with(trainer: int) -> bool:
    """SIGKILL this process (the keeper, or in ``process`` isolation the program) when the trainer's thread that
    started it dies: a trainer killed mid-run (``kill -9``, a Ray worker stopped) left the keeper waiting on a program
    that slept on for ever, outside any deadline (the deadline is the trainer's). A trainer already gone: exit."""
    return die_with_parent(trainer, exit_code=137)


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
        code = seccomp_program(seccomp_deny_processes, os.getpid())
        buf = ctypes.create_string_buffer(code)  # referenced until the prctl below has copied it
        prog = _SockFprog(len(code) // 8, ctypes.addressof(buf))
        if (
            libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0
            and libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) == 0
        ):
            done.append("seccomp")
    return done


def rlimits(
    memory_mb: int, cpu: int, file_size_mb: int, max_open_files: int, max_processes: int, uid: Optional[int]
) -> List[Tuple[str, int, Tuple[int, int]]]:
    """The rlimits of one run; ``uid``: the user the program runs as, whose tasks RLIMIT_NPROC counts (threads
    too: without it a program's threads could take every pid of the machine), or None for uid 0 (ignored there)."""
    mem, fsize = int(memory_mb) * 2**20, int(file_size_mb) * 2**20
    limits = [
        ("rlimit_as", resource.RLIMIT_AS, (mem, mem)),
        ("rlimit_cpu", resource.RLIMIT_CPU, (cpu, cpu + 1)),
        ("rlimit_fsize", resource.RLIMIT_FSIZE, (fsize, fsize)),
        ("rlimit_core", resource.RLIMIT_CORE, (0, 0)),
        ("rlimit_nofile", resource.RLIMIT_NOFILE, (max_open_files, max_open_files)),
        # no real-time scheduling, no higher priority, no POSIX message queues, whatever the trainer was allowed
        # (a cluster's limits.conf may grant rtprio: a SCHED_FIFO loop would starve the machine's other work)
        ("rlimit_rtprio", resource.RLIMIT_RTPRIO, (0, 0)),
        ("rlimit_nice", resource.RLIMIT_NICE, (0, 0)),
        ("rlimit_msgqueue", resource.RLIMIT_MSGQUEUE, (0, 0)),
        # no locked memory (mmap MAP_LOCKED, pure Python): GPU nodes run trainers with memlock unlimited (NCCL / RDMA),
        # so 32 programs pinned up to their whole address space each, out of reach of swap and reclaim
        ("rlimit_memlock", resource.RLIMIT_MEMLOCK, (0, 0)),
    ]
    if uid is not None:
        nproc = _user_task_count(uid) + max(1, max_processes) + _NPROC_SLACK
        limits.append(("rlimit_nproc", resource.RLIMIT_NPROC, (nproc, nproc)))
    return limits


def seccomp_denies_processes(max_processes: int) -> Optional[bool]:
    """The seccomp filter's ``deny_processes``, or None where the filter is not available (neither x86-64 nor
    aarch64)."""
    return (max_processes <= 1) if platform.machine() in _ARCHES and _LIBC else None
