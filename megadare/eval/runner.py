"""``megadare eval``: benchmark prompts -> the Ray-managed rollout engines -> the RL rewards -> metrics and files.

    megadare eval --config examples/configs/sdar_tiny.yaml --model /ckpt/hf --tasks gsm8k,math500 \\
        eval.data_dir=/data/bench eval.n_samples=4 eval.k=[1,4] eval.temperature=1.0

The model source and tokenizer are those of training (:mod:`megadare.trainer.model_setup`); engines start as the
RL loop starts them (``rollout.*`` sets engine kind, count and decoding knobs) and decode with the RL evaluation
sampling parameters, the temperature taken from ``eval.temperature`` when set. Sample j of every problem is decoded
with seed ``seed + j * SEED_STRIDE (+ the engine chunk)``, so the n samples of a problem differ and a rerun
reproduces them. Responses are scored by :func:`megadare.rewards.score_batch` with the task's RL reward.

Outputs in ``eval.output_dir`` (default ``<logging.run_dir>/eval``), each written atomically after its task:
``samples_<task>.jsonl`` (one row per sample: task, index, problem_id, prompt, sample, response, extracted, gold,
correct, reward, reward_error, length, forwards, finish_reason) and ``summary.json`` (settings + per-task metrics,
:mod:`megadare.eval.metrics`); at the end the per-task table is printed and written as ``summary.csv``. A task's
rewards that could not be computed for more than ``rewards.max_error_fraction`` of its samples stop the command
(:func:`megadare.rewards.check_reward_errors`, naming the first failing row's file:row). ``summary.json`` names
the tasks not done yet (``tasks_left``: empty once all are): a run that did not finish says so in its summary.

A SIGTERM (Slurm's time limit, ``scancel``) stops the command at once, exit 0 (megadare/stopping.py: the tasks
are the command's set-up phase, it has no loop): the tasks finished are kept, the one cut leaves nothing of its
own (a task's file is written once it is done), and one line names both and how to run the rest. A rerun does
not skip finished tasks (it redoes them all); before its first task it removes the outputs of these tasks that
an earlier eval left in ``eval.output_dir``, so that no older file passes for one of this run.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import os
import sys
import time
from typing import Any

from megadare.config import Config
from megadare.config.data_files import FILE_TASK_EXTENSIONS
from megadare.console import progress_bar
from megadare.data.fields import is_verl_row
from megadare.data.prompt_data import PromptRules, build_prompts
from megadare import stopping
from megadare.errors import ConfigError, StoppedBeforeTheLoop
from megadare.eval.files import (
    claim_output_dir,
    load_rows,
    task_file,
    write_json_atomic,
    write_jsonl_atomic,
    write_text_atomic,
)
from megadare.eval.metrics import task_metrics
from megadare.eval.tasks import PROMPT_STYLES, TASKS, TaskSpec, task_spec
from megadare.trainer.model_setup import materialise, tokenizer_for
from megadare.trainer.run_lock import run_dir_lock
from megadare.trainer.signals import stopping_before_the_loop
from megadare.trainer.spec import RunSpec
from megadare.rewards import (
    check_isolation,
    check_reward_errors,
    load_reward,
    reward_notes,
    runs_code,
    score_batch,
    set_isolation,
)
from megadare.rollout.setup import start_engines

__all__ = [
    "run_eval_command",
    "check_eval_config",
    "load_task_prompts",
    "generate_samples",
    "score_samples",
    "summary_table",
    "write_summary",
    "SEED_STRIDE",
]

SEED_STRIDE = 1_000_003  # seed distance between sample rounds (more than any task's number of engine chunks)


def check_eval_config(cfg: Config, files_here: bool = True) -> tuple[list[TaskSpec], float]:
    """(tasks, sampling temperature) of the eval section; ConfigErrors name the key to fix. ``files_here`` False
    (``--dry-run --config-only``: the files a config names need not exist here): file tasks are left out of the
    tasks, the benchmarks' names still checked (``--tasks gsm8kk`` passed a config-only dry run)."""
    e = cfg.eval
    names = list(e.tasks)
    if not names:
        raise ConfigError(f"eval.tasks is empty; choose from {', '.join(TASKS)}")
    names = [str(n) for n in dict.fromkeys(names) if files_here or not str(n).lower().endswith(FILE_TASK_EXTENSIONS)]
    specs = [task_spec(n, cfg.as_written("eval.tasks")) for n in names]
    seen = [s.name for s in specs]
    if len(set(seen)) < len(seen):
        twice = sorted({n for n in seen if seen.count(n) > 1})
        raise ConfigError(
            f"eval.tasks: two tasks are named {', '.join(twice)} (file tasks are named after their file); "
            "rename or copy one of the files"
        )
    for key in e.paths:
        if key not in TASKS:
            raise ConfigError(f"eval.paths.{key}: unknown task {key!r} (known: {', '.join(TASKS)})")
    if e.prompt_style not in PROMPT_STYLES:
        raise ConfigError(f"eval.prompt_style={e.prompt_style!r} is not one of {', '.join(PROMPT_STYLES)}")
    if not e.k:
        raise ConfigError("eval.k is empty; give the pass@k / maj@k values, e.g. eval.k=[1]")
    for k in e.k:
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ConfigError(f"eval.k={list(e.k)}: every k must be a positive integer")
        if k > e.n_samples:
            raise ConfigError(
                f"eval.k={list(e.k)}: k={k} > eval.n_samples={e.n_samples}; pass@k and maj@k need at "
                f"least k samples per problem (raise eval.n_samples or drop k={k})"
            )
    temperature = cfg.rollout.eval_temperature if e.temperature is None else float(e.temperature)
    key = "rollout.eval_temperature" if e.temperature is None else "eval.temperature"
    if temperature < 0:
        raise ConfigError(f"{key}={temperature} must be >= 0")
    if e.n_samples > 1 and temperature == 0:
        raise ConfigError(
            f"eval.n_samples={e.n_samples} with temperature 0 ({key}) gives n identical greedy samples; "
            "set eval.temperature > 0 (e.g. eval.temperature=1.0) or eval.n_samples=1"
        )
    return specs, temperature


