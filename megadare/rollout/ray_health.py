"""What the driver sees of Ray's own processes: where Ray's logs are, and a watch on the head's GCS.

Ray's driver lives on without its GCS (the head's ``gcs_server``) for ``gcs_rpc_server_reconnect_timeout_s`` (60 s)
and is then ended from Ray's C++ core (exit 1, ``Failed to connect to GCS within 60 seconds``), while its actors
go on answering; megadare's driver gets ``parallel.collective_timeout_s`` instead (``outliving_the_gcs``).
``GcsWatch`` probes the GCS port every second: refused (nothing listens: the process is gone) or unreachable for
``GCS_MISSES`` probes in a row (~30 s: a network blip Ray itself rides out does not end the run), it is dead. The
manager's waits then raise its ``PeerError``; a driver busy elsewhere (a train step) gets the same line printed and
exit 2 after ``grace_s``, ahead of Ray's end, unless it got SIGTERM: the signal reached Ray too, and the RL loop
stops on it, saving without Ray (``lost_to_sigterm``, trainer/rl.py).
"""

from __future__ import annotations

import os
import socket
import sys
import threading
from contextlib import contextmanager
from typing import Callable, Iterator, Optional

import torch.distributed as dist

from megadare.console import end_open_line
from megadare.errors import RESUME, JobStopping, PeerError
from megadare.rollout.ray_guard import is_ray

GCS_PROBE_S = 1.0  # seconds between two probes of the GCS port
GCS_MISSES = 10  # probes that time out in a row (2 s each + 1 s apart: ~30 s of a lost host, inside Ray's limit)
GCS_GRACE_S = 10.0  # seconds the driver gets to raise the error itself before the watch prints it and exits
GCS_WAIT_ENV = "RAY_gcs_rpc_server_reconnect_timeout_s"  # how long Ray lets a process live without its GCS (60 s)
RELEASE_S = 20.0  # seconds the engines' actors and placement group get to be released through the GCS at the end


_TERMINATED: list[bool] = []  # this process got SIGTERM (trainer/signals.py notes it): a local Ray may have too


def note_sigterm() -> None:
    """This process got SIGTERM: a GCS found dead afterwards most likely got it too (a signal to every process of
    the job), which its error then says."""
    _TERMINATED.append(True)


def terminated() -> bool:
    """Whether this process got SIGTERM (``note_sigterm``)."""
    return bool(_TERMINATED)


class LostToSigterm(JobStopping):
    """A call through Ray or a weight group (a rollout, an evaluation, a weight push) that broke on a rank after it
    got SIGTERM (``job_stop_error``): Ray went down with the job. Decided on the rank that failed and passed on to
    the others with its outcome (``on_every_rank``, ``run_on_rank0``: parallel/rank0.py), so every rank decides
    alike."""


def lost_to_sigterm(e: BaseException) -> bool:
    """``e`` says the Ray head died (``GcsWatch``'s error, on rank 0 or passed on to the others) after this process
    got SIGTERM, or is a call through Ray broken after it (``LostToSigterm``): the signal reached every process of
    the job, Ray's too, and the run stops on it, saving without Ray (trainer/rl.py)."""
    if isinstance(e, LostToSigterm):
        return True
    return terminated() and isinstance(e, PeerError) and str(e).startswith(_HEAD)


def job_stop_error(e: Exception, what: str) -> Exception:
    """The error to raise for ``e``, raised by ``what`` (a call through Ray or a weight group: a rollout, a push).
    A peer gone or silent (``peer_gone``: megadare's ``PeerError``, any of Ray's errors, a torch.distributed
    transport's loss) after this process got SIGTERM: a ``LostToSigterm`` (the engines went down with the job: the
    run saves and stops). The same without a SIGTERM: a one-line ``PeerError`` when it is Ray's or the transport's
    own (a traceback otherwise). Anything else (a bug, a bad reward): ``e`` itself."""
    if isinstance(e, LostToSigterm) or not peer_gone(e):
        return e
    if terminated():
        return LostToSigterm(str(e) if isinstance(e, PeerError) else _one_line(e, what))
    return e if isinstance(e, PeerError) else PeerError(f"{_one_line(e, what)}; {RESUME}")


