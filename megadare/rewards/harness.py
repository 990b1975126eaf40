"""DARE's humanevalplus harness, judged outside the process the program runs in.

A humanevalplus row's ground truth is a full harness (DARE @83ae8a3 runs ``BASE_IMPORTS + program + harness`` as
one script, a pass is exit status 0): ``import numpy as np``, evalplus' ``is_floats`` and ``assertion(out, exp,
atol)``, and ``check(candidate)`` looping over a literal ``inputs`` list, comparing each ``candidate(*inp)`` with
the literal ``results`` entry (or with ``ref_func(*inp)``, a reference function of the harness), then
``check(<entry>)``. Run that way the verdict is decided inside the program's process, where numpy (preloaded for
the harness) lets a program read and write its own memory through ``__array_interface__``: it could fake its pass.

Here the harness is read (:func:`parse_harness`) into its entry point, inputs, expected outputs and ``atol``; the
sandbox runs the program on the inputs only and prints what each call returned (plain data: JSON with tags for
tuples, sets, dicts, numpy scalars and arrays, long lists of numbers packed as doubles, a str / bytes / int over
:data:`BIG` as its SHA-256; any other object is a failed case); the trainer decodes those values and runs DARE's own
``assertion`` on them (:data:`DARE_HELPERS`, checked equal to the harness's). The expected outputs never enter the
program's sandbox: the ``results`` literal is read here, and ``ref_func`` runs alongside in a sandbox of its own
(trusted code only, its output cached per harness), so a program that reaches its memory can at best print
outputs, which pass only when they are the right ones. A harness of any other shape raises one
ValueError line naming the row (no fallback to the in-process verdict: it would be a fakeable pass, silently).

Parity with the in-process harness: the calls run in input order in one process, each return value encoded at
once (a list the program changes later is judged as returned); an exception, an early exit, a timeout or a value
that is no plain data fails. The reference function gets the inputs as written (they must be immutable: str,
int, float, bool, None, tuples of them; in DARE it runs after the program's call on the same objects).
"""

from __future__ import annotations

import array
import ast
import base64
import builtins
import functools
import hashlib
import json
import secrets
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, List, Optional, Tuple

import numpy as np

from megadare.rewards.sandbox import SandboxLimits, run_program

__all__ = ["DARE_HELPERS", "Harness", "Digest", "parse_harness", "harness_verdict", "decode_value"]

# evalplus' helpers as DARE's humanevalplus rows hold them (every row of DARE's test file): a harness's own copies
# must equal these (as ASTs), and these decide the verdict in the trainer
DARE_HELPERS = """
def is_floats(x) -> bool:
    # check if it is float; List[float]; Tuple[float]
    if isinstance(x, float):
        return True
    if isinstance(x, (list, tuple)):
        return all(isinstance(i, float) for i in x)
    if isinstance(x, np.ndarray):
        return x.dtype == np.float64 or x.dtype == np.float32
    return False


def assertion(out, exp, atol):
    exact_match = out == exp

    if atol == 0 and is_floats(exp):
        atol = 1e-6
    if not exact_match and atol != 0:
        assert np.allclose(out, exp, rtol=1e-07, atol=atol)
    else:
        assert exact_match
"""
_HELPERS: dict = {"np": np}
exec(compile(DARE_HELPERS, "dare_humanevalplus_helpers", "exec"), _HELPERS)  # trusted constant source
_HELPER_DUMPS = {n.name: ast.dump(n) for n in ast.parse(DARE_HELPERS).body}

# the check() shapes of DARE's rows, INPUTS / RESULTS / ATOL standing for the literals
_LITERAL_CHECK = """def check(candidate):
    inputs = INPUTS
    results = RESULTS
    for i, (inp, exp) in enumerate(zip(inputs, results)):
        assertion(candidate(*inp), exp, ATOL)
"""
_REF_CHECK = """def check(candidate):
    inputs = INPUTS
    for i, inp in enumerate(inputs):
        assertion(candidate(*inp), ref_func(*inp), ATOL)
"""
_SHAPES = {ast.dump(ast.parse(src).body[0]): ref for src, ref in ((_LITERAL_CHECK, False), (_REF_CHECK, True))}

