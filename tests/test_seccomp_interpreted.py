"""The code sandbox's seccomp filter (:func:`sandbox_kernel.seccomp_program`) for each machine it is built for,
checked by interpreting its classic BPF here: aarch64 (GH200 / GB200 nodes) cannot be executed on this x86-64 VM,
so a small interpreter runs both arches' programs over a ``struct seccomp_data`` and the syscall numbers come from
the kernel's own headers (asm-generic/unistd.h for aarch64, asm/unistd_64.h for x86-64), not from the module. The
x86-64 program is the one the sandbox tests execute for real (test_sandbox_escapes), which checks the interpreter."""

import json
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from megadare.rewards import sandbox_kernel
from megadare.rewards.sandbox_kernel import seccomp_program

ALLOW, KILL_PROCESS = 0x7FFF0000, 0x80000000
EPERM, ENOSYS = 0x00050000 | 1, 0x00050000 | 38
AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
FOREIGN_ARCHES = (0x40000003, 0x40000028, 0xC00000F3)  # i386, arm (aarch64's compat ABI), riscv64
HEADERS = {
    "x86_64": Path("/usr/include/x86_64-linux-gnu/asm/unistd_64.h"),
    "aarch64": Path("/usr/include/asm-generic/unistd.h"),
}
CLONE_THREAD_FLAGS = 0x3D0F00  # what glibc's pthread_create passes (CLONE_VM | ... | CLONE_THREAD | ...)
SIGCHLD, CLONE_NEWUSER = 17, 0x10000000
PID = 4242


def syscall_numbers(machine: str) -> dict:
    """name -> number from the kernel header of ``machine`` (asm-generic spells some ``__NR3264_``)."""
    path = HEADERS[machine]
    if not path.exists():
        pytest.skip(f"{path} not here (package linux-libc-dev)")
    found = re.findall(r"^#define __NR(?:3264)?_(\w+)\s+(\d+)\s*$", path.read_text(), re.M)
    return {name: int(nr) for name, nr in found}


def run_filter(program: bytes, nr: int, arch: int, args=(0,) * 6) -> int:
    """Classic BPF as seccomp runs it: A = a 32-bit word of seccomp_data {int nr; u32 arch; u64 ip; u64 args[6]}
    (little-endian), jeq / jge / jset against k with jt / jf, ret k."""
    data = struct.pack("<iIQ6Q", nr, arch, 0, *(a & 0xFFFFFFFFFFFFFFFF for a in args))
    insns = [struct.unpack("<HBBI", program[i : i + 8]) for i in range(0, len(program), 8)]
    pc, acc = 0, 0
    while True:
        code, jt, jf, k = insns[pc]  # running off the end raises IndexError: the kernel refuses such a program
        if code == 0x20:
            acc = struct.unpack_from("<I", data, k)[0]
        elif code == 0x06:
            return k
        elif code in (0x15, 0x35, 0x45):
            taken = {0x15: acc == k, 0x35: acc >= k, 0x45: bool(acc & k)}[code]
            pc += jt if taken else jf
        else:
            raise AssertionError(f"opcode {code:#x} at {pc} is not one this interpreter knows")
        pc += 1


def verdicts(machine: str, deny_processes: bool, own_group: bool = True):
    program, numbers = seccomp_program(deny_processes, PID, own_group, machine=machine), syscall_numbers(machine)

    def verdict(name: str, *args: int) -> int:
        return run_filter(program, numbers[name], AUDIT_ARCH[machine], args + (0,) * (6 - len(args)))

    return program, numbers, verdict


@pytest.mark.parametrize("machine", ["x86_64", "aarch64"])
def test_the_module_numbers_are_the_kernel_headers(machine):
    """Each name the filter refers to has this arch's number from the kernel header, and a name the filter uses
    that this arch lacks is absent from the header too (aarch64: fork, vfork, mknod), not forgotten."""
    numbers = syscall_numbers(machine)
    _, table, _ = sandbox_kernel._ARCHES[machine]
    assert {name: numbers.get(name) for name in table} == table
    used = set(sandbox_kernel._ALWAYS_DENIED) | {"clone", "clone3", "fork", "vfork", "socket", "prctl"}
    used |= {"kill", "tgkill", "tkill"}
    assert sorted(name for name in used - set(table) if name in numbers) == []
    if machine == "aarch64":
        assert used - set(table) == {"fork", "vfork", "mknod"}


@pytest.mark.parametrize("machine", ["x86_64", "aarch64"])
@pytest.mark.parametrize("deny_processes", [True, False])
def test_refused_syscalls_return_eperm_and_ordinary_ones_pass(machine, deny_processes):
    program, numbers, verdict = verdicts(machine, deny_processes)
    for name in ("sync", "syncfs", "io_uring_setup", "memfd_create", "shmget", "msgget", "unshare", "mount"):
        assert verdict(name) == EPERM, name
    for name in sandbox_kernel._ALWAYS_DENIED:
        if name in numbers:
            assert verdict(name) == EPERM, name
    assert verdict("clone3") == ENOSYS  # glibc falls back to clone
    for name in ("read", "write", "openat", "mmap", "close", "exit_group", "getpid", "futex"):
        assert verdict(name) == ALLOW, name
    assert verdict("socket", 1) == ALLOW and verdict("socket", 2) == EPERM  # AF_UNIX only, not AF_INET
    assert verdict("prctl", 4) == EPERM and verdict("prctl", 1) == EPERM and verdict("prctl", 15) == ALLOW
    for arch in FOREIGN_ARCHES + (AUDIT_ARCH["aarch64" if machine == "x86_64" else "x86_64"],):
        assert run_filter(program, numbers["getpid"], arch) == KILL_PROCESS, hex(arch)
    if machine == "x86_64":  # the x32 ABI's numbers; aarch64 has no such range
        assert run_filter(program, numbers["getpid"] | 0x40000000, AUDIT_ARCH[machine]) == EPERM


