"""The sandbox's child side: run by ``python -I -S -B -c <this file's source>`` (see :mod:`.sandbox`).

Standalone on purpose (stdlib only, nothing from megadare): it is the first code of the sandboxed interpreter. In
``namespaces`` mode it enters the OS isolation (:mod:`.sandbox_jail`, whose source the parent passes too) and execs
a fresh interpreter with the same arguments (the jail used ctypes, whose classes would stay alive in this one),
which checks it is not dumpable and goes on. It reads the program (and in test mode the tests) from unlinked files
the parent passed as fds and closes them (the program cannot read its tests back), writes ``main.py`` into its
cwd, installs the audit hook, closes the report pipe, then executes the program as ``__main__``.

Test mode (the parent passed a tests file): the program runs as module ``solution`` (so an
``if __name__ == "__main__"`` block does not run, as DARE strips it), then the tests run in a copy of its
namespace with the builtins as they were before the program ran (a program that rebinds ``abs`` or ``exec``, or
defines a global of that name, cannot change them for the tests). Modules named by the parent (``preload``, e.g. numpy, which loads ctypes) are imported before the
hook, so they load; ctypes' calls stay refused. The tests passed only if the parent receives a one-time token:
the token was read from a pipe before the program started and lives only in the audit hook's closure; the hook
writes it to the proof pipe only when the event ``megadare.tests_passed`` is raised with this bootstrap's own
frame, which only the bootstrap has and raises after the tests ran to their end. So exiting early (``sys.exit``,
``os._exit``, ``SystemExit`` inside a test), printing "PASS" or a zero exit status prove nothing. While the
program or tests run, every way to a frame object is closed (``sys._getframe``, traceback / generator /
coroutine frames, tracing and profiling hooks, new audit hooks, signal handlers, which receive the interrupted
frame, ``gc.set_debug`` whose DEBUG_SAVEALL hands collected frames out in ``gc.garbage``, second copies of builtin
modules that would bring those back, CPython's test modules), and so are ``/proc/*/mem``, gc walks, ctypes,
sub-interpreters, native code of the program's own and hand-made code objects (imports compile from source, so
``marshal.loads`` is refused too): the token cannot be read back from memory. As a second line, the hook accepts the
proof only while the frame is at ``_boot``'s last line, where it is only after the tests ran to their end (a
program holding the frame burns the token). Known limits: a program that reaches its own memory (numpy's
``__array_interface__`` with a raw address, a CPython memory-safety bug) can fake a pass (humanevalplus, which
preloads numpy, is therefore judged outside the process: :mod:`megadare.rewards.harness`); and, as in DARE, evalplus
and OpenCompass, a program can return an object whose ``__eq__`` always says True, or patch an attribute of a module
the tests use (``math.isclose``). A global of the program's named like a builtin (``abs``) is left out of the tests'
copy of its namespace, so the tests call the true builtin, unless the parent names it as under test (a task whose
function is ``sorted``: :func:`megadare.rewards.code.tested_builtins`).
"""

import builtins
import os
import resource
import sys
import traceback
import types

EXIT_REFUSED = 121  # an audit-hook refusal was not caught
EXIT_MEMORY = 122  # uncaught MemoryError
EXIT_SYSTEM_EXIT = 120  # the program raised SystemExit with a non-zero code (no test mode): _system_exit
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


JAILED = "-"  # the jail plan's argument once the jail is entered: the exec'd interpreter runs the program


def _jail(plan, source, rep):
    """OS isolation (:mod:`.sandbox_jail`, its source passed by the parent, with the plan as a Python literal, which
    costs no import); then, in the isolated process, a fresh interpreter (the same argv, the plan replaced by
    :data:`JAILED`) from the jail's executable-only copy of the binary: the program's interpreter never loaded
    ctypes (whose classes the jail's use would leave alive, reachable through ``type.__subclasses__``: raw memory
    without an audit event) and is not dumpable. Does not return."""
    namespace = {"__name__": "sandbox_jail"}
    exec(compile(source, "sandbox_jail.py", "exec"), namespace)
    plan = eval(plan, {"__builtins__": {}})
    tasks = plan.pop("nproc", None)
    namespace["enter"](plan, rep)
    try:
        os.execv(sys.executable, sys.orig_argv[:-2] + [JAILED, "%d,%d" % tasks if tasks else ""])
    except OSError as e:  # e.g. an LSM that refuses executing from a tmpfs: the kernel refused a step
        os.write(rep, ("unavailable exec of the interpreter's copy: %s\n" % (e,)).encode(errors="replace"))
        os._exit(namespace["EXIT_UNAVAILABLE"])