def load_task_prompts(spec: TaskSpec, path: str, limit: int | None, style: str, tok) -> list:
    """The task's PromptRecords (chat-rendered prompt ids + the evaluation record) from its data file; DARE rows
    keep their gold in ``reward_model.ground_truth`` (the prompt builder's fallback for ``answer``)."""
    rows = load_rows(path, limit)
    records = [spec.record(raw, where, style) for where, raw in rows]
    answer_key = "answer" if is_verl_row(rows[0][1]) else spec.gold_field
    return build_prompts(records, tok, [where for where, _ in rows], PromptRules(answer_key=answer_key))


def generate_samples(manager, prompt_ids: list[list[int]], params, n_samples: int, rollout, bar) -> list[list[Any]]:
    """``traj[i][j]``: sample j of problem i. Every (sample round, group of ``rollout.chunk_size *
    rollout.num_engines`` problems) is one engine request, all submitted at once so the engines stay busy; round j
    uses seed ``params.seed + j * SEED_STRIDE + c`` for the c-th chunk of ``rollout.chunk_size`` problems."""
    group, chunk_size = rollout.chunk_size * rollout.num_engines, rollout.chunk_size
    pending = []
    for j in range(n_samples):
        for start in range(0, len(prompt_ids), group):
            seed = params.seed + j * SEED_STRIDE + start // chunk_size
            batch = prompt_ids[start : start + group]
            pending.append((j, start, manager.submit(batch, dataclasses.replace(params, seed=seed))))
    traj: list[list[Any]] = [[None] * n_samples for _ in prompt_ids]
    for j, start, fut in pending:
        done = fut.result()
        for offset, t in enumerate(done):
            traj[start + offset][j] = t.validate()
        bar.update(len(done))
    return traj


