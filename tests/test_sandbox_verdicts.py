"""The code sandbox's verdict suite: wrong programs that try to make their own tests pass (or read them) from
inside, each checked through the verdict run_program and score_batch report (a wrong answer must score 0). The
escapes from the sandbox itself are in test_sandbox_escapes.py.

The attacks, in file order: frames reached through gc.garbage or second copies of _signal / gc that lead to the
bootstrap; sub-interpreters (no audit hook); the proof accepted anywhere but at the end of the tests; CPython's test
modules; a refused module loaded under another name (`x._ctypes`: raw memory, the token read and written to the
proof pipe; `x._testcapi`); ctypes classes the jail left in the program's interpreter (a `type.__subclasses__`
walk); json.loads patched before a call-based case decodes its expected value; the bootstrap's helpers reached
through a stub's `__globals__`; a non-str global key that shadows a builtin for the tests; a signalling NaN on
stdout that made LiveCodeBench's decimal rule raise (a reward error, not a wrong answer); a call-based return value
whose __eq__ is always true (itself, an element, a list subclass, a metaclass); a program that loops on every case of
a row with many cases (all of them ran to their timeout: a reward failure); a humanevalplus harness whose budget (1 s
per input) outran the reward call's limit; a task function named like a builtin (`def sorted`) passed with no code;
the fraction-of-cases reward ran every case, past the call's limit.
"""

from __future__ import annotations

import os
import sys
import time

import pytest

from megadare.rewards.sandbox import run_program

from test_code_harness import dare_harness
from test_sandbox_escapes import _prog


HUMANEVAL_ROW = {
    "data_source": "humaneval",
    "prompt": "def add(a, b):\n",
    "entry_point": "add",
    "answer": "def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(5, 5) == 10\n",
}


WRONG = "def add(a, b):\n    return 0\n"


# Ways a wrong program could make its tests "pass" (or read them) from pure Python, with the audit hook on: each gets
# a frame object `fr` of its own; from there f_back leads to the bootstrap (FORGE).
SAVEALL = """
    gc.set_debug(gc.DEBUG_SAVEALL)
    def f():
        try:
            raise ValueError
        except ValueError as e:
            err = e
    f()
    gc.collect()
    fr = next(o for o in gc.garbage if type(o).__name__ == 'frame')
"""


FORGE = """
    while fr is not None and 'audit' not in fr.f_locals:
        fr = fr.f_back
    print('tests:', fr.f_locals.get('test_source'))
    sys.audit('megadare.tests_passed', fr)
    os._exit(0)
"""


FORGERIES = {
    # DEBUG_SAVEALL puts collected cycles in gc.garbage: a frame of a function that caught an exception
    "gc_garbage": _prog("import gc, os, sys") + _prog(SAVEALL) + _prog(FORGE),
    # a second _signal module (BuiltinImporter) has the real signal(): a handler receives the interrupted frame
    "signal_module_copy": _prog("""
        import importlib.machinery as m, os, sys
        s = m.BuiltinImporter.create_module(m.ModuleSpec('_signal', m.BuiltinImporter, origin='built-in'))
        m.BuiltinImporter.exec_module(s)
        got = []
        s.signal(s.SIGALRM, lambda n, f: got.append(f))
        s.setitimer(s.ITIMER_REAL, 0.01)
        while not got:
            pass
        fr = got[0]
    """)
    + _prog(FORGE),
    # a gc module copy, for the gc_garbage route once gc.set_debug is gone
    "gc_module_copy": _prog("""
        import importlib.machinery as m, os, sys
        gc = m.BuiltinImporter.create_module(m.ModuleSpec('gc', m.BuiltinImporter, origin='built-in'))
        m.BuiltinImporter.exec_module(gc)
    """)
    + _prog(SAVEALL)
    + _prog(FORGE),
}


@pytest.mark.parametrize("how", sorted(FORGERIES))
def test_a_wrong_program_cannot_forge_its_tests(how):
    """Through the reward RL uses (rl.reward=auto on a DARE humaneval row): a wrong answer scores 0."""
    from megadare.rewards import score_batch

    response = "```python\n" + WRONG + _prog(FORGERIES[how]) + "```"
    scores, stats = score_batch("auto", [response], [HUMANEVAL_ROW])
    assert scores == [0.0], (how, stats)
    r = run_program(WRONG + _prog(FORGERIES[how]), tests="assert add(1, 2) == 3\n")
    assert not r.tests_passed and "assert add" not in r.stdout, (how, r)


