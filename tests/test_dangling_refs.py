"""A newcomer trusts what the prose names. This test finds, in the docstrings and comments of megadare/ and tools/
and the docstrings of benchmarks/, the references that name nothing of today's tree (read with ``ast``; torch
never loads): file paths under megadare/, benchmarks/, tests/, tools/, examples/; and in backticks (`x`, ``x``)
module paths ``megadare.x.y[.name]``, config keys ``section.key`` (or an old key of CONFIG_ALIASES), options
``--x`` (alone or in a ``megadare ...`` span: one the code spells), and names ``Foo``, ``foo()``, ``Foo.bar``,
``module.func``: each part a name the code binds or uses as an attribute (a renamed name is gone from all of
it), a builtin, or one of FOREIGN_NAMES. In README.md only the names: its paths, keys, options, commands and
``megadare.x`` names are tests/test_readme_contract.py's. A name the prose gives to another project (OWNER:
"DARE's ``x``", "HF ``x``") is skipped.

Left out as too noisy for what they would find: bare lowercase words without ``()`` (parameters, values, keys of
data); attributes of a variable or foreign module (``cfg.rollout``, ``torch.compile``); bare file names, short
paths (``models/head.py``), ``:mod:`` relative names; whether ``Foo.bar`` is Foo's own member (a renamed method
or class is caught, a moved one is not)."""

from __future__ import annotations

import ast
import builtins
import gc
import re
from fnmatch import fnmatch
from functools import lru_cache, reduce
from pathlib import Path

import pytest

from megadare.config import CONFIG_ALIASES, Config
from megadare.config.loading import _all_keys
from readme_text import dotted_keys, repo_paths

ROOT = Path(__file__).resolve().parents[1]
CODE_DIRS = ("megadare", "benchmarks", "tests", "tools", "examples")

# Names of other projects the prose names without the code using them: megatron's, SGLang's, torch's, importlib's.
FOREIGN_NAMES = {"RouterGatingLinearFunction", "LinearWithGradAccumulationAndAsyncCommunication", "ProcessGroupGloo"}
FOREIGN_NAMES |= {"Req", "ServerArgs", "LogitsProcessorOutput", "load_plugins", "BuiltinImporter"}

# readme_text.backtick_spans' spans (``x`` or `x`), with their positions: OWNER reads the text before each.
SPAN = re.compile(r"(?:``(.+?)``|(?<![`\w])`([^`]+?)`(?!`))")
OWNER = re.compile(
    r"\b(DARE|dLLM-RL|D-ARL|SGLang|sglang|verl|megatron|Megatron|transformers|HF|torch|PyTorch|apex|torchtitan|"
    r"Fast-dLLM|Dream|LLaDA|TraDo|SDAR|Ray|tiktoken|OpenCompass)"
    r"(?:'s?(?:(?!\. |;).){0,80}|\s*(?:@\w+,\s*)?\(?`{0,2})$"
)  # possessive in the same clause ("megatron's torch_dist save (``X``"), or the project right before the span
NAME = re.compile(r"^([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)(\(.*\))?$")
DOCUMENTED = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
COMMENT = re.compile(r"^\s*# ?(.*)$|\S  # (.*)$")  # a comment line, or a comment after code (ruff's two spaces)


def _comment_runs(src: str) -> list[tuple[int, str]]:
    """Comments, consecutive lines joined (a backticked name may wrap), with the line each run starts on."""
    runs: list[list] = []  # [first line, text, last line]
    for number, line in enumerate(src.splitlines(), 1):
        if "#" in line and (m := COMMENT.search(line)):
            text = (m.group(1) if m.group(1) is not None else m.group(2)).strip()
            if runs and runs[-1][2] == number - 1:
                runs[-1][1:] = [runs[-1][1] + " " + text, number]
            else:
                runs.append([number, text, number])
    return [(first, text) for first, text, _ in runs]


