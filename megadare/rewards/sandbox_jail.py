"""The sandbox's OS isolation: new namespaces, a read-only root built from a few binds, a private tmpfs, no
privileges. Run by the sandbox bootstrap (:mod:`.sandbox_child`) before any untrusted code, from its source
(stdlib only on purpose, nothing from megadare); :mod:`.sandbox` computes the plan and checks what it reports.

``enter(plan, report_fd)`` is called in the bootstrap, the process the trainer started (the *keeper*):

1. ``unshare(2)`` of new mount, PID, network, IPC, UTS and cgroup namespaces, and a new user namespace when the
   trainer is not root (it maps the trainer's own uid/gid only: that is what gives it the right to mount);
2. ``fork``: the child is PID 1 of the new PID namespace and becomes the program; the keeper closes every fd,
   waits for it and exits as it did (status or signal), so the trainer's ``wait4`` sees the program's end and
   CPU time. The child dies with the keeper (``PR_SET_PDEATHSIG``, set again after the uid change, which clears
   it; the seccomp filter keeps it set), and every process of the namespace dies
   with the child (the kernel ends a PID namespace with its init);
3. in the child, the new root: a tmpfs holding read-only binds of the plan's paths only (system directories and
   the Python the program needs), a minimal ``/dev`` (null, zero, full, random, urandom), a fresh read-only
   ``/proc`` of the new PID namespace, and one writable tmpfs (size- and inode-limited, ``noexec``) at the
   workdir, which is the program's cwd, HOME and TMPDIR. Every other mount is remounted read-only, nosuid (and
   nodev, but for the device binds); ``pivot_root`` into it and the old root is detached: nothing else of the machine
   (homes, /root, the run directory, credentials, other /tmp files) exists for the program;
4. privileges: the capability bounding set emptied, then the unprivileged uid/gid (root: ``plan["uid"]``,
   65534 = nobody, which clears every capability) or, in a user namespace, the capabilities dropped with
   ``capset``; checked in ``/proc/self/status``; not dumpable; ``PR_SET_NO_NEW_PRIVS``; the seccomp filter of the
   plan;
5. the bootstrap then execs a fresh interpreter (:mod:`.sandbox_child`) from a copy of the binary mounted over it
   that may be executed but not read: ctypes, which this module needs, is never loaded where the program runs, and
   the kernel keeps a process whose executable it cannot read not dumpable after the exec.

Any step the kernel refuses ends the child with :data:`EXIT_UNAVAILABLE` after writing one line
``unavailable <step>: <error>`` to the report pipe; the parent refuses to run code rewards then (it never runs
the program with less). On success the names of the layers in place are written to the report pipe.
"""

import ctypes
import os
import signal
import struct

EXIT_UNAVAILABLE = 123
CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x02000000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC = 1, 2, 4, 8, 32, 4096, 16384
MS_PRIVATE = 1 << 18
MOUNT_OPTION_FLAGS = {
    "nosuid": MS_NOSUID,
    "nodev": MS_NODEV,
    "noexec": MS_NOEXEC,
    "noatime": 1024,
    "nodiratime": 2048,
    "relatime": 1 << 21,
    "strictatime": 1 << 24,
}
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_SECCOMP, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 1, 4, 22, 24, 38
SECCOMP_MODE_FILTER = 2
CAP_VERSION_3 = 0x20080522
DEVICES = ("null", "zero", "full", "random", "urandom")
DEV_LINKS = (
    ("fd", "/proc/self/fd"),
    ("stdin", "/proc/self/fd/0"),
    ("stdout", "/proc/self/fd/1"),
    ("stderr", "/proc/self/fd/2"),
)


class _Refused(Exception):
    """A step of the jail the kernel refused (the message names the step)."""


class _Fprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def enter(plan, report_fd):
    """Isolate this process per ``plan`` (see the module docstring); returns in the isolated program only."""
    libc = ctypes.CDLL(None, use_errno=True)
    try:
        userns = _unshare(libc, plan)
    except _Refused as e:
        _unavailable(report_fd, e)
    try:
        pid = os.fork()
    except OSError as e:  # EAGAIN / ENOMEM: the parent tries again
        _unavailable(report_fd, "fork of the namespaces' first process: %s" % (e,))
    if pid:
        _keep(pid)
    try:
        layers = _jail(libc, plan, userns)
    except _Refused as e:
        _unavailable(report_fd, e)
    os.write(report_fd, ("\n".join(layers) + "\n").encode())


def _unavailable(report_fd, e):
    os.write(report_fd, ("unavailable %s\n" % (e,)).encode(errors="replace"))
    os._exit(EXIT_UNAVAILABLE)


def _check(ok, libc, what):
    if not ok:
        err = ctypes.get_errno()
        raise _Refused("%s: [Errno %d] %s" % (what, err, os.strerror(err)))


