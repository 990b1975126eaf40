"""Run a function in N local processes with torch.distributed env vars set (CPU gloo runs, tests, the demo).

``spawn(fn, world_size, *args)`` starts ``world_size`` processes (start method 'spawn'; 'forkserver' after
``preload_ranks``), calls ``fn(rank, world_size, *args)`` in each, and returns the per-rank results. An exception in
any rank is raised in the parent with that rank's traceback (megadare's own one-line errors as themselves, the
traceback as their cause); a hung collective fails after ``timeout_s`` instead of hanging. (torch.multiprocessing's
own ``spawn`` returns no results and waits for a hung rank forever: hence this one, on its processes.) The ranks
die with their launcher, SIGKILLed too (``_Launcher``).
"""

from __future__ import annotations

import ctypes
import os
import pickle
import queue as _q
import re
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing import forkserver
from typing import Any, Callable

import torch
import torch.multiprocessing as mp

from megadare import stopping
from megadare.console import share
from megadare.errors import RESUME, PeerError, StoppedBeforeTheLoop
from megadare.lifetime import die_with_parent
from megadare.parallel import peers


class WorkerError(RuntimeError):
    """A rank raised; the message carries its traceback."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# the start method of every launch; preload_ranks() sets 'forkserver' and what its server imports
_START: dict[str, Any] = {"method": "spawn", "preload": []}


def preload_ranks(modules: list[str]) -> None:
    """Later launches fork their ranks from one server process that imported ``modules`` once (start method
    'forkserver'), instead of a fresh interpreter per rank importing them again (torch + megatron: ~10 s of CPU per
    rank). For a process that launches many times (the test suite); a rank still gets its launcher's environment as
    it is at the launch. Not for CUDA runs: a module that initialises CUDA in the server breaks every rank."""
    _START.update(method="forkserver", preload=list(modules))


@dataclass(frozen=True)
class _Launcher:
    """What a rank takes from its launcher: its environment ``env`` (a forkserver's rank starts with the server's,
    from before this launch), and ``parent``, the pid of the process that starts the rank (the launcher, or its
    forkserver), which the rank dies with (``_die_with_launcher``)."""

    env: dict
    parent: int


def _launcher(method: str) -> _Launcher:
    """This launch's ``_Launcher``: under 'forkserver' the ranks' parent is the server (started here if it is not
    yet running; ``p.start()`` finds it so)."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    if method != "forkserver":
        return _Launcher(env, os.getpid())
    forkserver.ensure_running()
    return _Launcher(env, forkserver._forkserver._forkserver_pid)


def _die_with_launcher(parent: int) -> None:
    """This rank is SIGKILLed when its parent ends (``die_with_parent``; a parent already gone: it exits now): a
    launcher SIGKILLed (the OOM killer, ``kill -9``, a harness's timeout) left its ranks running for good. 'spawn':
    the parent is the launcher's thread that started the ranks, waiting for them in ``_spawn_once``. 'forkserver':
    the server, which ends once every holder of its "alive" pipe is gone; multiprocessing gives each rank one, so a
    server outlived its killed launcher (and the ranks it) while a rank held it: the rank closes its copy. (A
    forkserver this rank starts later is one of its own, with a pipe of its own.)"""
    die_with_parent(parent)
    server = forkserver._forkserver
    if server._forkserver_pid is None and server._forkserver_alive_fd is not None:
        os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None