# runs in the sandbox after the program (or the reference function): each return value as tagged JSON, one line
# after the nonce at the end. Whatever the program does to it, the line can only claim outputs, never a verdict
_DRIVER = """
import array as _md_array, base64 as _md_b64, hashlib as _md_hashlib, json as _md_json, os as _md_os, sys as _md_sys
_md_np = _md_sys.modules.get("numpy")
_MD_EXACT = 1 << 53
def _md_big(kind, data):
    return {"z": [kind, _md_hashlib.sha256(data).hexdigest()]}
def _md_enc(v):
    if _md_np is not None and isinstance(v, _md_np.ndarray):
        return {"n": [v.dtype.str, list(v.shape), [_md_enc(x) for x in v.ravel().tolist()]]}
    if _md_np is not None and isinstance(v, _md_np.generic):
        return {"g": [v.dtype.str, _md_enc(v.item())]}
    if v is None or isinstance(v, bool):
        return v
    if isinstance(v, str):
        return v if len(v) <= %(big)d else _md_big("str", v.encode("utf-8", "surrogatepass"))
    if isinstance(v, int):
        return int(v) if v.bit_length() <= %(big)d else _md_big("int", hex(v).encode())
    if isinstance(v, float):
        return float(v)
    if isinstance(v, complex):
        return {"c": [v.real, v.imag]}
    if isinstance(v, bytes):
        return {"b": v.hex()} if len(v) <= %(big)d else _md_big("bytes", bytes(v))
    if isinstance(v, list):
        exact = len(v) >= 64 and any(type(x) is float for x in v)
        if exact and all(type(x) is float or (type(x) is int and -_MD_EXACT <= x <= _MD_EXACT) for x in v):
            # packed as doubles, the ints' places kept: tri's outputs are 124 MB as JSON
            ints = [k for k, x in enumerate(v) if type(x) is int]
            return {"F": [_md_b64.b64encode(_md_array.array("d", v).tobytes()).decode(), ints]}
        return [_md_enc(x) for x in v]
    if isinstance(v, tuple):
        return {"t": [_md_enc(x) for x in v]}
    if isinstance(v, dict):
        return {"d": [[_md_enc(k), _md_enc(x)] for k, x in v.items()]}
    if isinstance(v, (set, frozenset)):
        return {"f" if isinstance(v, frozenset) else "s": [_md_enc(x) for x in v]}
    return {"u": type(v).__name__}
_md_fn = globals()[%(fn)r]
_md_out = []
for _md_inp in %(inputs)s:
    _md_out.append(_md_enc(_md_fn(*_md_inp)))
_md_line = ("\\n" + %(nonce)r + _md_json.dumps(_md_out) + "\\n").encode()
while _md_line:  # to fd 1 itself: a program that replaced sys.stdout still reports
    _md_line = _md_line[_md_os.write(1, _md_line) :]
"""


@dataclass(frozen=True)
class Harness:
    """A humanevalplus harness read: ``entry`` (the function ``check`` is called on), ``inputs`` (the list's
    source), ``n_inputs`` (its length), ``results`` (the expected outputs; None: ``ref_func`` computes them), ``atol``, ``prelude`` (the
    harness's top level but its ``check(...)`` call: what the reference function needs) and ``row`` (its name)."""

    entry: str
    inputs: str
    n_inputs: int
    results: Optional[list]
    atol: float
    prelude: str
    row: str


def _row_name(record: dict) -> str:
    extra = record.get("extra_info") if isinstance(record.get("extra_info"), dict) else {}
    index = extra.get("index", record.get("index"))
    return f"humanevalplus row (extra_info.index={index})" if index is not None else "humanevalplus row"


def _split_check(check: ast.FunctionDef) -> Tuple[ast.AST, Optional[ast.AST], ast.AST, bool]:
    """The inputs / results / atol nodes of ``check`` and whether it compares with ``ref_func``; ValueError when
    ``check`` is no DARE shape (:data:`_SHAPES`)."""
    body = check.body
    if len(body) not in (2, 3) or not all(isinstance(s, ast.Assign) for s in body[:-1]):
        raise ValueError("check() is not 'inputs = [...]' [, 'results = [...]'], one for loop")
    values = [s.value for s in body[:-1]]
    loop = body[-1]
    call = (
        loop.body[0].value if isinstance(loop, ast.For) and loop.body and isinstance(loop.body[0], ast.Expr) else None
    )
    if not isinstance(call, ast.Call) or len(call.args) != 3:
        raise ValueError("check()'s loop does not call assertion(candidate(*inp), expected, atol)")
    atol = call.args[2]
    stand_ins = [ast.Name("INPUTS", ast.Load()), ast.Name("RESULTS", ast.Load())][: len(values)]
    for s, name in zip(body[:-1], stand_ins):
        s.value = name
    call.args[2] = ast.Name("ATOL", ast.Load())
    ref = _SHAPES.get(ast.dump(check))
    if ref is None:
        raise ValueError("check() is none of DARE's two shapes (results literal, or ref_func)")
    return values[0], (None if ref else values[1]), atol, ref


