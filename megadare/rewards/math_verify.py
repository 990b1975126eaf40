"""Math answer verification: is a predicted final answer equal to the gold one? Plus the process pool that runs it.

``answers_equal(pred, gold)`` decides in this process: equal after
:func:`~megadare.rewards.math_answer.normalize_answer` (the MATH ``strip_string`` rules, a fast path that needs no
parsing), else what the ``math-verify`` package says (``parse`` + ``verify``: the checker of DARE, verl and
OpenCompass; LaTeX and plain expressions, fractions / decimals / percentages, tuples, intervals, sets, symbolic
equality through sympy). Malformed input gives False (math-verify's own rule), never an exception.

What math-verify lacks is a hard bound on time: sympy can hang on inputs such as ``9^{9^{9^{9}}}`` and its
``signal.alarm`` timeouts work only on a main thread. So untrusted text goes through :class:`VerifierPool`: fixed
worker processes (``forkserver``/``spawn`` context) fed over pipes, a wall-clock timeout per call, and a stuck worker
is SIGKILLed and replaced, so the pool stays usable. :func:`verify_answer` and :func:`math_reward` use it (a shared
default pool unless one is passed); a timed-out or crashed comparison raises there (a reward that could not be
computed is an error, not a wrong answer).
"""

from __future__ import annotations

import atexit
import importlib.util
import multiprocessing
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional

from megadare.rewards.dare_math import dare_answers_equal, dare_boxed, dare_gold, mathd_normalize
from megadare.rewards.dllm_rl_latex import dllm_rl_latex_equal
from megadare.rewards.errors import AnswerTimeout
from megadare.rewards.math_answer import extract_answer, extract_boxed, normalize_answer

__all__ = [
    "answers_equal",
    "VerifierPool",
    "VerifyResult",
    "verify_answer",
    "math_reward",
    "dare_math_reward",
    "default_pool",
]

MV_TIMEOUT_S = 3  # math-verify's own per-parse / per-verify alarm (main thread only); the pool's timeout is the bound


def _dollars(s: str) -> str:
    """math-verify's LaTeX extraction wants math mode: wrap a bare answer in ``$...$``."""
    s = s.strip()
    return s if s.startswith("$") or "\\boxed" in s else f"${s}$"


def _normalized_verdict(pred: str, gold: str) -> Optional[bool]:
    """What the normalised strings alone decide: False when either normalises to nothing, True when they are
    equal, None when math-verify has to compare them."""
    np_, ng = normalize_answer(pred), normalize_answer(gold)
    if not np_ or not ng:
        return False
    return True if np_ == ng else None


_LATEX_PARSER_WARM = threading.Event()


def _warm_latex_parser(mv_parse: Any) -> None:
    """Build the LaTeX grammar once per process, outside the alarm: the first LaTeX parse takes ~0.5 CPU-s (seconds
    of wall clock on a loaded machine), which the alarm would bill to whatever answer came first and score it
    False."""
    if not _LATEX_PARSER_WARM.is_set():
        on_main = threading.current_thread() is threading.main_thread()
        mv_parse("$\\frac{1}{2}$", parsing_timeout=60 if on_main else None)
        _LATEX_PARSER_WARM.set()


def answers_equal(pred: Optional[str], gold: Optional[str]) -> bool:
    """True when ``pred`` and ``gold`` are the same answer: normalised strings equal, else math-verify says so.

    Runs in this process; its time bound is math-verify's alarm, which only a main thread has. For model output use
    :func:`verify_answer` / :class:`VerifierPool`.
    """
    if pred is None or gold is None:
        return False
    pred, gold = str(pred), str(gold)
    settled = _normalized_verdict(pred, gold)
    if settled is not None:
        return settled
    from math_verify import parse as mv_parse  # sympy + latex2sympy2: loaded by the verifier workers only
    from math_verify import verify as mv_verify  # heavy: as above

    _warm_latex_parser(mv_parse)
    t = MV_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    g = mv_parse(_dollars(gold), parsing_timeout=t)
    p = mv_parse(_dollars(pred), parsing_timeout=t)
    return bool(g) and bool(p) and bool(mv_verify(g, p, timeout_seconds=t))


# what a pooled comparison decides with (dllm_rl: dLLM-RL's sympy stage, megadare.rewards.dllm_rl_math)
RULES = {"math_verify": answers_equal, "dare": dare_answers_equal, "dllm_rl": dllm_rl_latex_equal}