def test_no_subinterpreter_without_the_hook():
    """A sub-interpreter has no audit hook (ctypes would work there)."""
    r = run_program(
        _prog("""
        import _xxsubinterpreters as x
        x.run_string(x.create(), "import ctypes, sys; print('ctypes', ctypes.CDLL(None).getpid()); sys.stdout.flush()")
    """)
    )
    assert "ctypes" not in r.stdout and r.status != "ok", r  # CPython reports the refusal as "creation failed"


def _proof_event_at(guard, proof, offset):
    """Raise the proof event with this frame, the proof expecting it ``offset`` lines below the next line."""
    frame = sys._getframe(0)
    proof[0], proof[3] = frame, frame.f_lineno + 1 + offset
    return guard("megadare.tests_passed", (frame,))


@pytest.mark.parametrize("offset,token", [(0, b"token"), (-1, b""), (5, b"")])
def test_the_proof_is_accepted_only_at_the_end_of_the_tests(offset, token):
    """Defense in depth: a program that got hold of the bootstrap's frame (by a way not closed yet) and raises the
    proof event with it before the tests ended (the frame is elsewhere) burns the token instead of passing."""
    from megadare.rewards.sandbox_child import _test_guard

    r, w = os.pipe()
    try:
        proof = [None, b"token", w, 0]
        assert _proof_event_at(_test_guard(proof), proof, offset) is True
        assert proof[1] is None  # one shot either way
        os.set_blocking(r, False)
        try:
            got = os.read(r, 64)
        except BlockingIOError:
            got = b""
        assert got == token
    finally:
        os.close(r)
        os.close(w)


def test_no_test_module_in_test_mode():
    """_testcapi (unmarshalling code objects without an audit event, frame_new, raw sys objects) stays refused in
    test mode when a program names it by a str subclass that answers the hook's name checks with other text."""
    import importlib.util

    spec = importlib.util.find_spec("_testcapi")
    if spec is None or not str(spec.origin).endswith(".so"):
        pytest.skip("this Python has no _testcapi extension module")
    r = run_program(
        _prog(f"""
        import _imp
        class Name(str):
            def startswith(self, *a):
                return False
            def __eq__(self, other):
                return False
            __hash__ = str.__hash__
        class Spec:
            name = Name('_testcapi')
            origin = {spec.origin!r}
        print('loaded', _imp.create_dynamic(Spec()))
    """),
        tests="assert 1\n",
    )
    assert "loaded" not in r.stdout and not r.tests_passed, r


RENAMED = """
    import importlib.machinery as m, importlib.util as u
    C = u.module_from_spec(u.spec_from_file_location('x.{name}', {path!r}, loader=m.ExtensionFileLoader('x.{name}',
                                                                                                         {path!r})))
    print('loaded', C.__name__)
"""


# with _ctypes loaded under another name: no ctypes.* audit event for a Union of an address and a pointer, so the
# program reads its own memory, finds the one-time token (a 32-hex-digit bytes object) and writes it to the proof pipe
READ_TOKEN = """
    import os, re, stat, struct
    class Size(C._SimpleCData):
        _type_ = 'L'
    class Char(C._SimpleCData):
        _type_ = 'c'
    class CharPointer(C._Pointer):
        _type_ = Char
    class Raw(C.Union):
        _fields_ = [('address', Size), ('bytes', CharPointer)]
    raw, head, found = Raw(), struct.pack('<QQ', id(bytes), 32), set()
    for line in open('/proc/self/maps'):
        f = line.split()
        lo, hi = (int(x, 16) for x in f[0].split('-'))
        if f[1].startswith('rw') and hi - lo < 1 << 28 and not (len(f) > 5 and f[5].startswith('[v')):
            raw.address = lo
            data = raw.bytes[0 : hi - lo]
            for hit in re.finditer(re.escape(head), data):
                s = data[hit.end() + 8 : hit.end() + 41]
                if re.fullmatch(rb'[0-9a-f]{32}\\0', s):
                    found.add(s[:32])
    for fd in range(3, 64):
        try:
            if stat.S_ISFIFO(os.fstat(fd).st_mode):
                os.write(fd, b''.join(found))
        except OSError:
            pass
    os._exit(0)
"""


