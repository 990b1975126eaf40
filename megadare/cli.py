"""The ``megadare`` command: convert, demo, plan, sft, dpo, rl, eval, data inspect, data tokenizer."""

from __future__ import annotations

import argparse
import difflib
import importlib
import os
import re
import sys
from contextlib import nullcontext
from types import ModuleType
from typing import Optional

from megadare import demo_setup, stopping
from megadare.config import check_data_files, check_model_path, check_rules, load_config, to_yaml
from megadare.config.loading import suggestion
from megadare.console import end_open_line
from megadare.data.files import DataError
from megadare.files import inode_of
from megadare.errors import (
    CheckpointError,
    ConfigError,
    MegatronCheckpointError,
    ModelConfigError,
    OutputError,
    PeerError,
    RunStateError,
    StoppedBeforeTheLoop,
)
from megadare.options import positive_int, positive_number
from megadare.rewards import RewardError, RewardSpecError

# megadare's own errors: each is one line naming the file, key or value and the fix (no traceback)
_ONE_LINE_ERRORS = (
    ConfigError,
    ModelConfigError,
    CheckpointError,
    MegatronCheckpointError,
    DataError,
    RewardError,
    RewardSpecError,
    OutputError,
    RunStateError,
    PeerError,
)

# What each command runs, by module name, imported (``_module``) only once its arguments and config are checked:
# these modules pull torch / megatron / ray, seconds of CPU that `megadare --help` and a refused config must not
# wait for. Everything else cli.py needs (the config layer, the error types: torch-free) is imported above; this
# table is the dispatcher's one deferral. cli.py is the top import layer, so lint-imports loses no rule by it.
_MODULES = {
    "spec": "megadare.trainer.spec",  # resolve: the config against the model, the algorithm and the world
    "preflight": "megadare.preflight",  # --dry-run
    "launch": "megadare.parallel.launch",  # one process or --nproc local ones
    "layout": "megadare.parallel.layout",
    "sft": "megadare.trainer.sft_loop",
    "dpo": "megadare.trainer.dpo_loop",
    "rl": "megadare.trainer.rl",
    "eval": "megadare.eval",
    "plan": "megadare.plan",
    "convert": "megadare.convert.hf_megatron",
    "data inspect": "megadare.eval.data_inspect",
    "data tokenizer": "megadare.data.qwen_tokenizer",
    "demo": "megadare.demo",
    "torch": "torch",  # convert --dtype
}


def _module(name: str) -> ModuleType:
    """The module behind ``name`` in ``_MODULES``, imported now."""
    return importlib.import_module(_MODULES[name])


