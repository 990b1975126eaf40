"""The house rules that a reader relies on, checked: no function in megadare/ longer than a reader can hold or with
more parameters than a reader can keep apart.

(The import layers are checked by `lint-imports` in .ci/run against .importlinter.)
"""

import ast
import pathlib

import megadare

MAX_FUNCTION_LINES = 80  # issue 28: as ruff formats them


def _functions(root: pathlib.Path):
    for f in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text(), filename=str(f))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield f"{f.relative_to(root.parent)}::{node.name}", node.end_lineno - node.lineno + 1


def test_no_function_over_the_limit():
    root = pathlib.Path(megadare.__file__).parent
    found = list(_functions(root))
    assert len(found) > 500, "the walk found too few functions: wrong package root?"
    long = sorted((n, name) for name, n in found if n > MAX_FUNCTION_LINES)
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split them into named steps): {long}"


MAX_PARAMETERS = 6  # issue 28: positional + keyword-only + *args + **kwargs, not self / cls


def _parameter_counts(root: pathlib.Path):
    for f in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text(), filename=str(f))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                n = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + bool(a.vararg) + bool(a.kwarg)
                if a.args and a.args[0].arg in ("self", "cls"):
                    n -= 1
                yield f"{f.relative_to(root.parent)}:{node.lineno} {node.name}", n


def test_no_function_over_the_parameter_limit():
    root = pathlib.Path(megadare.__file__).parent
    found = list(_parameter_counts(root))
    assert len(found) > 500, "the walk found too few functions: wrong package root?"
    wide = sorted((n, name) for name, n in found if n > MAX_PARAMETERS)
    assert not wide, f"functions over {MAX_PARAMETERS} parameters (group what travels together): {wide}"