@pytest.mark.parametrize("name", ["_ctypes", "_testcapi"])
def test_no_refused_module_under_another_name(name):
    """An extension module's init function is named by the last part of its name: `_ctypes` loaded as `x._ctypes`
    (from this Python's own lib-dynload, where native code may load from) is still `_ctypes`. Through the reward RL
    uses (a DARE humaneval row) and run_program: not loaded, no forged pass."""
    import importlib.util

    spec = importlib.util.find_spec(name)
    if spec is None or not str(spec.origin).endswith(".so"):
        pytest.skip(f"{name} is not a shared-object extension module in this Python")
    attack = _prog(RENAMED.format(name=name, path=spec.origin)) + (_prog(READ_TOKEN) if name == "_ctypes" else "")
    r = run_program(WRONG + attack, tests="assert add(1, 2) == 3\n")
    assert "loaded" not in r.stdout and not r.tests_passed, r
    if name == "_ctypes":
        from megadare.rewards import score_batch

        scores, stats = score_batch("auto", ["```python\n" + WRONG + attack + "```"], [HUMANEVAL_ROW])
        assert scores == [0.0], stats


# the jail (ctypes: unshare, mount, prctl) ran in the program's own interpreter: _ctypes' classes stayed alive, and
# a walk of type.__subclasses__ (no audit event) finds them without any import
CTYPES_LEFT = """
    import types
    def walk(t, seen):
        for c in type.__subclasses__(t):
            if c not in seen:
                seen.add(c)
                walk(c, seen)
        return seen
    found = {c.__name__: c for c in walk(object, set()) if c.__module__ == '_ctypes'}
    print('found', sorted(found))
    C = types.SimpleNamespace(**found)
"""


def test_no_ctypes_left_in_the_program_interpreter():
    """The program's interpreter never loaded ctypes (the jail's own use of it stays in the process that exec'd it),
    and is not dumpable by the kernel's rule for an unreadable executable: no raw memory, no forged pass."""
    attack = _prog(CTYPES_LEFT) + _prog(READ_TOKEN)
    r = run_program(WRONG + attack, tests="assert add(1, 2) == 3\n")
    assert not r.tests_passed and "Union" not in r.stdout, r
    from megadare.rewards import score_batch

    scores, stats = score_batch("auto", ["```python\n" + WRONG + attack + "```"], [HUMANEVAL_ROW])
    assert scores == [0.0], stats


def test_call_based_tests_use_nothing_the_program_can_patch():
    """Call-based cases (TACO fn_name, LiveCodeBench functional): the tests decoded their arguments and expected value
    with json.loads at run time, after the program ran, so `json.loads = lambda s, **k: []` and a function returning
    [] passed every case. The expected value is a literal now (compiled before the program runs)."""
    from megadare.rewards.code import code_reward

    tests = {"fn_name": "add", "inputs": ["1\n2", "0.5\n1e300"], "outputs": ["3", "1e300"]}
    cheat = "import json\njson.loads = lambda s, **k: []\ndef add(*a):\n    return []\n"
    assert code_reward("```python\n" + cheat + "```", tests) == 0.0
    assert code_reward("```python\ndef add(a, b):\n    return a + b\n```", tests) == 1.0
    value = '{"k": [null, true, "\\u00e9\\n\'"], "n": [1e-320, -0.0, 12345678901234567890]}'
    odd = {"fn_name": "f", "inputs": [value + "\nNaN"], "outputs": [value]}
    assert code_reward("```python\ndef f(d, z):\n    assert z != z\n    return d\n```", odd) == 1.0