def _unshare(libc, plan):
    """New namespaces for this process (its next child is PID 1 of the new PID namespace); True when a user
    namespace was needed (not root)."""
    uid, gid = os.geteuid(), os.getegid()  # read before the new user namespace, where they are unmapped
    userns = uid != 0
    flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWCGROUP
    if userns:
        flags |= CLONE_NEWUSER
    _check(
        libc.unshare(flags) == 0,
        libc,
        "unshare(%s)"
        % (
            "user, mount, pid, net, ipc, uts, cgroup namespaces"
            if userns
            else "mount, pid, net, ipc, uts, cgroup namespaces"
        ),
    )
    if userns:
        try:
            for name, text in (
                ("setgroups", "deny"),
                ("uid_map", "%d %d 1" % (uid, uid)),
                ("gid_map", "%d %d 1" % (gid, gid)),
            ):
                with open("/proc/self/" + name, "w") as f:
                    f.write(text)
        except OSError as e:
            raise _Refused("writing /proc/self/%s of the new user namespace: %s" % (name, e)) from None
    return userns


def _keep(pid):
    """The keeper: hold no fd of the program, wait for it, end as it ended."""
    os.closerange(0, 1 << 16)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)
    os._exit(os.waitstatus_to_exitcode(status))


def _mount(libc, src, dst, flags, what=None):
    """A bind, remount or propagation change (no filesystem type, no data); a refusal names ``what``."""
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(
        libc.mount(enc(src), enc(dst), None, ctypes.c_ulong(flags), None) == 0,
        libc,
        what or "mount %s on %s" % (src, dst),
    )


def _mount_fs(libc, fstype, dst, flags, data=None, what=None):
    """A new ``fstype`` filesystem (tmpfs, proc; its source named like its type) at ``dst`` with mount ``data``."""
    _check(
        libc.mount(
            fstype.encode(),
            dst.encode(),
            fstype.encode(),
            ctypes.c_ulong(flags),
            None if data is None else data.encode(),
        )
        == 0,
        libc,
        what or "mount %s on %s" % (fstype, dst),
    )


def _jail(libc, plan, userns):
    """PID 1 of the new namespaces: build the new root, enter it, drop every privilege; the layers' names."""
    _check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0, libc, "prctl(PR_SET_PDEATHSIG)")
    os.umask(0o022)
    new = plan["workdir"]  # on the machine an empty dir: the new root is staged on it, and shows it again
    work = new + plan["workdir"]
    _mount(libc, None, "/", MS_REC | MS_PRIVATE, what="making the mounts private")
    _mount_fs(libc, "tmpfs", new, MS_NOSUID | MS_NODEV, "mode=0755,size=1m,nr_inodes=4096")
    try:
        _build_root(libc, plan, new, work)
    except OSError as e:
        raise _Refused("building the new root: %s" % (e,)) from None
    _read_only(libc, new, keep_writable=(work,))
    _check(libc.sethostname(b"sandbox", 7) == 0, libc, "sethostname")
    os.chdir(new)
    _check(libc.syscall(plan["pivot_root_nr"], b".", b".") == 0, libc, "pivot_root")
    _check(libc.umount2(b".", MNT_DETACH) == 0, libc, "detaching the old root")
    os.chdir(plan["workdir"])
    _drop_privileges(libc, plan, userns)
    # again: the uid change cleared it (a setsid program would outlive the keeper's kill); the filter keeps it set
    _check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0, libc, "prctl(PR_SET_PDEATHSIG)")
    unreadable = [p for p in plan["must_see"] if not os.access(p, os.R_OK | os.X_OK)]
    if unreadable:
        raise _Refused(
            "uid %d cannot read %s in the sandbox, which this Python needs (make it world-readable)"
            % (os.getuid(), ", ".join(unreadable))
        )
    layers = ["netns", "pidns", "mntns", "ipcns", "utsns"] + (["userns"] if userns else [])
    layers += ["read_only_root", "private_tmpfs", "no_capabilities", "no_new_privs"]
    layers += [] if userns else ["unprivileged_uid"]
    if plan["seccomp"]:
        _seccomp(libc, bytes.fromhex(plan["seccomp"]))
        layers.append("seccomp")
    return layers