def _last_user_turn(rec: dict) -> str:
    msgs = rec.get("messages") or rec.get("prompt") or []
    return next((m["content"] for m in reversed(msgs) if m.get("role") == "user"), "")


def score_samples(
    spec: TaskSpec, tok, prompts: list, traj: list[list[Any]], max_error_fraction: float = 0.0
) -> tuple[list[dict], dict[str, Any]]:
    """Per-sample rows (decoded response, extracted answer, verdict) and the scorer's error / timeout counts; more
    than ``max_error_fraction`` of samples whose reward could not be computed raise RewardError (naming file:row)."""
    flat = [(i, j, t) for i, samples in enumerate(traj) for j, t in enumerate(samples)]
    texts = [tok.decode(t.response_ids) for _, _, t in flat]
    full = [prompts[i].reward_text(text) for (i, _, _), text in zip(flat, texts)]
    records = [prompts[i].record for i, _, _ in flat]
    scores, stats = score_batch(load_reward(spec.reward), full, records)
    check_reward_errors(
        stats, spec.reward, [prompts[i].where for i, _, _ in flat], max_error_fraction, f"eval task {spec.name}"
    )
    rows = []
    for n, ((i, j, t), rec, text, shown, reward) in enumerate(zip(flat, records, texts, full, scores)):
        gold = spec.reference(str(rec["answer"])) if spec.reference else None
        rows.append(
            {
                "task": spec.name,
                "index": i,
                "problem_id": rec["problem_id"],
                "prompt": _last_user_turn(rec),
                "sample": j,
                "response": text,
                "extracted": spec.extract(shown),
                "gold": gold,
                "correct": reward >= 1.0,
                "reward": float(reward),
                "reward_error": stats.failed.get(n),  # the reward could not be computed: scored wrong, not judged
                "length": len(t.response_ids),
                "forwards": int(t.num_forwards),
                "finish_reason": t.finish_reason,
            }
        )
    return rows, {
        "reward_errors": stats.errors,
        "reward_timeouts": stats.timeouts,
        "answer_timeouts": stats.answer_timeouts,
        "first_reward_error": stats.first_error,
    }


def _print_task(name: str, metrics: dict[str, Any]) -> None:
    shown = "  ".join(
        f"{k} {v:.3f}"
        for k, v in metrics.items()
        if k.split("@")[0] in ("mean", "pass", "maj") or k in ("response_length", "forwards_per_token")
    )
    failed = metrics.get("reward_errors", 0) + metrics.get("reward_timeouts", 0)
    note = f"; {failed} samples' rewards could not be computed and count as wrong" if failed else ""
    print(f"eval {name}: {shown}  ({metrics['problems']} problems x {metrics['samples_per_problem']} samples{note})")