@contextmanager
def job_stop_errors(what: str) -> Iterator[None]:
    """Around a call through Ray or a weight group on the rank that makes it: its error as ``job_stop_error``
    says, the original as the cause."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - sorted by job_stop_error; anything else is raised unchanged
        error = job_stop_error(e, what)
        if error is e:
            raise
        raise error from e


# gloo's / NCCL's words for a group whose member is gone or silent
_PEER_LOST = (
    "connection reset",
    "connection closed",
    "connection refused",
    "broken pipe",
    "timed out",
    "pair closure",
    "remote process exited",
)


def peer_lost(e: BaseException) -> bool:
    """A torch.distributed error that means a member of the group is gone or silent (gloo / NCCL wording)."""
    text = str(e).lower()
    return any(w in text for w in _PEER_LOST)


def peer_gone(e: BaseException) -> bool:
    """``e`` is how a peer gone or silent surfaces: megadare's ``PeerError``, any of Ray's errors (an actor died,
    Ray's own processes gone, a timed-out get), or a torch.distributed error of a group that lost a member."""
    ray_errors = sys.modules.get("ray.exceptions")  # not loaded: no Ray call raised it
    if isinstance(e, PeerError) or (ray_errors is not None and isinstance(e, ray_errors.RayError)):
        return True
    return isinstance(e, dist.DistError) or (isinstance(e, RuntimeError) and peer_lost(e))


def _one_line(e: BaseException, what: str) -> str:
    """'<what> failed: <its type>: <its first line>'."""
    first = (str(e).strip().splitlines() or [""])[0][:300].rstrip(".")
    return f"{what} failed: {type(e).__name__}: {first}"


_HEAD = "the Ray head (its GCS"


def _gcs_end() -> str:
    """How the GCS most likely ended, for its error line."""
    if _TERMINATED:
        return (
            "ended by the SIGTERM this run got too: sent to every process of the job (Slurm's time limit, `kill "
            "-TERM -- -PGID`) it stops a local Ray with the run, and the step in flight is lost; send it to "
            "megadare's process alone to stop after the step with a checkpoint (the Slurm scripts do)"
        )
    return "killed, or its host lost"


def ray_logs() -> str:
    """Where this Ray session's logs are (each node's raylet.out, gcs_server.out, the workers' output)."""
    import ray  # heavy: Ray

    node = getattr(ray._private.worker, "_global_node", None)
    return node.get_logs_dir_path() if node is not None else "/tmp/ray/session_latest/logs on each node"


def ray_died(what: str, how: str) -> str:
    """'<what> died (<how>; Ray's logs: <dir>)': how a message names a dead Ray process (a node's raylet, the
    head's GCS)."""
    return f"{what} died ({how}; Ray's logs: {ray_logs()})"


def end_local_ray() -> list[int]:
    """SIGKILL the Ray processes this process started (a local Ray: its raylet, agents and workers) -> their pids.
    With the GCS dead, ``ray.shutdown`` cannot end them: its raylet's graceful stop waits for the GCS, and the
    agents it orphans wait for the GCS forever. Nothing of a Ray this process only joined is its child."""
    import psutil  # heavy: only on this path

    ours = []
    for p in psutil.Process().children(recursive=True):
        try:
            if is_ray(p):
                ours.append(p)
        except psutil.Error:  # already gone
            continue
    for p in ours:
        try:
            p.kill()
        except psutil.Error:
            pass
    return [p.pid for p in ours]


def within(deadline_s: float, work: Callable[[], None]) -> bool:
    """Run ``work`` in a daemon thread -> whether it returned within ``deadline_s`` (its error is raised here). A call
    through Ray's GCS waits as long as the GCS takes it and never answers (a stopped or swamped ``gcs_server``: its
    port still accepts, so ``GcsWatch`` sees it alive); past the deadline it is left to its thread."""
    done, raised = threading.Event(), []

    def run() -> None:
        try:
            work()
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread, raised there
            raised.append(e)
        finally:
            done.set()

    threading.Thread(target=run, name="megadare-ray-release", daemon=True).start()
    if not done.wait(deadline_s):
        return False
    if raised:
        raise raised[0]
    return True


def left_to_ray(what: str, deadline_s: float, ended: list[int]) -> str:
    """The line of a release through the GCS that did not end within ``deadline_s``: the local Ray this process
    started was ended (``ended``: its pids), or, of a Ray it only joined (nothing to end: never another's), what is
    left there."""
    head = (
        f"Ray's GCS did not release {what} within {deadline_s:.0f} s (it takes calls but answers none: stopped, "
        f"swamped, or waiting for a lost node; Ray's logs: {ray_logs()})"
    )
    if ended:
        return f"{head}: ended the local Ray this run started ({len(ended)} processes)"
    return f"{head}: they hold their resources on the Ray cluster until it frees them (`ray stop` on its nodes)"


@contextmanager
def outliving_the_gcs(wait_s: float) -> Iterator[None]:
    """Around ``ray.init``: the driver it connects lives on ``wait_s`` (at least) without the head's GCS, not
    Ray's 60 s (``GCS_WAIT_ENV``: its core reads it at ``ray.init``, never later). Ray then ended the driver from
    its C++ core, cutting the checkpoint a run saves without Ray after a SIGTERM to the whole job (trainer/rl.py),
    or the update before it, once longer; ``GcsWatch`` ends a driver whose GCS died in seconds instead, with its
    line, unless the run stops on that SIGTERM. A local Ray's processes started meanwhile inherit it: megadare ends
    them itself (``end_local_ray``, rollout/ray_guard.py)."""
    before = os.environ.get(GCS_WAIT_ENV)
    set_s = int(before) if before and before.strip().isdigit() else 0
    os.environ[GCS_WAIT_ENV] = str(max(int(wait_s), set_s))  # a longer one set by the user stays
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(GCS_WAIT_ENV, None)
        else:
            os.environ[GCS_WAIT_ENV] = before


def gcs_reachable(address: str, timeout_s: float = 2.0) -> Optional[bool]:
    """True: the GCS port at ``host:port`` accepts a connection; False: refused (nothing listens there);
    None: no answer within ``timeout_s`` (a slow network or a lost host)."""
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return True
    except ConnectionRefusedError:
        return False
    except OSError:
        return None


def _still_joined(address: str) -> bool:
    """This process is still joined to the Ray cluster of the GCS at ``address`` (no ``ray.shutdown`` since)."""
    import ray  # heavy: Ray

    return ray.is_initialized() and ray.get_runtime_context().gcs_address == address


class GcsWatch:
    """A daemon thread probing the GCS at ``address``; ``check()`` raises its ``PeerError`` once it is dead."""

    def __init__(
        self,
        address: str,
        grace_s: float = GCS_GRACE_S,
        probe_s: float = GCS_PROBE_S,
        on_exit: Callable[[int], None] = os._exit,
    ):
        self.address, self.grace_s, self.probe_s, self.on_exit = address, grace_s, probe_s, on_exit
        self.error: Optional[PeerError] = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="megadare-gcs-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        misses = 0
        while not self._stop.wait(self.probe_s):
            up = gcs_reachable(self.address)
            misses = 0 if up else misses + 1
            if up is False or misses >= GCS_MISSES:
                break
        else:
            return
        if not _still_joined(self.address):  # this process shut Ray down itself (ray.shutdown stops the GCS)
            return
        self._dead()
        if terminated():  # the driver stops on the signal, saving without Ray, once a wait on Ray raises the error
            return
        if self._stop.wait(self.grace_s) or not _still_joined(self.address):  # the driver raised it in time
            return
        end_open_line(sys.stderr)  # a progress bar's line
        print(f"megadare: error: {self.error}", file=sys.stderr, flush=True)
        end_local_ray()  # os._exit runs no ray.shutdown, which could not end them anyway
        self.on_exit(2)

    def _dead(self) -> None:
        self.error = PeerError(
            f"{ray_died(f'{_HEAD}, gcs_server at {self.address})', _gcs_end())}: "
            f"no rollout engine can be reached through Ray any more; {RESUME} once Ray is up again"
        )

    def found_dead(self) -> bool:
        """Whether the GCS is found dead; after a SIGTERM, a GCS that refuses now is dead at once (a call through it
        would wait until Ray ends this driver)."""
        if self.error is None and terminated() and gcs_reachable(self.address) is False:
            self._dead()
        return self.error is not None

    def check(self) -> None:
        """Raise the watch's ``PeerError`` (stopping the watch) once the GCS is found dead (``found_dead``)."""
        if self.found_dead():
            self._stop.set()
            raise self.error

    def stop(self) -> None:
        self._stop.set()
