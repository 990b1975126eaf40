"""Collectives of the trainer's ranks around rank 0's work: its rank (``trainer_rank``) and ``run_on_rank0``
(rank 0 runs a rollout or scoring while the other ranks stand by, and every rank gets its result or its error)."""

from __future__ import annotations

import pickle
from typing import Any, Callable, Optional

import torch.distributed as dist

from megadare.errors import RESUME, JobStopping, PeerError


def trainer_rank() -> int:
    """This process's rank in the trainer's world (0 without torch.distributed)."""
    return dist.get_rank() if dist.is_initialized() else 0


def run_on_rank0(work: Callable[[], Any], push: Optional[Callable[[], Any]] = None, manager: Any = None) -> Any:
    """Collective: rank 0 runs ``work()`` (a rollout, scoring) while the other ranks stand by; returns its result on
    every rank. An exception on rank 0 is raised on every rank (the same exception when it pickles, e.g. a
    ``RewardError``), so no rank waits on a broadcast that never comes. With ``push`` and the rollout ``manager``:
    should the rollout find no engine holding the current weights (every one was restarted), rank 0 calls for a
    push (``manager.on_stale``) and every rank runs ``push()`` before rank 0 goes on; a push that fails on any rank
    ends this call on every rank with that error (``on_every_rank``), and rank 0 tells nothing more."""
    multi = dist.is_initialized() and dist.get_world_size() > 1

    def tell(kind: str, value: Any = None) -> None:
        if multi:
            dist.broadcast_object_list([(kind, value)], src=0)

    if trainer_rank() == 0:
        push_failed: list[BaseException] = []  # every rank raised this push's error: none listens to rank 0 now

        def stale() -> None:
            if push_failed:  # work() caught the push's error and asks again: the other ranks have left
                raise push_failed[0]
            tell("push")
            try:
                on_every_rank(push)
            except BaseException as e:  # any failure, an interrupt too: every rank raised it, rank 0 tells no more
                push_failed.append(e)
                raise

        if manager is not None and push is not None:
            manager.on_stale = stale
        try:
            result = work()
        except BaseException as e:  # an interrupt too: the other ranks wait for rank 0's word
            if not push_failed:
                tell("error", picklable(e))
            raise
        finally:
            if manager is not None:
                manager.on_stale = None
        if push_failed:  # work() swallowed the push's error: every other rank raised it, so rank 0 does too
            raise push_failed[0]
        tell("done", result)
        return result
    while True:
        box: list[Any] = [None]
        _stand_by(box)
        kind, value = box[0]
        if kind == "push":
            on_every_rank(push)
        elif kind == "error":
            raise value
        else:
            return value


def on_every_rank(push: Callable[[], Any]) -> Any:
    """``push()`` on every rank, then every rank's outcome to every rank: should it raise on any (on all, as a
    header rank 0 could not decide; on rank 0 or on the others only, as a transfer that broke mid-way), it raises
    on every rank (its own error where it failed, else the lowest failing rank's; a ``JobStopping`` on any rank
    before any other, so all decide to save and stop alike), so none goes on alone; else its result on this
    rank."""
    failed: Optional[BaseException] = None
    result = None
    try:
        result = push()
    except BaseException as e:  # noqa: BLE001 - any failure, an interrupt too: every rank learns of it, then raises
        failed = e
    outcomes: list[Optional[BaseException]] = [failed]
    if dist.is_initialized() and dist.get_world_size() > 1:
        outcomes = [None] * dist.get_world_size()
        dist.all_gather_object(outcomes, None if failed is None else picklable(failed))
    stopping = next((e for e in outcomes if isinstance(e, JobStopping)), None)
    if stopping is not None and not isinstance(failed, JobStopping):
        raise stopping from failed  # another rank saw the job stopping: so does this one
    first = failed or next((e for e in outcomes if e is not None), None)
    if first is not None:
        raise first
    return result


def picklable(e: BaseException) -> BaseException:
    """``e`` itself when it survives pickling, else a RuntimeError with its type and message."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # noqa: BLE001 - any pickling failure: send the message instead
        return RuntimeError(f"trainer rank {trainer_rank()} failed: {type(e).__name__}: {e}")


def _stand_by(box: list) -> None:
    """Rank 0's next word into ``box``; a wait past the process group's timeout is one line saying what it means."""
    try:
        dist.broadcast_object_list(box, src=0)
    except RuntimeError as e:  # torch's DistBackendError; gloo: 'Timed out waiting ...ms', NCCL: 'timeout'
        if "timed out" not in str(e).lower() and "timeout" not in str(e).lower():
            raise
        raise PeerError(
            f"trainer rank {trainer_rank()} waited for rank 0 (its rollout or scoring) longer than "
            f"parallel.collective_timeout_s: rank 0 hung, or is slower than that; {RESUME} (raise "
            "parallel.collective_timeout_s if rank 0 is only slow)"
        ) from e