@pytest.mark.parametrize("machine", ["x86_64", "aarch64"])
def test_process_rules_when_processes_are_denied(machine):
    _, numbers, verdict = verdicts(machine, deny_processes=True)
    assert [verdict("kill", target, 9) for target in (0, PID, -PID)] == [ALLOW] * 3
    assert [verdict("kill", target, 9) for target in (1, -1, PID + 1, -(PID + 1))] == [EPERM] * 4
    assert verdict("tgkill", PID, PID, 9) == ALLOW and verdict("tgkill", 1, 1, 9) == EPERM
    assert verdict("tkill", PID, 9) == EPERM
    assert verdict("clone", CLONE_THREAD_FLAGS) == ALLOW and verdict("clone", SIGCHLD) == EPERM
    for name in ("fork", "vfork"):
        assert name not in numbers or verdict(name) == EPERM, name
    _, _, alone = verdicts(machine, deny_processes=True, own_group=False)
    assert alone("kill", PID, 9) == ALLOW and alone("kill", 0, 9) == EPERM and alone("kill", -PID, 9) == EPERM


@pytest.mark.parametrize("machine", ["x86_64", "aarch64"])
def test_process_rules_when_children_are_allowed(machine):
    _, numbers, verdict = verdicts(machine, deny_processes=False)
    assert verdict("kill", -1, 9) == EPERM and verdict("kill", 1234, 9) == ALLOW and verdict("kill", 0, 9) == ALLOW
    assert verdict("tkill", 1234, 9) == ALLOW and verdict("tgkill", 1, 1234, 9) == ALLOW
    assert verdict("clone", SIGCHLD) == ALLOW and verdict("clone", CLONE_THREAD_FLAGS) == ALLOW
    assert verdict("clone", CLONE_NEWUSER | SIGCHLD) == EPERM
    for name in ("fork", "vfork"):
        assert name not in numbers or verdict(name) == ALLOW, name


def test_the_machine_chooses_the_filter(monkeypatch):
    """platform.machine() picks the table: aarch64 nodes get the filter (and the sandbox requires it there), other
    machines none (registry's note says so)."""
    monkeypatch.setattr(sandbox_kernel.platform, "machine", lambda: "aarch64")
    assert sandbox_kernel.seccomp_denies_processes(1) is True
    assert seccomp_program(True, PID) == seccomp_program(True, PID, machine="aarch64")
    monkeypatch.setattr(sandbox_kernel.platform, "machine", lambda: "riscv64")
    assert sandbox_kernel.seccomp_denies_processes(1) is None
    with pytest.raises(ValueError, match="riscv64"):
        seccomp_program(True, PID)


_REAL_RUN = r"""
import ctypes, json, os
from megadare.rewards.sandbox_kernel import seccomp_program
libc = ctypes.CDLL(None, use_errno=True)
calls = json.loads(os.environ["CALLS"].replace('"PID"', str(os.getpid())))
program = ctypes.create_string_buffer(seccomp_program(True, os.getpid()))
class Fprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
fprog = Fprog(len(program.raw) // 8, ctypes.addressof(program))
assert libc.prctl(38, 1, 0, 0, 0) == 0 and libc.prctl(22, 2, ctypes.byref(fprog), 0, 0) == 0
got = {}
for label, (nr, *args) in calls.items():
    ret = libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(a) for a in args])
    got[label] = 0 if ret >= 0 else ctypes.get_errno()
print(json.dumps(got))
"""
# label: (name, *args), harmless: were it let through, a call would fail on its arguments (NULL, size 0) or do nothing
REAL_CALLS = {
    "getpid": ("getpid",),
    "socket unix": ("socket", 1, 1, 0),
    "socket inet": ("socket", 2, 1, 0),
    "memfd_create": ("memfd_create", 0, 0),
    "io_uring_setup": ("io_uring_setup", 1, 0),
    "shmget size 0": ("shmget", 0, 0, 0o600),
    "clone3": ("clone3", 0, 0),
    "prctl dumpable": ("prctl", 4, 1),
    "prctl get name": ("prctl", 16, 0),
    "kill self 0": ("kill", "PID", 0),
    "tkill self 0": ("tkill", "PID", 0),
    "unshare 0": ("unshare", 0),
}


@pytest.mark.skipif(sandbox_kernel.platform.machine() != "x86_64", reason="executes x86-64 syscalls")
def test_the_interpreter_agrees_with_the_kernel_here():
    """The interpreter checked against the kernel that runs the x86-64 program: what each call gets from the
    installed filter (EPERM, ENOSYS, or through to the kernel) is what interpreting the program says."""
    numbers = syscall_numbers("x86_64")
    env = dict(os.environ, CALLS=json.dumps({k: [numbers[name], *args] for k, (name, *args) in REAL_CALLS.items()}))
    out = subprocess.run([sys.executable, "-c", _REAL_RUN], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    real = {label: {1: EPERM, 38: ENOSYS}.get(err, ALLOW) for label, err in json.loads(out.stdout).items()}
    program = seccomp_program(True, PID)
    interpreted = {}
    for label, (name, *args) in REAL_CALLS.items():
        args = tuple(PID if a == "PID" else a for a in args)
        interpreted[label] = run_filter(program, numbers[name], AUDIT_ARCH["x86_64"], args + (0,) * (6 - len(args)))
    assert real == interpreted
    passed = sorted(label for label, verdict in real.items() if verdict == ALLOW)
    assert passed == ["getpid", "kill self 0", "prctl get name", "socket unix"]