class Tree:
    """The files, modules, names and options of CODE_DIRS, and the prose read (each file parsed once)."""

    def __init__(self):
        self.files = [p.relative_to(ROOT).as_posix() for d in CODE_DIRS for p in (ROOT / d).rglob("*")]
        self.modules: dict[str, set[str]] = {}
        self.names = set(dir(builtins)) | FOREIGN_NAMES
        self.options, self.classes = set(), set()
        self.texts: list[tuple[str, int, str]] = []
        for path in (p for d in CODE_DIRS for p in (ROOT / d).rglob("*.sh")):
            self.names |= set(re.findall(r"\b[A-Z][A-Z0-9_]{2,}\b", path.read_text()))  # environment variables
        for path in sorted(p for d in CODE_DIRS for p in (ROOT / d).rglob("*.py")):
            self._read(path, path.relative_to(ROOT).as_posix())

    def _read(self, path: Path, rel: str) -> None:
        src = path.read_text()
        tree = ast.parse(src)
        dotted = rel.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
        self.modules[dotted] = set().union(*(_bound(n) for n in tree.body))
        prose = []
        for node in ast.walk(tree):
            self.names |= _bound(node)
            if isinstance(node, DOCUMENTED) and (doc := ast.get_docstring(node, clean=False)):
                prose.append((node.body[0].lineno, doc))
            if isinstance(node, ast.ClassDef):
                self.classes.add(node.name)
            elif isinstance(node, ast.Attribute):
                self.names.add(node.attr)  # a foreign API the code calls: engine.update_weights_from_tensor
            elif isinstance(node, ast.arg):
                self.names.add(node.arg)  # a parameter may be called: ``step_fn(indices)``
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                self._read_string(node.value, rel.startswith("tests/"))
        if rel.startswith(("megadare/", "tools/", "benchmarks/")):
            prose += [] if rel.startswith("benchmarks/") else _comment_runs(src)
            self.texts += [(rel, line, " ".join(text.split())) for line, text in prose]

    def _read_string(self, value: str, whole_only: bool) -> None:
        """A string of the code: an audit event, a key config/foreign.py refuses, options, environment variables,
        a program it writes (harness.py's ``check(candidate)``). Of the tests' (they misspell on purpose in their
        texts), only whole strings: ``Yes``, ``trainer.total_epochs``."""
        if len(value) < 200:
            self.names.add(value)
        if not whole_only:
            self.names |= set(re.findall(r"[A-Za-z_]\w*" if "def " in value else r"\b[A-Z][A-Z0-9_]{2,}\b", value))
            self.options |= set(re.findall(r"(?<![\w-])--[a-z][\w-]*", value))

    def module_has(self, parts: list[str]) -> bool:
        """``megadare.x.y[.name]``: the longest module of ours, then one of its top-level names (or a submodule)."""
        for i in range(len(parts), 0, -1):
            module = ".".join(parts[:i])
            if module in self.modules:
                return i == len(parts) or parts[i] in self.modules[module]
        return False