class _Parser(argparse.ArgumentParser):
    """argparse's errors in one line (no usage block), with where to look."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


CONFIG_COMMANDS = ("sft", "dpo", "rl", "eval", "plan")
_EPILOG = (
    "Config keys are set after the options as key=value (parallel.tp=4 optim.lr=1e-6, not --tp 4); a key of "
    "verl / DARE / dLLM-RL is refused with the megadare key it means. Every key and its value: "
    "megadare %(prog)s --config FILE --dry-run --config-only."
)


def _add_convert(sub) -> None:
    """``megadare convert hf-to-megatron | megatron-to-hf`` and their options."""
    conv = sub.add_parser("convert", help="HF <-> Megatron checkpoint conversion")
    csub = conv.add_subparsers(dest="direction", required=True)
    h2m = csub.add_parser("hf-to-megatron", help="HF safetensors -> Megatron distributed checkpoint")
    h2m.add_argument("--hf", required=True, help="HF checkpoint directory (config.json + *.safetensors)")
    h2m.add_argument("--out", required=True, help="output checkpoint directory")
    for k in ("tp", "pp", "ep"):
        h2m.add_argument(
            f"--{k}",
            type=positive_int,
            default=1,
            help=f"target {k.upper()} size (validated; the checkpoint itself loads under any layout)",
        )
    h2m.add_argument(
        "--vpp", type=positive_int, default=None, help="target virtual pipeline stages per PP rank (validated)"
    )
    h2m.add_argument("--etp", type=positive_int, default=None, help="expert TP size (default: --tp)")
    h2m.add_argument(
        "--dtype",
        choices=("keep", "fp32", "bf16", "fp16"),
        default="keep",
        help="tensor dtype written (keep: the source's)",
    )
    m2h = csub.add_parser("megatron-to-hf", help="Megatron distributed checkpoint -> HF safetensors")
    m2h.add_argument("--ckpt", required=True, help="checkpoint dir (or a run's checkpoint root)")
    m2h.add_argument("--out", required=True, help="output HF directory (new, empty or a previous HF export)")
    m2h.add_argument(
        "--dtype",
        choices=("keep", "fp32", "bf16", "fp16"),
        default="keep",
        help="tensor dtype written (keep: the source's)",
    )
    m2h.add_argument("--max-shard-gb", type=positive_number, default=2.0, help="largest safetensors file written")


def _parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="megadare", description="Megatron-core post-training for diffusion LLMs")
    sub = ap.add_subparsers(dest="command", required=True)

    _add_convert(sub)

    data = sub.add_parser("data", help="data files")
    dsub = data.add_subparsers(dest="action", required=True)
    ins = dsub.add_parser(
        "inspect", help="schema, fields, lengths, a rendered prompt and the reward of the gold answers of data files"
    )
    ins.add_argument("files", nargs="+", help=".jsonl / .json / .parquet files")
    ins.add_argument("--reward", default="auto", help="reward that scores the gold answers (default: auto, per row)")
    ins.add_argument(
        "--model",
        help="a checkpoint or tokenizer directory whose tokenizer counts the lengths (default: UTF-8 bytes)",
    )
    ins.add_argument("--limit", type=positive_int, default=100, help="records per file whose gold answer is scored")
    tkn = dsub.add_parser(
        "tokenizer",
        help="write the Qwen tokenizer files of SDAR / TraDo or Dream, built offline "
        "from the dashscope wheel's Qwen ranks (no model hub)",
    )
    tkn.add_argument("out", help="a new directory for the tokenizer files")
    tkn.add_argument("--family", choices=("sdar", "dream"), default="sdar", help="whose specials / chat template")

    demo = sub.add_parser("demo", help="the end-to-end demo on CPU")
    demo.add_argument("rest", nargs=argparse.REMAINDER)

    for name, text in (
        ("sft", "supervised fine-tuning"),
        ("dpo", "offline preference optimisation (VRPO)"),
        ("rl", "reinforcement learning"),
        ("eval", "benchmark evaluation"),
        ("plan", "memory / layout planner"),
    ):
        p = sub.add_parser(name, help=text, epilog=_EPILOG.replace("%(prog)s", name))
        p.add_argument("--config", help="YAML config file")
        p.add_argument(
            "--dry-run",
            action="store_true",
            help="check everything that can be checked before any "
            "process starts (config, memory plan, model, data, reward, engine, run directory), print the "
            "resolved config, exit",
        )
        p.add_argument(
            "--config-only",
            action="store_true",
            help="with --dry-run: check the config and the memory plan only (the files it names need not exist here)",
        )
        p.add_argument(
            "--nproc",
            type=positive_int,
            default=1,
            help="local processes to launch (under torchrun / Slurm leave at 1: WORLD_SIZE is used)",
        )
        p.add_argument("overrides", nargs="*", help="key=value config overrides, e.g. parallel.tp=2 rl.n_samples=8")
        if name == "eval":
            p.add_argument("--model", help="HF checkpoint directory to evaluate (= model.hf_path)")
            p.add_argument("--tasks", help="comma-separated tasks (= eval.tasks), e.g. gsm8k,math500")
    return ap


def _dtype(name: str):
    torch = _module("torch")
    return {"keep": None, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


def _launch(worker, run, cfg, nproc: int) -> dict:
    """``run(cfg)`` in this process (torchrun / Slurm set WORLD_SIZE), or ``worker`` on ``nproc`` local processes."""
    if nproc > 1 and "WORLD_SIZE" not in os.environ:
        _say_if_oversubscribed(nproc)
        out = _module("launch").spawn(worker, nproc, cfg, timeout_s=7 * 24 * 3600)[0]
    else:
        out = _module("launch").run_here(run, cfg)
    stopping.loop_ended()  # the run returned: a SIGTERM from here on lets the summary be printed
    return out


def _summary(line: str) -> None:
    """The run's last line, saying so when a SIGTERM came after its loop (its checkpoints written)."""
    if stopping.sigterm_after_the_loop():
        line += "; SIGTERM received after the last checkpoint was written: nothing lost"
    print(line, flush=True)


