"""Math answer verification: is a predicted final answer equal to the gold one? Plus the process pool that runs it.

``answers_equal(pred, gold)`` decides in this process, in order:

1. string equality after :func:`~megadare.rewards.math_answer.normalize_answer` (the MATH ``strip_string`` rules
   that DARE / dLLM-RL / d1 use);
2. the ``math-verify`` package (``from math_verify import parse, verify``), when it is importable
   (``pip install 'megadare[math]'``); it can only say yes here, a "no" falls through;
3. tuples / intervals / sets: same brackets and length, compared element-wise (sets and bare comma lists
   unordered);
4. numeric equality of plain numbers, fractions (``\\frac{1}{2}``, ``1/2``) and decimals within 1e-6 relative;
   a ``%`` on one side also accepts the value divided by 100 (``50\\%`` == ``50`` == ``0.5``);
5. symbolic equality with sympy, through a small LaTeX-lite parser of our own that builds sympy objects directly
   (never ``eval``/``parse_expr`` on model text): ``\\frac``, ``\\sqrt{x}``, ``\\sqrt[n]{x}``, ``^``, ``\\cdot``,
   ``\\times``, ``\\pi``, ``!``, ``\\binom``, trig/log functions, implicit multiplication (``2\\sqrt{3}``, ``2x``);
   bare ``e`` is Euler's number and bare ``i`` the imaginary unit.

Malformed input gives False, never an exception. sympy can hang on inputs such as ``9^{9^{9^{9}}}``, so
untrusted text goes through :class:`VerifierPool`: fixed worker processes (``forkserver``/``spawn`` context) fed
over pipes, a wall-clock timeout per call, and a stuck worker is SIGKILLed and replaced, so the pool stays usable.
:func:`verify_answer` and :func:`math_reward` use it (a shared default pool unless one is passed).
"""
from __future__ import annotations

import atexit
import multiprocessing
import os
import queue
import re
import threading
import time
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, List, Optional, Tuple

from megadare.rewards.math_answer import clean_latex, extract_answer, extract_boxed, normalize_answer

__all__ = ["answers_equal", "VerifierPool", "VerifyResult", "verify_answer", "math_reward", "default_pool",
           "latex_to_sympy"]

_REL_TOL = 1e-6


# ------------------------------------------------------------------------------------------ math-verify (optional)
_MV: Any = None  # (parse, verify) once imported, False when unavailable


def _math_verify_equal(pred: str, gold: str) -> bool:
    """True when the math-verify package is installed and says the answers match; False otherwise."""
    global _MV
    if _MV is None:
        try:
            from math_verify import parse, verify  # the PyPI package, not this module
            _MV = (parse, verify)
        except Exception:
            _MV = False
    if not _MV:
        return False
    parse, verify = _MV
    # its own timeouts use signal.alarm, which only works on the main thread; our pool does the timing
    t = 5 if threading.current_thread() is threading.main_thread() else None
    try:
        g = parse(_dollars(gold), parsing_timeout=t)
        p = parse(_dollars(pred), parsing_timeout=t)
        return bool(g) and bool(p) and bool(verify(g, p, timeout_seconds=t))
    except Exception:
        return False


def _dollars(s: str) -> str:
    s = s.strip()
    return s if s.startswith("$") or "\\boxed" in s else f"${s}$"


# -------------------------------------------------------------------------------------------- LaTeX-lite parser
class _ParseError(ValueError):
    pass


_TOKEN_RE = re.compile(r"\s*(?:(?P<num>\d+(?:\.\d+)?|\.\d+)|(?P<cmd>\\[A-Za-z]+|\\[^A-Za-z\s])|(?P<ch>\S))")
_GREEK = {"alpha", "beta", "gamma", "delta", "epsilon", "varepsilon", "zeta", "eta", "theta", "vartheta", "iota",
          "kappa", "lambda", "mu", "nu", "xi", "rho", "sigma", "tau", "upsilon", "phi", "varphi", "chi", "psi",
          "omega", "Gamma", "Delta", "Theta", "Lambda", "Xi", "Sigma", "Phi", "Psi", "Omega"}
_FUNCS = {"sin", "cos", "tan", "cot", "sec", "csc", "arcsin", "arccos", "arctan", "sinh", "cosh", "tanh",
          "ln", "log", "exp"}
_MUL = {"*", "\\cdot", "\\times", "\\ast"}
_DIV = {"/", "\\div"}