def _limit_tasks(tasks, rep):
    """In the exec'd interpreter, before the program: RLIMIT_NPROC (``"soft,hard"`` from the jail's plan; "" when
    there is none). A root trainer's jail drops to uid 65534, and the kernel fails the execve of a process whose new
    uid has more tasks than its RLIMIT_NPROC (EAGAIN): threads of other sandboxes of that uid, started after this
    run's limit was counted, made the exec fail, which read as the machine refusing the sandbox and stopped every
    code reward of the run. A non-root trainer's jail (a user namespace) failed its fork of PID 1 the same way: the
    new namespace bounds the uid's tasks on the machine by the limit its creator had. Set after the exec, the limit
    only stops the program's own threads (in a user namespace, kernel >= 5.14, it counts that namespace's tasks)."""
    if tasks:
        resource.setrlimit(resource.RLIMIT_NPROC, tuple(map(int, tasks.split(","))))
        os.write(rep, b"rlimit_nproc\n")


def _not_dumpable(rep):
    """In the exec'd interpreter: report ``not_dumpable`` when the kernel refuses this process its own memory file
    (the parent refuses a run without it)."""
    try:
        os.close(os.open("/proc/self/mem", os.O_RDONLY))
    except PermissionError:
        os.write(rep, b"not_dumpable\n")


def _system_exit(e):
    """The program's own ``SystemExit`` (no test mode): code 0 / None ends as Python ends it; any other code (after a
    non-int one is printed, as Python prints it) ends with :data:`EXIT_SYSTEM_EXIT`, so the parent tells it from a
    crash (status 1): DARE's stdin cases accept any ``SystemExit`` (LiveCodeBench's ``call_method``)."""
    code = e.code
    if code is None or (isinstance(code, int) and code == 0):
        raise SystemExit(0)
    if not isinstance(code, int):
        try:
            sys.stderr.write("%s\n" % (code,))
        except BaseException:  # a closed stderr: Python's own exit ignores the failed print too; the status
            pass  # below still tells the parent it was the program's SystemExit, not a pass
    raise SystemExit(EXIT_SYSTEM_EXIT)


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


def _refusing(message):
    """A function that raises ``SandboxRefused(message)``, for the stubs this bootstrap puts into modules. Its globals
    are its own: a function defined here would hand the program this bootstrap's globals (``stub.__globals__``), and
    with them ``_die``, whose replacement by a no-op made a failed test fall through to the proof."""
    namespace = {"SandboxRefused": SandboxRefused, "message": message}
    exec("def refused(*args, **kwargs):\n    raise SandboxRefused(message)\n", namespace)
    return namespace["refused"]


def _close_frame_sources():
    """Test mode, before the program: the ways to a frame object the audit hook cannot see. Signal handlers receive
    the interrupted frame; ``gc.set_debug(DEBUG_SAVEALL)`` puts every collected cycle (frames of exceptions caught
    in a function) in ``gc.garbage``; a second copy of ``_signal`` or ``gc`` (``BuiltinImporter.create_module``)
    would bring both back, so every builtin module is imported now and ``_imp.create_builtin`` is gone (the
    replaced functions are referenced nowhere else)."""
    import _imp  # sandbox child: imports nothing it need not, and only here (test mode)

    for name in sys.builtin_module_names:
        if name not in sys.modules:
            __import__(name)
    import _signal  # sandbox child: after every builtin module above (see the docstring)
    import gc
    import signal

    _signal.signal = signal.signal = _refusing("sandbox: installing signal handlers is refused while tests run")
    gc.set_debug = _refusing("sandbox: gc.set_debug is refused while tests run (DEBUG_SAVEALL hands out frames)")
    _imp.create_builtin = _refusing("sandbox: creating a builtin module again is refused while tests run")


def _proof(root, token_fd, proof_fd):
    """Test mode: what the hook needs to accept the proof once (see the module docstring): the bootstrap's frame,
    the token (read and its pipe closed), the proof pipe, and the line the frame must be at then (``_boot``'s last,
    which it reaches only after the tests ran to their end: a program holding the frame cannot be there)."""
    _close_frame_sources()
    sys.pycache_prefix = os.path.join(root, "no_pycache")  # imports compile from source: no marshal.loads
    frame = sys._getframe(1)
    last_line = max(line for _, _, line in frame.f_code.co_lines() if line is not None)
    proof = [frame, os.read(token_fd, 64), proof_fd, last_line]
    os.close(token_fd)
    return proof


def _passed(audit, frame):
    audit("megadare.tests_passed", frame)
    _flush()
    os._exit(0)


