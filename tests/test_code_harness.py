"""DARE's humanevalplus harness judged outside the program's process (megadare/rewards/harness.py).

In process, the harness's verdict (the one-time token of the sandbox's test mode) was decided where the program
runs, with numpy preloaded: a wrong ``add`` found the token through numpy's ``__array_interface__``, wrote it to the
proof pipe and exited, and scored 1.0. Now the sandbox only reports what the program returned on the inputs (the
expected results never enter it) and DARE's ``assertion`` decides in the trainer. Honest programs get the verdicts
the in-process harness gives (parity on rows of DARE's shapes); a harness of another shape is one error line.
"""

from __future__ import annotations

import hashlib
import platform

import pytest

from megadare.rewards import harness as harness_mod
from megadare.rewards.code import code_reward
from megadare.rewards.code_forms import PREAMBLE, dare_code_reward, dare_test_cases
from megadare.rewards.harness import DARE_HELPERS, decode_value, parse_harness
from megadare.rewards.sandbox import SandboxLimits


def dare_harness(entry: str, inputs: list, results=None, atol=0, ref_func: str = "") -> str:
    """A harness as DARE's humanevalplus rows hold it (``results`` None: compared with ``ref_func``)."""
    head = "\nimport numpy as np\n" + DARE_HELPERS + "\n" + ref_func + "\n"
    if results is None:
        loop = f"    for i, inp in enumerate(inputs):\n        assertion(candidate(*inp), ref_func(*inp), {atol})\n"
        body = f"    inputs = {inputs!r}\n" + loop
    else:
        loop = f"    for i, (inp, exp) in enumerate(zip(inputs, results)):\n        assertion(candidate(*inp), exp, {atol})\n"
        body = f"    inputs = {inputs!r}\n    results = {results!r}\n" + loop
    return head + "\ndef check(candidate):\n" + body + f"\ncheck({entry})\n"


def plus_row(entry: str, harness: str, index: int, timeout_s: float = 3.0) -> dict:
    prompt = f"def {entry}(*args):\n"
    extra = {"index": index, "split": "test", "task": "code"}
    return {
        "data_source": "humanevalplus",
        "prompt": prompt,
        "answer": harness,
        "extra_info": extra,
        "timeout_s": timeout_s,
    }


ADD = plus_row("add", dare_harness("add", [[1, 2], [5, 5], [-3, 3]], [3, 10, 0]), 52)

# a wrong add that fakes its pass in process: it finds the one-time token (a 32-hex-digit bytes object) in its own
# memory through numpy, writes it to the proof pipe (the one write-only pipe past stderr) and exits with status 0
EXPLOIT = """
def add(a, b):
    return 0


def _fake_pass():
    import fcntl, os, re, stat, sys
    np = sys.modules["numpy"]

    class Raw:
        def __init__(self, addr, size):
            self.__array_interface__ = {"data": (addr, False), "shape": (size,), "typestr": "|u1", "version": 3}

    bytes_type, size32 = id(bytes).to_bytes(8, "little"), (32).to_bytes(8, "little")
    found = set()
    with open("/proc/self/maps") as f:
        maps = [line.split() for line in f.read().splitlines()]
    for parts in maps:
        if not parts[1].startswith("rw") or (len(parts) > 5 and parts[5].startswith("/")):
            continue
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        if hi - lo > 1 << 22:
            continue
        mem = np.asarray(Raw(lo, hi - lo)).tobytes()
        for m in re.finditer(rb"[0-9a-f]{32}\\x00", mem):
            head = m.start() - 32
            if head >= 0 and mem[head + 8 : head + 16] == bytes_type and mem[head + 16 : head + 24] == size32:
                found.add(m.group()[:32])
    for fd in range(3, 256):
        try:
            st, flags = os.fstat(fd), fcntl.fcntl(fd, fcntl.F_GETFL)
        except OSError:
            continue
        if stat.S_ISFIFO(st.st_mode) and flags & os.O_ACCMODE == os.O_WRONLY and len(found) == 1:
            os.write(fd, found.pop())
    os._exit(0)


_fake_pass()
"""


def _in_process(row: dict, program: str) -> float:
    """The verdict of the harness run inside the program's process (megadare's path before, DARE's own)."""
    limits = SandboxLimits(
        timeout_s=float(row["timeout_s"]), memory_mb=1024, allow_site_packages=True, preload=("numpy",)
    )
    return code_reward("", dare_test_cases(row), code=program, preamble=PREAMBLE, limits=limits, all_or_nothing=True)


def _fenced(program: str) -> str:
    return f"```python\n{program}\n```"


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the exploit reads CPython's 64-bit object layout")
def test_a_numpy_memory_exploit_no_longer_fakes_a_humanevalplus_pass():
    """The wrong ``add`` above scored 1.0: it passes the in-process harness (the hole is real, so this test is not
    vacuous) and scores 0 now, as does a program that prints a forged marker and exits."""
    row = dict(ADD, timeout_s=20.0)  # the memory scan takes a second or two
    assert _in_process(row, EXPLOIT) == 1.0
    assert dare_code_reward(_fenced(EXPLOIT), row) == 0.0
    forged = "import os\ndef add(a, b):\n    return 0\nprint('passed')\nos._exit(0)\n"
    assert dare_code_reward(_fenced(forged), ADD) == 0.0
    assert dare_code_reward(_fenced("def add(a, b):\n    return a + b\n"), ADD) == 1.0


