"""A newcomer reads the README's map, then the code, and trusts what the prose names. This test finds the names
that lead nowhere: in the docstrings and comments of megadare/ and tools/, the docstrings of benchmarks/ and the
text of README.md, the backticked (`x` or ``x``) references that look like code and do not resolve in today's tree.

What is checked, each against the tree read with ``ast`` (nothing is imported; torch never loads):

- module paths ``megadare.x.y`` (then attributes: the module's own names, a class's members) and relative
  ``.x`` module names, against the files of megadare/;
- file paths with a folder (``megadare/x/y.py``, ``benchmarks/x.py``, ``tests/x.py``, ``tools/...``, and the
  short ``models/head.py`` this code base writes for megadare/'s own), backticked or not, against the files;
- config keys ``section.key`` (``section.key.sub``, old keys of CONFIG_ALIASES) against the dataclasses of
  megadare/config/sections.py; under a dict-valued key (``algo.params``, ``eval.paths``) anything goes;
- options ``--x`` against the ``add_argument`` calls of megadare/, benchmarks/, tools/ and tests/ (cli.py's
  parser and each script's own), plus FOREIGN_OPTIONS;
- names ``Foo``, ``foo()``, ``FOO_BAR``, ``Foo.bar``, ``module.func``: a name must be bound (def, class,
  assignment, import, parameter) or used as an attribute somewhere in the code of megadare/, benchmarks/, tests/,
  tools/ (a renamed name is gone from all of it), be a Python builtin, an environment variable the code or a
  shell script sets or reads, or one of FOREIGN_NAMES; ``Foo.bar`` of a class of ours must be a member of it or
  of a base of ours (a class with a foreign base may inherit anything); ``module.func`` of a module of ours must
  be a name of that module (a variable named like a module: a name the code has).

A name the prose gives to another project (OWNER: "DARE's ``x``", "HF ``x``") is not ours to resolve.

Left out, as too noisy to resolve reliably: bare lowercase words without ``()`` (parameters, values, field
names of data rows, JSON keys); dotted names whose head is a variable (``cfg.rollout``, ``batch.reqs``); bare
file names without a folder (``generation_utils.py`` is as often another project's file as ours); commands'
positional arguments and options written after a foreign program (``torchrun``, ``pip``)."""

from __future__ import annotations

import ast
import builtins
import gc
import re
from functools import lru_cache
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
CODE_DIRS = ("megadare", "benchmarks", "tests", "tools", "examples")

# Options of programs that are not ours, named in our prose: SGLang's server (the plugin's), torchrun's.
FOREIGN_OPTIONS = {"--dllm-algorithm", "--dllm-algorithm-config", "--dllm-fdfo", "--nproc_per_node", "--help"}

# Names of other projects that the prose names without the code importing them: the sources our ports follow
# (DARE, dLLM-RL, SGLang internals the plugin mirrors) and megatron / transformers classes named for orientation.
FOREIGN_NAMES = {
    "RouterGatingLinearFunction",  # megatron's router GEMM
    "LinearWithGradAccumulationAndAsyncCommunication",  # megatron's tensor-parallel linear
    "Req",  # SGLang's scheduler request
    "ServerArgs",  # SGLang's engine settings
    "LogitsProcessorOutput",  # SGLang's forward output
    "load_plugins",  # SGLang's plugin loader
    "DLLM_PARAMS",  # SGLang's dLLM defaults
    "ProcessGroupGloo",  # torch.distributed's gloo group
    "kaiming_uniform_",  # torch.nn.init's
    "BuiltinImporter",  # importlib's
}

SPAN = re.compile(r"(:\w+:)?(?:``(.+?)``|(?<![`\w])`([^`]+?)`(?!`))")
# A span the prose gives to another project: possessive within the same clause (no ". " or ";" between), "DARE's
# ``dLLMRMDataset``", "megatron's torch_dist save (``FileSystemWriterAsync``"; or the project right before it,
# "DARE ``trainer/ppo/dtreerpo_algos.py``", "HF ``DynamicCache``", "dLLM-RL @10b4fd1, ``data/readme.md``".
OWNER = re.compile(
    r"\b(DARE|dLLM-RL|D-ARL|SGLang|sglang|verl|megatron|Megatron|transformers|HF|torch|PyTorch|apex|torchtitan|"
    r"Fast-dLLM|Dream|LLaDA|TraDo|SDAR|Ray|tiktoken|OpenCompass)"
    r"(?:'s?(?:(?!\. |;).){0,80}|\s*(?:@\w+,\s*)?\(?`{0,2})$"
)
FILE_EXTS = {"py", "json", "jsonl", "md", "sh", "yaml", "yml", "txt", "parquet", "toml", "png", "log", "jinja"}
PATH = re.compile(
    r"(?<![\w/.$~<-])((?:megadare|benchmarks|tests|tools|examples|[a-z_]+)/(?:[\w.-]+/)*[\w-]+\.(?:py|md|sh))\b"
)
IDENT = r"[A-Za-z_]\w*"
DOTTED = re.compile(rf"^({IDENT}(?:\.{IDENT})*)(\(.*\))?$")


