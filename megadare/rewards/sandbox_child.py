"""The sandbox's child side: run by ``python -I -S -B -c <this file's source>`` (see :mod:`.sandbox`).

Standalone on purpose (stdlib only, nothing from megadare): it is the first code of the sandboxed interpreter. It
reads the program (and in test mode the tests) from unlinked files the parent passed as fds and closes them (the
program cannot read its tests back), enters the OS isolation in ``namespaces`` mode (:mod:`.sandbox_jail`, whose
source the parent passes too), writes ``main.py`` into its cwd, installs the audit hook, closes the report pipe,
then executes the program as ``__main__``.

Test mode (the parent passed a tests file): the program runs as module ``solution`` (so an
``if __name__ == "__main__"`` block does not run, as DARE strips it), then the tests run in a copy of its
namespace with the builtins as they were before the program ran (a program that rebinds ``abs`` or ``exec`` cannot
change them). Modules named by the parent (``preload``, e.g. numpy, which loads ctypes) are imported before the
hook, so they load; ctypes' calls stay refused. The tests passed only if the parent receives a one-time token:
the token was read from a pipe before the program started and lives only in the audit hook's closure; the hook
writes it to the proof pipe only when the event ``megadare.tests_passed`` is raised with this bootstrap's own
frame, which only the bootstrap has and raises after the tests ran to their end. So exiting early (``sys.exit``,
``os._exit``, ``SystemExit`` inside a test), printing "PASS" or a zero exit status prove nothing. While the
program or tests run, every way to a frame object is closed (``sys._getframe``, traceback / generator /
coroutine frames, tracing and profiling hooks, new audit hooks, signal handlers, which receive the interrupted
frame), and so are ``/proc/*/mem``, gc walks, ctypes and hand-made code objects (imports compile from source, so
``marshal.loads`` is refused too): the token cannot be read back from memory. Known limit, as in DARE, evalplus
and OpenCompass: a program can still return an object whose ``__eq__`` always says True, or patch an attribute of
a module the tests use (``math.isclose``).
"""
import builtins
import os
import sys
import traceback
import types

EXIT_REFUSED = 121     # an audit-hook refusal was not caught
EXIT_MEMORY = 122      # uncaught MemoryError
FRAME_ATTRS = frozenset(("tb_frame", "gi_frame", "cr_frame", "ag_frame", "f_back", "f_locals", "f_globals"))


class SandboxRefused(PermissionError):
    pass


def _read_fd(fd):
    """All of an inherited (unlinked) file, then the fd closed: the program cannot read it back."""
    chunks = []
    while True:
        chunk = os.pread(fd, 1 << 20, sum(map(len, chunks)))
        if not chunk:
            break
        chunks.append(chunk)
    os.close(fd)
    return b"".join(chunks)


def _jail(plan, source, rep):
    """OS isolation (:mod:`.sandbox_jail`, its source passed by the parent, with the plan as a Python literal, which
    costs no import); returns in the isolated program."""
    namespace = {"__name__": "sandbox_jail"}
    exec(compile(source, "sandbox_jail.py", "exec"), namespace)
    namespace["enter"](eval(plan, {"__builtins__": {}}), rep)
    for name in [m for m in sys.modules if m in ("ctypes", "_ctypes") or m.startswith("ctypes.")]:
        del sys.modules[name]   # importing ctypes again meets the audit hook


def _write(path, data):
    with open(path, "wb") as f:
        f.write(data)


def _exit_for(e):
    """The exit code of an uncaught exception: refused / memory / 1 (its cause chain is searched)."""
    refused, memory, seen = False, False, set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        refused |= isinstance(e, SandboxRefused)
        memory |= isinstance(e, MemoryError)
        e = e.__cause__ or e.__context__
    return EXIT_REFUSED if refused else EXIT_MEMORY if memory else 1


def _die(e, audit, frame, note=""):
    """Print the traceback (after re-opening frame access for it in test mode) and exit without cleanup."""
    if frame is not None:
        audit("megadare.tests_failed", frame)
    if note:
        sys.stderr.write(note + "\n")
    try:
        traceback.print_exception(type(e), e, e.__traceback__)
    except BaseException:
        pass
    _flush()
    os._exit(_exit_for(e))


def _flush():
    for s in (sys.stdout, sys.stderr):
        try:
            s.flush()
        except BaseException:
            pass


def _no_signal_handlers(*args, **kwargs):
    raise SandboxRefused("sandbox: installing signal handlers is refused while tests run")


