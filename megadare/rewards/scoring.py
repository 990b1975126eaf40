"""The one batch scorer that RL and evaluation share, and the stop when a reward cannot be computed.

``score_batch`` scores responses on a pool of threads with a per-call time limit and counts what failed;
``check_reward_errors`` raises :class:`RewardError` when more than ``max_fraction`` of a batch failed, naming the
reward, the first failing record's source (``file:row``) and its exception. An answer whose check timed out
(:class:`AnswerTimeout`: a verifier on a pathological expression) is a wrong answer, not a failure, as a program
that runs past its limit fails its test.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from megadare.rewards.errors import AnswerTimeout, RewardError, SandboxUnavailable
from megadare.rewards.registry import RewardSpec, as_score, load_reward

__all__ = ["ScoreStats", "score_batch", "check_reward_errors"]


@dataclass
class ScoreStats:
    """What happened in one :func:`score_batch` call.

    ``errors``: calls that raised or returned a non-finite / non-numeric value; ``timeouts``: calls that ran past
    ``timeout_s`` (both are reward failures, scored 0.0); ``answer_timeouts``: answers whose check ran past its own
    limit (:class:`AnswerTimeout`, scored 0.0 as wrong answers); ``first_error`` / ``first_error_index``: the first
    failed sample in batch order and its exception; ``failed``: every failed sample's exception.
    """

    n: int = 0
    errors: int = 0
    timeouts: int = 0
    answer_timeouts: int = 0
    mean: float = 0.0
    wall_s: float = 0.0
    first_error: Optional[str] = None
    first_error_index: Optional[int] = None
    failed: Dict[int, str] = field(default_factory=dict)  # sample index -> its exception

    @property
    def failures(self) -> int:
        return self.errors + self.timeouts

    def fail(self, i: int, message: str) -> None:
        self.failed[i] = message
        if self.first_error_index is None or i < self.first_error_index:
            self.first_error, self.first_error_index = message, i

    def to_dict(self) -> dict:
        return asdict(self)


def score_batch(
    fn: RewardSpec, responses: Sequence[str], records: Sequence[dict], workers: int = 8, timeout_s: float = 60.0
) -> Tuple[List[float], ScoreStats]:
    """Score every ``(response, record)`` pair with ``fn`` on a pool of up to ``workers`` threads (a thread per call
    cost more than a cheap reward: ~0.1 ms each); returns (scores, stats).

    A call that raises, returns a non-finite / non-numeric value (a string too), or runs longer than ``timeout_s``
    (measured from its own start) scores 0.0 and is counted in the stats (:func:`check_reward_errors` turns them into a
    stop). A timed-out call's thread cannot be killed: it is abandoned (daemon thread, its slot handed to the next
    call) and its late result ignored; the heavy rewards bound their own work (the verifier pool and the sandbox
    kill their processes). :class:`SandboxUnavailable` (the kernel refused the code sandbox) is raised, never
    counted: no tolerance turns it into scores.
    """
    fn = load_reward(fn)
    if len(responses) != len(records):
        raise ValueError(f"{len(responses)} responses but {len(records)} records")
    t0 = time.monotonic()
    n = len(responses)
    scores = [0.0] * n
    stats = ScoreStats(n=n)
    done_q: "queue.Queue[Tuple[int, bool, Any]]" = queue.Queue()
    refused: List[SandboxUnavailable] = []

    def call(i: int) -> None:
        try:
            value = as_score(fn(responses[i], records[i]))
            if not math.isfinite(value):
                raise ValueError(f"reward returned {value}")
            done_q.put((i, True, value))
        except AnswerTimeout:
            done_q.put((i, True, None))
        except SandboxUnavailable as e:
            refused.append(e)
            done_q.put((i, False, str(e)))
        except BaseException as e:  # noqa: B902 - counted, named, and the run stops on them (check_reward_errors)
            done_q.put((i, False, f"{type(e).__name__}: {e}"))

    pool = _CallPool(call, n, workers)
    finished = 0
    while finished < n:
        starts = pool.start_times()
        wait = min(starts) + timeout_s - time.monotonic() if starts else timeout_s
        try:
            i, ok, value = done_q.get(timeout=max(0.0, wait))
            if refused:
                raise refused[0]
            if pool.finish(i):  # else: a late result of a call already counted as timed out
                finished += 1
                if ok and value is None:
                    stats.answer_timeouts += 1
                elif ok:
                    scores[i] = value
                else:
                    stats.errors += 1
                    stats.fail(i, value)
        except queue.Empty:
            pass
        for i in pool.expire(timeout_s):
            finished += 1
            stats.timeouts += 1
            stats.fail(i, f"TimeoutError: the reward call ran past {timeout_s:g}s")
    stats.wall_s = time.monotonic() - t0
    stats.mean = sum(scores) / n if n else 0.0
    return scores, stats


class _CallPool:
    """``call(i)`` for i = 0..n-1 in order on up to ``workers`` threads, each taking the next index when its call
    returns. A call past the time limit (``expire``) keeps its thread (it cannot be killed): that thread stops when
    the call returns and a new one takes its slot."""

    def __init__(self, call: Callable[[int], None], n: int, workers: int):
        self.call, self.pending = call, queue.SimpleQueue()
        for i in range(n):
            self.pending.put(i)
        self.running: Dict[int, float] = {}  # index -> start time
        self.abandoned: set = set()
        self.lock = threading.Lock()
        for _ in range(min(max(1, workers), n)):
            self._start()

    def _start(self) -> None:
        threading.Thread(target=self._work, daemon=True, name="reward-worker").start()

    def _work(self) -> None:
        while True:
            try:
                i = self.pending.get_nowait()
            except queue.Empty:
                return
            with self.lock:
                self.running[i] = time.monotonic()
            self.call(i)
            with self.lock:
                if i in self.abandoned:
                    return

    def start_times(self) -> List[float]:
        with self.lock:
            return list(self.running.values())

    def finish(self, i: int) -> bool:
        """Call i returned; False when it had already timed out (its result is ignored)."""
        with self.lock:
            return self.running.pop(i, None) is not None

    def expire(self, timeout_s: float) -> List[int]:
        """The running calls past ``timeout_s`` since their start, abandoned; each one's slot gets a new thread."""
        now = time.monotonic()
        with self.lock:
            late = [i for i, s in self.running.items() if now - s >= timeout_s]
            for i in late:
                del self.running[i]
                self.abandoned.add(i)
        for _ in late:
            self._start()
        return late


def check_reward_errors(
    stats: ScoreStats,
    reward: str,
    sources: Sequence[str],
    max_fraction: float,
    where: str = "",
    key: str = "rewards.max_error_fraction",
) -> None:
    """Raise :class:`RewardError` when more than ``max_fraction`` of the batch's rewards failed.

    ``sources[i]``: the source (``file:row``) of sample i's record; ``where`` says which batch (e.g. "RL step 3").
    """
    if not stats.failures or stats.failures <= max_fraction * stats.n:
        return
    i = stats.first_error_index
    source = sources[i] if i is not None and i < len(sources) else "<unknown record>"
    raise RewardError(
        f"{where + ': ' if where else ''}reward {reward!r} could not be computed for {stats.failures} of {stats.n} "
        f"samples ({stats.errors} raised, {stats.timeouts} ran past the time limit), more than {key}="
        f"{max_fraction:g}; first failure: {source}: {stats.first_error}. A reward that cannot be computed is not a "
        f"wrong answer: fix the data or the reward ('megadare data inspect FILE --reward {reward}' checks a file), "
        f"or raise {key} to tolerate it (failed samples then score 0.0)"
    )