# ---------------------------------------------------------------- the texts a reader reads


@lru_cache(maxsize=None)
def parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


COMMENT = re.compile(r"^\s*# ?(.*)$|\S  # (.*)$")  # a comment line, or a comment after code (ruff's two spaces)


def _comment_runs(src: str) -> list[tuple[int, str]]:
    """Comments, consecutive lines joined (a backticked name may wrap), with the line each run starts on. Read
    by line, not tokenized (a tenth of the time): a string holding "  # " would count, none does today."""
    runs: list[tuple[int, str]] = []
    last = -2
    for number, line in enumerate(src.splitlines(), 1):
        if "#" not in line or not (m := COMMENT.search(line)):
            continue
        text = (m.group(1) if m.group(1) is not None else m.group(2)).strip()
        if number == last + 1 and runs:
            runs[-1] = (runs[-1][0], runs[-1][1] + " " + text)
        else:
            runs.append((number, text))
        last = number
    return runs


def _docstrings(node: ast.AST) -> list[tuple[int, str]]:
    """Docstrings of the module, its classes and functions (statements walked, expressions not)."""
    out = []
    body = getattr(node, "body", None)
    if not isinstance(body, list):
        return out
    first = body[0].value if body and isinstance(body[0], ast.Expr) else None
    has_docstring = isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
    if has_docstring and isinstance(first, ast.Constant) and isinstance(first.value, str):
        out.append((first.lineno, first.value))
    for stmt in body + getattr(node, "orelse", []) + getattr(node, "finalbody", []) + getattr(node, "handlers", []):
        out += _docstrings(stmt)
    return out


def texts() -> list[tuple[str, int, str]]:
    """(file, line, text) of every docstring and comment the checker reads, and README.md's paragraphs."""
    out = []
    files = [(p, True) for p in sorted(ROOT.glob("megadare/**/*.py")) + sorted(ROOT.glob("tools/**/*.py"))]
    files += [(p, False) for p in sorted(ROOT.glob("benchmarks/*.py"))]
    for path, with_comments in files:
        src = path.read_text()
        rel = path.relative_to(ROOT).as_posix()
        found = _docstrings(parsed(path)) + (_comment_runs(src) if with_comments else [])
        out += [(rel, line, " ".join(text.split())) for line, text in found]
    line = 1
    for para in (ROOT / "README.md").read_text().replace("```", "").split("\n\n"):
        out.append(("README.md", line, " ".join(para.split())))
        line += para.count("\n") + 2
    return out


# ---------------------------------------------------------------- what the tree defines


