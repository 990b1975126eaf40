"""README.md is a contract: what it names exists and what it shows is accepted, checked in-process (no training,
no subprocess). Five kinds of claims:

* repository paths (``megadare/...``, ``tests/...``, ``benchmarks/...``, ``examples/...``, ``tools/...``) anywhere
  in the text, and the short ones in backticks or in "Where things are" (``models/head.py``, ``preflight.py``);
* command lines (indented blocks, and ``megadare ...`` / ``python ...`` in backticks): each is parsed by the
  argparse parser of the command it names -- ``megadare <sub>`` by ``megadare.cli._parser()`` (the demo by
  ``megadare.demo.parser``), ``torchrun`` by torch's own, ``python <script>`` by the parser the script builds,
  caught when it calls ``parse_args``; the text of ``megadare <sub> --help`` is held to the same rules;
* Python names (``megadare.algos.REGISTRY``, ``megadare.models.lora.merge_lora(chunks)``) in backticks: each
  imports and resolves to an attribute;
* dotted config keys (``train.logits``, ``rollout.compile``) in backticks, command lines and ``--help``: each is a
  key (or an alias, or a glob over keys) of the config tree, and each ``key=value`` loads (``load_config``);
* ``examples/configs/*.yaml``: each loads and passes ``megadare <cmd> --config X --dry-run --config-only`` for every
  command the file's header or the README runs it with (``megadare plan``: its plan fits), and the README's
  ``$ megadare plan`` outputs are what it prints today (the full-size configs' model and data paths are a
  cluster's, placeholders here: the config, its layout against the model's config.json and the memory plan are
  what can be checked without weights). ``examples/configs/dare/`` has its own test (tests/test_dare_presets.py).

Each check reads README text given as an argument, so a broken copy of the README must fail it
(``test_a_broken_readme_fails_every_check``)."""

import argparse
import contextlib
import fnmatch
import importlib
import io
import itertools
import os
import re
import runpy
import shutil
import sys

import pytest