def _literal(node: ast.AST, what: str) -> Any:
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError) as e:
        raise ValueError(f"{what} is no literal ({type(e).__name__})") from e


def _immutable(v: Any) -> bool:
    if isinstance(v, tuple):
        return all(map(_immutable, v))
    return v is None or isinstance(v, (bool, int, float, complex, str, bytes))


@functools.lru_cache(maxsize=64)
def _read(text: str) -> Harness:
    """The harness read (cached: a row is scored once per response, and DARE's largest take 0.1 s to read)."""
    tree = ast.parse(text)
    *top, last = tree.body
    if not (isinstance(last, ast.Expr) and ast.unparse(last.value).startswith("check(")):
        raise ValueError("it does not end with check(<entry point>)")
    if len(last.value.args) != 1 or not isinstance(last.value.args[0], ast.Name) or last.value.keywords:
        raise ValueError("its last line is not check(<a function name>)")
    defs = {n.name: n for n in top if isinstance(n, ast.FunctionDef)}
    if any(not isinstance(n, (ast.Import, ast.ImportFrom, ast.FunctionDef)) for n in top) or "check" not in defs:
        raise ValueError("its top level holds more than imports and defs (with check) before check(...)")
    for name, dump in _HELPER_DUMPS.items():
        if name not in defs or ast.dump(defs[name]) != dump:
            raise ValueError(f"its {name}() is not DARE's (evalplus') one, which the trainer runs")
    prelude = ast.unparse(ast.Module([n for n in top if n is not defs["check"]], []))
    inputs_node, results_node, atol_node, ref = _split_check(defs["check"])
    inputs = _literal(inputs_node, "inputs")
    atol = _literal(atol_node, "atol")
    if not isinstance(inputs, list) or not all(isinstance(i, (list, tuple)) for i in inputs):
        raise ValueError("inputs is not a list of argument lists")
    if isinstance(atol, bool) or not isinstance(atol, (int, float)):
        raise ValueError(f"atol {atol!r} is no number")
    results = None if ref else _literal(results_node, "results")
    if ref and ("ref_func" not in defs or not all(_immutable(a) for i in inputs for a in i)):
        raise ValueError("its ref_func is missing, or an input is mutable (the program's call could change it)")
    if not ref and (not isinstance(results, list) or len(results) != len(inputs)):
        raise ValueError(f"results is not a list of {len(inputs)} values (one per input)")
    return Harness(last.value.args[0].id, ast.unparse(inputs_node), len(inputs), results, float(atol), prelude, "")


def parse_harness(text: str, record: dict) -> Harness:
    """The harness of a humanevalplus row read into a :class:`Harness`; one ValueError line naming the row when it
    is not one of DARE's shapes (the module docstring)."""
    row = _row_name(record)
    try:
        return replace(_read(text), row=row)
    except (ValueError, SyntaxError) as e:
        why = f"line {e.lineno}: {e.msg}" if isinstance(e, SyntaxError) else str(e)
        raise ValueError(
            f"{row}: its harness (answer) is not DARE's humanevalplus form ({why}); megadare judges these rows "
            "outside the program's process and reads only that form: fix the row or drop it"
        ) from None


# a str or bytes over this many characters, an int over this many bits, travels as its SHA-256 (and equals only
# the same value of the same type): a row's outputs can be large (string_sequence's 135 inputs return 147 MB)
BIG = 1024
_DIGESTED = {
    "str": lambda v: isinstance(v, str) and v.encode("utf-8", "surrogatepass"),
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool) and hex(v).encode(),
    "bytes": lambda v: isinstance(v, bytes) and bytes(v),
}


class Digest:
    """A large str / int / bytes the program returned, as its SHA-256: equal to the value it stands for."""

    __slots__ = ("kind", "sha")

    def __init__(self, kind: str, sha: str):
        self.kind, self.sha = kind, sha

    def _key(self, other: Any) -> Optional[Tuple[str, str]]:
        if isinstance(other, Digest):
            return other.kind, other.sha
        data = _DIGESTED[self.kind](other)
        return None if data is False else (self.kind, hashlib.sha256(data).hexdigest())

    def __eq__(self, other: Any) -> Any:
        key = self._key(other)
        return NotImplemented if key is None else key == (self.kind, self.sha)

    def __ne__(self, other: Any) -> Any:
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    def __hash__(self) -> int:
        return hash((self.kind, self.sha))