class Tree:
    """Names, modules, classes, options and config keys of the repository, read with ``ast``."""

    def __init__(self):
        self.modules: dict[str, dict[str, str]] = {}  # megadare.x.y -> {its top-level name: "import" | "def"}
        self.stems: dict[str, list[str]] = {}  # y -> [megadare.x.y, ...]
        self.classes: dict[str, list[tuple[set[str], list[str]]]] = {}  # Foo -> [(members, base names)]
        self.names: set[str] = set(dir(builtins))
        self.options: set[str] = set(FOREIGN_OPTIONS)
        self.megadare_options: set[str] = {"--help"}  # the parsers of megadare/ (cli.py's, demo.py's)
        self._in_megadare = False
        self.strings: set[str] = set()  # string constants of the code: audit events, env var names
        self.module_strings: dict[str, set] = {}  # megadare.x.y -> its top-level string constants
        self.files = {p.relative_to(ROOT).as_posix() for d in CODE_DIRS for p in (ROOT / d).rglob("*") if p.is_file()}
        self.dirs = {p.relative_to(ROOT).as_posix() for d in CODE_DIRS for p in (ROOT / d).rglob("*") if p.is_dir()}
        for d in CODE_DIRS:
            for path in sorted((ROOT / d).rglob("*.py")):
                self._read(path)
            for path in sorted((ROOT / d).rglob("*.sh")):
                self.strings |= set(re.findall(r"\b[A-Z][A-Z0-9_]{2,}\b", path.read_text()))

    def _read(self, path: Path) -> None:
        tree = parsed(path)
        rel = path.relative_to(ROOT).with_suffix("")
        dotted = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        self.modules[dotted] = {
            name: "import" if isinstance(node, (ast.Import, ast.ImportFrom)) else "def"
            for node in tree.body
            for name in _bound_names(node)
        }  # kinds, not nodes: the trees are let go once read
        self.module_strings[dotted] = {
            n.value.value for n in tree.body if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)
        }
        self.stems.setdefault(dotted.rpartition(".")[2], []).append(dotted)
        self._in_megadare = dotted.startswith("megadare")
        todo: list[tuple[ast.AST, tuple[set[str], ...]]] = [(tree, ())]
        while todo:  # one pass; a name bound in a class also counts for the classes around it (their members)
            node, around = todo.pop()
            kind = type(node)
            if kind in BINDINGS:
                bound = _bound_names(node)
                self.names |= bound
                for members in around:
                    members |= bound
                if kind is ast.ClassDef:
                    around = around + (set(),)
                    self.classes.setdefault(node.name, []).append((around[-1], [_base_name(b) for b in node.bases]))
            elif kind is ast.Attribute:
                self._note_attribute(node, around)
            elif kind in NOTED:
                self._note(node)
            todo += [(child, around) for child in ast.iter_child_nodes(node)]

    def _note_attribute(self, node: ast.Attribute, around: tuple[set[str], ...]) -> None:
        self.names.add(node.attr)  # a foreign API the code calls: engine.update_weights_from_tensor
        if around and _is_self(node.value):
            for members in around:
                members.add(node.attr)

    def _note(self, node: ast.AST) -> None:
        if isinstance(node, ast.arg):
            self.names.add(node.arg)  # a parameter may be called: ``step_fn(indices)``
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
            self._add_options({a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value)[:2] == "--"})
        elif isinstance(node, ast.For) and isinstance(node.iter, (ast.Tuple, ast.List)):
            self._add_options(_looped_options(node))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "def " in node.value:
            self.names |= _program_names(node.value)  # a program the code writes: harness.py's check()
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and len(node.value) < 200:
            self.strings.add(node.value)
            self.strings |= set(re.findall(r"\b([A-Z][A-Z0-9_]{2,})=", node.value))  # env var names: "X=1"

    def _add_options(self, options: set[str]) -> None:
        self.options |= options
        if self._in_megadare:
            self.megadare_options |= options

    def module_has(self, module: str, attrs: list[str]) -> bool:
        """``attrs`` resolve in ``module``: a submodule, a top-level name, then a member of a class of ours."""
        while attrs and f"{module}.{attrs[0]}" in self.modules:
            module = f"{module}.{attrs.pop(0)}"
        if not attrs:
            return True
        kind = self.modules[module].get(attrs[0])
        if kind is None:  # a class the module makes under a name it holds: sglang_plugin.MegadareBlockDiffusion
            return len(attrs) == 1 and attrs[0] in self.module_strings[module]
        if kind == "import" or len(attrs) == 1:
            return True  # a name it imports: resolved where it comes from, or foreign
        return self.class_has(attrs[0], attrs[1:])

    def class_has(self, cls: str, attrs: list[str]) -> bool:
        for members, bases in self.classes.get(cls, []):
            if attrs[0] in members:
                return True
            if any(b not in self.classes or self.class_has(b, attrs) for b in bases):
                return True
        return not self.classes.get(cls)  # not a class: a function, a constant; its attributes are not checked


BINDINGS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Import, ast.ImportFrom, ast.Assign)
BINDINGS += (ast.AnnAssign, ast.AugAssign)
NOTED = (ast.arg, ast.Call, ast.For, ast.Constant)  # the other kinds of node _note reads