def _boot():
    rep, code_fd, tests_fd, root = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    maxc, audit_on, token_fd, proof_fd = int(sys.argv[5]), sys.argv[6] == "1", int(sys.argv[7]), int(sys.argv[8])
    preload, jail_plan, jail_source = sys.argv[9], sys.argv[10], sys.argv[11]
    source = _read_fd(code_fd)
    test_source = _read_fd(tests_fd) if tests_fd >= 0 else None
    if jail_plan:
        _jail(jail_plan, jail_source, rep)
    path = os.path.join(root, "main.py")
    _write(path, source)
    try:
        code = compile(source, "main.py", "exec")
        tests = compile(test_source, "tests.py", "exec") if test_source is not None else None
    except (SyntaxError, ValueError):
        traceback.print_exc(limit=0)
        sys.exit(1)
    if not hasattr(builtins, "exit"):  # -S skips site, which defines exit()/quit()
        builtins.exit = builtins.quit = sys.exit
    for name in filter(None, preload.split(",")):  # trusted imports the hook would refuse (numpy loads ctypes)
        __import__(name)
    audit, run, frame = sys.audit, exec, None
    if audit_on:
        if maxc == 0:
            stub = types.ModuleType("_posixsubprocess")

            def fork_exec(*a, **k):
                raise SandboxRefused("sandbox: process creation refused (_posixsubprocess)")
            stub.fork_exec = fork_exec
            sys.modules["_posixsubprocess"] = stub
        proof = None
        if tests is not None:
            import signal
            import _signal
            _signal.signal = signal.signal = _no_signal_handlers
            sys.pycache_prefix = os.path.join(root, "no_pycache")   # imports compile from source: no marshal.loads
            frame = sys._getframe(0)
            proof = [frame, os.read(token_fd, 64), proof_fd]
            os.close(token_fd)
        sys.addaudithook(_make_hook(root, maxc, proof))
        del proof
        os.write(rep, b"audit_hook\n")
    os.close(rep)
    pristine = dict(builtins.__dict__)
    mod = types.ModuleType("__main__" if tests is None else "solution")
    mod.__file__ = path
    mod.__builtins__ = builtins
    sys.modules["__main__"] = mod
    sys.argv = [path]
    try:
        run(code, mod.__dict__)
    except SystemExit as e:
        if tests is None:
            raise
        _die(e, audit, frame, "sandbox: the program exited before its tests ran")
    except BaseException as e:
        _die(e, audit, frame)
    if tests is None:
        return
    namespace = dict(mod.__dict__, __builtins__=pristine, __name__="tests")
    try:
        run(tests, namespace)
    except BaseException as e:  # a failed assert, SystemExit inside a test, anything
        _die(e, audit, frame, "sandbox: the tests did not pass")
    audit("megadare.tests_passed", frame)
    _flush()
    os._exit(0)


PROC_EVENTS = frozenset(("os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.exec", "os.system",
                         "subprocess.Popen", "os.startfile", "pty.spawn"))
DENY_EVENTS = frozenset(("gc.get_objects", "gc.get_referrers", "gc.get_referents", "os.killpg", "signal.pthread_kill",
                         "sys.remote_exec", "os.symlink"))
# test mode: no frame objects (they reach the hook's closure), no tracing, no new hooks, no re-imported _signal,
# no hand-made code objects (bytecode can read memory)
FRAME_EVENTS = frozenset(("sys._getframe", "sys._current_frames", "sys._current_exceptions", "sys.settrace",
                          "sys.setprofile", "sys.addaudithook"))
TEST_IMPORTS = frozenset(("_signal", "_testcapi", "_testinternalcapi"))
TEST_DENIED = frozenset(("code.__new__", "marshal.loads", "marshal.load"))
# event -> (indices of path args, index of the dir_fd arg or None)
PATH_EVENTS = {"os.remove": ((0,), 1), "os.rmdir": ((0,), 1), "os.mkdir": ((0,), 2), "os.chmod": ((0,), 2),
               "os.chown": ((0,), 3), "os.utime": ((0,), 3), "os.truncate": ((0,), None),
               "os.rename": ((0, 1), 2), "os.link": ((0, 1), 2), "os.chdir": ((0,), None),
               "os.setxattr": ((0,), None), "os.removexattr": ((0,), None), "os.chflags": ((0,), None),
               "os.lchflags": ((0,), None), "os.lchmod": ((0,), None), "shutil.rmtree": ((0,), 1)}