def decode_value(v: Any) -> Any:
    """A value as the driver encoded it (tagged JSON, decoded), back as the object; ValueError when malformed or
    not plain data (the case fails)."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, list):
        return [decode_value(x) for x in v]
    if not (isinstance(v, dict) and len(v) == 1):
        raise ValueError("malformed output")
    ((tag, x),) = v.items()
    if tag in ("t", "s", "f"):
        return {"t": tuple, "s": set, "f": frozenset}[tag](decode_value(i) for i in x)
    if tag == "d":
        return {decode_value(k): decode_value(i) for k, i in x}
    if tag == "z" and x[0] in _DIGESTED:
        return Digest(str(x[0]), str(x[1]))
    if tag == "F":
        packed = array.array("d")
        packed.frombytes(base64.b64decode(x[0], validate=True))
        values = packed.tolist()
        for k in x[1]:
            values[k] = int(values[k])
        return values
    if tag == "c":
        return complex(float(x[0]), float(x[1]))
    if tag == "b":
        return bytes.fromhex(x)
    if tag in ("n", "g"):
        return _decode_numpy(tag, x)
    raise ValueError(f"the program returned no plain data ({tag}: {str(x)[:60]})")


def _decode_numpy(tag: str, x: Any) -> Any:
    dtype = np.dtype(str(x[0]))
    if dtype.kind not in "biufcUSO" or dtype.itemsize > 1 << 16:
        raise ValueError(f"numpy dtype {dtype} is not judged")
    if tag == "g":
        return dtype.type(decode_value(x[1]))
    shape, flat = [int(n) for n in x[1]], [decode_value(i) for i in x[2]]
    if dtype.kind != "O":
        return np.array(flat, dtype=dtype).reshape(shape)
    out = np.empty(len(flat), dtype=object)
    for k, item in enumerate(flat):
        out[k] = item
    return out.reshape(shape)


def _outputs(code: str, fn: str, inputs: str, limits: SandboxLimits, tests: bool) -> Optional[List[Any]]:
    """What ``fn`` returned on each input, run in the sandbox after ``code`` (in test mode when ``tests``: the
    program's names, the true builtins), decoded; None when the run did not end well or printed no such line."""
    nonce = "megadare-outputs-" + secrets.token_hex(16) + ":"
    driver = _DRIVER % {"fn": fn, "inputs": inputs, "nonce": nonce, "big": BIG}
    if tests:
        run = run_program(code, "", limits, tests=driver, tested=(fn,) if hasattr(builtins, fn) else ())
    else:
        run = run_program(code + "\n" + driver, "", limits)
    if not run.ok or (tests and not run.tests_passed):
        return None
    lines = [line for line in run.stdout.split("\n") if line.startswith(nonce)]
    try:
        values = json.loads(lines[-1][len(nonce) :]) if lines else None
    except (ValueError, RecursionError):
        return None
    return values if isinstance(values, list) else None


@functools.lru_cache(maxsize=16)
def _reference(prelude: str, inputs: str, limits: SandboxLimits, row: str) -> str:
    """The reference function's outputs (the encoded JSON of each), run alone in a sandbox (trusted code)."""
    values = _outputs(prelude, "ref_func", inputs, limits, tests=False)
    if values is None:
        raise ValueError(f"{row}: its ref_func did not run to its end in the sandbox (trusted code): check the row")
    return json.dumps(values)


def harness_verdict(program: str, harness: Harness, limits: SandboxLimits) -> bool:
    """Does ``program`` pass ``harness``? Its outputs come from the sandbox, the verdict from DARE's ``assertion``
    here (see the module docstring). A ``ref_func`` row's reference runs at the same time, in a sandbox of its own
    under the same limits (the call stays within one harness budget)."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="harness-ref") as ex:
        ref = None if harness.results is not None else ex.submit(_expected, harness, limits)
        outputs = _outputs(program, harness.entry, harness.inputs, limits, tests=True)
        expected = harness.results if ref is None else ref.result()
    if outputs is None or len(outputs) != harness.n_inputs:
        return False
    with np.errstate(all="ignore"):
        for out, exp in zip(outputs, expected):
            try:
                _HELPERS["assertion"](decode_value(out), exp, harness.atol)
            except Exception:  # a wrong value, or one DARE's assertion cannot compare: the harness fails, as there
                return False
    return True


def _expected(harness: Harness, limits: SandboxLimits) -> list:
    return [decode_value(v) for v in json.loads(_reference(harness.prelude, harness.inputs, limits, harness.row))]