def _looped_options(loop: ast.For) -> set[str]:
    """``for k in ("tp", "pp"): p.add_argument(f"--{k}")``: the options the loop adds."""
    values = [e.value for e in loop.iter.elts if isinstance(e, ast.Constant)]
    calls = [n for n in ast.walk(loop) if isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "add_argument"]
    if not any(isinstance(a, ast.JoinedStr) for c in calls for a in c.args):
        return set()
    return {f"--{v}" for v in values}


def _program_names(text: str) -> set[str]:
    try:
        program = ast.parse(text)
    except SyntaxError:
        return set()
    return {
        n.name if hasattr(n, "name") else n.arg for n in ast.walk(program) if isinstance(n, (ast.FunctionDef, ast.arg))
    }


def _is_self(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def _base_name(node: ast.AST) -> str:
    return node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "?")


def _bound_names(node: ast.AST) -> set[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return {(a.asname or a.name).split(".")[0] for a in node.names} | {
            a.name.rpartition(".")[2] for a in node.names
        }
    if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return set()


@lru_cache(maxsize=1)
def tree() -> Tree:
    return Tree()


# ---------------------------------------------------------------- the config tree


@lru_cache(maxsize=1)
def config_keys() -> tuple[dict[str, dict[str, str]], set[str]]:
    """({dataclass: {field: annotation}}, the old keys of CONFIG_ALIASES), from megadare/config/sections.py."""
    mod = ast.parse((ROOT / "megadare/config/sections.py").read_text())
    classes = {
        n.name: {f.target.id: ast.unparse(f.annotation) for f in n.body if isinstance(f, ast.AnnAssign)}
        for n in mod.body
        if isinstance(n, ast.ClassDef)
    }
    aliases = next(n.value for n in mod.body if isinstance(n, ast.AnnAssign) and n.target.id == "CONFIG_ALIASES")

    scope = {c: c for c in classes} | {"fields": lambda c: [SimpleNamespace(name=f) for f in classes[c]]}
    old = eval(compile(ast.Expression(aliases), "sections.py", "eval"), scope)  # a literal dict of f-strings
    return classes, set(old)


def key_resolves(key: str) -> bool:
    """``key`` is a key of the config tree, an old key of CONFIG_ALIASES, or a key under a dict-valued one."""
    classes, old = config_keys()
    parts = key.split(".")
    if ".".join(parts[:2]) in old:
        return True
    fields, ann = classes["Config"], ""
    for part in parts:
        if ann and ann not in classes:
            return bool(re.match(r"(Optional\[)?(dict|list|Any)\b", ann))  # a dict value's own keys: eval.paths.gsm8k
        if part == "*" or part.endswith("*"):
            return any(f.startswith(part.rstrip("*")) for f in fields)
        if part not in fields:
            return False
        ann = fields[part]
        fields = classes.get(ann, {})
    return True


def sections() -> set[str]:
    return set(config_keys()[0]["Config"]) - {"seed"}


# ---------------------------------------------------------------- one reference


def path_problem(path: str, where: str) -> str | None:
    """Why ``path`` (``megadare/x/y.py``, or short: ``models/head.py``, ``hf/common.py``) is no file of today's
    tree; None if it is one, or if its first folder is none of ours (another project's file)."""
    t = tree()
    here = where.rpartition("/")[0]
    if any(c in t.files or c.rstrip("/") in t.dirs for c in (path, f"megadare/{path}", f"{here}/{path}")):
        return None
    if any(f.endswith("/" + path) for f in t.files):
        return None
    head = path.split("/")[0]
    ours = head in CODE_DIRS or head in {d.rpartition("/")[2] for d in t.dirs}
    return f"file {path}" if ours else None


def span_problem(span: str, role: str, where: str) -> str | None:
    """Why ``span`` (one backticked text of ``where``, after a ``:mod:``-like ``role`` or none) names nothing of
    today's tree; None if it resolves or is not a kind of reference the checker reads."""
    t = tree()
    span = span.strip().rstrip(".,:;")
    if re.fullmatch(r"--[a-z][\w-]*", span.split("=")[0]):
        return None if span.split("=")[0] in t.options else f"option {span}"
    if m := re.match(r"megadare (\w+)((?: [a-z][\w-]*)*)(.*)", span):
        bad = [o for o in re.findall(r"(?<!\S)(--[a-z][\w-]*)", m.group(3)) if o not in t.megadare_options]
        return f"option {bad[0]} in `{span}`" if bad else None
    if role and re.fullmatch(rf"\.{IDENT}(\.{IDENT})*", span):
        package = ".".join(Path(where).with_suffix("").parts[:-1])
        mod = span[1:].split(".")[0]
        if f"{package}.{mod}" in t.modules or mod in t.modules.get(package, {}):
            return None
        return f"relative module {span}"
    m = DOTTED.match(span.split("=")[0] if re.match(rf"{IDENT}\.{IDENT}=", span) else span)
    if not m or span in t.strings or m.group(1).rpartition(".")[2] in FILE_EXTS:
        return None  # not a name, an audit event's or environment variable's name, a file name
    name, called = m.group(1), m.group(2)
    parts = name.split(".")
    if parts[0] == "megadare":
        return None if t.module_has("megadare", parts[1:]) else f"module path {name}"
    if parts[0] in sections() and len(parts) > 1 and not called:
        return None if key_resolves(name) or _python_resolves(parts) else f"config key {name}"
    if len(parts) == 1 and not called and not re.search(r"[A-Z]", name):
        return None  # a bare lowercase word: a parameter, a value, a field (left out)
    if len(parts) == 1 and name.isupper() and len(name) < 3:
        return None  # T, B, V: math
    return None if _python_resolves(parts) else f"name {name}"


def _python_resolves(parts: list[str]) -> bool:
    t = tree()
    head, rest = parts[0], parts[1:]
    if head in FOREIGN_NAMES:
        return True
    if not rest:
        return head in t.names or head in t.strings
    if head in t.stems and any(t.module_has(m, list(rest)) for m in t.stems[head]):
        return True
    if head in t.stems or head[0].islower():
        # a variable named like a module of ours (spec.mask_mod, config.context_parallel_size): its attribute must
        # be a name the code has; any other variable's (cfg.rollout) or a foreign module's (torch.compile): left out
        return rest[-1] in t.names if head in t.stems else True
    if head in t.classes:
        return t.class_has(head, list(rest))
    return head in t.names


def text_problems(where: str, line: int, text: str) -> list[str]:
    """The dangling references of one docstring, comment run or README paragraph of ``where``."""
    found = set()
    for m in SPAN.finditer(text):
        if OWNER.search(text[max(0, m.start() - 100) : m.start()]):
            continue  # another project's name
        if (why := span_problem(m.group(2) or m.group(3), m.group(1), where)) is not None:
            found.add(why)
    for m in PATH.finditer(text):
        if OWNER.search(text[max(0, m.start() - 100) : m.start()]):
            continue
        if (why := path_problem(m.group(1), where)) is not None:
            found.add(why)
    return [f"{where}:{line}: {why} (rename it to today's name, or rewrite the sentence)" for why in sorted(found)]


def problems() -> list[str]:
    collecting = gc.isenabled()
    gc.disable()  # a million AST nodes alive: the collector's passes would triple the time
    try:
        return [p for where, line, text in texts() for p in text_problems(where, line, text)]
    finally:
        parsed.cache_clear()
        if collecting:
            gc.enable()


def test_no_dangling_references():
    found = problems()
    assert not found, f"{len(found)} references that name nothing of today's tree:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "good, broken, expected",
    [
        ("``megadare.rollout.manager.RolloutManager``", "``megadare.rollout.manager.RolloutManagr``", "module path"),
        ("``megadare.trainer.rl_rollout``", "``megadare.trainer.rl_rollouts``", "module path"),
        ("megadare/rollout/decoders.py", "megadare/rollout/decoder.py", "file megadare/rollout/decoder.py"),
        ("(models/head.py)", "(models/heads.py)", "file models/heads.py"),
        ("``benchmarks/weight_sync.py``", "``benchmarks/weights_sync.py``", "file benchmarks/weights_sync.py"),
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
        ("see :mod:`.loading`", "see :mod:`.loader`", "relative module .loader"),
    ],
)
def test_a_dangling_reference_is_named(good, broken, expected):
    """Each kind the checker reads: today's name passes, a misspelt one is named (as a renamed one would be)."""
    where = "megadare/config/sections.py"
    assert text_problems(where, 1, f"a sentence naming {good} in a docstring") == []
    found = text_problems(where, 1, f"a sentence naming {broken} in a docstring")
    assert len(found) == 1 and expected in found[0], found


if __name__ == "__main__":
    print("\n".join(problems()))