from megadare import cli, demo
from megadare.config import CONFIG_ALIASES, Config, load_config
from megadare.config.foreign import foreign_fix
from megadare.config.loading import _all_keys, suggestion
from megadare.preflight import check_plan_fits, preflight
from megadare.rollout.choices import CONFIDENCES, SCHEDULES
from megadare.trainer.spec import resolve
from readme_text import (
    backtick_spans,
    command_lines,
    dotted_keys,
    overrides_of,
    prompted_blocks,
    python_names,
    repo_paths,
    short_paths,
    _tokens,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()

# Names the README shows that are not ours, each with its reason.
NOT_OURS = {
    "configuration_sdar.py": "a publisher's remote code (SDAR's hf/ directory), carried by checkpoints",
    "modeling_*.py": "a publisher's remote code, carried by checkpoints",
    "config.yaml": "a run's resolved config, written under <run_dir>",
}
# Dotted keys the README shows on purpose although they are not megadare's: each must be in config/foreign.py's
# table (the line refusing it names the megadare key).
FOREIGN_KEYS = {
    "rollout.num_task_per_step": "dLLM-RL's key, shown as refused (README Config)",
    "data.micro_batch_size_per_gpu": "DARE's SFT key, the setting megadare's normalisations match (README SFT)",
    "data.balance_dp_token": "DARE's SFT key, the setting megadare's normalisations match (README SFT)",
}


# ---------------------------------------------------------------------------------------------------------------
# Checks: each returns the problems it found (empty: the README holds)


def _repo_files() -> list[str]:
    skip = {".git", ".venv", "venv", "runs", "__pycache__", "node_modules", ".pytest_cache"}
    out = []
    for d, dirs, files in os.walk(ROOT):
        dirs[:] = [x for x in dirs if x not in skip and not x.endswith(".egg-info")]
        rel = os.path.relpath(d, ROOT)
        out.append(rel + "/")
        out.extend(os.path.join(rel, f) if rel != "." else f for f in files)
    return out


def missing_paths(text: str) -> list[str]:
    files = _repo_files()
    bad = []
    for p in repo_paths(text):
        if not any(fnmatch.fnmatch(f, p) or fnmatch.fnmatch(f, p.rstrip("/") + "/") for f in files):
            bad.append(f"{p}: no such file or directory in the repository")
    for p in short_paths(text):
        if p in NOT_OURS:
            continue
        if not any(fnmatch.fnmatch("/" + f, "*/" + p) for f in files):
            bad.append(f"{p}: no file of the repository ends in it")
    return bad


def config_key_problems(text: str) -> list[str]:
    keys = set(_all_keys(Config()))
    dicts = {k for k in keys if isinstance(_get_default(k), dict)}
    bad = []
    for key in dotted_keys(_key_chunks(text)):
        if key in FOREIGN_KEYS:
            if foreign_fix(key, "1") is None:
                bad.append(f"{key}: shown as another project's key, but config/foreign.py does not know it")
            continue
        if "*" in key:
            if not fnmatch.filter(keys | set(CONFIG_ALIASES), key):
                bad.append(f"{key}: matches no config key")
        elif key not in keys and key not in CONFIG_ALIASES and not any(key.startswith(d + ".") for d in dicts):
            bad.append(f"{key}: not a config key (megadare/config/sections.py)")
    shown = sorted({o for chunk in _key_chunks(text) for o in overrides_of(chunk)})
    return bad + override_problems([ov for ov in shown if ov.split("=")[0] not in FOREIGN_KEYS])


def override_problems(overrides: list[str]) -> list[str]:
    """The overrides the loader refuses: loaded in batches that set each key once (a load costs ~0.1 s), a
    refused batch one by one."""
    batches: list[dict[str, str]] = []
    for ov in overrides:
        key = ov.split("=")[0]
        key = CONFIG_ALIASES.get(key, key)
        free = [b for b in batches if key not in b]
        if not free:
            batches.append({})
            free = batches[-1:]
        free[0][key] = ov
    bad = []
    for batch in batches:
        if _loads(list(batch.values())) is None:
            continue
        for ov in batch.values():
            problem = _loads([ov])
            if problem:
                bad.append(f"{ov}: refused by the loader: {problem}")
    return bad


def _loads(overrides: list[str]):
    try:
        load_config(None, overrides)
    except Exception as e:  # noqa: BLE001 -- the loader's message is the finding
        return str(e)
    return None


def _get_default(key: str):
    obj = Config()
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def _key_chunks(text: str) -> list[str]:
    return backtick_spans(text) + command_lines(text)


class _Parsed(Exception):
    def __init__(self, parser: argparse.ArgumentParser, argv):
        self.parser, self.argv = parser, list(argv if argv is not None else sys.argv[1:])


def script_parser(path: str) -> tuple[argparse.ArgumentParser, list[str]]:
    """The parser ``python path`` builds, and the argv it hands it: the script runs as ``__main__`` until its
    first ``parse_args`` / ``parse_known_args``, which is stopped there (nothing after it runs)."""

    def caught(self, args=None, namespace=None):
        raise _Parsed(self, args)

    full = os.path.join(ROOT, path)
    parser_class = argparse.ArgumentParser
    saved = sys.argv, list(sys.path), parser_class.parse_args, parser_class.parse_known_args
    sys.argv, parser_class.parse_args, parser_class.parse_known_args = [full], caught, caught
    sys.path.insert(0, os.path.dirname(full))
    try:
        runpy.run_path(full, run_name="__main__")
    except _Parsed as p:
        return p.parser, p.argv
    finally:
        sys.argv, sys.path[:], parser_class.parse_args, parser_class.parse_known_args = saved
    raise AssertionError(f"{path} never parsed its arguments")


def _descend(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[argparse.ArgumentParser, list[str]]:
    """The sub-parser ``argv`` selects (``convert megatron-to-hf``), and the rest of argv."""
    while argv:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs or argv[0] not in subs[0].choices:
            break
        parser, argv = subs[0].choices[argv[0]], argv[1:]
    return parser, argv


def _variants(tokens: list[str]) -> list[list[str]]:
    """``a|b|c`` alternatives of a command line, each combination (a ``key=a|b`` override is one token: the
    loader check covers its values)."""
    alts = [[t] if "=" in t or "|" not in t else t.split("|") for t in tokens]
    return [list(c) for c in itertools.islice(itertools.product(*alts), 64)]


def parse_command(line: str) -> list[str]:
    """Problems of one command line: the parser of the command it runs refuses it."""
    tokens = [t for t in _tokens(line) if t != "\\"]
    elided = "..." in tokens  # `megadare convert hf-to-megatron ...`: only the options shown are checked
    tokens = [t for t in tokens if t != "..."]
    while tokens and re.match(r"^[A-Z_]+=", tokens[0]):  # MODEL=... sbatch ...
        tokens = tokens[1:]
    if not tokens:
        return []
    bad = []
    for argv in _variants(tokens):
        problem = _refusal(argv, elided)
        if problem:
            bad.append(f"{line!r}: {problem}")
    return bad


def _refusal(argv: list[str], elided: bool = False):
    """Why the command ``argv`` runs is refused by its parser (None: accepted, or not ours: sbatch, pip)."""
    if argv[0] == "torchrun":
        from torch.distributed.run import get_args_parser

        i = argv.index("-m")
        problem = _try_parse(get_args_parser(), argv[1:i] + ["x.py"], "torchrun")
        return problem or _refusal(argv[i + 1 :], elided)
    if argv[0] == "python" and argv[1:2] != ["-m"] and not os.path.exists(os.path.join(ROOT, argv[1])):
        return f"{argv[1]} does not exist"
    found = parser_of(argv)
    if found is None:
        return None
    parser, rest = found
    if parser.prog == "megadare":
        return f"megadare has no subcommand {argv[1:2]}"
    return _try_parse(parser, rest, parser.prog, elided)


def parser_of(argv: list[str]):
    """(the parser of the command ``argv`` runs, the arguments it gets), or None for a command not ours."""
    if argv[:2] == ["python", "-m"]:
        argv = argv[2:]
    if argv[0] == "python":
        parser, prefix = script_parser(argv[1])
        parser, rest = _descend(parser, prefix)
        parser.prog = argv[1]
        return parser, rest + argv[2:]
    if argv[0] == "megadare" and argv[1:2] == ["demo"]:
        return demo.parser(), argv[2:]
    if argv[0] == "megadare":
        return _descend(cli._parser(), argv[1:])
    return None


def flag_problems(text: str) -> list[str]:
    """A bare option in backticks (`--calib-prompts FILE`, `--tp/--pp/--ep`) is an option of a command the text
    runs (torchrun's included: its spellings are shown as refused by megadare)."""
    options = _options(command_lines(text))
    bad = []
    for span in backtick_spans(text):
        if span.startswith("--"):
            flag = re.split(r"[\s=]", span)[0]
            bad += [
                f"`{span}`: {f} is an option of no command the README runs" for f in flag.split("/") if f not in options
            ]
    return bad


def _options(lines: list[str]) -> set[str]:
    out: set[str] = set()
    for line in lines:
        for argv in _variants([t for t in _tokens(line) if t not in ("...", "\\")]):
            if argv[0] == "torchrun":
                from torch.distributed.run import get_args_parser

                out |= set(get_args_parser()._option_string_actions)
                argv = argv[argv.index("-m") + 1 :]
            found = parser_of(argv) if argv[0] != "python" or os.path.exists(os.path.join(ROOT, argv[1])) else None
            if found:
                out |= set(found[0]._option_string_actions)
    return out


def _try_parse(parser: argparse.ArgumentParser, argv: list[str], name: str, elided: bool = False):
    """Why ``parser`` refuses ``argv`` (None: it accepts it); ``elided``: arguments were left out (``...``), so only
    the options shown are checked."""
    if elided:
        unknown = [t for t in argv if t.startswith("--") and t.split("=")[0] not in parser._option_string_actions]
        return f"{name} has no option {unknown[0]}" if unknown else None

    def refuse(message):
        raise _Refused(message)

    parser.error = refuse  # one parser per call: nothing to restore
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                sub.error = refuse
    try:
        parser.parse_args(argv)
    except _Refused as e:
        return f"{name} refuses {argv}: {e}"
    except SystemExit as e:
        return f"{name} exited {e.code} on {argv}"
    return None


class _Refused(Exception):
    pass


def command_problems(text: str) -> list[str]:
    return [p for line in command_lines(text) for p in parse_command(line)]


def subcommand_list_problems(text: str) -> list[str]:
    """ "Where things are" lists the commands as ``megadare {convert,demo,...,data inspect|tokenizer}``: the same
    set as ``megadare --help``; a command listed with sub-commands lists all of them."""
    bad = []
    commands = _subparsers(cli._parser())
    for listed in re.findall(r"megadare \{([^{}]*)\}", text):
        shown = [w for n in listed.split(",") for w in _expand_alternatives(" ".join(n.split()))]
        tops = {n.split()[0] for n in shown}
        bad += [
            f"megadare {{{listed}}}: lists {n!r}, megadare has no such command" for n in sorted(tops - set(commands))
        ]
        bad += [f"megadare {{{listed}}}: leaves out {n!r}" for n in sorted(set(commands) - tops)]
        for top in tops & set(commands):
            subs = {n.split()[1] for n in shown if n.startswith(top + " ")}
            real = set(_subparsers(commands[top])) if subs else set()
            bad += [f"megadare {{{listed}}}: {top} has no sub-command {n!r}" for n in sorted(subs - real)]
            bad += [f"megadare {{{listed}}}: leaves out {top} {n}" for n in sorted(real - subs)]
    return bad


def _expand_alternatives(name: str) -> list[str]:
    head, _, alts = name.rpartition(" ")
    return [f"{head} {a}".strip() for a in alts.split("|")]


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(subs[0].choices) if subs else {}


def foreign_pair_problems(text: str) -> list[str]:
    """The README's "`another project's key or option` -> `megadare's`" pairs (the paragraph that names
    config/foreign.py): megadare's one-line refusal of the first names the second."""
    bad = []
    options = sorted(_subparsers(cli._parser())["sft"]._option_string_actions)
    for para in re.split(r"\n\s*\n", text):
        if "config/foreign.py" not in para:
            continue
        for theirs, ours in re.findall(r"`([^`]+)` ->\s+`([^`]+)`", " ".join(para.split())):
            if theirs.startswith("-"):
                name, _, value = theirs.partition(" ")
                line = cli._unknown_option(theirs, name, value or None, options)
            else:
                key, _, value = theirs.partition("=")
                line = suggestion(key, value or None)
            if ours not in line:
                bad.append(f"`{theirs}` -> `{ours}`: megadare says {line!r}")
    return bad


def help_texts() -> dict[str, str]:
    """``megadare <sub> --help`` of every subcommand (and sub-subcommand), unwrapped."""
    columns = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "1000"  # argparse wraps to the terminal's width
    try:
        out = {"megadare demo": demo.parser().format_help()}
        stack = [cli._parser()]
        while stack:
            p = stack.pop()
            out[p.prog] = p.format_help()
            for a in p._actions:
                if isinstance(a, argparse._SubParsersAction):
                    stack.extend(a.choices.values())
    finally:
        os.environ.pop("COLUMNS") if columns is None else os.environ.update(COLUMNS=columns)
    return out


def help_problems(helps: dict[str, str]) -> list[str]:
    """The keys, ``key=value`` examples and ``megadare ...`` commands each --help text shows."""
    bad = []
    for prog, text in helps.items():
        commands = re.findall(r"megadare [a-z]+(?: (?:--[\w-]+|[A-Z]+))+", text)
        as_text = "\n".join(f"`{c}`" for c in commands) + "\n" + "\n".join(f"`{w}`" for w in text.split())
        bad += [f"{prog} --help: {p}" for p in config_key_problems(as_text) + command_problems(as_text)]
    return bad


def example_config_problems(text: str, configs: str = os.path.join(ROOT, "examples", "configs")) -> list[str]:
    """Each examples/configs/*.yaml (read from ``configs``) under ``--dry-run --config-only`` of each command that
    runs it (its header's or the README's)."""
    bad = []
    for name in sorted(os.listdir(configs)):
        if not name.endswith(".yaml"):
            continue
        rel, path = f"examples/configs/{name}", os.path.join(configs, name)
        header = open(path, encoding="utf-8").read()
        jobs = set(re.findall(r"megadare (\w+) --config %s" % re.escape(rel), header + "\n" + " ".join(text.split())))
        if not jobs:
            bad.append(f"{rel}: neither its header nor the README runs it (`megadare <cmd> --config {rel}`)")
        for job in sorted(jobs):
            try:
                cfg = load_config(path)
                spec = resolve(cfg, job=job)
                if job in ("sft", "dpo", "rl") and spec.arch is not None:
                    preflight(spec, config_only=True)
                if job == "plan":  # `megadare plan` exits 1 when the plan does not fit its cluster
                    check_plan_fits(cfg, spec.arch)
            except Exception as e:  # noqa: BLE001 -- the one-line error is the finding
                bad.append(f"megadare {job} --config {rel} --dry-run --config-only: {type(e).__name__}: {e}")
    return bad


def config_command_problems(text: str) -> list[str]:
    """``megadare sft|dpo|rl|plan --config <a repository file> key=value ...`` as a whole: the file with the
    overrides loads and passes the config-only pre-flight on ``--nproc`` processes (the layout against the model,
    the memory plan); a command on a model path of a cluster (``model.hf_path=/ckpt/...``) is left out."""
    bad = []
    for line in command_lines(text):
        for argv in _variants([t for t in _tokens(line) if t != "\\"]):
            if argv[0] != "megadare" or argv[1:2] not in (["sft"], ["dpo"], ["rl"], ["plan"]) or "..." in argv:
                continue
            args = cli._parser().parse_args(argv[1:])
            if not args.config or not os.path.exists(os.path.join(ROOT, args.config)):
                continue
            if any(o.startswith("model.hf_path=") for o in args.overrides):
                continue
            try:
                spec = resolve(load_config(os.path.join(ROOT, args.config), args.overrides), job=args.command)
                if args.command != "plan":
                    preflight(spec, config_only=True, world=args.nproc if args.nproc > 1 else None)
            except Exception as e:  # noqa: BLE001 -- the one-line error is the finding
                bad.append(f"{' '.join(argv)}: {type(e).__name__}: {e}")
    return bad


def plan_output_problems(text: str) -> list[str]:
    """Each ``$ megadare plan ...`` block's lines are (the starts of) lines the command prints today."""
    bad = []
    for command, shown in prompted_blocks(text):
        if not command.startswith("megadare plan "):
            continue
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            cli.main(_tokens(command)[1:])
        lines = [" ".join(ln.split()) for ln in printed.getvalue().splitlines()]
        bad += [f"{command}: prints no line starting {s!r}" for s in shown if not any(ln.startswith(s) for ln in lines)]
    return bad


def unresolved_python_names(text: str) -> list[str]:
    """The Python names of the text that do not import: the longest importable module, then attributes."""
    bad = []
    for name in python_names(text):
        parts = name.split(".")
        i = len(parts)
        while i > 1:
            try:
                obj = importlib.import_module(".".join(parts[:i]))
                break
            except ImportError:
                i -= 1
        else:
            obj = importlib.import_module(parts[0])
        for j in range(i, len(parts)):
            if not hasattr(obj, parts[j]):
                bad.append(f"{name}: {'.'.join(parts[:j])} has no {parts[j]!r}")
                break
            obj = getattr(obj, parts[j])
    return bad


# ---------------------------------------------------------------------------------------------------------------
# The tests


def test_readme_paths_exist():
    assert missing_paths(README) == []


def test_readme_python_names_resolve():
    assert len(python_names(README)) >= 3
    assert unresolved_python_names(README) == []


def test_readme_config_keys_exist_and_load():
    assert config_key_problems(README) == []


def test_readme_commands_parse():
    assert command_problems(README) == []


def test_readme_config_commands_pass_the_config_only_dry_run(monkeypatch):
    monkeypatch.chdir(ROOT)
    assert config_command_problems(README) == []


def test_readme_lists_every_subcommand():
    assert re.search(r"megadare \{[^{}]*\}", README)
    assert subcommand_list_problems(README) == []


def test_readme_foreign_keys_are_refused_with_the_key_it_names():
    assert len(re.findall(r"` ->\s+`", README)) >= 5
    assert foreign_pair_problems(README) == []


def test_readme_bare_options_belong_to_a_command():
    assert flag_problems(README) == []


def test_help_texts_hold_the_same_rules():
    assert help_problems(help_texts()) == []


def test_readme_plan_output_is_what_plan_prints():
    assert len([c for c, _ in prompted_blocks(README) if c.startswith("megadare plan")]) >= 2
    assert plan_output_problems(README) == []


def test_example_configs_pass_the_config_only_dry_run(monkeypatch):
    monkeypatch.chdir(ROOT)
    assert example_config_problems(README) == []


PLAN = "    $ megadare plan --config examples/configs/plan_sdar30b.yaml\n"


@pytest.mark.parametrize(
    "good, broken, check",
    [
        ("`megadare/rollout/manager.py`", "`megadare/rollout/managers.py`", missing_paths),
        ("tests/test_scored_head.py", "tests/test_scored_heads.py", missing_paths),
        ("`models/head.py`", "`models/heads.py`", missing_paths),
        ("`.ci/run` does", "`.ci/runs` does", missing_paths),
        ("`megadare.algos.REGISTRY`", "`megadare.algos.REGISTRIES`", unresolved_python_names),
        (
            "`megadare.convert.fp8. fp8_rollout_weights`",
            "`megadare.convert.fp9. fp8_rollout_weights`",
            unresolved_python_names,
        ),
        ("`train.logits=scored`", "`train.logit=scored`", config_key_problems),
        ("`train.logits=scored`", "`train.logits=everywhere`", config_key_problems),
        ("`rl.rollout_is*`", "`rl.rollouts_is*`", config_key_problems),
        ("`megadare demo --algo coupled_grpo`", "`megadare demo --algorithm coupled_grpo`", command_problems),
        (
            "`megadare data inspect a.jsonl --model /tmp/t`",
            "`megadare data inspect a.jsonl --tok /t`",
            command_problems,
        ),
        ("    python benchmarks/demo_sweep.py\n", "    python benchmarks/demo_sweep.py --fast\n", command_problems),
        ("    python benchmarks/demo_sweep.py\n", "    python benchmarks/demo_sweeps.py\n", command_problems),
        (
            "    megadare sft --config examples/configs/sft_sdar_tiny.yaml --nproc 2\n",
            "    megadare sft --config examples/configs/sft_sdar_tiny.yaml --nprocs 2\n",
            command_problems,
        ),
        (
            "`python benchmarks/train_throughput.py` (`--variants a`)",
            "`python benchmarks/train_throughput.py` (`--variant a`)",
            flag_problems,
        ),
        (
            "    megadare sft --config examples/configs/sft_sdar_tiny.yaml --nproc 2 parallel.tp=2\n",
            "    megadare sft --config examples/configs/sft_sdar_tiny.yaml --nproc 2 parallel.tp=3\n",
            config_command_problems,
        ),
        (
            "megadare {convert,demo,plan,sft,dpo,rl,eval,data inspect|tokenizer}",
            "megadare {convert,demo,plan,sft,rl,eval,data inspect|tokenise}",
            subcommand_list_problems,
        ),
        (
            "megadare/config/foreign.py: `--tp 4` -> `parallel.tp=4`",
            "megadare/config/foreign.py: `--tp 4` -> `parallel.tensor_parallel=4`",
            foreign_pair_problems,
        ),
        ("`megadare plan --config FILE --dry-run`", "`megadare plan --config FILE --dryrun`", command_problems),
        ("e.g. parallel.tp=2 rl.n_samples=8", "e.g. parallel.tp=2 rl.n_sample=8", lambda t: help_problems({"h": t})),
        ("(= eval.tasks)", "(= eval.task)", lambda t: help_problems({"h": t})),
        (
            "run megadare sft --config FILE --dry-run",
            "run megadare sft --config FILE --dry-runs",
            lambda t: help_problems({"h": t}),
        ),
        (PLAN + "      trainer total 56.64\n", PLAN + "      trainer total 56.74\n", plan_output_problems),
    ],
)
def test_a_broken_readme_fails_every_check(good, broken, check):
    """Each check passes the good snippet and names what is wrong in the broken one."""
    assert check(good) == []
    problems = check(broken)
    assert problems and any(w in " ".join(problems) for w in _names(broken)), problems


def _names(snippet: str) -> list[str]:
    return [w.strip("`()") for w in snippet.split()]


def test_an_unrun_or_broken_example_config_is_named(tmp_path, monkeypatch):
    """An example config no command runs, or one its command refuses, is named."""
    monkeypatch.chdir(ROOT)  # the full-size configs name examples/configs/hf/... from the repository root
    configs = tmp_path / "configs"
    configs.mkdir()
    for name in ("sdar_tiny.yaml", "sft_sdar_tiny.yaml"):
        shutil.copy(os.path.join(ROOT, "examples", "configs", name), configs / name)
    unrun = README.replace("--config examples/configs/sdar_tiny.yaml", "--config CONFIG")
    assert any("examples/configs/sdar_tiny.yaml: neither" in p for p in example_config_problems(unrun, str(configs)))
    with open(configs / "sft_sdar_tiny.yaml", "a") as f:
        f.write("parallel: {tp: 3}\n")  # the tiny SDAR's 4 heads do not split 3 ways
    problems = example_config_problems(README, str(configs))
    assert [p for p in problems if p.startswith("megadare sft --config examples/configs/sft_sdar_tiny.yaml")], problems


def test_readme_names_every_decoder_choice():
    """The README's decoder paragraph lists ``rollout.confidence`` and ``rollout.schedule`` value by value; one
    added to the config (``linspace_remaining``, DARE's MDPO for Dream) was missing from it."""
    spans = set(backtick_spans(README))
    missing = [v for v in (*CONFIDENCES, *SCHEDULES) if v not in spans]
    assert not missing, f"README names no `{missing}` among rollout.confidence / rollout.schedule's values"