def _bound(node: ast.AST) -> set[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return {n for a in node.names for n in ((a.asname or a.name).split(".")[0], a.name.rpartition(".")[2])}
    if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return set()


@lru_cache(maxsize=1)
def tree() -> Tree:
    gc.disable()  # parsing makes a million AST nodes: the collector's passes would take half the time
    try:
        return Tree()
    finally:
        gc.enable()


@lru_cache(maxsize=1)
def config_keys() -> tuple[set[str], set[str]]:
    """(every key of the config tree, the keys whose value is a dict, a list or None: anything goes under them)."""
    config = Config()
    keys = set(_all_keys(config))
    return keys, {k for k in keys if isinstance(reduce(getattr, k.split("."), config), (dict, list, type(None)))}


def key_resolves(key: str) -> bool:
    keys, open_keys = config_keys()
    if "*" in key:
        return any(fnmatch(k, key) for k in keys | set(CONFIG_ALIASES))
    under_open = any(key.startswith(k + ".") for k in open_keys)  # eval.paths.gsm8k
    return key in keys or ".".join(key.split(".")[:2]) in CONFIG_ALIASES or under_open


def name_resolves(parts: list[str]) -> bool:
    """``module.func``: a name of that module of ours, or (a variable named like it) names of the code; ``Foo.bar``
    of a class of ours: names of the code. Other heads' attributes (a variable's, a foreign class's): left out."""
    t = tree()
    modules = [m for m in t.modules if m.endswith("." + parts[0])]
    if any(t.module_has(m.split(".") + parts[1:]) for m in modules):
        return True
    if not modules and len(parts) > 1 and parts[0] not in t.classes:
        return parts[0] in t.names if parts[0][0].isupper() else True
    return all(p in t.names for p in parts)


def span_problem(span: str, readme: bool) -> str | None:
    """Why ``span`` (one backticked text) names nothing of today's tree; None if it resolves, or is no kind of
    reference the checker reads (in README.md: only names)."""
    span = span.strip().rstrip(".,:;")
    if span in tree().names:
        return None  # a string of ours: an audit event, a foreign key the config refuses, an environment variable
    options = re.findall(r"(?<!\S)(--[a-z][\w-]*)", span) if re.match(r"--|megadare \w", span) else []
    if options or span.startswith("megadare "):
        bad = [o for o in options if o not in tree().options]
        return None if readme or not bad else f"option {bad[0]}"
    keys = dotted_keys([span.split("=")[0]]) if " " not in span else []
    if keys and keys[0] == span.split("=")[0]:
        if readme or key_resolves(keys[0]) or name_resolves(keys[0].split(".")):
            return None
        return f"config key {keys[0]}"
    m = NAME.match(span.split("=")[0])
    if not m or m.group(1).rpartition(".")[2] in {"py", "md", "sh", "yaml", "json", "jsonl", "txt"}:
        return None  # not a name, a file name
    name, called = m.group(1), m.group(2)
    parts = name.split(".")
    if parts[0] == "megadare":
        return None if readme or tree().module_has(parts) else f"module path {name}"
    if len(parts) == 1 and not called and (name.islower() or len(name) < 3):
        return None  # a bare lowercase word (a parameter, a value: left out), T, B, V (math)
    return None if name_resolves(parts) else f"name {name}"


def text_problems(where: str, line: int, text: str) -> list[str]:
    """The dangling references of one docstring, comment run or README paragraph of ``where``."""
    readme = where == "README.md"
    found, ours = set(), text
    for m in SPAN.finditer(text):
        if OWNER.search(text[max(0, m.start() - 100) : m.start()]):
            ours = ours.replace(m.group(0), "")  # another project's path: DARE's ``tests/x.py``
        else:
            found.add(span_problem(m.group(1) or m.group(2), readme))
    if not readme:
        files = tree().files  # paths of files (``benchmarks/carry`` is a folder a command makes)
        found |= {f"file {p}" for p in repo_paths(ours) if "." in p[-5:] and not any(fnmatch(f, p) for f in files)}
    return [f"{where}:{line}: {why} (rename it to today's name, or rewrite the sentence)" for why in found - {None}]


def problems() -> list[str]:
    paragraphs, line = [], 1
    for para in (ROOT / "README.md").read_text().replace("```", "").split("\n\n"):
        paragraphs.append(("README.md", line, " ".join(para.split())))
        line += para.count("\n") + 2
    return [p for where, line, text in tree().texts + paragraphs for p in text_problems(where, line, text)]


def test_no_dangling_references():
    found = problems()
    assert not found, f"{len(found)} references that name nothing of today's tree:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "good, broken, expected",
    [
        ("``megadare.rollout.manager.RolloutManager``", "``megadare.rollout.manager.RolloutManagr``", "module path"),
        ("``megadare.trainer.rl_rollout``", "``megadare.trainer.rl_rollouts``", "module path"),
        ("megadare/rollout/decoders.py", "megadare/rollout/decoder.py", "file megadare/rollout/decoder.py"),
        ("``rollout.weight_transport``", "``rollout.weights_transport``", "config key rollout.weights_transport"),
        ("``rl.canvas=full`` (an old key)", "``rl.canva=full``", "config key rl.canva"),
        ("``rewards.code.isolation``", "``rewards.code.isolate``", "config key rewards.code.isolate"),
        ("`megadare demo --foundation`", "`megadare demo --foundations`", "option --foundations"),
        ("``--config-only``", "``--config-onl``", "option --config-onl"),
        ("``Rollouts.evaluate``", "``RLRollouts.evaluate``", "name RLRollouts.evaluate"),
        ("``Rollouts.evaluate``", "``Rollouts.evaluates``", "name Rollouts.evaluates"),
        ("``dllm_step.denoise_step``", "``dllm_step.denoise_steps``", "name dllm_step.denoise_steps"),
        ("``resolve_sft_mode()``", "``resolve_sft_modes()``", "name resolve_sft_modes"),
        ("``CONFIG_ALIASES``", "``CONFIG_ALIAS``", "name CONFIG_ALIAS"),
    ],
)
def test_a_dangling_reference_is_named(good, broken, expected):
    """Each kind the checker reads: today's name passes, a misspelt one is named (as a renamed one would be)."""
    assert text_problems("megadare/x.py", 1, f"a sentence naming {good} in a docstring") == []
    found = text_problems("megadare/x.py", 1, f"a sentence naming {broken} in a docstring")
    assert len(found) == 1 and expected in found[0], found


def test_readme_is_read_for_names_only():
    """README.md's keys and options are test_readme_contract's; its other names are this test's."""
    assert text_problems("README.md", 1, "``rl.canva`` and ``--config-onl``") == []
    assert "name RLRollouts.evaluate" in text_problems("README.md", 1, "see ``RLRollouts.evaluate``")[0]
