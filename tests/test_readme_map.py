"""README's "Where things are" is the map of the tree: every package of megadare/ has a header line saying what it
is, every module a line under its package's header (``name.py   what it is``, or a listed group ending in ``: what
they are``), and nothing in the map is gone from the tree. Each check reads the map's text, so a broken copy of the
README fails it (``test_a_broken_map_fails``)."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEADER = re.compile(r"^    (\S+/)(?:\s{2,}(.*))?$")
ENTRY = re.compile(r"^      (\S.*)$")
NAME = re.compile(r"(?<![\w/.])(\w+\.py)\b")


def map_block(readme: str) -> str:
    return readme.split("\n## Where things are", 1)[1].split("\n## ", 1)[0]


def parse_map(block: str) -> tuple[dict[str, str], dict[str, set[str]], list[str]]:
    """(header dir -> its description, dir -> the module names listed under it, entry lines with no description)."""
    headers: dict[str, str] = {}
    named: dict[str, set[str]] = {}
    bare: list[str] = []
    current, pending = None, ""
    for line in block.splitlines():
        if m := HEADER.match(line):
            current = m.group(1)
            headers[current] = (headers.get(current, "") + " " + (m.group(2) or "")).strip()
            named.setdefault(current, set())
        elif current and (m := ENTRY.match(line)):
            body = (pending + " " + m.group(1)).strip()
            if body.endswith(","):  # a listed group goes on on the next line
                pending = body
                continue
            pending = ""
            names, _, what = body.partition("  ") if "  " in body else body.rpartition(": ")
            if not NAME.search(names) or not what.strip():
                bare.append(line.strip())
            named[current] |= set(NAME.findall(names))
    return headers, named, bare


def map_problems(readme: str, root: Path = ROOT) -> list[str]:
    headers, named, bare = parse_map(map_block(readme))
    problems = [f"map entry without 'name.py  what it is': {b!r}" for b in bare]
    problems += [f"map header {d} says nothing about what it is" for d, what in headers.items() if not what]
    problems += [f"map names {d}, which does not exist" for d in headers if not (root / d).is_dir()]
    for d, names in named.items():
        problems += [f"map names {d}{n}, which does not exist" for n in sorted(names) if not (root / d / n).is_file()]
    for init in sorted((root / "megadare").rglob("__init__.py")):
        pkg = init.parent.relative_to(root).as_posix() + "/"
        if pkg not in headers:
            problems.append(f"package {pkg} has no header line in README's 'Where things are'")
    for mod in sorted((root / "megadare").rglob("*.py")):
        if mod.name == "__init__.py":
            continue
        pkg = mod.parent.relative_to(root).as_posix() + "/"
        if mod.name not in named.get(pkg, set()):
            problems.append(f"{pkg}{mod.name} is missing from README's 'Where things are' (add a line under {pkg})")
    return problems


def test_readme_map_matches_the_tree():
    problems = map_problems((ROOT / "README.md").read_text())
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    "edit, expected",
    [
        (lambda t: t.replace("      peers.py ", "      peerz.py "), "megadare/parallel/peerz.py, which does not exist"),
        (lambda t: re.sub(r"\n      peers\.py [^\n]*", "", t), "megadare/parallel/peers.py is missing"),
        (lambda t: t.replace("    megadare/models/hf/ ", "    megadare/models/hff/ "), "megadare/models/hf/ has no"),
        (lambda t: re.sub(r"(\n      peers\.py) [^\n]*", r"\1", t), "without 'name.py  what it is'"),
        (lambda t: t.replace(", vrpo.py: one algorithm", ": one algorithm"), "megadare/algos/vrpo.py is missing"),
    ],
)
def test_a_broken_map_fails(edit, expected):
    readme = (ROOT / "README.md").read_text()
    broken = edit(readme)
    assert broken != readme
    assert any(expected in p for p in map_problems(broken)), map_problems(broken)