def _build_root(libc, plan, new, work):
    """Inside the new root's tmpfs: symlinks, read-only binds, /dev, /proc, and the writable tmpfs."""
    for target, dst in plan["symlinks"]:
        os.makedirs(os.path.dirname(new + dst), 0o755, exist_ok=True)
        os.symlink(target, new + dst)
    for src, dst in plan["binds"]:
        if os.path.isdir(src):
            os.makedirs(new + dst, 0o755, exist_ok=True)
        else:  # a file of /etc
            os.makedirs(os.path.dirname(new + dst), 0o755, exist_ok=True)
            os.close(os.open(new + dst, os.O_CREAT | os.O_WRONLY, 0o644))
        _mount(libc, src, new + dst, MS_BIND | MS_REC)
    dev = new + "/dev"
    os.makedirs(dev, 0o755, exist_ok=True)
    _mount_fs(libc, "tmpfs", dev, MS_NOSUID | MS_NOEXEC, "mode=0755,size=64k,nr_inodes=64")
    for name in DEVICES:
        os.close(os.open(dev + "/" + name, os.O_CREAT | os.O_WRONLY, 0o666))
        _mount(libc, "/dev/" + name, dev + "/" + name, MS_BIND)
    for name, target in DEV_LINKS:
        os.symlink(target, dev + "/" + name)
    os.mkdir(dev + "/shm")
    os.makedirs(new + "/proc", 0o755, exist_ok=True)
    _exec_only_interpreter(libc, plan["executable"], new, staging=new + "/proc")
    _mount_fs(
        libc,
        "proc",
        new + "/proc",
        MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY,
        what="mounting /proc of the new PID namespace",
    )
    os.makedirs(work, 0o755, exist_ok=True)
    _mount_fs(
        libc,
        "tmpfs",
        work,
        MS_NOSUID | MS_NODEV | MS_NOEXEC,  # noexec: no native code of its own
        "mode=0700,uid=%d,gid=%d,size=%dm,nr_inodes=%d"
        % (plan["uid"], plan["gid"], plan["tmpfs_mb"], plan["tmpfs_inodes"]),
    )


def _exec_only_interpreter(libc, exe, new, staging):
    """Over the interpreter's binary in the new root, a copy that may be executed but not read (mode 0711, on a
    tmpfs of its own, mounted at ``staging`` for the copy only): the program's interpreter is exec'd from it (a
    fresh one: this one loaded ctypes), and the kernel makes a process whose executable it cannot read not dumpable
    (its /proc/self/mem and the like belong to root), whatever its uid."""
    with open(exe, "rb") as f:
        data = f.read()
    size_kb = len(data) // 1024 + 64
    _mount_fs(libc, "tmpfs", staging, MS_NOSUID | MS_NODEV, "mode=0700,size=%dk,nr_inodes=8" % size_kb)
    copy = staging + "/python"
    fd = os.open(copy, os.O_CREAT | os.O_WRONLY, 0o700)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fchmod(fd, 0o711)
    finally:
        os.close(fd)
    _mount(libc, copy, new + exe, MS_BIND)
    _check(libc.umount2(staging.encode(), MNT_DETACH) == 0, libc, "unmounting the interpreter's staging tmpfs")


def _unescape(field):
    """A /proc/self/mountinfo path field (octal escapes for space, tab, newline, backslash) as text."""
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def _read_only(libc, new, keep_writable):
    """Remount every mount under ``new`` (itself included) read-only and nosuid (nodev but for the device binds),
    keeping the flags a user namespace may not clear; ``keep_writable`` and /proc (mounted read-only) skipped."""
    with open("/proc/self/mountinfo") as f:
        rows = [line.split() for line in f]
    skip = set(keep_writable) | {new + "/proc"}
    for row in rows:
        point = _unescape(row[4])
        if point in skip or not (point == new or point.startswith(new + "/")):
            continue
        flags = MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID
        for opt in row[5].split(","):
            flags |= MOUNT_OPTION_FLAGS.get(opt, 0)
        if not point.startswith(new + "/dev/"):
            flags |= MS_NODEV
        _mount(libc, None, point, flags, what="remounting %s read-only" % point[len(new) :])


def _drop_privileges(libc, plan, userns):
    for cap in range(64):
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 and ctypes.get_errno() != 22:  # EINVAL: no such cap
            _check(False, libc, "emptying the capability bounding set")
    if userns:
        header = ctypes.create_string_buffer(struct.pack("Ii", CAP_VERSION_3, 0))
        data = ctypes.create_string_buffer(24)
        _check(libc.capset(header, data) == 0, libc, "capset (dropping the user namespace's capabilities)")
    else:
        try:
            os.setgroups([])
            os.setresgid(plan["gid"], plan["gid"], plan["gid"])
            os.setresuid(plan["uid"], plan["uid"], plan["uid"])
        except OSError as e:
            raise _Refused("switching to uid %d: %s" % (plan["uid"], e)) from None
    with open("/proc/self/status") as f:
        status = dict(line.split(":", 1) for line in f if ":" in line)
    held = [k for k in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb") if int(status.get(k, "0"), 16)]
    if held or (not userns and int(status["Uid"].split()[0]) != plan["uid"]):
        raise _Refused("privileges still held after dropping them: %s uid %s" % (held, status["Uid"].split()))
    # no core dump (a pipe core_pattern hands it to a helper on the machine whatever RLIMIT_CORE says); the seccomp
    # filter refuses to turn it back on
    _check(libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) == 0, libc, "prctl(PR_SET_DUMPABLE)")
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0, libc, "prctl(PR_SET_NO_NEW_PRIVS)")


def _seccomp(libc, code):
    buf = ctypes.create_string_buffer(code)
    prog = _Fprog(len(code) // 8, ctypes.addressof(buf))
    _check(
        libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) == 0,
        libc,
        "installing the seccomp filter",
    )