def _boot():
    rep, code_fd, tests_fd, root = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    maxc, audit_on, token_fd, proof_fd = int(sys.argv[5]), sys.argv[6] == "1", int(sys.argv[7]), int(sys.argv[8])
    preload, tested, jail_plan, jail_source = (
        sys.argv[9],
        frozenset(sys.argv[10].split(",")),
        sys.argv[11],
        sys.argv[12],
    )
    if jail_plan == JAILED:
        _not_dumpable(rep)
        _limit_tasks(jail_source, rep)
    elif jail_plan:
        _jail(jail_plan, jail_source, rep)
    source = _read_fd(code_fd)
    test_source = _read_fd(tests_fd) if tests_fd >= 0 else None
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
    # what decides the verdict once the program ran: locals, which it cannot reach (module globals and builtins it can)
    audit, run, frame, die, passed, kind, text = sys.audit, exec, None, _die, _passed, type, str
    if audit_on:
        if maxc == 0:
            stub = types.ModuleType("_posixsubprocess")
            stub.fork_exec = _refusing("sandbox: process creation refused (_posixsubprocess)")
            sys.modules["_posixsubprocess"] = stub
        proof = None
        if tests is not None:
            proof = _proof(root, token_fd, proof_fd)
            frame = proof[0]
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
            _system_exit(e)
        die(e, audit, frame, "sandbox: the program exited before its tests ran")
    except BaseException as e:
        die(e, audit, frame)
    if tests is None:
        return
    # the tests see the program's names but the true builtins: a global ``abs`` of the program's cannot change what
    # the tests' ``abs`` means (the program's own functions still see it: their globals are the module's), but for
    # the builtin names the parent says are under test (``def sorted``: ``tested``); str keys only (a key object
    # that equals "abs" on the second comparison only would shadow it)
    namespace = {k: v for k, v in mod.__dict__.items() if kind(k) is text and (k not in pristine or k in tested)}
    namespace.update(__builtins__=pristine, __name__="tests")
    try:
        run(tests, namespace)
    except BaseException as e:  # a failed assert, SystemExit inside a test, anything
        die(e, audit, frame, "sandbox: the tests did not pass")
    passed(audit, frame)  # must stay the last line of _boot (the proof is accepted only from there)


PROC_EVENTS = frozenset(
    (
        "os.fork",
        "os.forkpty",
        "os.posix_spawn",
        "os.spawn",
        "os.exec",
        "os.system",
        "subprocess.Popen",
        "os.startfile",
        "pty.spawn",
    )
)
DENY_EVENTS = frozenset(
    (
        "gc.get_objects",
        "gc.get_referrers",
        "gc.get_referents",
        "os.killpg",
        "signal.pthread_kill",
        "sys.remote_exec",
        "os.symlink",
        "cpython.PyInterpreterState_New",
    )
)  # a sub-interpreter has no audit hook
# test mode: no frame objects (they reach the hook's closure), no tracing, no new hooks, no re-imported _signal,
# no hand-made code objects (bytecode can read memory)
FRAME_EVENTS = frozenset(
    (
        "sys._getframe",
        "sys._current_frames",
        "sys._current_exceptions",
        "sys.settrace",
        "sys.setprofile",
        "sys.addaudithook",
    )
)
TEST_IMPORTS = frozenset(("_signal", "gc"))  # again, after sys.modules lost them: _close_frame_sources
TEST_IMPORT_PREFIXES = ("_test", "_xx")  # CPython's test modules (_testcapi, _testbuffer, ...), sub-interpreters
TEST_DENIED = frozenset(("code.__new__", "marshal.loads", "marshal.load"))
# event -> (indices of path args, index of the dir_fd arg or None)
PATH_EVENTS = {
    "os.remove": ((0,), 1),
    "os.rmdir": ((0,), 1),
    "os.mkdir": ((0,), 2),
    "os.chmod": ((0,), 2),
    "os.chown": ((0,), 3),
    "os.utime": ((0,), 3),
    "os.truncate": ((0,), None),
    "os.rename": ((0, 1), 2),
    "os.link": ((0, 1), 2),
    "os.chdir": ((0,), None),
    "os.setxattr": ((0,), None),
    "os.removexattr": ((0,), None),
    "os.chflags": ((0,), None),
    "os.lchflags": ((0,), None),
    "os.lchmod": ((0,), None),
    "shutil.rmtree": ((0,), 1),
}


def _exact(value):
    """A str (or str subclass) as an exact str, other values as they are: a subclass cannot answer the hook's
    checks (``startswith``, ``__eq__``, ``split``) with other text than the one CPython uses."""
    return "".join((value,)) if isinstance(value, str) else value


def _module_names(name, filename=None):
    """What an import is of: its name, the name's last part (an extension module's init function is named by it:
    ``_ctypes`` loaded as ``x._ctypes`` is ``_ctypes``) and the stem of the file it loads (``_ctypes.cpython-311-...
    .so``); exact strs (a subclass cannot answer the checks with other text)."""
    name, filename = _exact(name), _exact(filename)
    names = {name, name.rpartition(".")[2]} if isinstance(name, str) else set()
    if isinstance(filename, str):
        names.add(os.path.basename(filename).partition(".")[0])
    return names


