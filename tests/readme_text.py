"""Reading README.md's text: code spans, command lines, repository paths, config keys and overrides, Python
names, ``$ command`` blocks. Pure text functions; tests/test_readme_contract.py holds them to the repository."""

import re
import shlex
from dataclasses import fields, is_dataclass

from megadare.config import Config

PREFIXES = ("megadare", "tests", "benchmarks", "examples", "tools", ".ci")
FILE_EXTS = ("py", "json", "jsonl", "yaml", "yml", "parquet", "md", "sh", "txt", "csv", "png", "distcp", "toml")
SECTIONS = [f.name for f in fields(Config) if is_dataclass(getattr(Config(), f.name))]


def backtick_spans(text: str) -> list[str]:
    """Inline code spans (may wrap a line); a fenced marker such as ```python is not a span."""
    text = text.replace("```", "")
    return [" ".join(s.split()) for s in re.findall(r"`([^`]+)`", text)]


def command_lines(text: str) -> list[str]:
    """Logical lines of the indented (4-space) blocks, ``\\`` continuations joined, ``$ `` prompts and ``#``
    comments dropped; plus every backtick span that starts with ``megadare `` or ``python ``."""
    out, pending, prompted = [], "", None
    for line in text.splitlines():
        if not line.startswith("    ") or line.strip().startswith("|"):
            pending, prompted = "", None
            continue
        body = line.strip()
        prompted = body.startswith("$ ") if prompted is None else prompted
        if prompted and not pending and not body.startswith("$ "):
            continue  # the output of a `$ command` block
        body = body[2:] if body.startswith("$ ") else body
        body = re.sub(r"\s#\s.*$", "", " " + body).strip()
        pending += (" " if pending else "") + body.rstrip("\\").strip()
        if not body.endswith("\\"):
            out.append(pending)
            pending = ""
    runs = re.compile(r"^(megadare|torchrun|python|[A-Z_]+=\S+) ")
    out = [c for c in out if runs.match(c)]
    out += [s for s in backtick_spans(text) if re.match(r"(megadare|python) \S", s)]
    return out


def _expand_braces(path: str) -> list[str]:
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return [q for alt in m.group(1).split(",") for q in _expand_braces(path[: m.start()] + alt + path[m.end() :])]


def repo_paths(text: str) -> list[str]:
    """Every path under one of PREFIXES the text names (``{a,b}`` expanded, ``<x>`` made a ``*`` glob)."""
    pat = re.compile(r"(?<![\w/.$~-])((?:%s)/(?:[\w/.*<>-]|\{[\w,]+\})*)" % "|".join(map(re.escape, PREFIXES)))
    out = []
    for m in pat.finditer(text):
        p = re.sub(r"<[^<>]*>", "*", m.group(1)).rstrip(".-")
        out.extend(_expand_braces(p))
    return sorted(set(out))


def short_paths(text: str) -> list[str]:
    """``dir/name.ext`` and ``name.py`` in backticks and in the "Where things are" block (resolved by suffix)."""
    where = (text.split("## Where things are", 1)[1:] or [""])[0].split("\n## ", 1)[0]
    blocks = [ln for ln in where.splitlines() if ln.startswith("    ")]
    chunks = backtick_spans(text) + blocks
    pat = re.compile(r"(?<![\w/.$~-])((?:\w[\w*-]*/)*\w[\w*-]*\.(?:py|sh|md|yaml))(?![\w/])")
    out = set()
    for chunk in chunks:
        for m in pat.finditer(chunk):
            p = m.group(1)
            if not p.startswith(PREFIXES):
                out.add(p)
    return sorted(out)


def dotted_keys(chunks: list[str]) -> list[str]:
    """``section.key`` (``section.key.sub``, ``section.*``, ``section.key_*``) in the chunks; a dotted file name
    (``rl.py``) is not a key."""
    pat = re.compile(r"(?<![\w/.$-])((?:%s)\.[\w*]+(?:\.(?:[\w*]+|<[^<>]*>))*)" % "|".join(SECTIONS))
    out = set()
    for chunk in chunks:
        for m in pat.finditer(chunk):
            key = re.sub(r"\.?<[^<>]*>", "", m.group(1))  # eval.paths.<task> -> eval.paths
            if key.rpartition(".")[2] not in FILE_EXTS:
                out.add(key)
    return sorted(out)


def overrides_of(chunk: str) -> list[str]:
    """The concrete ``section.key=value`` tokens of a backtick span or command line; ``a|b|c`` values give one
    override each; values with placeholders (``<...>``, ``...``) are left out."""
    out = []
    for tok in _tokens(chunk):
        key, eq, value = tok.partition("=")
        if not eq or key.split(".")[0] not in SECTIONS or "." not in key:
            continue
        if re.search(r"<|>|\.\.\.|^$", value):
            continue
        out.extend(f"{key}={v.strip()}" for v in value.split("|"))
    return out


def _tokens(chunk: str) -> list[str]:
    """Shell words of a chunk (brackets of optional parts dropped); an unbalanced quote keeps plain splitting."""
    chunk = re.sub(r"(?<!\S)\[([^\[\]]*)\]", r"\1", chunk)  # [--family sdar|dream], not data.path=[a,b]
    chunk = re.sub(r"\s*\|\s*", "|", chunk)
    chunk = re.sub(r"\{[^{}]*\}", lambda m: m.group(0).replace(" ", "\0"), chunk)  # {num_gpus: 1} is one word
    try:
        words = shlex.split(chunk)
    except ValueError:
        words = chunk.split()
    return [w.replace("\0", " ").rstrip(",;") for w in words]


def prompted_blocks(text: str) -> list[tuple[str, list[str]]]:
    """(command, the output lines shown under it) of each ``$ command`` in an indented block."""
    out: list[tuple[str, list[str]]] = []
    continued = False
    for line in text.splitlines():
        if not line.startswith("    "):
            continued = False
            continue
        body = line.strip()
        if body.startswith("$ "):
            out.append((body[2:].rstrip("\\").strip(), []))
        elif continued:
            out[-1] = (out[-1][0] + " " + body.rstrip("\\").strip(), out[-1][1])
        elif out and body != "...":
            out[-1][1].append(" ".join(body.split()))
        continued = body.endswith("\\") and bool(out)
    return out


def python_names(text: str) -> list[str]:
    """``megadare.<module>...<attribute>`` at the start of a backtick span (a span wrapped after a dot rejoined)."""
    out = set()
    for span in backtick_spans(text):
        m = re.match(r"megadare(?:\.\s*\w+)+", span)
        if m:
            out.add(re.sub(r"\s+", "", m.group(0)))
    return sorted(out)