@pytest.fixture
def sent(monkeypatch):
    """What each sandbox run of the harness got (program and driver), in order."""
    seen = []
    real = harness_mod.run_program

    def spy(code, stdin="", limits=None, **kw):
        seen.append(code + (kw.get("tests") or ""))
        return real(code, stdin, limits, **kw)

    monkeypatch.setattr(harness_mod, "run_program", spy)
    return seen


def test_the_expected_results_never_enter_the_programs_sandbox(sent):
    """What the program's sandbox gets (its source and the driver) holds the inputs, never the expected results;
    the reference function of a ref_func row runs in a sandbox of its own, without the program."""
    row = plus_row("shout", dare_harness("shout", [["quiet"]], ["QUIET-EXPECTED-RESULT"]), 1)
    assert dare_code_reward(_fenced("def shout(s):\n    return s.upper() + '-EXPECTED-RESULT'\n"), row) == 1.0
    assert len(sent) == 1 and "quiet" in sent[0] and "QUIET-EXPECTED-RESULT" not in sent[0]
    sent.clear()
    harness_mod._reference.cache_clear()  # the reference's outputs are cached per harness
    assert dare_code_reward(_fenced(PREFIXES_RIGHT), PREFIXES) == 1.0
    assert any("ref_func" in s and "all_prefixes" not in s for s in sent), sent
    assert any("all_prefixes" in s and "def ref_func" not in s for s in sent), sent


PREFIXES_REF = "def ref_func(string):\n    return [string[:(i + 1)] for i in range(len(string))]\n"
PREFIXES = plus_row("all_prefixes", dare_harness("all_prefixes", [[""], ["abc"], ["WWW"]], ref_func=PREFIXES_REF), 14)
PREFIXES_RIGHT = "def all_prefixes(string):\n    return [string[:k] for k in range(1, len(string) + 1)]\n"
TRUNC = plus_row("truncate_number", dare_harness("truncate_number", [[3.5], [1.33], [123.456]], [0.5, 0.33, 0.456]), 2)
PAIR = plus_row(
    "sum_product", dare_harness("sum_product", [[[]], [[1, 2, 3]], [[3, 5, 7]]], [(0, 1), (6, 6), (15, 105)]), 8
)
SEQ_REF = "def ref_func(n):\n    return ' '.join(map(str, range(n + 1)))\n"
SEQ = plus_row("string_sequence", dare_harness("string_sequence", [[3], [50000], [49999]], ref_func=SEQ_REF), 15)
TRI_REF = (
    "def ref_func(n):\n    ans = [1, 3]\n    for i in range(2, n + 1):\n"
    "        ans.append(1 + i / 2 if i % 2 == 0 else ans[-1] + ans[-2] + 1 + (i + 1) / 2)\n    return ans\n"
)
TRI = plus_row("tri", dare_harness("tri", [[100], [101]], ref_func=TRI_REF), 130)
TRI_RIGHT = TRI_REF.replace("ref_func", "tri")
CLOSE = plus_row("close", dare_harness("close", [[1.0], [2.0]], [1.0, 2.0], atol=1e-06), 9)