def _say_if_oversubscribed(nproc: int) -> None:
    """More local ranks than CPU cores on a machine without a GPU (``--nproc 16`` on a laptop) run, each on a share
    of a core and with its own copy of torch and megatron in memory: one line says so before they start."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if nproc > cores and not _module("torch").cuda.is_available():
        print(
            f"megadare: --nproc {nproc} starts {nproc} trainer processes on {cores} CPU cores and no GPU: each runs "
            f"on a share of a core, with its own torch and megatron in memory; --nproc {cores} or fewer runs faster",
            file=sys.stderr,
            flush=True,
        )


def _run_sft(cfg, nproc: int) -> int:
    sft = _module("sft")
    out = _launch(sft.sft_worker, sft.run_sft, cfg, nproc)
    if not out["history"]:
        return _nothing_done("sft", out)
    last = out["history"][-1]
    how = "stopped by signal" if out["stopped_by_signal"] else "done"
    _summary(f"sft {how} at step {out['step']}: loss {last['loss']:.4f}; checkpoints in {out['checkpoint_root']}")
    return 0


def _nothing_done(command: str, out: dict) -> int:
    """The summary of a run that trained no step (resumed at its last step, or stopped before its first)."""
    if out.get("already_finished"):
        key = "rl.steps" if command == "rl" else "train.steps"
        _summary(
            f"{command}: nothing to train: this run already finished at step {out['step']} (checkpoints in "
            f"{out['checkpoint_root']}); raise {key} above {out['step']} to continue it, or set a new "
            "logging.run_dir"
        )
    else:
        _summary(f"{command}: stopped before its first step; checkpoints in {out['checkpoint_root']}")
    return 0


def _run_dpo(cfg, nproc: int) -> int:
    dpo = _module("dpo")
    out = _launch(dpo.dpo_worker, dpo.run_dpo, cfg, nproc)
    h = out["history"]
    if not h:
        return _nothing_done("dpo", out)
    how = "stopped by signal" if out["stopped_by_signal"] else "done"
    shown = (
        f": loss {h[-1]['loss']:.4f}, margin {h[0]['margin']:.4f} -> {h[-1]['margin']:.4f}, pair accuracy "
        f"{h[-1]['pair_accuracy']:.2f}"
        if h
        else ""
    )
    _summary(f"dpo {how} at step {out['step']}{shown}; checkpoints in {out['checkpoint_root']}")
    return 0


def _run_rl(cfg, nproc: int) -> int:
    rl = _module("rl")
    out = _launch(rl.rl_worker, rl.run_rl, cfg, nproc)
    if out.get("already_finished"):
        return _nothing_done("rl", out)
    evals = out["evals"]
    steps = sorted(evals)[:1] + sorted(evals)[1:][-1:]  # the first and last evaluated steps (one when they agree)
    acc = "; held-out accuracy " + " -> ".join(f"{evals[s]['accuracy']:.3f} at step {s}" for s in steps)
    acc = acc if evals else ""
    how = "stopped by signal" if out["stopped_by_signal"] else "done"
    _summary(f"rl {how} at step {out['step']}{acc}; checkpoints in {out['checkpoint_root']}")
    return 0


def _run_convert(args) -> int:
    convert = _module("convert")
    before = inode_of(args.out)
    try:
        if args.direction == "hf-to-megatron":
            out = _hf_to_megatron(convert, args)
        else:
            out = convert.megatron_to_hf(
                args.ckpt, args.out, dtype=_dtype(args.dtype), max_shard_bytes=int(args.max_shard_gb * 2**30)
            )
    except OSError as e:  # a full disk, a read-only directory: the export was written aside and removed
        where = f" ({e.filename})" if e.filename else ""
        raise OutputError(
            f"writing --out {args.out} failed: {e.strerror or e}{where}; nothing of this export was "
            f"kept and {args.out} is as it was"
        ) from None
    except StoppedBeforeTheLoop as stop:  # the export's staging directory was removed on its way out
        if isinstance(stop.__context__, _ONE_LINE_ERRORS):  # one of ours was on its way out: it ends the command
            raise
        if inode_of(args.out) in (None, before):
            print(
                f"convert stopped by SIGTERM: nothing of this export was kept and {args.out} is as it was; run the "
                "same command again",
                flush=True,
            )
            return 0
        print(f"wrote {args.out}; SIGTERM received after the export was in place: nothing lost", flush=True)
        return 0
    print(f"wrote {out}")
    return 0


_LAYOUT_KEYS = re.compile(r"\bparallel\.(tp|pp|ep|vpp|etp)\b")  # the layout's messages name its config keys


def _hf_to_megatron(convert: ModuleType, args) -> str:
    """``convert hf-to-megatron``: the layout's errors (``parallel.tp=3: MLP width ...``) name the options the
    user typed (``--tp=3``), not the config keys of a training run's layout."""
    try:
        layout = _module("layout").Layout(tp=args.tp, pp=args.pp, ep=args.ep, vpp=args.vpp, etp=args.etp)
        return convert.hf_to_megatron(args.hf, args.out, layout, dtype=_dtype(args.dtype))
    except ConfigError as e:
        raise ConfigError(_LAYOUT_KEYS.sub(r"--\1", str(e))) from None


