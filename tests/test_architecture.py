"""The house rules that a reader relies on, checked: no function in megadare/ longer than a reader can hold or with
more parameters than a reader can keep apart.

(The import layers are checked by `lint-imports` in .ci/run against .importlinter.)
"""

import ast
import pathlib
import re

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


# Public names of megadare/ that no code outside tests/ uses, each kept on purpose. Anything else only tests call
# is either a reference form (it belongs in tests/: tests/offpolicy_reference.py, tests/fp8_reference.py) or dead.
ONLY_TESTS_CALL = {
    "resolve_model_source": "trainer/model_setup.py: a config's model, written when tiny; for scripts of one's own",
    "versions_seen": "ReplayBuffer introspection (the buffer's state for a reader / debugger)",
    "size_per_version": "ReplayBuffer introspection",
    "denoise_block": "sglang_plugin.py: SGLang calls it (its dLLM algorithm interface)",
    "health": "rollout engine protocol; RolloutManager.call_all dispatches by name",
    "RolloutEngine": "rollout/engine.py: the protocol every engine implements (documentation in code)",
    "sync_weights": "weight_sync/sync.py: one push without keeping the plan, for scripts of one's own",
    "as_dict": "PlanReport.as_dict, named in README Planner",
    "is_installed": "parallel/cpu.py: whether the CPU mode is on",
    "lora_parameters": "models/lora.py: the LoRA API beside merge_lora",
    "lora_state_dict": "models/lora.py: the LoRA API beside merge_lora",
    "merge_lora": "models/lora.py: in-memory merge, named in README SFT",
    "cached_qwen_tokenizer": "data/qwen_tokenizer.py: the cached real tokenizer (README Data)",
    "preload_ranks": "parallel/launch.py: forkserver ranks for a process that launches many times (tests/conftest.py)",
    "config_from_dict": "megadare.config: a Config from a dict, for scripts of one's own (no YAML file)",
    "combine": "megadare.rewards: a weighted sum of rewards for a user's pkg.module:function reward",
}


def _used_names(files) -> set:
    """Names, attributes, imported names and identifier-like strings (getattr, entry points) of these files;
    ``__all__`` lists and a package ``__init__``'s imports (re-exports) do not count as a use."""
    used = set()
    for f in files:
        tree = ast.parse(f.read_text(), filename=str(f))
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
                node.value = ast.Constant(None)
        for node in ast.walk(tree):
            if isinstance(node, ast.Name):
                used.add(node.id)
            elif isinstance(node, ast.Attribute):
                used.add(node.attr)
            elif isinstance(node, ast.alias) and f.name != "__init__.py":
                used.add(node.name.rpartition(".")[2])
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                used.update(p for p in node.value.replace(":", ".").split(".") if p.isidentifier())
    return used


def _public_definitions(root: pathlib.Path):
    """(where, name) of every public module-level function / class and public method of a public class."""
    for f in sorted(root.rglob("*.py")):
        for node in ast.parse(f.read_text(), filename=str(f)).body:
            if not isinstance(node, (ast.FunctionDef, ast.ClassDef)) or node.name.startswith("_"):
                continue
            yield f"{f.relative_to(root.parent)}:{node.lineno}", node.name
            if isinstance(node, ast.ClassDef):
                for sub in node.body:
                    if isinstance(sub, ast.FunctionDef) and not sub.name.startswith("_"):
                        yield f"{f.relative_to(root.parent)}:{sub.lineno}", sub.name


def test_no_public_function_only_tests_call():
    """A newcomer reads megadare/ as what runs: a public function that only tests call is a reference form (move it
    to tests/) or dead (remove it), unless ONLY_TESTS_CALL says why it stays."""
    root = pathlib.Path(megadare.__file__).parent
    repo = root.parent
    code = [*root.rglob("*.py"), *(repo / "benchmarks").rglob("*.py"), *(repo / "tools").rglob("*.py")]
    used = _used_names([*code, repo / "setup.py"])
    unused = [
        f"{where} {name}"
        for where, name in _public_definitions(root)
        if name not in used and name not in ONLY_TESTS_CALL and name not in ("forward", "extra_repr")
    ]
    assert not unused, f"public names nothing outside tests/ uses (move to tests/, remove, or list why): {unused}"
    stale = sorted(set(ONLY_TESTS_CALL) & used)
    assert not stale, f"ONLY_TESTS_CALL lists names code now uses (drop them from the list): {stale}"


def test_every_module_opens_with_a_docstring_naming_real_files():
    """A newcomer opens a module and reads what it is for first: every module of megadare/ (``__init__`` and
    ``__main__`` included) starts with a docstring, and a repository path it names (``examples/...``,
    ``megadare/...``, a glob) exists."""
    root = pathlib.Path(megadare.__file__).parent
    bare, stale = [], []
    for f in sorted(root.rglob("*.py")):
        doc = ast.get_docstring(ast.parse(f.read_text(), filename=str(f)))
        if not doc:
            bare.append(str(f.relative_to(root.parent)))
            continue
        for path in re.findall(r"(?<![\w/.~])(?:examples|megadare)/[\w./*-]*[\w*]", doc):
            if not any(root.parent.glob(path)):
                stale.append(f"{f.relative_to(root.parent)}: {path}")
    assert not bare, f"modules without a docstring (say in 1-3 lines what the module is for): {bare}"
    assert not stale, f"module docstrings naming files that do not exist: {stale}"