def _tokenize(s: str) -> List[Tuple[str, str]]:
    out: List[Tuple[str, str]] = []
    pos = 0
    while pos < len(s):
        m = _TOKEN_RE.match(s, pos)
        if m is None:  # only whitespace left
            break
        pos = m.end()
        kind = m.lastgroup
        assert kind is not None
        out.append((kind, m.group(kind)))
    return out


class _Parser:
    """Recursive descent over the tokens of one scalar expression; builds sympy objects directly."""

    def __init__(self, text: str):
        import sympy
        self.sp = sympy
        self.toks = _tokenize(text)
        self.i = 0

    # -- token helpers
    def peek(self) -> Optional[str]:
        return self.toks[self.i][1] if self.i < len(self.toks) else None

    def take(self) -> Tuple[str, str]:
        if self.i >= len(self.toks):
            raise _ParseError("unexpected end")
        tok = self.toks[self.i]
        self.i += 1
        return tok

    def expect(self, text: str) -> None:
        if self.take()[1] != text:
            raise _ParseError(f"expected {text!r}")

    def starts_factor(self) -> bool:
        if self.i >= len(self.toks):
            return False
        kind, text = self.toks[self.i]
        if kind == "num" or text in ("(", "{"):
            return True
        if kind == "ch":
            return text.isalpha()
        name = text[1:]
        return kind == "cmd" and (name in _GREEK or name in _FUNCS
                                  or name in ("frac", "cfrac", "sqrt", "pi", "infty", "binom"))

    # -- grammar
    def parse(self) -> Any:
        if not self.toks:
            raise _ParseError("empty")
        e = self.expr()
        if self.i != len(self.toks):
            raise _ParseError(f"trailing {self.peek()!r}")
        return e

    def expr(self) -> Any:
        e = self.term()
        while self.peek() in ("+", "-"):
            op = self.take()[1]
            rhs = self.term()
            e = e + rhs if op == "+" else e - rhs
        return e

    def term(self) -> Any:
        e = self.signed()
        while True:
            t = self.peek()
            if t in _MUL:
                self.take()
                e = e * self.signed()
            elif t in _DIV:
                self.take()
                e = e / self.signed()
            elif self.starts_factor():  # implicit multiplication: 2\sqrt{3}, 2x, (a)(b)
                e = e * self.power()
            else:
                return e

    def signed(self) -> Any:
        if self.peek() == "-":
            self.take()
            return -self.signed()
        if self.peek() == "+":
            self.take()
            return self.signed()
        return self.power()

    def power(self) -> Any:
        base = self.postfix()
        if self.peek() == "^":
            self.take()
            if self.i < len(self.toks) and self.toks[self.i][0] == "num":  # plain-text 2^10 means 2**10
                return base ** self.atom()
            return base ** self.argument()
        return base

    def postfix(self) -> Any:
        e = self.atom()
        while self.peek() == "!":
            self.take()
            e = self.sp.factorial(e)
        return e

    def argument(self) -> Any:
        """A macro argument / exponent: ``{...}``, or one token (one digit of a number: ``\\frac12``, ``x^23``)."""
        if self.peek() == "{":
            self.take()
            e = self.expr()
            self.expect("}")
            return e
        if self.peek() == "-":
            self.take()
            return -self.argument()
        if self.i < len(self.toks) and self.toks[self.i][0] == "num" and len(self.toks[self.i][1]) > 1:
            digits = self.toks[self.i][1]
            self.toks[self.i] = ("num", digits[1:])
            if digits[1:].startswith("."):
                raise _ParseError("split decimal")
            return self.sp.Integer(int(digits[0]))
        return self.atom()

    def atom(self) -> Any:
        sp = self.sp
        kind, text = self.take()
        if kind == "num":
            return sp.Rational(text)
        if text in ("(", "{", "["):
            close = {"(": ")", "{": "}", "[": "]"}[text]
            e = self.expr()
            self.expect(close)
            return e
        if kind == "ch" and text.isalpha():
            if self.peek() == "_":
                self.take()
                sub = self.take()[1] if self.peek() != "{" else self._braced_text()
                return sp.Symbol(f"{text}_{sub}")
            return {"e": sp.E, "i": sp.I}.get(text, sp.Symbol(text))
        if kind != "cmd":
            raise _ParseError(f"unexpected {text!r}")
        name = text[1:]
        if name in ("frac", "cfrac"):
            num = self.argument()
            den = self.argument()
            return num / den
        if name == "binom":
            n = self.argument()
            k = self.argument()
            return sp.binomial(n, k)
        if name == "sqrt":
            if self.peek() == "[":
                self.take()
                n = self.expr()
                self.expect("]")
                return sp.root(self.argument(), n)
            return sp.sqrt(self.argument())
        if name == "pi":
            return sp.pi
        if name == "infty":
            return sp.oo
        if name in _GREEK:
            return sp.Symbol(name)
        if name in _FUNCS:
            return self.function(name)
        raise _ParseError(f"unsupported command {text}")

    def function(self, name: str) -> Any:
        sp = self.sp
        power = None
        base = None
        if name == "log" and self.peek() == "_":
            self.take()
            base = self.argument()
        if self.peek() == "^":  # \sin^2 x
            self.take()
            power = self.argument()
        arg = self.postfix() if self.peek() in ("(", "{") else self.power()
        fn = {"ln": sp.log, "log": sp.log, "exp": sp.exp, "arcsin": sp.asin, "arccos": sp.acos,
              "arctan": sp.atan}.get(name) or getattr(sp, name)
        val = sp.log(arg, base) if base is not None else fn(arg)
        return val ** power if power is not None else val

    def _braced_text(self) -> str:
        self.expect("{")
        parts = []
        while self.peek() not in ("}", None):
            parts.append(self.take()[1])
        self.expect("}")
        return "".join(parts)


