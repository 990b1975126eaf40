"""The house rules that a reader relies on, checked: no function in megadare/ longer than a reader can hold or with
more parameters than a reader can keep apart.

(The import layers are checked by `lint-imports` in .ci/run against .importlinter.)
"""

import ast
import pathlib

import megadare

MAX_FUNCTION_LINES = 80  # issue 28: as ruff formats them
MAX_PARAMETERS = 6  # issue 28: positional + keyword-only + *args + **kwargs, not self / cls


def _functions():
    """(where, function node) for every function in megadare/."""
    root = pathlib.Path(megadare.__file__).parent
    found = []
    for f in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text(), filename=str(f))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.append((f"{f.relative_to(root.parent)}:{node.lineno} {node.name}", node))
    assert len(found) > 500, "the walk found too few functions: wrong package root?"
    return found


def _parameters(node: ast.FunctionDef) -> int:
    a = node.args
    n = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + bool(a.vararg) + bool(a.kwarg)
    return n - 1 if a.args and a.args[0].arg in ("self", "cls") else n


def test_no_function_over_the_limit():
    long = sorted((n.end_lineno - n.lineno + 1, where) for where, n in _functions())
    long = [x for x in long if x[0] > MAX_FUNCTION_LINES]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split them into named steps): {long}"


def test_no_function_over_the_parameter_limit():
    wide = sorted((_parameters(n), where) for where, n in _functions())
    wide = [x for x in wide if x[0] > MAX_PARAMETERS]
    assert not wide, f"functions over {MAX_PARAMETERS} parameters (group what travels together): {wide}"
