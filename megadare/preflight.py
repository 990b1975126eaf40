"""``megadare sft|dpo|rl|eval --dry-run``: everything that can be checked before Ray and torchrun start (the Slurm
scripts run it first), each failure one line naming the file, row or key and the fix.

* the config's shape (``validate`` of trainer/checks.py, the command's own checks) and the memory plan on the cluster it
  declares (``plan.*``; on ``parallel.world_size`` trainer GPUs when that is set): DOES NOT FIT is an error that
  names the first change that fits;
* the model: config.json, readable safetensors headers, a tokenizer (an HF model; tiny models use the byte
  tokenizer); ``checkpoint.load`` intact and of this model;
* the data: every file exists and parses, its first ``ROWS`` records build (fields, chat template) and fit
  ``data.max_length`` under ``data.overlong`` (RL prompts: ``data.max_length - rollout.max_new_tokens``);
* RL: the reward resolves (``rewards.name=auto``: a rule for each of those rows); the engine imports (sglang);
* eval: the eval section (``eval.k <= eval.n_samples`` ...) and each task's data file;
* the run directory: not held by another live run; what a start would resume from.

``--config-only`` keeps to the first point, eval's section (less its files) and a built-in reward's name (a config
for a cluster checked from a laptop: its paths are the cluster's).
"""

from __future__ import annotations

import sys
from dataclasses import replace
from typing import Optional

from megadare.config import Config
from megadare.convert.hf_megatron import HFSource
from megadare.convert.mcore_ckpt import intact_checkpoint_dir, newest_intact
from megadare.data.files import as_paths, load_many
from megadare.data.preference_data import build_preference_examples
from megadare.data.prompt_data import PromptRules, build_prompts
from megadare.data.sft_data import build_sft_examples
from megadare.data.tokenizer import ByteTokenizer
from megadare.errors import ConfigError, RunStateError
from megadare.eval.files import task_file
from megadare.eval.runner import check_eval_config, load_task_prompts
from megadare.models.family import ModelArch
from megadare.plan import plan
from megadare.plan.memory import trainer_world
from megadare import rewards
from megadare.rewards import RewardSpecError, load_reward, runs_code, score_batch, set_isolation
from megadare.rewards.registry import BUILTIN_REWARDS, auto_rule, gold_response
from megadare.rollout.sglang_engine import _import_sglang
from megadare.trainer.checkpoint import check_same_model
from megadare.trainer.model_setup import tokenizer_for
from megadare.trainer.rl_setup import check_golds, prompt_budget
from megadare.trainer.monitor import foreign_run_config
from megadare.trainer.rl import checkpoint_roots
from megadare.trainer.run_lock import holder_alive, lock_dirs
from megadare.trainer.dpo_loop import preference_record_keys
from megadare.trainer.sft_loop import checkpoint_root, sft_record_keys
from megadare.trainer.spec import ModelSource, RunSpec

ROWS = 64  # records of each data file built and length-checked


def _note(msg: str) -> None:
    print(f"pre-flight: {msg}", file=sys.stderr)


def check_plan_fits(cfg: Config, arch: ModelArch, world: Optional[int] = None) -> None:
    """The memory plan fits the declared cluster (``plan.*``; with a known world size -- ``parallel.world_size``,
    ``--nproc``, torchrun's WORLD_SIZE -- that many trainer GPUs of ``plan.gpu_memory_gb``); ConfigError naming
    the peak, the bottleneck and the first change that fits."""
    pl, ws = cfg.plan, cfg.parallel.world_size or world
    planned = cfg
    if ws is not None and ws != trainer_world(cfg):  # the run's own GPU count, of the declared kind
        planned = cfg.replace(plan=replace(pl, nodes=1, gpus_per_node=ws + pl.rollout_gpus))
    report = plan(planned, arch)
    if report.fits:
        return
    gib = 2**30
    fix = next((a["change"] for a in report.advice if a["fits"]), None)
    cluster = f"{planned.plan.nodes} x {planned.plan.gpus_per_node} GPUs of {pl.gpu_memory_gb:g} GB"
    raise ConfigError(
        f"the memory plan does not fit: peak {report.peak / gib:.1f} GB per GPU ({report.bottleneck} "
        f"phase) on {cluster} (plan.*); "
        + (f"{fix} fits" if fix else "no change of layout fits: add GPUs (plan.nodes) or larger ones")
        + " -- `megadare plan` shows the table"
    )