def summary_table(tasks: dict[str, dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """(header, rows) of the per-task summary: problems, samples, every mean@ / pass@ / maj@ metric, response
    length, forwards per token and the reward error counts (blank where a task has no such metric)."""
    metric_keys = list(
        dict.fromkeys(k for m in tasks.values() for k in m if k.split("@")[0] in ("mean", "pass", "maj"))
    )
    header = [
        "task",
        "problems",
        "samples",
        *metric_keys,
        "response_length",
        "forwards_per_token",
        "reward_errors",
        "reward_timeouts",
        "answer_timeouts",
    ]
    rows = []
    for name, m in tasks.items():
        values = [
            m.get("problems"),
            m.get("samples_per_problem"),
            *(m.get(k) for k in metric_keys),
            m.get("response_length"),
            m.get("forwards_per_token"),
            m.get("reward_errors"),
            m.get("reward_timeouts"),
            m.get("answer_timeouts"),
        ]
        rows.append([name] + ["" if v is None else f"{v:.4f}" if isinstance(v, float) else str(v) for v in values])
    return header, rows


def write_summary(out_dir: str, tasks: dict[str, dict[str, Any]]) -> str:
    """Print the summary table and write it as ``summary.csv`` (one row per task); returns the csv path."""
    header, rows = summary_table(tasks)
    widths = [max(len(r[c]) for r in [header, *rows]) for c in range(len(header))]
    for r in [header, *rows]:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip())
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerows([header, *rows])
    path = os.path.join(out_dir, "summary.csv")
    write_text_atomic(path, buf.getvalue())
    return path


def run_eval_command(spec: RunSpec, nproc: int = 1) -> int:
    """Evaluate the model of a resolved ``megadare eval`` run on ``eval.tasks``; returns the exit code (0)."""
    cfg = spec.cfg
    _refuse_trainer_options(cfg, nproc)
    tasks, temperature = check_eval_config(cfg)
    e = cfg.eval
    src = materialise(spec.source, cfg)
    if not cfg.model.hf_path:  # model.tiny=true and no --model: what is scored must not pass for a checkpoint
        print(
            f"eval: no --model given: scoring a randomly initialised tiny {src.family.name} ({src.hf_dir}); "
            "give --model DIR (an HF checkpoint or export) to evaluate a trained one",
            file=sys.stderr,
            flush=True,
        )
    tok = tokenizer_for(cfg, src, generates=True)
    files = {t.name: t.path or task_file(e.data_dir, dict(e.paths), t.name) for t in tasks}
    prompts = {t.name: load_task_prompts(t, files[t.name], e.limit, e.prompt_style, tok) for t in tasks}
    set_isolation(cfg.rewards.code.isolation)
    if any(runs_code(t.reward, [p.record for p in prompts[t.name]]) for t in tasks):
        check_isolation()  # refuse before the engines start, where the kernel refuses the code sandbox
    for t in tasks:
        for note in reward_notes(t.reward, [p.record for p in prompts[t.name]]):
            print(f"eval {t.name}: {note}", file=sys.stderr, flush=True)
    params = dataclasses.replace(spec.eval_sampling, temperature=temperature)
    out_dir = e.output_dir or os.path.join(cfg.logging.run_dir, "eval")
    claim_output_dir(out_dir, ["summary.json", "summary.csv", *(f"samples_{t.name}.jsonl" for t in tasks)])
    with stopping_before_the_loop(), run_dir_lock(out_dir, key="eval.output_dir"):  # a second eval there would
        return _run_tasks(spec, src, tok, (tasks, files, prompts), params, out_dir)  # rewrite the same files


def _run_tasks(spec: RunSpec, src, tok, work: tuple, params, out_dir: str) -> int:
    """Start the engines, evaluate each task (``work``: the tasks, their files and prompts) and write the outputs
    into ``out_dir`` (locked by the caller)."""
    cfg, e = spec.cfg, spec.cfg.eval
    tasks, files, prompts = work
    summary: dict[str, Any] = {
        "model": src.hf_dir,
        "family": src.family.name,
        "n_samples": e.n_samples,
        "k": list(e.k),
        "prompt_style": e.prompt_style,
        "limit": e.limit,
        "seed": cfg.seed,
        "sampling": dataclasses.asdict(params),
        "tasks": {},
        "tasks_left": [t.name for t in tasks],
    }
    manager = start_engines(cfg, src, tok)
    stopped = False
    try:
        _begin_outputs(out_dir, summary)
        for task in tasks:
            metrics, rows = _eval_task(cfg, manager, tok, task, prompts[task.name], params)
            metrics["file"] = files[task.name]
            summary["tasks"][task.name] = metrics
            summary["tasks_left"].remove(task.name)
            write_jsonl_atomic(os.path.join(out_dir, f"samples_{task.name}.jsonl"), rows)
            write_json_atomic(os.path.join(out_dir, "summary.json"), summary)
            _print_task(task.name, metrics)
    except StoppedBeforeTheLoop as stop:
        if type(stop.__context__).__module__.startswith("megadare."):  # one of our errors was on its way out: it
            raise  # ends the command (cli.py); a library's, caught and handled, is not one
        stopped = True
    finally:
        stopping.loop_ended()  # a SIGTERM from here on lets the engines go and the last line be printed
        manager.shutdown(ray_stopped=stopped)  # the job's SIGTERM reached Ray too: its local Ray is ended
    if stopped:
        print(_stopped_line(out_dir, list(summary["tasks"]), summary["tasks_left"]), flush=True)
        return 0
    csv_path = write_summary(out_dir, summary["tasks"])
    print(f"eval: wrote {os.path.join(out_dir, 'summary.json')}, {csv_path} and samples_<task>.jsonl")
    return 0


def _begin_outputs(out_dir: str, summary: dict[str, Any]) -> None:
    """Before the first task: remove what an earlier eval wrote for these tasks (``claim_output_dir`` checked that
    megadare eval wrote the directory), and write the summary naming every task as left."""
    names = ["summary.csv", *(f"samples_{name}.jsonl" for name in summary["tasks_left"])]
    for name in names:
        if os.path.isfile(os.path.join(out_dir, name)):
            os.remove(os.path.join(out_dir, name))
    write_json_atomic(os.path.join(out_dir, "summary.json"), summary)


def _stopped_line(out_dir: str, done: list[str], left: list[str]) -> str:
    """The line of an eval stopped by SIGTERM: the tasks finished (kept), the one cut, those not started, and how
    to run the rest."""
    kept = (
        f"{', '.join(done)} finished and kept in {out_dir} (samples_<task>.jsonl, summary.json)"
        if done
        else f"no task finished (nothing kept in {out_dir})"
    )
    not_started = f", {', '.join(left[1:])} not started" if len(left) > 1 else ""
    return (
        f"eval stopped by SIGTERM: {kept}; {left[0]} cut (nothing of it written){not_started}; run the rest with "
        f"--tasks {','.join(left)} and a new eval.output_dir (a rerun does not skip finished tasks)"
    )


def _refuse_trainer_options(cfg, nproc: int) -> None:
    """Evaluation starts engines, no trainer: refuse --nproc > 1 and a Megatron checkpoint.load, naming the fix."""
    if nproc > 1:
        raise ConfigError(
            f"--nproc {nproc}: evaluation runs no trainer processes; scale it with "
            "rollout.num_engines (engine actors) instead"
        )
    if cfg.checkpoint.load:
        raise ConfigError(
            f"checkpoint.load={cfg.checkpoint.load!r}: the engines load HF checkpoints; export it with "
            "'megadare convert megatron-to-hf' and pass the result as --model"
        )


def _eval_task(cfg, manager, tok, task, task_prompts, params) -> tuple[dict[str, Any], list[dict]]:
    """One task: ``eval.n_samples`` samples per prompt -> scored rows -> its metrics (``file`` is the caller's)."""
    e = cfg.eval
    t0 = time.perf_counter()
    with progress_bar(
        total=len(task_prompts) * e.n_samples, desc=f"eval {task.name}", unit="sample", dynamic_ncols=True
    ) as bar:
        traj = generate_samples(manager, [p.prompt_ids for p in task_prompts], params, e.n_samples, cfg.rollout, bar)
        bar.set_postfix_str("scoring")
        rows, reward_stats = score_samples(task, tok, task_prompts, traj, cfg.rewards.max_error_fraction)
    metrics: dict[str, Any] = {"file": None, "problems": len(task_prompts), "samples_per_problem": e.n_samples}
    metrics.update(task_metrics(rows, list(e.k), task.vote_key))
    metrics.update(reward_stats, seconds=time.perf_counter() - t0)
    return metrics, rows