def latex_to_sympy(text: str) -> Any:
    """Parse one LaTeX-lite scalar expression into a sympy object; raises ValueError when it cannot."""
    return _Parser(clean_latex(text)).parse()


# ------------------------------------------------------------------------------------------------- comparisons
_NUM = r"-?\d+(?:\.\d+)?"
_PLAIN_RE = re.compile(rf"^{_NUM}(?:e[-+]?\d{{1,3}})?$")
_SLASH_RE = re.compile(rf"^({_NUM})/({_NUM})$")
_FRAC_RE = re.compile(rf"^(-?)\\frac\{{({_NUM})\}}\{{({_NUM})\}}$")


def _as_number(norm: str) -> Optional[Fraction]:
    """Exact value of a normalised plain number / decimal / ``a/b`` / ``\\frac{a}{b}``, else None."""
    try:
        if _PLAIN_RE.match(norm):
            return Fraction(norm)
        m = _SLASH_RE.match(norm)
        if m:
            return Fraction(m.group(1)) / Fraction(m.group(2))
        m = _FRAC_RE.match(norm)
        if m:
            v = Fraction(m.group(2)) / Fraction(m.group(3))
            return -v if m.group(1) else v
    except (ValueError, ZeroDivisionError):
        return None
    return None


def _close(a: Any, b: Any) -> bool:
    return a == b or abs(a - b) <= _REL_TOL * max(abs(a), abs(b))


def _has_percent(s: str) -> bool:
    return "%" in s


def _numeric_equal(pred: str, gold: str) -> Optional[bool]:
    """Numeric verdict when both sides are plain numbers (None when either is not)."""
    a, b = _as_number(normalize_answer(pred)), _as_number(normalize_answer(gold))
    if a is None or b is None:
        return None
    if _close(a, b):
        return True
    if _has_percent(pred) and _close(a / 100, b):
        return True
    return _has_percent(gold) and _close(a, b / 100)


def _symbolic_equal(pred: str, gold: str) -> bool:
    import sympy
    try:
        a, b = latex_to_sympy(pred), latex_to_sympy(gold)
        if a == b:
            return True
        if isinstance(a, sympy.Basic) and isinstance(b, sympy.Basic) and not a.free_symbols and not b.free_symbols:
            if a.has(sympy.oo, -sympy.oo, sympy.zoo, sympy.nan) or b.has(sympy.oo, -sympy.oo, sympy.zoo, sympy.nan):
                return False
            av, bv = complex(sympy.N(a, 30)), complex(sympy.N(b, 30))
            return _close(av, bv)
        diff = a - b
        return sympy.expand(diff) == 0 or sympy.simplify(diff) == 0
    except Exception:  # parse errors, sympy TypeErrors/ValueErrors, ZeroDivisionError, ...
        return False


def _scalar_equal(pred: str, gold: str) -> bool:
    if normalize_answer(pred) == normalize_answer(gold):
        return True
    numeric = _numeric_equal(pred, gold)
    if numeric is not None:
        return numeric
    return _symbolic_equal(pred, gold)


def _split_top(inner: str) -> List[str]:
    parts, depth, cur = [], 0, []
    for c in inner:
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        if c == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(c)
    parts.append("".join(cur))
    return [p.strip() for p in parts]