def check_model(cfg: Config, src: Optional[ModelSource], generates: bool = False):
    """The model source as the run will build it (the resolved ``src``): weights readable, a tokenizer (that
    decodes every id the model samples, when the run ``generates``); ``checkpoint.load`` intact and of this model.
    Returns (ModelSource or None without a model, tokenizer)."""
    m = cfg.model
    if src is None:
        return None, ByteTokenizer()
    if m.hf_path:
        _check_weights(m.hf_path)
        tok = tokenizer_for(cfg, src)
    else:  # a tiny random model: the run writes it; its family and shapes are known
        tok = tokenizer_for(cfg, src, generates=generates)
        src = replace(src, hf_dir=f"a tiny {m.family} model", hf_config={})
    if cfg.checkpoint.load:
        check_same_model(intact_checkpoint_dir(cfg.checkpoint.load), src)
    return src, tok


def _check_weights(hf_dir: str) -> None:
    """Every safetensors file of the checkpoint has a readable header (the index, the shards it names); the
    reader's CheckpointError names the damaged file."""
    reader = HFSource(hf_dir).reader  # the headers' tensors and shapes against config.json (no weight is read)
    for fn in sorted(set(reader.weight_map.values())):  # and the shards holding none of them (cached: read once)
        reader._header(fn)


def _first_rows(paths, key: str) -> list[tuple[str, dict]]:
    """The first ROWS records of each file of ``paths`` (every file exists, parses and holds records)."""
    out = []
    for path in as_paths(paths, key):
        out.extend(load_many(path, key)[:ROWS])
    return out


def check_data(command: str, cfg: Config, tok) -> None:
    """The command's data files: present, parsing, their first records building and fitting (see module doc)."""
    d = cfg.data
    if command == "rl":  # a generated task has no file, but its reward still has to resolve
        named_reward(cfg)
    if d.synthetic or command == "eval":
        return
    if not d.path:
        raise ConfigError("no data: set data.path (.jsonl / .parquet, or a list of files) or data.synthetic")
    rows = _first_rows(d.path, "data.path")
    records, where = [r for _, r in rows], [w for w, _ in rows]
    if command == "sft":
        build_sft_examples(records, tok, d.max_length, d.overlong, source=where, **sft_record_keys(cfg))
    elif command == "dpo":
        build_preference_examples(records, tok, d.max_length, d.overlong, source=where, **preference_record_keys(cfg))
    elif command == "rl":
        check_prompts(cfg, tok, rows)
        if d.eval_path:
            check_prompts(cfg, tok, _first_rows(d.eval_path, "data.eval_path"))


def check_prompts(cfg: Config, tok, rows: list[tuple[str, dict]]) -> None:
    """RL prompt rows build, fit the prompt budget under data.overlong, and have a reward rule."""
    d, reward = cfg.data, cfg.rewards
    skipped: Optional[list] = [] if reward.skip_rows_without_answer else None
    overlong: list = []
    built = build_prompts(
        [r for _, r in rows],
        tok,
        [w for w, _ in rows],
        PromptRules.of(d, reward, prompt_budget(cfg)),
        skipped=skipped,
        overlong_rows=overlong,
    )
    if overlong:
        _note(
            f"data.overlong={d.overlong} applies to {len(overlong)} of the first {len(rows)} prompts (longer than "
            f"{prompt_budget(cfg)} tokens), e.g. {overlong[0]}"
        )
    named_reward(cfg)
    if runs_code(reward.name, [p.record for p in built]):
        set_isolation(cfg.rewards.code.isolation)
        rewards.check_isolation()  # the kernel accepts the code sandbox (else one line naming rewards.code.isolation)
    if reward.name == "auto":
        for p in built:
            try:
                auto_rule(p.record)
            except ValueError as e:
                raise RewardSpecError(f"{p.where}: {e}") from None
    check_golds(reward.name, built)
    if built and not runs_code(reward.name, [p.record for p in built]):
        try_reward(reward.name, built[0])


