"""Starting a sandboxed program: its inputs (the program and tests as unlinked files, stdin a sealed memfd), the
jail's plan (what :mod:`.sandbox_jail` shows of this machine: the system directories, a few /etc entries and this
Python, read-only) and the child process itself (``sys.executable -I -S -B -c <sandbox_child>``, its own session,
a scrubbed environment, the kernel layers of :mod:`.sandbox_kernel` set before exec).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import platform
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import List, Optional, Tuple

from megadare.rewards import sandbox_child, sandbox_jail
from megadare.rewards.errors import SandboxUnavailable
from megadare.rewards.sandbox_kernel import make_preexec, seccomp_denies_processes, seccomp_program

__all__ = ["program_uid", "refused", "required_layers", "start_child", "sealed", "unlinked"]

# ---------------------------------------------------------------------------------------------- child bootstrap
_BOOTSTRAP = Path(sandbox_child.__file__).read_text(encoding="utf-8")
_JAIL = Path(sandbox_jail.__file__).read_text(encoding="utf-8")


# ---------------------------------------------------------------------------------------------- the jail's plan
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


def refused(detail: str) -> SandboxUnavailable:
    """The error that refuses code rewards where the kernel refuses the namespaces, naming the way out."""
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
        raise refused(f"no pivot_root syscall number known for {platform.machine()}")
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
        "executable": os.path.realpath(sys.executable),
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


def program_uid(mode: str) -> Optional[int]:
    """The uid the program runs as, where the kernel applies RLIMIT_NPROC to it: uid 65534 (nobody) in
    ``namespaces`` isolation of a root trainer, the trainer's own uid when it is not root; None for a root program
    (``process`` isolation of a root trainer)."""
    if os.geteuid() != 0:
        return os.geteuid()
    return _NOBODY if mode == "namespaces" else None


def required_layers(seccomp: bool) -> frozenset:
    """The isolation layers a ``namespaces`` run must report (the rlimits are best effort, as in ``process``: a
    trainer's own lower hard limit stands)."""
    return frozenset(
        ("netns", "pidns", "mntns", "ipcns", "read_only_root", "private_tmpfs", "no_capabilities", "no_new_privs")
        + ("dies_with_trainer",)
        + (("seccomp",) if seccomp else ())
        # required of a root trainer's program (uid 65534: the kernel gives its /proc/self files to root). In a user
        # namespace they go to the machine's root too, reported, not required: the program itself in the tests'
        # harness, which maps its uid 1000 to root
        + (("not_dumpable",) if os.geteuid() == 0 else ())
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


@contextlib.contextmanager
def sealed(text: str):
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
def unlinked(text: Optional[str]):
    """``text`` in an unlinked temp file (rewound), or None: what the child reads from an inherited fd."""
    if text is None:
        yield None
        return
    with tempfile.TemporaryFile() as f:
        f.write(text.encode("utf-8"))
        f.seek(0)
        yield f


def start_child(
    mode: str, boot: list, stdin_f, allow_site_packages: bool, limits: list, file_size_mb: int
) -> subprocess.Popen:
    """Start the child: ``boot`` = the bootstrap's arguments (report fd, code fd, tests fd, workdir, children
    allowed, audit hook, token fd, proof fd, preload, tested builtins); in ``namespaces`` mode the jail's plan and
    source follow."""
    is_root, workdir, deny = os.geteuid() == 0, boot[3], seccomp_denies_processes(boot[4] + 1)
    jail = ["", ""]
    if mode == "namespaces":
        seccomp = seccomp_program(deny, 1, own_group=False) if deny is not None else None
        plan = _jail_plan(workdir, is_root, max(64, 4 * file_size_mb), seccomp, allow_site_packages)
        # RLIMIT_NPROC is set after the jail's exec (sandbox_child._limit_tasks): before it, other sandboxes' threads
        # failed the jail's exec (a root trainer's uid change) or its fork of PID 1 (a non-root trainer: the user
        # namespace takes the limit its creator had as the bound of the uid's tasks on the machine)
        plan["nproc"] = next((v for name, _, v in limits if name == "rlimit_nproc"), None)
        limits = [lim for lim in limits if lim[0] != "rlimit_nproc"]
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
            preexec_fn=make_preexec(boot[0], limits, is_root, deny, mode == "namespaces"),
        )
    except (OSError, subprocess.SubprocessError) as e:
        raise RuntimeError(f"sandbox: could not start the program: {e}") from e