def _encloses(s: str) -> bool:
    """True when the bracket opening ``s`` closes at its very last character."""
    depth = 0
    for k, c in enumerate(s):
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0 and k != len(s) - 1:
                return False
    return depth == 0


def _sequence(s: str) -> Optional[Tuple[str, List[str]]]:
    """``(kind, items)`` for a tuple/interval ``(a,b]``, a set ``\\{a,b\\}`` or a bare list ``a, b``; else None."""
    s = clean_latex(s)
    if s.startswith("\\{") and s.endswith("\\}"):
        items = _split_top(s[2:-2])
        return ("set", items) if items != [""] else None
    if len(s) >= 2 and s[0] in "([" and s[-1] in ")]" and _encloses(s):
        items = _split_top(s[1:-1])
        return (s[0] + s[-1], items) if len(items) >= 2 else None
    items = _split_top(s)
    return ("list", items) if len(items) >= 2 and all(items) else None


def _sequence_equal(p: Tuple[str, List[str]], g: Tuple[str, List[str]]) -> bool:
    (pk, pi), (gk, gi) = p, g
    if pk != gk or len(pi) != len(gi):
        return False
    if pk not in ("set", "list"):
        return all(_scalar_equal(a, b) for a, b in zip(pi, gi))
    unmatched = list(gi)
    for a in pi:
        hit = next((k for k, b in enumerate(unmatched) if _scalar_equal(a, b)), None)
        if hit is None:
            return False
        unmatched.pop(hit)
    return True


def answers_equal(pred: Optional[str], gold: Optional[str]) -> bool:
    """True when ``pred`` and ``gold`` are the same answer (see the module docstring for the rules).

    Runs in this process with no time limit; for model output use :func:`verify_answer` / :class:`VerifierPool`.
    """
    if pred is None or gold is None:
        return False
    pred, gold = str(pred), str(gold)
    np_, ng = normalize_answer(pred), normalize_answer(gold)
    if not np_ or not ng:
        return False
    if np_ == ng:
        return True
    try:
        if _math_verify_equal(pred, gold):
            return True
        ps, gs = _sequence(pred), _sequence(gold)
        if ps is not None or gs is not None:
            return ps is not None and gs is not None and _sequence_equal(ps, gs)
        return _scalar_equal(pred, gold)
    except RecursionError:
        return False


# ------------------------------------------------------------------------------------------------ process pool
@dataclass
class VerifyResult:
    """Outcome of one pooled comparison: ``status`` is "ok", "timeout" (worker killed) or "error"."""
    equal: bool
    status: str
    wall_s: float


def _worker_main(conn: Any, memory_mb: int) -> None:
    """Worker loop: warm sympy (and math-verify), say ready, then answer ``(pred, gold)`` requests until None/EOF."""
    try:
        import resource
        lim = memory_mb * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (lim, lim))
    except (ImportError, ValueError, OSError):
        pass
    # warm the imports (sympy, math-verify) so that the first request is not billed for them
    _symbolic_equal("2\\sqrt{3}", "\\sqrt{12}")
    _math_verify_equal("1", "1")
    conn.send(("ready", None))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        pred, gold = msg
        try:
            reply = ("ok", bool(answers_equal(pred, gold)))
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

    def __init__(self, num_workers: int = 2, *, context: str = "forkserver", memory_mb: int = 4096,
                 startup_timeout: float = 120.0):
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
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
        proc = self._ctx.Process(target=_worker_main, args=(child, self._memory_mb), daemon=True,
                                 name="megadare-verifier")
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

    def verify(self, pred: Optional[str], gold: Optional[str], timeout: float = 5.0) -> VerifyResult:
        """Compare ``pred`` with ``gold`` in a worker, giving up after ``timeout`` seconds of wall clock."""
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
                w.conn.send((str(pred), str(gold)))
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

    def equal(self, pred: Optional[str], gold: Optional[str], timeout: float = 5.0) -> bool:
        """``verify(...).equal``: False on timeout or error."""
        return self.verify(pred, gold, timeout).equal

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


def verify_answer(pred: Optional[str], gold: Optional[str], pool: Optional[VerifierPool] = None,
                  timeout: float = 5.0) -> bool:
    """:func:`answers_equal` with a timeout: normalised-string matches are decided here, the rest in the pool."""
    if pred is None or gold is None:
        return False
    np_, ng = normalize_answer(pred), normalize_answer(gold)
    if not np_ or not ng:
        return False
    if np_ == ng:
        return True
    return (pool or default_pool()).verify(pred, gold, timeout).equal


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