VERDICT_PATH = {
    # the stubs the bootstrap put into modules (gc.set_debug, signal.signal, _posixsubprocess.fork_exec) were its own
    # functions: their __globals__ were the bootstrap's, and a no-op _die made a failed test fall through to the proof
    "bootstrap_globals": """
        import gc, signal, sys
        for stub in (gc.set_debug, signal.signal, sys.modules['_posixsubprocess'].fork_exec):
            stub.__globals__['_die'] = lambda *a, **k: None
    """,
    # a global whose key is no str: it passes the check that leaves builtins' names out of the tests' view (its
    # __eq__ says no then), and shadows abs for the tests (it says yes later)
    "non_str_key": """
        class Key:
            seen = 0
            def __hash__(self):
                return hash('abs')
            def __eq__(self, other):
                Key.seen += 1
                return Key.seen > 1
        globals()[Key()] = lambda x: 0
    """,
}


@pytest.mark.parametrize("how", sorted(VERDICT_PATH))
def test_the_verdict_path_is_out_of_the_program_reach(how):
    """What decides the verdict after the program ran (the bootstrap's helpers, the tests' namespace) cannot be
    changed by the program: a wrong answer on a humaneval row whose test uses abs() scores 0."""
    from megadare.rewards import score_batch

    row = dict(HUMANEVAL_ROW, answer="def check(candidate):\n    assert abs(candidate(1, 2) - 3) < 1e-6\n")
    attack = WRONG + _prog(VERDICT_PATH[how])
    scores, stats = score_batch("auto", ["```python\n" + attack + "```"], [row])
    assert scores == [0.0], (how, stats)
    r = run_program(attack, tests="assert abs(add(1, 2) - 3) < 1e-6\n")
    assert not r.tests_passed, (how, r)


def test_a_signalling_nan_on_stdout_is_a_wrong_answer():
    """LiveCodeBench's stdout rule reads words as decimals; `print('sNaN')` made `==` raise InvalidOperation, so a
    wrong program turned its verdict into a reward error (counted as a failure: enough of them stop the run). It
    scores 0 as any wrong output; the same text on both sides stays equal as text."""
    from megadare.rewards import score_batch
    from megadare.rewards.code import lcb_output_equal

    row = {
        "data_source": "codeforces",
        "prompt": [{"role": "user", "content": "q"}],
        "extra_info": {"task": "code"},
        "answer": [{"input": "1 2\n", "output": "3\n", "testtype": "stdin"}],
    }
    scores, stats = score_batch("auto", ["```python\nprint('sNaN')\n```"], [row])
    assert scores == [0.0] and stats.failures == 0, stats
    assert not lcb_output_equal("3 sNaN", "3 1") and lcb_output_equal("sNaN", "sNaN")


ALWAYS_EQUAL = {
    # the return value itself says it equals anything
    "object": "class A:\n    def __eq__(self, other):\n        return True\n\ndef add(a, b):\n    return A()\n",
    # inside a list: list == list compares the elements with the element's __eq__
    "element": "class A:\n    def __eq__(self, other):\n        return True\n\ndef add(a, b):\n    return [A()]\n",
    # a list subclass, and a metaclass that says its class is list (a `type(v) in (list, ...)` check would ask it)
    "subclass": "class L(list):\n    def __eq__(self, other):\n        return True\n\ndef add(a, b):\n    return L()\n",
    "metaclass": (
        "class M(type):\n    def __eq__(cls, other):\n        return True\n    __hash__ = type.__hash__\n\n"
        "class A(metaclass=M):\n    def __eq__(self, other):\n        return True\n\ndef add(a, b):\n    return A()\n"
    ),
}


@pytest.mark.parametrize("how", sorted(ALWAYS_EQUAL))
def test_call_based_cases_compare_plain_data_only(how):
    """Call-based cases (TACO fn_name, LiveCodeBench functional) compared the return value with `==`, so an object
    whose __eq__ is always true passed every case. Only exact built-in data types are compared now; a right answer
    as a tuple, or nested plain data, still passes."""
    from megadare.rewards.code import code_reward

    tests = {"fn_name": "add", "inputs": ["1\n2", "0\n5"], "outputs": ["[3]", "[5]"]}
    assert code_reward("```python\n" + ALWAYS_EQUAL[how] + "```", tests) == 0.0, how
    nested = {"fn_name": "f", "inputs": ["1"], "outputs": ['[[1, 2.5], {"a": [true, null, "x"]}]']}
    assert code_reward("```python\ndef f(x):\n    return [x, 2.5], {'a': [True, None, 'x']}\n```", nested) == 1.0