def named_reward(cfg: Config):
    """The reward ``rewards.name`` names; RewardSpecError naming the key when it does not resolve."""
    try:
        return load_reward(cfg.rewards.name)
    except RewardSpecError as e:
        raise RewardSpecError(f"{cfg.as_written('rewards.name')}: {e}") from None


def try_reward(name: str, prompt) -> None:
    """One call of the reward on a prompt row (its gold answer as the response, for a built-in; else an empty
    response): a reward of the wrong signature (verl's ``compute_score(data_source, solution_str, ...)``) or return
    type fails here, not after the first rollout."""
    builtin = name in BUILTIN_REWARDS
    text = (gold_response(name, prompt.record) if builtin else None) or ""
    _, stats = score_batch(load_reward(name), [prompt.reward_text(text)], [prompt.record], workers=1, timeout_s=60)
    if stats.failures:
        raise RewardSpecError(
            f"{prompt.where}: rewards.name={name} failed a trial call reward(response, record) on this row: "
            f"{stats.first_error}; a reward takes (response text, record dict) and returns a float"
        )


def check_engine(cfg: Config) -> None:
    """The rollout engine can be imported here (sglang for rollout.engine=sglang)."""
    if cfg.rollout.engine == "sglang":
        try:
            _import_sglang()
        except ImportError as e:
            raise ConfigError(f"rollout.engine=sglang: {e}") from None


def check_eval(cfg: Config) -> None:
    """The eval section and every task's data file (``megadare eval``)."""
    specs, _ = check_eval_config(cfg)
    for s in specs:
        if not s.path:
            task_file(cfg.eval.data_dir, dict(cfg.eval.paths), s.name)


def check_eval_rows(cfg: Config, tok) -> None:
    """The first rows of every task's data file build into prompts as the run builds them (an empty file, a row
    without the task's fields: one line naming the file and row, here rather than after the model is loaded)."""
    e = cfg.eval
    for s in check_eval_config(cfg)[0]:
        path = s.path or task_file(e.data_dir, dict(e.paths), s.name)
        load_task_prompts(s, path, min(ROWS, e.limit or ROWS), e.prompt_style, tok)


def check_run_dir(command: str, spec: RunSpec) -> None:
    """The run directory and every checkpoint root the run locks (TraceRL's value model's too) are not held by
    another live run; say what a start would resume from."""
    cfg = spec.cfg
    root = checkpoint_root(cfg)
    for d in lock_dirs(cfg.logging.run_dir, *(checkpoint_roots(spec) if command == "rl" else (root,))):
        held = holder_alive(d)
        if held:
            raise RunStateError(held)
    foreign = foreign_run_config(cfg.logging.run_dir)
    if foreign:
        raise RunStateError(foreign)
    pick = newest_intact(root, required=("train_state.json",))
    for d, problem in pick.skipped:
        _note(f"a start would pass over {d}: {problem}")
    if pick.path:
        _note(f"a start would resume from {pick.path}")
    elif pick.skipped:
        raise RunStateError(f"no intact checkpoint under {root}; move the damaged ones aside to start over")


def preflight(spec: RunSpec, config_only: bool = False, world: Optional[int] = None) -> None:
    """Everything ``--dry-run`` checks for the resolved run ``spec`` (module docstring); raises the first problem
    as a one-line error. ``world``: the trainer processes the run will have, when known (``--nproc``, WORLD_SIZE)."""
    command, cfg, arch = spec.job, spec.cfg, spec.arch
    if arch is not None and command in ("sft", "dpo", "rl"):
        check_plan_fits(cfg, arch, world)
    if config_only:
        if command == "eval":  # its task names and settings are config; its files need not exist here
            check_eval_config(cfg, files_here=False)
        if command == "rl" and ":" not in cfg.rewards.name:  # a built-in's name (an import path: the cluster's)
            named_reward(cfg)
        return
    if command == "eval":
        check_eval(cfg)
    _, tok = check_model(cfg, spec.source, generates=command in ("rl", "eval"))
    check_data(command, cfg, tok)
    if command == "eval":
        check_eval_rows(cfg, tok)
    if command in ("rl", "eval"):
        check_engine(cfg)
    if command in ("sft", "dpo", "rl"):
        check_run_dir(command, spec)