RUN_COMMANDS = ("sft", "dpo", "rl")
WATCHED_COMMANDS = (*RUN_COMMANDS, "eval", "convert", "plan", "demo")  # a SIGTERM stops them in one line, exit 0


def main(argv: Optional[list[str]] = None) -> int:
    """The command. A run's SIGTERM handling (megadare/stopping.py) starts first: before its config is read and
    torch, megatron, ray load (seconds), a SIGTERM ended it by the default handler (exit 143, not a word)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        with stopping.watching() if argv[:1] in [[c] for c in WATCHED_COMMANDS] else nullcontext():
            return _command(argv)
    except StoppedBeforeTheLoop as e:  # a second chance: it came as the command's own handling of one ended
        return _stopped_before_the_loop(argv, e)


def _command(argv: list[str]) -> int:
    try:
        if argv[:1] == ["demo"]:
            return _run_demo(argv[1:])
        parser = _parser()
        if argv[:1] in [[c] for c in CONFIG_COMMANDS]:
            _check_options(_subcommand(parser, argv[0])._option_string_actions, argv[1:])
        return _dispatch(_parse(parser, argv))
    except _ONE_LINE_ERRORS as e:
        stopping.loop_ended()  # a SIGTERM now lets the line be printed: the run ends by its error, not a stop
        report_error(e)
        return 2
    except StoppedBeforeTheLoop as e:  # a run's SIGTERM while it set up: it ended as a run stopped in its loop does
        return _stopped_before_the_loop(argv, e)
    except KeyboardInterrupt:  # Ctrl-C outside a training step (a step's signal handler checkpoints instead)
        print(
            "\nmegadare: interrupted (Ctrl-C); run the same command again to resume from its newest checkpoint, if any",
            file=sys.stderr,
        )
        return 130


def _run_demo(argv: list[str]) -> int:
    """``megadare demo``: it parses its own options; its work directory is checked before torch. A SIGTERM outside
    its stages' loops (its set-up, between SFT and RL) stops it as one in a stage does: one line naming what its
    stages saved (``demo_setup.stopped_line``), exit 0."""
    demo_parser = demo_setup.parser(_Parser)
    if "--foundation" in argv:
        return _module("demo").main(argv, demo_parser)
    _check_options(demo_parser._option_string_actions, argv)
    demo = demo_setup.demo_run(demo_parser.parse_args(argv))
    try:
        demo_setup.check_workdir(demo)
        return _module("demo").main(argv, demo_parser)
    except StoppedBeforeTheLoop as stop:
        if isinstance(stop.__context__, _ONE_LINE_ERRORS):  # the error ended the demo (``_stopped_before_the_loop``)
            raise
        print(demo_setup.stopped_line(demo), flush=True)
        return 0


def _stopped_before_the_loop(argv: list[str], stop: StoppedBeforeTheLoop) -> int:
    """The stop's line, exit 0; unless the SIGTERM came while one of our errors was on its way out (the stop's
    context; only ours: an ImportError a library's import caught and handled is a context too): the error ended
    the run, so it is reported as without the SIGTERM, exit 2."""
    if isinstance(stop.__context__, _ONE_LINE_ERRORS):
        report_error(stop.__context__)
        return 2
    command = argv[0] if argv else "megadare"
    if command in ("eval", "convert", "plan", "demo"):  # no checkpoint to resume from (the demo's: ``_run_demo``)
        print(f"{command} stopped by SIGTERM before it wrote anything; run the same command again", flush=True)
        return 0
    print(
        f"{command} stopped by SIGTERM before its first step: nothing new to save; run the same command again to "
        "resume from its newest checkpoint, if any",
        flush=True,
    )
    return 0


def report_error(e: BaseException) -> None:
    """Print the run's one-line error as its last words: Ray (joined by this process) is shut down first, so its
    log dumps (a dead raylet's last lines, on stdout from a thread of its own) come before the line, not after it,
    and stdout is flushed (a pipe, a Slurm log: block-buffered, written at exit otherwise)."""
    ray = sys.modules.get("ray")
    if isinstance(e, PeerError) and ray is not None and ray.is_initialized():
        try:
            ray.shutdown()
        except Exception:  # noqa: BLE001 - a Ray that cannot shut down still gets the line printed
            pass
    sys.stdout.flush()
    end_open_line(sys.stderr)  # a progress bar left its line open (a killed rank's): the error starts its own
    print(f"megadare: error: {e}", file=sys.stderr, flush=True)


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """The arguments, a config command's ``key=value`` overrides wherever they stand: argparse takes only the
    first run of them and refuses the rest (``megadare eval --model X parallel.tp=2 --dry-run model.tiny=true``:
    'unrecognized arguments: model.tiny=true')."""
    args, extra = parser.parse_known_args(argv)
    if args.command in CONFIG_COMMANDS:
        overrides = [t for t in extra if "=" in t and not t.startswith("-")]
        args.overrides += overrides  # in the order written: the first run of them comes before any later one
        extra = [t for t in extra if t not in overrides]
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def _check_options(known: dict[str, argparse.Action], tokens: list[str]) -> None:
    """An option a config command (or the demo) does not have, among the ``known`` ones (``--tp 4``, ``--tp=4``,
    torchrun's ``--nproc_per_node 2``) is refused in one line naming it and what to write: the option it misspells,
    else the config key it means. Before argparse, which would take ``4`` for an override and name ``--tp`` alone."""
    i = 0
    while i < len(tokens) and tokens[i] != "--":
        name, eq, value = tokens[i].partition("=")
        if not name.startswith("-") or _is_number(name):
            i += 1
            continue
        matches = [o for o in known if o.startswith(name)]  # argparse takes a prefix of one option (or refuses it)
        if matches:
            i += 1 if eq or known.get(name, known[matches[0]]).nargs == 0 else 2
            continue
        if not eq and i + 1 < len(tokens) and "=" not in tokens[i + 1]:
            value = tokens[i + 1] if not tokens[i + 1].startswith("-") or _is_number(tokens[i + 1]) else ""
        typed = " ".join(tokens[i : i + 1 + (not eq and bool(value))])
        raise ConfigError(_unknown_option(typed, name, value or None, sorted(known)))


def _subcommand(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices[name]


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _unknown_option(typed: str, name: str, value: Optional[str], options: list[str]) -> str:
    """The line for an unknown option ``name`` (``typed``: as written, with its value): the option it misspells,
    else the config key it means."""
    spelled = name.replace("_", "-")
    close = [spelled] if spelled in options else difflib.get_close_matches(name, options, n=1, cutoff=0.8)
    if close:
        return f"unknown option {typed!r}: did you mean {close[0]}?"
    hint = suggestion(name.lstrip("-").replace("-", "_"), value)
    how = "" if "megadare: --" in hint else "config keys are set as key=value; "  # the fix is an option itself
    return f"unknown option {typed!r}: {how}{hint}"


def _dispatch(args) -> int:
    if args.command == "convert":
        return _run_convert(args)
    if args.command == "data" and args.action == "tokenizer":
        print(f"wrote {_module('data tokenizer').write_qwen_tokenizer(args.out, args.family)}")
        return 0
    if args.command == "data":
        return _module("data inspect").inspect_command(args.files, args.reward, args.model, args.limit)
    if args.command == "demo":
        return _module("demo").main(args.rest)
    cfg, spec = _config_and_spec(args)
    arch = spec.arch
    if args.dry_run:
        return _dry_run(args, cfg, spec)
    if args.command in ("sft", "dpo", "rl", "eval") and arch is None:
        how = (
            "--model /path/to/hf_checkpoint (or model.hf_path / model.family)"
            if args.command == "eval"
            else "set model.hf_path (an HF checkpoint) or model.family + model.tiny=true"
        )
        raise ConfigError(f"no model: {how}")
    if args.command in ("sft", "dpo", "rl"):
        return {"sft": _run_sft, "dpo": _run_dpo, "rl": _run_rl}[args.command](cfg, args.nproc)
    if args.command == "eval":
        return _module("eval").run_eval_command(spec, args.nproc)
    return _module("plan").run_plan_command(cfg, arch)


def _config_and_spec(args):
    """The run's config (file + overrides) and its resolved spec (checked; ``spec.arch`` is None when no model is
    named). The config's own checks (keys, types, values, algo.name, model.hf_path, the rules between settings:
    config/rules.py, the data files: config/data_files.py) run before the spec's module (torch) loads."""
    overrides, flags = list(args.overrides), {}
    if args.command == "eval":
        if args.model:
            overrides.append(f"model.hf_path={args.model}")
            flags["model.hf_path"] = "--model"
        if args.tasks is not None:
            tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
            if not tasks:
                raise ConfigError(f"--tasks {args.tasks!r} names no task; e.g. --tasks gsm8k,math500")
            overrides.append(f"eval.tasks=[{','.join(tasks)}]")
            flags["eval.tasks"] = "--tasks"
    cfg = load_config(args.config, overrides, flags)
    check_model_path(cfg)
    check_rules(cfg, args.command)  # the cross-checks that need no model, once: resolve's validate is told they ran
    if not (args.dry_run and args.config_only):  # --config-only: the files it names need not exist here
        check_data_files(cfg, args.command)
    return cfg, _module("spec").resolve(cfg, job=args.command, rules_checked=True)


def _dry_run(args, cfg, spec) -> int:
    """Pre-flight: check what the command would run (megadare/preflight.py), then print the resolved config."""
    world = args.nproc if args.nproc > 1 else int(os.environ.get("WORLD_SIZE", "0")) or None
    _module("preflight").preflight(spec, config_only=args.config_only, world=world)
    print(to_yaml(cfg), end="")
    checked = "the config and the memory plan" if args.config_only else "every check"
    print(f"pre-flight: {checked} passed; nothing started (the resolved config is on stdout)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