def test_a_looping_program_stops_at_its_first_failed_case(monkeypatch):
    """An all-or-nothing code reward (score_batch("auto") on a code row) ran every case to its timeout after the first
    had failed: a program that loops on a row with 48 cases took 48 / 4 workers x 5 s, past score_batch's 60 s, and
    its wrong answer became a reward failure (rewards.max_error_fraction=0: the run stopped). The cases stop at the
    first failure now, as LiveCodeBench's harness does; every case of a right program still runs."""
    from megadare.rewards import code, score_batch
    from megadare.rewards.sandbox import SandboxResult

    runs = []

    def sandbox(program, stdin="", limits=None, tests=None, tested=()):  # each case times out, after a while
        runs.append(stdin)
        time.sleep(0.05)
        ok = "print(" in program
        return SandboxResult("ok" if ok else "timeout", 0, "3\n" if ok else "", "", 0.05)

    monkeypatch.setattr(code, "run_program", sandbox)
    cases = [{"input": "1 2\n", "output": "3\n", "testtype": "stdin"}] * 48
    row = {"data_source": "codeforces", "prompt": "q", "extra_info": {"task": "code"}, "answer": cases}
    scores, stats = score_batch("auto", ["```python\nwhile True:\n    pass\n```"], [row])
    assert scores == [0.0] and stats.failures == 0 and len(runs) <= 8, (len(runs), stats)
    runs.clear()
    assert score_batch("auto", ["```python\nprint(3)\n```"], [row])[0] == [1.0] and len(runs) == 48


def test_a_humanevalplus_harness_stays_within_the_reward_call_limit(monkeypatch):
    """DARE's humanevalplus budget is 1 s per harness input: a harness of 70 inputs ran a looping program for 70 s,
    past score_batch's 60 s per call, so its wrong answer became a reward failure (the eval stopped, and the
    abandoned sandbox ran on). The budget is capped below the call's limit; it scores 0."""
    import inspect

    from megadare.rewards import code, score_batch
    from megadare.rewards import harness as harness_mod

    seen = []

    def sandbox(program, stdin="", limits=None, tests=None, tested=()):
        seen.append(limits.timeout_s)
        return code.SandboxResult("timeout", None, "", "", limits.timeout_s, tests_passed=False)

    monkeypatch.setattr(harness_mod, "run_program", sandbox)
    harness = dare_harness("add", [[1, 2]] * 1000, [3] * 1000)
    row = {"data_source": "humanevalplus", "prompt": "def add(a, b):\n", "entry_point": "add", "answer": harness}
    scores, stats = score_batch("auto", ["```python\ndef add(a, b):\n    while True:\n        pass\n```"], [row])
    limit = inspect.signature(score_batch).parameters["timeout_s"].default
    assert scores == [0.0] and stats.failures == 0 and len(seen) == 1 and 5 <= seen[0] < limit - 10, (seen, stats)


def test_a_function_named_like_a_builtin_is_the_programs():
    """A task whose function is named like a builtin (`def sorted`): the tests saw the true builtins only, so a
    response defining nothing (or a wrong `sorted`) passed `assert sorted([3, 1, 2]) == [1, 2, 3]`. The tests see
    the program's `sorted` now, and fail without one; the other builtins stay the true ones (`list` below)."""
    from megadare.rewards.code import call_case, code_reward, tested_builtins
    import ast

    asserts = ["assert sorted([3, 1, 2]) == list((1, 2, 3))"]
    right = "def sorted(xs):\n    out = []\n    for x in xs:\n        out.insert(sum(y < x for y in out), x)\n    return out\n"
    nothing, wrong = "x = 1\n", "def sorted(xs):\n    return xs\n"
    calls = [call_case("sorted", [[2, 1]], [1, 2])]
    solution = "class Solution:\n    def sorted(self, xs):\n        return [min(xs), max(xs)]\n"
    got = {
        (name, kind): code_reward("", tests, code=code)
        for name, code in (("nothing", nothing), ("wrong", wrong), ("right", right), ("solution", solution))
        for kind, tests in (("asserts", asserts), ("call", calls))
    }
    assert got == {
        ("nothing", "asserts"): 0.0,
        ("nothing", "call"): 0.0,
        ("wrong", "asserts"): 0.0,
        ("wrong", "call"): 0.0,
        ("right", "asserts"): 1.0,
        ("right", "call"): 1.0,
        ("solution", "asserts"): 0.0,
        ("solution", "call"): 1.0,
    }, got
    # a function with its own name under test: no builtin is the program's (its `abs` cannot fool the tests)
    assert tested_builtins(ast.parse("r = f([3])\nassert abs(r) == 3")) == ()
    assert tested_builtins(ast.parse("def check(c):\n    assert c([2]) == [2]\ncheck(sorted)")) == ("sorted",)