def _entry(rank: int, world: int, call, queue, launcher: _Launcher, line) -> None:
    """Rank ``rank``: dies with its launcher (``_die_with_launcher``), takes its environment and torch.distributed's
    variables, then puts the result or error of ``call`` (``_pack``) into ``queue``. ``line``: the launch's shared
    record of an open progress-bar line (megadare.console). A SIGTERM from here on is the run's (set-up: stop, loop:
    save, after it: finish; megadare/stopping.py), up to the answer put."""
    with stopping.watching():
        _die_with_launcher(launcher.parent)
        share(line)
        os.environ.clear()
        os.environ.update(launcher.env, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
        torch.set_num_threads(1)
        try:
            fn, args = pickle.loads(call) if isinstance(call, bytes) else call
            # plain pickle copies tensor data: torch's fd sharing would die with this process
            queue.put((rank, True, pickle.dumps(run_here(fn, rank, world, *args))))
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            queue.put((rank, False, (traceback.format_exc(), _one_line_error(e))))


def _one_line_error(e: BaseException):
    """megadare's own one-line errors (ValueError subclasses defined in megadare: ConfigError, DataError, ...; a
    ``PeerError``; a SIGTERM before the loop, ``StoppedBeforeTheLoop``), pickled to be raised again in the parent as
    they are; None for anything else."""
    if isinstance(e, (ValueError, PeerError, StoppedBeforeTheLoop)) and type(e).__module__.startswith("megadare."):
        try:
            return pickle.dumps(e)
        except Exception:  # noqa: BLE001 - an unpicklable error is reported by its traceback
            return None
    return None


# what torch's gloo / NCCL say in a collective whose peer process is gone (killed, crashed, its host lost)
_PEER_LOST = re.compile(
    r"(?:(?:Read|Write) error \[[^\]]*\]:\d+: )?(?:Connection reset by peer|Connection closed by peer|Broken pipe|"
    r"remote process exited or there was a network error)"
)


# what gloo says in a collective a peer did not answer within the process group's timeout
_TIMED_OUT = re.compile(r"Timed out waiting \d+ms for \w+ operation to complete")


def run_here(run: Callable, *args: Any) -> Any:
    """``run(*args)`` in this process, one rank of a launch (torchrun, Slurm, ``spawn``). A collective that fails
    because another rank's process is gone (gloo: 'Connection reset by peer'; NCCL: 'remote process exited') or did
    not answer within ``parallel.collective_timeout_s`` (gloo: 'Timed out waiting ...ms') is one ``PeerError``
    line naming that rank where it can be told (``lost_rank``, ``silent_rank``), not torch's traceback; the launcher
    then ends the other ranks. megadare's own ``PeerError`` (a rollout engine lost mid-push) passes as it is,
    whatever its cause says."""
    try:
        return run(*args)
    except PeerError:
        raise
    except RuntimeError as e:
        lost, late = _PEER_LOST.search(str(e)), _TIMED_OUT.search(str(e))
        if lost is not None:
            raise PeerError(lost_rank(lost.group(0))) from e
        if late is not None:
            raise PeerError(silent_rank(late.group(0))) from e
        raise


# how long a survivor looks again for the dead peer on its host (``peers.dead_within``) before naming none
_SETTLE_S = 0.5


def _me() -> tuple[str, str, str]:
    """This rank, the world size and '(pid P on host)'."""
    here = f"(pid {os.getpid()} on {socket.gethostname()})"
    return os.environ.get("RANK", "?"), os.environ.get("WORLD_SIZE", ""), here


def _where_named() -> str:
    return "torchrun's report ('Root Cause')" if "TORCHELASTIC_RUN_ID" in os.environ else "its log"


def lost_rank(cause: str) -> str:
    """The line for this rank losing another in a collective (``cause``: gloo's or NCCL's words). Neither names the
    dead rank: a dead one on this host is found (``peers.dead_within``); else in a world of two it is the other one,
    else 'a peer of trainer rank R' (torchrun's 'Root Cause' names it)."""
    rank, world, here = _me()
    named = _where_named()
    dead = peers.dead_within(int(rank), _SETTLE_S) if rank.isdigit() else []
    if dead:
        ranks = ", ".join(map(str, dead))
        dead_s, who = f"trainer rank{'s' if len(dead) > 1 else ''} {ranks}", f"trainer rank {rank} {here} lost it"
        named += " says why"
    elif world == "2" and rank in ("0", "1"):
        dead_s, who = f"trainer rank {1 - int(rank)}", f"trainer rank {rank} {here} lost it"
        named += " says why"
    else:
        dead_s, who = f"a peer of trainer rank {rank} {here}", "that rank was lost"
        named += " names it"
    return (
        f"{dead_s} died (SIGKILL, the OOM killer, a segfault, a lost node) without an error of its own: {who} in a "
        f"collective ({cause}); {named}; {RESUME}"
    )


def silent_rank(cause: str) -> str:
    """The line for this rank waiting in a collective past ``parallel.collective_timeout_s`` (``cause``: gloo's
    words): the rank it waited for when it can be told (stopped or dead on this host, or the other of two)."""
    rank, world, here = _me()
    found = peers.suspects(int(rank)) if rank.isdigit() else []
    if found:
        who = f"{peers.named(found)}: trainer rank {rank} {here} waited for it"
    elif world == "2" and rank in ("0", "1"):
        who = f"trainer rank {1 - int(rank)} did not answer (hung): trainer rank {rank} {here} waited for it"
    else:
        who = f"a peer of trainer rank {rank} {here} did not answer (hung; {_where_named()} shows which): it waited"
    return (
        f"{who} in a collective longer than parallel.collective_timeout_s ({cause}); {RESUME} (raise "
        "parallel.collective_timeout_s if a rank is only slow)"
    )


def spawn(fn: Callable, world_size: int, *args: Any, timeout_s: float = 600) -> list[Any]:
    """``fn`` in ``world_size`` fresh processes. ``free_port`` releases the port it found before rank 0 binds it, so
    another process can take it in between (EADDRINUSE at rank 0's TCPStore): then the launch starts again on a new
    port, up to three times, before the error is raised."""
    for attempt in range(3):
        results, errors, own = _spawn_once(fn, world_size, args, timeout_s)
        port_taken = errors and not results and "EADDRINUSE" in errors[0]
        if not (port_taken and attempt < 2):
            break
    if own:
        raise own[0] from WorkerError("\n".join(errors))
    if errors:
        raise WorkerError("\n".join(errors))
    return [results[r] for r in range(world_size)]


def _pack(fn: Callable, args: tuple):
    """``(fn, args)`` as the ranks get them. 'spawn': as they are (a rank starts with the launcher's environment).
    'forkserver': pickled here by value, to be unpickled once the rank restored the launcher's environment (a module
    imported while unpickling sees it: Ray reads RAY_AUTH_MODE at import), unless ``args`` hold what only
    inheritance passes (a multiprocessing Queue or Event): those go as they are."""
    if _START["method"] == "spawn":
        return fn, args
    try:
        return pickle.dumps((fn, args))  # by value (tensors too): each rank unpickles its own copy
    except RuntimeError:  # "Queue objects should only be shared between processes through inheritance"
        return fn, args


def _spawn_once(fn: Callable, world_size: int, args: tuple, timeout_s: float):
    """One launch: (results by rank, error texts, megadare's own errors; a rank that died first)."""
    _quiet_tracker()
    ctx = mp.get_context(_START["method"])
    if _START["preload"]:
        ctx.set_forkserver_preload(_START["preload"])
    queue = ctx.Queue()
    launcher = _launcher(_START["method"])
    call = _pack(fn, args)
    line = ctx.RawValue("b", 0)  # a rank's progress bar left stderr's line open: the launcher's error ends it
    share(line)
    procs = [
        ctx.Process(target=_entry, args=(r, world_size, call, queue, launcher, line), daemon=False)
        for r in range(world_size)
    ]
    known = _children()
    reaper = _subreaper(True)  # what a killed rank's children leave (Ray's agents) becomes ours to end
    for p in procs:
        p.start()
    passed: list[int] = []  # the SIGTERMs passed on to the ranks
    previous = _pass_sigterm_on(procs, passed)
    done = threading.Event()
    if reaper:  # an adopted process that ends meanwhile (a double-forked helper) must not stay a zombie
        keep = known | {p.pid for p in procs}
        threading.Thread(target=_reap_adopted, args=(keep, done), name="megadare-reaper", daemon=True).start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    own: list[BaseException] = []
    try:
        _collect(procs, queue, results, errors, own, timeout_s)
    finally:
        for p in procs:
            p.join(timeout=5 if errors else 60)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        done.set()
        _restore(previous)
        if reaper:
            _end_orphans(known | {p.pid for p in procs}, wait_s=2.0 if errors else 0.0)
            _subreaper(False)
    if passed and _killed_by_sigterm_alone(procs):
        own[:] = [StoppedBeforeTheLoop(signal.SIGTERM)]
    return results, errors, own


def _killed_by_sigterm_alone(procs: list) -> bool:
    """Whether the ranks that died did so by SIGTERM (and some did): the job's SIGTERM, passed on, reached them
    before their handler (``_entry``: a rank sets up from there; the interpreter's start and the imports of this
    module come first), a stop before the loop, not a crash."""
    died = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
    return bool(died) and all(code == -signal.SIGTERM for code in died)


def _pass_sigterm_on(procs: list, passed: list[int]) -> dict:
    """While the ranks run, SIGTERM to this process goes on to them (each finishes its step, saves and answers),
    noted in ``passed``: it ended the launcher, so a SIGTERM to the whole job (Slurm's time limit, ``kill -TERM --
    -PGID``) left the ranks to save unseen, with no summary and exit -15. Returns the previous handler
    (``_restore``)."""

    def pass_on(signum, frame) -> None:
        passed.append(signum)
        for p in procs:
            if p.pid is not None and p.exitcode is None:
                try:
                    os.kill(p.pid, signum)
                except ProcessLookupError:
                    pass

    try:
        return {signal.SIGTERM: signal.signal(signal.SIGTERM, pass_on)}
    except ValueError:  # not the main thread: leave handlers alone
        return {}


def _restore(previous: dict) -> None:
    for s, h in previous.items():
        signal.signal(s, h)


# multiprocessing's resource tracker (started with this process's -W options) warns as this process ends of what a
# killed rank had not released, after the run's one-line error; it removes them all the same
_LEAK_WARNING = "ignore:resource_tracker:UserWarning"


def _quiet_tracker() -> None:
    """The resource tracker, once started by this launch, keeps its leak warning to itself (see ``_LEAK_WARNING``)."""
    if _LEAK_WARNING not in sys.warnoptions:
        sys.warnoptions.append(_LEAK_WARNING)


PR_SET_CHILD_SUBREAPER = 36


def _subreaper(on: bool) -> bool:
    """This process adopts its descendants' orphans (Linux ``PR_SET_CHILD_SUBREAPER``) while ``on``: a rank killed
    (the OOM killer) takes its local Ray's raylet and GCS along (Ray's fate sharing), but their children, Ray's
    dashboard and runtime-env agents, were left to init, waiting for the GCS forever. True when it took."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) == 0
    except (OSError, AttributeError):  # not Linux
        return False


def _children() -> set[int]:
    import psutil  # heavy: only around a launch

    return {c.pid for c in psutil.Process().children()}


def _reap_adopted(keep: set[int], done: threading.Event) -> None:
    """Each second until ``done``: reap the adopted processes (children other than ``keep``, the ranks and
    multiprocessing's helpers) that ended."""
    import psutil  # heavy: only around a launch

    while not done.wait(1.0):
        for c in psutil.Process().children():
            try:
                if c.pid not in keep and c.status() == psutil.STATUS_ZOMBIE and c.pid not in _helpers():
                    os.waitpid(c.pid, os.WNOHANG)
            except (psutil.Error, ChildProcessError):
                pass


def _helpers() -> set:
    """multiprocessing's forkserver and resource tracker (this process's children, never ended here)."""
    from multiprocessing import forkserver, resource_tracker

    return {getattr(forkserver._forkserver, "_forkserver_pid", None), resource_tracker._resource_tracker._pid}


def _end_orphans(known: set[int], wait_s: float) -> list[int]:
    """SIGKILL the processes adopted during the launch (this process's children other than ``known``, the ranks
    and multiprocessing's own helpers) with their descendants, waiting up to ``wait_s`` for them to arrive (a
    dead rank's raylet dies a moment after it) -> their pids."""
    import psutil  # heavy: only around a launch

    helpers = _helpers()
    end, ended = time.monotonic() + wait_s, []
    while True:
        for c in psutil.Process().children():
            if c.pid in known or c.pid in helpers:
                continue
            try:
                tree = [*c.children(recursive=True), c]
            except psutil.Error:  # gone meanwhile
                continue
            for p in tree:
                try:
                    p.kill()
                    p.wait(5)
                    ended.append(p.pid)
                except psutil.Error:  # already gone, or another's to reap
                    pass
        if time.monotonic() >= end:
            return ended
        time.sleep(0.2)


def _collect(procs: list, queue, results: dict, errors: list, own: list, timeout_s: float) -> None:
    """Every rank's answer from ``queue``, until the first error. A rank whose process ends without one (SIGKILL,
    the OOM killer, a segfault, ``os._exit``) is noticed within a second, while the others may wait for it in a
    collective or work on: its death is the run's error, ahead of what a survivor then says (a reset connection)."""
    deadline = time.monotonic() + timeout_s
    reported: set[int] = set()
    while len(reported) < len(procs):
        try:
            rank, ok, val = queue.get(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
        except _q.Empty:
            dead = _died(procs, reported)
            if dead or time.monotonic() >= deadline:
                waiting = sorted(set(range(len(procs))) - reported)
                errors.append(dead or f"timed out after {timeout_s}s waiting for ranks {waiting}")
                own.extend([PeerError(dead)] if dead else [])
                return
            continue
        reported.add(rank)
        if ok:
            results[rank] = pickle.loads(val)
            continue
        tb, err = val
        dead = _died(procs, reported, grace_s=2.0)
        own.extend([PeerError(dead)] if dead else [])
        errors.append(f"rank {rank} failed:\n{tb}")
        if err is not None:
            own.append(pickle.loads(err))
        return


def _died(procs: list, reported: set, grace_s: float = 0.0) -> str:
    """One line naming the ranks whose process ended without an answer (waiting up to ``grace_s`` for one to
    end: a survivor may report the lost connection before the dead rank's exit is seen); '' when none did."""
    end = time.monotonic() + grace_s
    while True:
        dead = [(r, p) for r, p in enumerate(procs) if r not in reported and p.exitcode not in (None, 0)]
        if dead or time.monotonic() >= end:
            break
        time.sleep(0.1)
    if not dead:
        return ""
    host = socket.gethostname()
    what = "; ".join(f"trainer rank {r} (pid {p.pid} on {host}) {_exit_cause(p.exitcode)}" for r, p in dead)
    return f"{what} without an error of its own; {RESUME}"


def _exit_cause(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        why = " (the OOM killer, kill -9)" if name == "SIGKILL" else ""
        return f"was killed by {name}{why}"
    return f"exited with code {code}"