def _refuse(what):
    raise SandboxRefused("sandbox: %s refused" % what)


def _test_guard(proof):
    """The test-mode part of the hook: the proof event, and refusals of what could reach the token."""
    write = os.write

    def test_mode(event, args):
        """True when ``event`` was handled here: the proof, and what could reach it."""
        if event == "megadare.tests_passed" or event == "megadare.tests_failed":
            if args and args[0] is proof[0]:
                if event == "megadare.tests_passed" and proof[1]:
                    write(proof[2], proof[1])
                proof[0] = proof[1] = None   # one shot; frames are harmless once the token is gone
            return True
        if proof[1] is None:
            return False
        if event in FRAME_EVENTS or (event == "object.__getattr__" and args[1] in FRAME_ATTRS):
            raise ValueError("sandbox: frame access is refused while tests run")  # the error stdlib callers expect
        if event == "import" and args[0] in TEST_IMPORTS:
            _refuse("import of %s" % args[0])
        if event in TEST_DENIED:
            _refuse(event)
        return False
    return test_mode


def _make_hook(root, maxc, proof):
    realpath, fspath, fsdecode, readlink, isdir = os.path.realpath, os.fspath, os.fsdecode, os.readlink, os.path.isdir
    getpid, getpgrp = os.getpid, os.getpgrp
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
    root_slash = root.rstrip("/") + "/"
    dev_ok = ("/dev/null", "/dev/stdout", "/dev/stderr")
    deny_imports = frozenset(("_ctypes", "_posixsubprocess") if maxc == 0 else ("_ctypes",))
    test_mode = _test_guard(proof) if proof is not None else None
    spawned = [0]

    def resolve(p, dir_fd=None):
        if isinstance(p, int):
            return readlink("/proc/self/fd/%d" % p)
        p = fsdecode(fspath(p))
        if ".." in p.split("/"):
            raise ValueError("no '..' in checked paths")  # cwd changes by another thread could re-aim them
        if dir_fd is not None and dir_fd >= 0 and not p.startswith("/"):  # audit events say -1 for "none"
            p = readlink("/proc/self/fd/%d" % dir_fd) + "/" + p
        return p

    def inside(p, dir_fd=None):
        try:
            p = resolve(p, dir_fd)
        except (OSError, TypeError, ValueError):
            return False
        if p in dev_ok:
            return True
        rp = realpath(p)
        return rp == root or rp.startswith(root_slash)

    def hook(event, args):
        if test_mode is not None and test_mode(event, args):
            return
        if event == "open":
            path, mode, flags = args
            if isinstance(path, int):
                return
            writing = (isinstance(mode, str) and ("w" in mode or "a" in mode or "x" in mode or "+" in mode)) \
                or (isinstance(flags, int) and flags & write_flags)
            if writing and not inside(path):
                _refuse("writing %r outside the sandbox dir" % (path,))
            if not inside(path):
                try:
                    is_dir = isdir(path)
                except (TypeError, ValueError):
                    is_dir = False
                if is_dir:
                    _refuse("opening directory %r outside the sandbox dir" % (path,))
                try:
                    real = realpath(fsdecode(fspath(path)))
                except (OSError, TypeError, ValueError):
                    real = ""
                if real.startswith("/proc/") and real.endswith("/mem"):
                    _refuse("reading process memory (%r)" % (path,))
        elif event.startswith("socket."):
            _refuse("network (%s)" % event)
        elif event.startswith("ctypes."):
            _refuse("ctypes (%s)" % event)
        elif event in PROC_EVENTS:
            if spawned[0] >= maxc:
                _refuse("process creation (%s)" % event)
            spawned[0] += 1
        elif event in PATH_EVENTS:
            idx, dfd = PATH_EVENTS[event]
            dir_fd = args[dfd] if dfd is not None and dfd < len(args) else None
            for k in idx:
                if not inside(args[k], dir_fd):
                    _refuse("%s on %r outside the sandbox dir" % (event, args[k]))
        elif event == "os.kill":
            pid, group = args[0], getpgrp()   # 0 in a PID namespace: the group is the keeper's, outside it
            if pid not in ((getpid(), 0, -group) if group else (getpid(),)) and (maxc == 0 or pid < 0):
                _refuse("signal to pid %r" % (pid,))
        elif event == "import":
            if args[0] in deny_imports:
                _refuse("import of %s" % args[0])
        elif event in DENY_EVENTS:
            _refuse(event)
    return hook


if __name__ == "__main__":
    _boot()