def test_the_code_reward_stops_at_its_budget(monkeypatch):
    """The fraction-of-cases `code` reward ran every case: N cases / 4 workers x timeout_s (a slow program on 48
    cases of 5 s: 60 s) ran past score_batch's 60 s per call, a reward failure that stops the run. The cases run
    within a total budget now (code.BUDGET_S, 45 s; shrunk here): the cases not started in it count as failed."""
    from megadare.rewards import code
    from megadare.rewards.registry import load_reward

    monkeypatch.setattr(code, "BUDGET_S", 2.3)
    slow = "```python\nimport time\ntime.sleep(0.6)\nprint(input())\n```"
    row = {"tests": {"inputs": ["7\n"] * 8, "outputs": ["7\n"] * 8}, "timeout_s": 2.0}
    # the first 4 cases (one per worker) run; the next ones would start at >= 0.6 s, and 0.6 + 2.0 > 2.3
    assert load_reward("code")(slow, row) == 0.5
    results = code.run_tests(slow.split("\n", 1)[1][:-3], row["tests"], limits=code.SandboxLimits(timeout_s=2.0))
    assert [r.passed for r in results] == [True] * 8  # no budget: all of them run
    results = code.run_tests(
        slow.split("\n", 1)[1][:-3], row["tests"], limits=code.SandboxLimits(timeout_s=2), budget_s=2.3
    )
    assert [r.passed for r in results] == [True] * 4 + [False] * 4 and "budget" in results[-1].run.stderr


def test_dare_stdin_cases_accept_any_system_exit():
    """DARE's grade_stdio (LiveCodeBench's call_method) swallows SystemExit: a program that prints the right answer
    then calls sys.exit(1) (or exit("msg")) scores 1.0 there, and scored 0.0 here (exit status 1 was an "error").
    Checked against DARE @83ae8a3 run from a scratch copy: [True] for both, Runtime Error for a raise after the
    answer, Wrong answer for a wrong output then sys.exit(1). megadare's own stdin rule keeps exit status 0."""
    from megadare.rewards import score_batch

    row = {
        "data_source": "codeforces",
        "prompt": [{"role": "user", "content": "q"}],
        "extra_info": {"task": "code"},
        "answer": [{"input": "1 2\n", "output": "3\n", "testtype": "stdin"}],
    }
    programs = {
        "exit1": "print(3)\nimport sys\nsys.exit(1)",
        "exit_msg": "print(3)\nexit('bye')",
        "raise": "print(3)\nraise ValueError('x')",
        "wrong_exit1": "print(4)\nimport sys\nsys.exit(1)",
    }
    names = sorted(programs)
    scores, stats = score_batch("auto", [f"```python\n{programs[n]}\n```" for n in names], [row] * len(names))
    assert dict(zip(names, scores)) == {"exit1": 1.0, "exit_msg": 1.0, "raise": 0.0, "wrong_exit1": 0.0}, stats
    assert stats.failures == 0, stats
    own = {"tests": {"inputs": ["1 2\n"], "outputs": ["3\n"]}}
    assert score_batch("code", ["```python\nprint(3)\nimport sys\nsys.exit(1)\n```"], [own])[0] == [0.0]
    r = run_program("import sys\nprint('a')\nsys.exit('bye')\n")
    assert (r.status, r.exited, r.stdout, r.stderr.strip()) == ("error", True, "a\n", "bye"), r
    r = run_program("print('a')\nraise ValueError('x')\n")
    assert (r.status, r.exited) == ("error", False), r