PARITY = [
    (ADD, "def add(a, b):\n    return a + b\n", 1.0),
    (ADD, "def add(a, b):\n    return a - b\n", 0.0),
    (ADD, "def add(a, b):\n    return a + b if a > 0 else 1\n", 0.0),  # right on the first inputs only
    (ADD, "def add(a, b):\n    return float(a + b)\n", 1.0),  # 3.0 == 3
    (ADD, "def add(a, b):\n    raise ValueError(a)\n", 0.0),
    (ADD, "def add(a, b):\n    while True:\n        pass\n", 0.0),  # its timeout
    (ADD, "import sys\ndef add(a, b):\n    return a + b\nsys.exit(0)\n", 0.0),  # exits before the tests
    (ADD, "import numpy as np\ndef add(a, b):\n    return np.int64(a + b)\n", 1.0),
    (ADD, "def add(a, b):\n    return str(a + b)\n", 0.0),
    (ADD, "def adder(a, b):\n    return a + b\n", 0.0),  # no function of the entry point's name
    (ADD, "import io, sys\nsys.stdout = io.StringIO()\ndef add(a, b):\n    return a + b\n", 1.0),
    (TRUNC, "def truncate_number(x):\n    return x % 1.0\n", 1.0),  # 0.33000000000000007: within 1e-6
    (TRUNC, "def truncate_number(x):\n    return round(x % 1.0, 2)\n", 0.0),  # 0.46 for 0.456
    (TRUNC, "import numpy as np\ndef truncate_number(x):\n    return np.float32(x % 1.0)\n", 1.0),  # float32: 1e-8 off
    (TRUNC, "def truncate_number(x):\n    return float('nan')\n", 0.0),
    (PAIR, "def sum_product(xs):\n    import math\n    return sum(xs), math.prod(xs)\n", 1.0),
    (PAIR, "def sum_product(xs):\n    import math\n    return [sum(xs), math.prod(xs)]\n", 0.0),  # a list: != tuple
    (PREFIXES, PREFIXES_RIGHT, 1.0),
    (PREFIXES, "def all_prefixes(string):\n    return [string[:k] for k in range(len(string))]\n", 0.0),
    (SEQ, "def string_sequence(n):\n    return ' '.join(str(k) for k in range(n + 1))\n", 1.0),  # 0.3 MB each
    (SEQ, "def string_sequence(n):\n    return ' '.join(str(k) for k in range(n + 1 - (n > 49999)))\n", 0.0),
    (TRI, TRI_RIGHT, 1.0),  # 100 values a call, ints first: packed as doubles
    (TRI, TRI_RIGHT.replace("(i + 1) / 2", "i / 2"), 0.0),
    (CLOSE, "def close(x):\n    return x + 1e-9\n", 1.0),
    (CLOSE, "def close(x):\n    return x + 1e-3\n", 0.0),
    (CLOSE, "import numpy as np\ndef close(x):\n    return np.array([x])\n", 1.0),  # == gives [True]: truthy
]


@pytest.mark.parametrize(
    "row,program,want", PARITY, ids=[f"{r['extra_info']['index']}-{k}" for k, (r, _, _) in enumerate(PARITY)]
)
def test_honest_programs_get_the_in_process_harness_verdict(row, program, want, sent):
    """Right, wrong, partly wrong, float tolerance (DARE's 1e-6 for float results, a row's own atol), numpy return
    values, exceptions, timeouts, early exits: the verdict judged outside (the program's sandbox never got the
    harness) is the in-process harness's."""
    assert (dare_code_reward(_fenced(program), row), _in_process(row, program)) == (want, want)
    assert sent and not [s for s in sent if "def check(" in s and program in s], sent


def test_a_harness_of_another_shape_is_one_error_line_naming_the_row():
    """A harness megadare cannot read into inputs / expected outputs / atol is refused, not run in process."""
    shapes = {
        "own loop": ADD["answer"].replace("assertion(candidate(*inp), exp, 0)", "assert candidate(*inp) == exp"),
        "other assertion": ADD["answer"].replace("rtol=1e-07", "rtol=1e-01"),
        "computed inputs": ADD["answer"].replace("inputs = [[1, 2], [5, 5], [-3, 3]]", "inputs = [[1, 2]] * 3"),
        "short results": ADD["answer"].replace("results = [3, 10, 0]", "results = [3, 10]"),
        "no check call": ADD["answer"].replace("check(add)", "print(1)"),
        "syntax": ADD["answer"] + "def (:\n",
    }
    for what, text in shapes.items():
        row = dict(ADD, answer=text)
        with pytest.raises(ValueError) as info:
            dare_code_reward(_fenced("def add(a, b):\n    return a + b\n"), row)
        message = str(info.value)
        assert "\n" not in message and "humanevalplus row (extra_info.index=52)" in message, (what, message)


def test_returned_values_decode_to_what_the_program_returned():
    """The sandbox's encoding of return values, decoded: types kept (a tuple is no list), anything else refused."""
    import numpy as np

    assert decode_value({"t": [1, [2.5, None], {"s": ["a"]}]}) == (1, [2.5, None], {"a"})
    big = {"z": ["int", hashlib.sha256(hex(10**5000).encode()).hexdigest()]}  # over 1024 bits: its SHA-256
    assert decode_value({"d": [[{"t": [1, 2]}, big]]}) == {(1, 2): 10**5000} != {(1, 2): 10**5000 + 1}
    text = {"z": ["str", hashlib.sha256(b"ab" * 1000).hexdigest()]}
    assert decode_value([text]) == ["ab" * 1000] and decode_value(text) != b"ab" * 1000 and decode_value(text) != 1
    import array
    import base64

    packed = base64.b64encode(array.array("d", [1.0, 2.5, float("-inf")]).tobytes()).decode()
    assert [type(v) for v in decode_value({"F": [packed, [0]]})] == [int, float, float]  # the ints stay ints
    array = decode_value({"n": ["<f8", [2, 1], [1.0, 2.0]]})
    assert array.dtype == np.float64 and array.shape == (2, 1)
    assert type(decode_value({"g": ["<i8", 5]})) is np.int64
    for bad in ({"u": "Fake"}, {"t": [1], "s": [2]}, {"n": ["<M8[D]", [1], [0]]}, {"n": ["<U99999", [1], ["a"]]}):
        with pytest.raises(ValueError):
            decode_value(bad)
    assert parse_harness(PREFIXES["answer"], PREFIXES).results is None