# ------------------------------------------------------------------------------------------------ process pool
@dataclass
class VerifyResult:
    """Outcome of one pooled comparison: ``status`` is "ok", "timeout" (worker killed) or "error"."""

    equal: bool
    status: str
    wall_s: float


def _worker_main(conn: Any, memory_mb: int) -> None:
    """Worker loop: warm math-verify (sympy, the LaTeX parser), say ready, then answer ``(pred, gold)`` requests until
    None/EOF."""
    try:
        import resource  # Unix only: elsewhere the worker runs without a memory limit

        lim = memory_mb * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (lim, lim))
    except (ImportError, ValueError, OSError):
        pass
    for equal in RULES.values():  # warm the parsers so that the first request is not billed for them
        equal("2\\sqrt{3}", "\\sqrt{12}")
    conn.send(("ready", None))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        pred, gold, rule = msg
        try:
            reply = ("ok", bool(RULES[rule](pred, gold)))
        except BaseException:  # MemoryError, RecursionError, anything sympy throws
            reply = ("error", False)
        try:
            conn.send(reply)
        except (OSError, ValueError):
            return


@dataclass(eq=False)
class _Worker:
    process: Any
    conn: Any
    ready: bool = False


class VerifierPool:
    """Fixed set of verifier processes with a per-call wall-clock timeout; thread-safe.

    A call takes an idle worker (waiting for one if all are busy), sends it the pair and waits ``timeout``
    seconds; a worker that overruns is SIGKILLed and replaced by a fresh one, and the call reports
    ``status="timeout"``. A worker that dies is replaced too (``status="error"``). The startup of a worker
    (importing sympy) is not billed to the call's timeout.
    """

    def __init__(
        self,
        num_workers: int = 2,
        *,
        context: str = "forkserver",
        memory_mb: int = 4096,
        startup_timeout: float = 120.0,
    ):
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if importlib.util.find_spec("math_verify") is None:  # here, not as a dead worker's "error" verdict
            raise ImportError("the math verifier needs math-verify: pip install 'math-verify>=0.8'")
        if context not in multiprocessing.get_all_start_methods():
            context = "spawn"
        self._ctx = multiprocessing.get_context(context)
        self._memory_mb = memory_mb
        self._startup_timeout = startup_timeout
        self._idle: "queue.Queue[_Worker]" = queue.Queue()
        self._lock = threading.Lock()
        self._workers: set = set()
        self._closed = False
        self.stats = {"calls": 0, "timeouts": 0, "errors": 0, "restarts": 0}
        for _ in range(num_workers):
            self._idle.put(self._spawn())

    def _spawn(self) -> _Worker:
        parent, child = self._ctx.Pipe(duplex=True)
        proc = self._ctx.Process(
            target=_worker_main, args=(child, self._memory_mb), daemon=True, name="megadare-verifier"
        )
        proc.start()
        child.close()
        w = _Worker(proc, parent)
        with self._lock:
            self._workers.add(w)
        return w

    def _kill(self, w: _Worker) -> None:
        try:
            w.process.kill()
        except (OSError, ValueError, AttributeError):
            pass
        w.process.join(timeout=10)
        w.conn.close()
        with self._lock:
            self._workers.discard(w)

    def _replace(self, w: _Worker, counter: str) -> _Worker:
        self._kill(w)
        with self._lock:
            self.stats[counter] += 1
            self.stats["restarts"] += 1
        return self._spawn()

    def _wait_ready(self, w: _Worker) -> bool:
        if not w.ready and w.conn.poll(self._startup_timeout):
            w.ready = w.conn.recv() == ("ready", None)
        return w.ready

    def verify(
        self, pred: Optional[str], gold: Optional[str], timeout: float = 5.0, rule: str = "math_verify"
    ) -> VerifyResult:
        """Compare ``pred`` with ``gold`` in a worker by ``rule`` (a key of :data:`RULES`), giving up after
        ``timeout`` seconds of wall clock."""
        if self._closed:
            raise RuntimeError("VerifierPool is closed")
        if pred is None or gold is None:
            return VerifyResult(False, "ok", 0.0)
        with self._lock:
            self.stats["calls"] += 1
        w = self._idle.get()
        t0 = time.monotonic()
        try:
            try:
                if not self._wait_ready(w):
                    w = self._replace(w, "errors")
                    return VerifyResult(False, "error", time.monotonic() - t0)
                t0 = time.monotonic()
                w.conn.send((str(pred), str(gold), rule))
                if not w.conn.poll(timeout):
                    waited = time.monotonic() - t0
                    w = self._replace(w, "timeouts")
                    return VerifyResult(False, "timeout", waited)
                status, equal = w.conn.recv()
                return VerifyResult(bool(equal), status, time.monotonic() - t0)
            except (EOFError, OSError, ValueError):
                w = self._replace(w, "errors")
                return VerifyResult(False, "error", time.monotonic() - t0)
        finally:
            self._idle.put(w)

    def close(self) -> None:
        """Stop every worker (idempotent)."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            workers = list(self._workers)
        for w in workers:
            try:
                w.conn.send(None)
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + 2.0
        for w in workers:
            w.process.join(timeout=max(0.0, deadline - time.monotonic()))
            self._kill(w)

    def __enter__(self) -> "VerifierPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


_DEFAULT_POOL: Optional[VerifierPool] = None
_DEFAULT_LOCK = threading.Lock()


def default_pool() -> VerifierPool:
    """The process-wide pool (``min(4, cpu_count)`` workers), started on first use and closed at exit."""
    global _DEFAULT_POOL
    with _DEFAULT_LOCK:
        if _DEFAULT_POOL is None or _DEFAULT_POOL._closed:
            _DEFAULT_POOL = VerifierPool(num_workers=max(1, min(4, os.cpu_count() or 1)))
            atexit.register(_DEFAULT_POOL.close)
        return _DEFAULT_POOL


def verify_answer(
    pred: Optional[str],
    gold: Optional[str],
    pool: Optional[VerifierPool] = None,
    timeout: float = 5.0,
    rule: str = "math_verify",
) -> bool:
    """:func:`answers_equal` (``rule="dare"``: DARE's :func:`dare_answers_equal`; ``"dllm_rl"``: dLLM-RL's sympy
    stage, all of it in the pool) with a timeout: normalised-string matches are decided here, the rest in the pool.

    Raises :class:`AnswerTimeout` when the comparison ran past ``timeout`` (its worker was killed) and RuntimeError
    when the worker died: neither is a verdict.
    """
    if pred is None or gold is None:
        return False
    if rule == "dare":
        if mathd_normalize(pred) == mathd_normalize(gold):
            return True
    elif rule == "math_verify":
        settled = _normalized_verdict(pred, gold)
        if settled is not None:
            return settled
    result = (pool or default_pool()).verify(pred, gold, timeout, rule)
    if result.status == "timeout":
        raise AnswerTimeout(
            f"math verifier: no verdict within {timeout:g}s comparing {pred[:200]!r} with {gold[:200]!r}"
        )
    if result.status != "ok":
        raise RuntimeError(f"math verifier: the worker failed comparing {pred[:200]!r} with {gold[:200]!r}")
    return result.equal


def math_reward(response: str, gold: str, pool: Optional[VerifierPool] = None, timeout: float = 5.0) -> float:
    """1.0 when the final answer of ``response`` (:func:`extract_answer`) equals ``gold``, else 0.0.

    A gold that still holds a ``\\boxed{}`` (a full MATH solution) is reduced to its boxed content first.
    """
    pred = extract_answer(response)
    if pred is None:
        return 0.0
    gold = str(gold)
    if "\\boxed" in gold or "\\fbox" in gold:
        gold = extract_boxed(gold) or gold
    return 1.0 if verify_answer(pred, gold, pool=pool, timeout=timeout) else 0.0


def dare_math_reward(response: str, gold: object, pool: Optional[VerifierPool] = None, timeout: float = 5.0) -> float:
    """DARE's ``math_rm`` score (:mod:`megadare.rewards.dare_math`): 1.0 when the content of the last ``\\boxed{}``
    of ``response`` equals the gold by DARE's MATH / sympy rules, else 0.0 (no box: 0.0)."""
    pred, gold = dare_boxed(response) if "\\boxed" in (response or "") else None, dare_gold(gold)
    if pred is None:
        return 0.0
    return 1.0 if verify_answer(pred, gold, pool=pool, timeout=timeout, rule="dare") else 0.0