def _refuse(what):
    raise SandboxRefused("sandbox: %s refused" % what)


def _test_guard(proof):
    """The test-mode part of the hook: the proof event, and refusals of what could reach the token."""
    write = os.write

    def test_mode(event, args):
        """True when ``event`` was handled here: the proof, and what could reach it."""
        if event == "megadare.tests_passed" or event == "megadare.tests_failed":
            if args and args[0] is proof[0]:
                if event == "megadare.tests_passed" and proof[1] and args[0].f_lineno == proof[3]:
                    write(proof[2], proof[1])
                proof[0] = proof[1] = None  # one shot (a forgery burns it); frames are harmless once it is gone
            return True
        if proof[1] is None:
            return False
        if event in FRAME_EVENTS or (event == "object.__getattr__" and args[1] in FRAME_ATTRS):
            raise ValueError("sandbox: frame access is refused while tests run")  # the error stdlib callers expect
        if event == "import":
            for name in _module_names(*args[:2]):
                if name in TEST_IMPORTS or name.startswith(TEST_IMPORT_PREFIXES):
                    _refuse("import of %s" % name)
        if event in TEST_DENIED:
            _refuse(event)
        return False

    return test_mode


def _path_guard(root):
    """``inside(path, dir_fd=None)``: does ``path`` (str, bytes, path-like or fd) resolve into the sandbox dir
    ``root`` (or /dev/null, /dev/stdout, /dev/stderr)?"""
    realpath, fspath, fsdecode, readlink = os.path.realpath, os.fspath, os.fsdecode, os.readlink
    root_slash = root.rstrip("/") + "/"
    dev_ok = ("/dev/null", "/dev/stdout", "/dev/stderr")

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

    return inside


def _open_guard(inside):
    """The check of an ``open`` event: no writing outside the sandbox dir, no directory outside it (no ``dir_fd``
    tricks), no ``/proc/*/mem``."""
    realpath, fspath, fsdecode, isdir = os.path.realpath, os.fspath, os.fsdecode, os.path.isdir
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC

    def check_open(path, mode, flags):
        if isinstance(path, int):
            return
        writing = (isinstance(mode, str) and ("w" in mode or "a" in mode or "x" in mode or "+" in mode)) or (
            isinstance(flags, int) and flags & write_flags
        )
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

    return check_open


def _import_guard(maxc):
    """The check of an ``import`` event: refused modules, and native code (``_imp.create_dynamic``, which names
    the file) only from this Python's own directories (``sys.path`` now: read-only in the sandbox), never from a
    file the program wrote (its dir, a memfd, ``/proc/self/fd/N``)."""
    realpath = os.path.realpath
    deny = frozenset(("_ctypes", "_posixsubprocess") if maxc == 0 else ("_ctypes",))
    lib_dirs = tuple(realpath(p).rstrip("/") + "/" for p in sys.path if p)

    def check_import(name, filename=None, *rest):
        if deny.intersection(_module_names(name, filename)):
            _refuse("import of %s" % (name,))
        filename = _exact(filename)
        if filename is not None and not (isinstance(filename, str) and realpath(filename).startswith(lib_dirs)):
            _refuse("loading native code from %r (not a directory of this Python)" % (filename,))

    return check_import


def _kill_guard(maxc):
    """The check of an ``os.kill`` event: itself (and its group) only; with children allowed, any process of its
    own process group (its children) but no other (in ``process`` isolation the trainer's pid is visible)."""
    getpid, getpgrp, getpgid = os.getpid, os.getpgrp, os.getpgid

    def group_of(pid):
        try:
            return getpgid(pid)
        except OSError:
            return -1

    def check_kill(pid, *rest):
        group = getpgrp()  # 0 in a PID namespace: the group is the keeper's, outside it
        if pid in ((getpid(), 0, -group) if group else (getpid(),)):
            return
        if maxc == 0 or pid < 0 or (group and group_of(pid) != group):
            _refuse("signal to pid %r" % (pid,))

    return check_kill


def _make_hook(root, maxc, proof):
    inside = _path_guard(root)
    check_open, check_import, check_kill = _open_guard(inside), _import_guard(maxc), _kill_guard(maxc)
    test_mode = _test_guard(proof) if proof is not None else None
    spawned = [0]

    def hook(event, args):
        if test_mode is not None and test_mode(event, args):
            return
        if event == "open":
            check_open(*args)
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
            check_kill(*args)
        elif event == "import":
            check_import(*args)
        elif event in DENY_EVENTS:
            _refuse(event)

    return hook


if __name__ == "__main__":
    _boot()
