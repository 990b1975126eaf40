"""Where one RL step's time goes, and what this branch's changes save, old and new code in one process.

    python benchmarks/rl_step_phases.py [--steps 8] [--rounds 5] [--baseline f34a189] [--long 512]
                                        [--chunk-before 16] [key=value ...]

The ``--baseline`` commit's functions are read with ``git show`` and swapped in for the "before" rounds (rounds
alternate with the current code); f34a189 is the commit before the changes.

1. Runs the demo RL config (megadare/configs/demo_rl.yaml: tiny SDAR, TraceRL, built-in engine in one Ray actor,
   random weights unless ``checkpoint.load=...``) for ``--steps`` steps and prints the start-up (imports, then the
   first call of each set-up phase: Ray and the engine actors, model build, the first weight push, which waits for
   the engines to start, the first evaluation) and the mean split of a steady step (the first, warm-up step and the
   last, A/B step left out) from the trainer's timers and timed wrappers (``PhaseClock``): rollout (engine busy,
   rewards, the rest: Ray, queue, samples), train (rows, packing, old / reference passes, the train steps'
   forward/backward, optimizer and glue), weight sync (the engine check, a Ray round trip, and the transfer),
   logging; and the share of the step outside the forward/backward. At the last step its whole update runs with
   the baseline's row builders and a dense attention mask built per layer vs the current code (its optimizer steps
   are timing only: the run's own update follows), and its rollout in requests of ``--chunk-before`` prompts vs
   the run's ``rollout.chunk_size`` (the trajectories must be identical).
2. The update's rows (``algo.batch_rows``) of the last step, and of 16 synthetic ``--long``-token responses, with
   the baseline's ``views_to_row`` / ``replay_views`` vs the current ones; the rows must be identical.
3. The dense attention masks of the step's micro-batches: ``MaskSpec.dense`` vs its ``mask_mod`` on the whole
   grid (the construction before the block-diffusion fast path); and the last step's update with the CUDA-to-CPU
   mode on everywhere vs scoped out of the hot sections (parallel/cpu.py ``SCOPED``); and that update on the
   process's torch intra-op threads vs on one (``threads_ab``; run with OMP_NUM_THREADS unset to see the default).
4. ``score_batch`` of 128 exact-match responses, a thread per call (baseline) vs a pool.

``--rows-only``: no run, only an RL step's views, rows and packing of the demo's shape and of ``--long``-token
responses (``rows_micro``) for tracerl, d1 and coupled_grpo, the ``--baseline`` commit's samplers, row builders
and packer vs the current ones (identical output).

Measured (2-core machine shared with other jobs, load 9-40; CPU ms per step, median of alternated rounds):
* 179fc7b -> bb41658, segment ids without ``repeat_interleave``: coupled_grpo's demo rows 904 -> 106 (x8.5) on 2
  torch threads, 143 -> 118 (x1.21) on 1.
* bb41658 -> 9ff7f91, views with scalar operands: demo views d1 20.3 -> 13.2 (x1.54), coupled_grpo 49.8 -> 36.7
  (x1.36) (1 thread, 9 rounds); in the run below x1.28 and x1.05 (the load swings: read several runs).
* 9ff7f91 -> 47a0367, an unedited trace's replay rounds as whole tensors (from 64 response tokens):
  ``replay_views`` alone, 16 samples of 512 tokens, 91.9 -> 37.2 (x2.47, 9 rounds).
* 179fc7b -> 47a0367 all together, ``--rows-only --long 512 --rounds 15``, OMP_NUM_THREADS=1, load 16-18:
  demo tracerl rows 111.5 -> 108.5, d1 71.0 -> 68.2, coupled_grpo 113.3 -> 106.9; 512-token tracerl rows
  96.0 -> 63.6 (x1.51), d1 17.6 -> 17.0, coupled_grpo 27.7 -> 29.4 (noise: packing, unchanged, read x0.99-1.21).
* the demo's whole update (4 steps, last step's update, 5 rounds, OMP_NUM_THREADS unset): 2 threads CPU 11.05 s,
  wall 25.0 s; 1 thread CPU 0.88 s, wall 2.13 s (x11.8 wall): cli.py now gives a one-process run one thread.

The machine's cores may be shared: read the ratios (same process, rounds alternated), not seconds between runs;
the load average is printed at the start and the end. On a loaded machine torch's intra-op threads wait for each
other (a [512, 64] mean took 4-12 ms with 2 threads vs 0.1 ms with 1 at load 10 on 2 cores): ``OMP_NUM_THREADS=1``
keeps the forward/backward from swamping the split there. On CPU megadare's CUDA-to-CPU torch function mode
(parallel/cpu.py) adds ~2 us to every torch call where it is on: model build, schedules' glue, grad norm /
clipping; not in the model forwards and the optimizer's copies and inner step. It is off on GPU runs.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import inspect
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

PHASES = (
    ("step", "step_time_s"),
    ("  rollout", "rollout_s"),
    ("    engine busy", "async/rollout_busy_s"),
    ("    rewards", "reward_wall_s"),
    ("  train", "train_s"),
    ("    rows + passes", "prepare_s"),
    ("  weight sync", "sync_s"),
)


class PhaseClock:
    """Wall seconds of the functions it wraps, per phase, summed over the steps it is ``on`` (benchmark only: each
    ``module.name`` is swapped for a timed wrapper, restored by ``close``). A phase ``inside`` another is timed only
    while that one runs (the forward / backward of the train steps, not of the old / reference passes); ``first``
    records each phase's first call apart, on or off (the start-up: Ray, engines, first push)."""

    def __init__(self):
        self.on, self.total, self.first, self.running = False, {}, {}, set()
        self.saved: list[tuple[Any, str, Any]] = []
        self.gc_t0, self.gc_s = 0.0, {0: 0.0, 1: 0.0, 2: 0.0}
        gc.callbacks.append(self._gc)

    def _gc(self, phase: str, info: dict) -> None:
        """The garbage collector's seconds per generation while ``on`` (spread over the phases it interrupts)."""
        if phase == "start":
            self.gc_t0 = time.perf_counter()
        elif self.on:
            self.gc_s[info["generation"]] += time.perf_counter() - self.gc_t0

    def wrap(self, module: Any, name: str, phase: str, inside: str = "") -> None:
        fn = getattr(module, name)

        def timed(*args, **kw):
            if inside and inside not in self.running:
                return fn(*args, **kw)
            self.running.add(phase)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                dt = time.perf_counter() - t0
                self.running.discard(phase)
                self.first.setdefault(phase, dt)
                if self.on:
                    self.total[phase] = self.total.get(phase, 0.0) + dt

        self.saved.append((module, name, fn))
        setattr(module, name, timed)

    def close(self) -> None:
        gc.callbacks.remove(self._gc)
        for module, name, fn in reversed(self.saved):
            setattr(module, name, fn)
        self.saved.clear()


def clocked(clock: PhaseClock) -> None:
    """The phases of a step and of the start-up: where each is measured."""
    from megadare.parallel import cpu as _cpu  # noqa: F401 - the mode's module, loaded before the wraps
    from megadare.rollout.manager import RolloutManager
    from megadare.trainer import rl, rl_setup, rl_update, step

    clock.wrap(rl, "init_distributed", "init distributed")
    clock.wrap(rl_setup, "materialise", "model source (HF export)")
    clock.wrap(rl_setup, "rl_policy", "model build + checkpoint load")
    clock.wrap(rl_setup, "start_engines", "Ray init + engine actors")
    clock.wrap(rl, "push_weights", "weight push")
    clock.wrap(rl, "evaluate_at", "evaluation")
    clock.wrap(RolloutManager, "check_engines", "engine check before push")
    clock.wrap(rl_update, "pack_rows", "packing")
    clock.wrap(rl_update, "store_outputs", "old / ref passes")
    clock.wrap(rl_update, "train_step", "train steps")
    clock.wrap(step, "run_schedule", "forward/backward", inside="train steps")
    clock.wrap(rl, "log_step", "logging")


def step_table(history: list[dict], clock: PhaseClock, steps: int) -> None:
    """Mean seconds per steady step (``history`` of those steps) of each phase and its share of the step; the
    share of the step spent outside the train steps' forward / backward."""
    n = len(history)
    mean = {k: sum(h.get(k, 0.0) for h in history) / n for _, k in PHASES}
    t = {k: v / n for k, v in clock.total.items()}
    step = mean["step_time_s"]
    rollout_rest = mean["rollout_s"] - mean["async/rollout_busy_s"] - mean["reward_wall_s"]
    rows_s = mean["prepare_s"] - t.get("packing", 0.0) - t.get("old / ref passes", 0.0)
    fb = t.get("forward/backward", 0.0)
    rows = [
        ("step", step),
        ("  rollout", mean["rollout_s"]),
        ("    engine generate (busy)", mean["async/rollout_busy_s"]),
        ("    reward scoring", mean["reward_wall_s"]),
        ("    Ray wait / samples", rollout_rest),
        ("  train", mean["train_s"]),
        ("    rows (algo.batch_rows)", rows_s),
        ("    packing", t.get("packing", 0.0)),
        ("    old / ref passes", t.get("old / ref passes", 0.0)),
        ("    forward/backward", fb),
        ("    optimizer + step glue", t.get("train steps", 0.0) - fb),
        ("  weight sync", mean["sync_s"]),
        ("    engine check (Ray)", t.get("engine check before push", 0.0)),
        ("    transfer", mean["sync_s"] - t.get("engine check before push", 0.0)),
        ("  logging (after the step)", t.get("logging", 0.0)),
        ("  untimed", step - mean["rollout_s"] - mean["train_s"] - mean["sync_s"]),
    ]
    print(f"phase split over {n} steady steps (steps 2..{steps - 1}; mean seconds, share of the step):")
    for name, s in rows:
        print(f"  {name:30s} {s:8.4f}  {100 * s / step:5.1f}%")
    g = {k: v / n for k, v in clock.gc_s.items()}
    print(
        f"  garbage collection inside these phases: {g[2]:.4f} s full, {g[0] + g[1]:.4f} s young "
        f"({100 * (g[0] + g[1] + g[2]) / step:.1f}% of the step)"
    )
    print(
        f"  outside the train steps' forward/backward: {step - fb:.4f} s, {100 * (step - fb) / step:.1f}% of the step"
    )


def startup_table(clock: PhaseClock, imports_s: float, first_step_s: float) -> None:
    """The run's start-up: imports, then each set-up phase's first call, until the first step begins."""
    f = clock.first
    names = ("init distributed", "model source (HF export)", "model build + checkpoint load")
    names += ("Ray init + engine actors", "weight push", "evaluation")
    print(f"start-up (seconds until the first step {imports_s + first_step_s:.2f}):")
    print(f"  {'imports (torch, megatron, ray, megadare)':42s} {imports_s:8.3f}")
    for k in names:
        label = k + (" (first: waits for the engines)" if k == "weight push" else "")
        print(f"  {label:42s} {f.get(k, 0.0):8.3f}")
    rest = first_step_s - sum(f.get(k, 0.0) for k in names)
    print(f"  {'the rest (config, tokenizer, prompts, Monitor)':42s} {rest:8.3f}")


def baseline_module(rev: str, path: str, name: str) -> types.ModuleType:
    """The module at ``path`` as of commit ``rev`` (its own namespace; it imports today's megadare)."""
    src = subprocess.run(["git", "-C", ROOT, "show", f"{rev}:{path}"], check=True, capture_output=True, text=True)
    mod = types.ModuleType(name)
    mod.__file__ = f"{rev}:{path}"
    sys.modules[name] = mod  # dataclasses resolve their module by name
    exec(compile(src.stdout, mod.__file__, "exec"), mod.__dict__)
    return mod


def same_rows(a: list, b: list) -> bool:
    import torch

    def same(x, y):
        if isinstance(x, torch.Tensor):
            return isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)
        return x == y

    fields = ("tokens", "labels", "weight", "position_ids", "stream_ids", "denom", "segment_ids")
    fields += ("slot", "head", "adv", "tok", "sample")
    return len(a) == len(b) and all(same(getattr(r, f), getattr(s, f)) for r, s in zip(a, b) for f in fields)


def long_samples(n: int, prompt: int, length: int, block: int, vocab: int) -> list:
    """``n`` samples of ``prompt`` + ``length`` tokens shaped as a built-in engine's trace with ``block``-token
    blocks and one token committed per step (the row building of a long-response step: a GPU run's shape)."""
    import torch

    from megadare.algos.base import RLSample

    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        order = [int(x) for b in range(0, length, block) for x in torch.randperm(min(block, length - b), generator=g)]
        out.append(
            RLSample(
                prompt_ids=torch.randint(3, vocab, (prompt,), generator=g).tolist(),
                response_ids=torch.randint(3, vocab, (length,), generator=g).tolist(),
                reward=float(i % 2),
                advantage=float(i % 2) - 0.5,
                index=i,
                group=i // 8,
                commit_step=[(k // block) * block + order[k] for k in range(length)],
                block_step=order,
            )
        )
    return out


@contextlib.contextmanager
def swapped(names: list[tuple[Any, str, Any]]):
    """Each ``module.name`` set to ``value`` inside the block, restored after it."""
    saved = [(m, n, getattr(m, n)) for m, n, _ in names]
    for m, n, v in names:
        setattr(m, n, v)
    try:
        yield
    finally:
        for m, n, v in saved:
            setattr(m, n, v)


def baseline_rows(rev: str) -> list[tuple[Any, str, Any]]:
    """The row builders of commit ``rev`` where the algorithms look them up: ``views_to_row``, the trace
    replay's ``replay_views`` (with its own ``_Replay``) and d1's / Coupled-GRPO's samplers (with their own
    ``CleanSequence``)."""
    from megadare.algos import algorithm, cj_grpo, coupled_grpo, d1, tracerl, vrpo

    old_base = baseline_module(rev, "megadare/algos/base.py", "_baseline_base")
    old_replay = baseline_module(rev, "megadare/diffusion/trace_replay.py", "_baseline_trace_replay")
    old_row = old_base.views_to_row
    if "cols" not in inspect.signature(old_row).parameters:  # before SampleColumns: nothing shared per sample

        def old_row(s, views, arch, slot_weight, denom, cols=None, _f=old_row):
            return _f(s, views, arch, slot_weight, denom)

        shared = [(algorithm, "SampleColumns", lambda s: None)]
    else:
        shared = [(algorithm, "SampleColumns", old_base.SampleColumns)]
    corr = baseline_module(rev, "megadare/diffusion/corruption.py", "_baseline_corruption")
    shared += [(d1, "one_step", corr.one_step), (coupled_grpo, "coupled", corr.coupled)]
    shared += [(m, "CleanSequence", corr.CleanSequence) for m in (d1, coupled_grpo)]
    return (
        shared
        + [(m, "views_to_row", old_row) for m in (algorithm, vrpo)]
        + [(m, "replay_views", old_replay.replay_views) for m in (tracerl, cj_grpo)]
    )


def row_building(su, samples, rev: str, rounds: int) -> None:
    old = baseline_rows(rev)
    sh = su.shape

    def build(names):
        with swapped(names):
            t0 = time.process_time()
            rows = su.algo.batch_rows(
                samples, sh.arch, sh.block, lambda i: sh.generator_for(su.cfg.seed, su.step, i, 0)
            )
            return rows, time.process_time() - t0

    new: list = []
    spent = {"baseline": 0.0, "current": 0.0}
    for _ in range(rounds):
        old_rows, dt = build(old)
        spent["baseline"] += dt
        new_rows, dt = build(new)
        spent["current"] += dt
        if not same_rows(old_rows, new_rows):
            raise SystemExit("row building: the current code's rows differ from the baseline's")
    print(
        f"row building of one step ({len(samples)} samples, {len(new_rows)} rows; CPU seconds per step, "
        f"{rounds} alternated rounds): baseline {rev} {spent['baseline'] / rounds:.4f}, "
        f"current {spent['current'] / rounds:.4f}, speed-up x{spent['baseline'] / spent['current']:.2f}; rows identical"
    )


def rows_micro(rev: str, rounds: int, long: int) -> None:
    """``--rows-only``: an RL step's views (``algo.views`` of every sample), rows (``algo.batch_rows``) and their
    packing (``pack_rows``) for the demo's shape (128 samples, 16-token prompts, 4-token responses, SDAR blocks of
    4, seq_length 128, 4 rows a micro-batch), and of 16 ``long``-token responses after 64-token prompts
    (seq_length 4096), without a run: commit ``rev``'s samplers, row builders and packer vs the current ones,
    rounds alternated, process seconds, median over rounds; views, rows and micro-batches must be identical."""
    import torch

    from megadare.algos import build_algorithm
    from megadare.data.rows import MB_COLUMNS, pack_rows
    from megadare.models import get_family

    fam = get_family("sdar")
    arch = dataclasses.replace(fam.arch(fam.tiny_config()), block_size=4)
    demo = (long_samples(128, 16, 4, 4, arch.vocab_size), 128)
    shapes = [demo] + ([(long_samples(16, 64, long, 4, arch.vocab_size), 4096)] if long else [])
    old, old_pack = baseline_rows(rev), baseline_module(rev, "megadare/data/rows.py", "_baseline_rows").pack_rows
    fields = ("tokens", "labels", "weight", "position_ids", "segment_ids", "stream_ids", "padding") + MB_COLUMNS
    gen = lambda i: torch.Generator().manual_seed(i)  # noqa: E731
    for name, (samples, seq_length) in ((n, sh) for sh in shapes for n in ("tracerl", "d1", "coupled_grpo")):
        algo = build_algorithm(name)
        spent: dict[str, list[list[float]]] = {k: [[], [], []] for k in ("baseline", "current")}
        for r in range(rounds + 1):  # round 0 warms up
            built = {}
            for tag, names, pack in [("baseline", old, old_pack), ("current", [], pack_rows)][:: 1 if r % 2 else -1]:
                with swapped(names):
                    gc.collect()  # each side starts from a clean heap (the other's garbage is not its cost)
                    t0 = time.process_time()
                    views = [algo.views(s, arch, 4, gen(s.index)) for s in samples] if name != "tracerl" else []
                    t1 = time.process_time()
                    rows = algo.batch_rows(samples, arch, 4, gen)
                    t2 = time.process_time()
                    mbs = pack(rows, seq_length, 4)
                    t3 = time.process_time()
                built[tag] = views, rows, mbs
                if r:
                    for i, dt in enumerate((t1 - t0, t2 - t1, t3 - t2)):
                        spent[tag][i].append(dt)
            (va, ra, ma), (vb, rb, mb) = built["baseline"], built["current"]
            if any(not _same_views(x, y) for x, y in zip(va, vb, strict=True)):
                raise SystemExit(f"{name}: the current code's views differ from the baseline's")
            if not same_rows(ra, rb) or len(ma) != len(mb):
                raise SystemExit(f"{name}: the current code's rows differ from the baseline's")
            if not all(_same_opt(getattr(x, f), getattr(y, f)) for x, y in zip(ma, mb) for f in fields):
                raise SystemExit(f"{name}: the current code's packed micro-batches differ from the baseline's")
        (vw_b, rows_b, pack_b), (vw_c, rows_c, pack_c) = (
            [statistics.median(v) * 1e3 for v in spent[k]] for k in ("baseline", "current")
        )
        views = f"views {vw_b:.1f} -> {vw_c:.1f} (x{vw_b / vw_c:.2f}), " if name != "tracerl" else ""
        print(
            f"{name}: {len(samples)} samples of {len(samples[0].response_ids)} tokens -> {len(rb)} rows -> {len(mb)} micro-batches; ms per step "
            f"(CPU, {rounds} alternated rounds, median), baseline {rev} vs current: {views}rows (views included) "
            f"{rows_b:.1f} -> {rows_c:.1f} (x{rows_b / rows_c:.2f}), packing {pack_b:.1f} -> {pack_c:.1f} "
            f"(x{pack_b / pack_c:.2f}); identical"
        )


def _same_views(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        _same_opt(getattr(x, f), getattr(y, f))
        for x, y in zip(a, b)
        for f in ("tokens", "coef", "slot", "labels", "adv")
    )


def reward_scoring(rev: str, rounds: int, n: int = 128) -> None:
    """``score_batch`` of ``n`` exact-match responses (a cheap reward: the batch scorer's own cost) with the
    current code and the ``rev`` commit's, alternated."""
    from megadare.rewards import score_batch

    old = baseline_module(rev, "megadare/rewards/scoring.py", "_baseline_scoring").score_batch
    records = [{"answer": "abc"}] * n
    spent = {"baseline": 0.0, "current": 0.0}
    for _ in range(rounds * 4):
        for name, score in (("baseline", old), ("current", score_batch)):
            t0 = time.perf_counter()
            scores, stats = score("exact_match", ["abc"] * n, records)
            spent[name] += time.perf_counter() - t0
            if scores != [1.0] * n or stats.failures:
                raise SystemExit(f"reward scoring ({name}) gave {scores[:4]}..., {stats.failures} failures")
    k = rounds * 4
    print(
        f"scoring {n} exact-match rewards (wall ms, {k} alternated rounds): baseline {rev} "
        f"{1000 * spent['baseline'] / k:.2f}, current {1000 * spent['current'] / k:.2f}, "
        f"speed-up x{spent['baseline'] / spent['current']:.2f}"
    )


def mask_building(su, samples, rounds: int) -> None:
    """The dense attention mask of each micro-batch of the step (SDPA / reference backends), built once per forward
    (models/attention.py ``dense_mask``): ``MaskSpec.dense`` now vs the ``mask_mod`` evaluated on the whole grid
    (what ``dense`` did before its block-diffusion fast path), alternated; the masks must be identical."""
    from megadare.data.rows import pack_rows

    sh, cfg = su.shape, su.cfg
    rows = su.algo.batch_rows(samples, sh.arch, sh.block, lambda i: sh.generator_for(cfg.seed, su.step, i, 0))
    mbs = pack_rows(rows, cfg.train.seq_length, cfg.train.micro_batch_size, pad_id=sh.pad_id)
    specs = [(mb.mask(sh.kind, sh.block), mb.tokens.shape[0], mb.tokens.shape[1]) for mb in mbs]
    spent = {"grid": 0.0, "current": 0.0}
    for _ in range(rounds * 4):
        for spec, n, S in specs:
            t0 = time.process_time()
            old = grid_mask(spec, S, n)
            t1 = time.process_time()
            new = spec.dense(S, S, n)
            spent["grid"] += t1 - t0
            spent["current"] += time.process_time() - t1
            if not torch_equal(old, new):
                raise SystemExit(f"dense mask of a {spec.kind} micro-batch differs from its mask_mod")
    k = rounds * 4
    print(
        f"dense masks of one step's {len(mbs)} micro-batches ({sh.kind}, CPU ms per step, {k} alternated rounds): "
        f"mask_mod grid {1000 * spent['grid'] / k:.3f}, current {1000 * spent['current'] / k:.3f}, "
        f"speed-up x{spent['grid'] / spent['current']:.2f}; masks identical"
    )


def grid_mask(spec, S: int, n: int):
    """``spec.mask_mod`` on the [n, S, S] grid: ``MaskSpec.dense`` before its block-diffusion fast path."""
    import torch

    if not any(t is not None for t in (spec.segment_ids, spec.position_ids, spec.stream_ids)):
        n = 1
    b, q, k = torch.arange(n).view(-1, 1, 1), torch.arange(S).view(1, -1, 1), torch.arange(S).view(1, 1, -1)
    return spec.mask_mod(b, torch.zeros((), dtype=torch.long), q, k).expand(n, S, S).unsqueeze(1)


def _same_opt(a, b) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch_equal(a, b))


def torch_equal(a, b) -> bool:
    import torch

    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


def mode_ab(update, args: tuple, rounds: int) -> str:
    """The step's whole update with the CUDA-to-CPU torch function mode on in every section (``SCOPED`` False, as
    before) vs off in the hot sections (parallel/cpu.py ``hot_section``), alternated (optimizer steps: timing only)."""
    from megadare.parallel import cpu

    spent: dict[str, list[float]] = {"mode everywhere": [], "scoped": []}
    calls = {}
    mode_call = cpu._CudaToCpuMode.__torch_function__

    def counted(self, *a, **kw):
        calls[name] = calls.get(name, 0) + 1
        return mode_call(self, *a, **kw)

    for r in range(rounds + 1):
        for name, scoped in (("mode everywhere", False), ("scoped", True)):
            with swapped(
                [(cpu, "SCOPED", scoped)] + ([(cpu._CudaToCpuMode, "__torch_function__", counted)] * (r == 0))
            ):
                t0 = time.process_time()
                update(*args)
                if r:  # the first round counts the torch calls the mode sees (untimed)
                    spent[name].append(time.process_time() - t0)
    mid = {k: statistics.median(v) for k, v in spent.items()}
    low = {k: min(v) for k, v in spent.items()}
    a, b = "mode everywhere", "scoped"
    return (
        f"one whole update of the last step (CPU s, {rounds} alternated rounds, median / min): CUDA-to-CPU mode "
        f"everywhere {mid[a]:.4f} / {low[a]:.4f}, scoped to setup {mid[b]:.4f} / {low[b]:.4f}, "
        f"speed-up x{mid[a] / mid[b]:.2f} / x{low[a] / low[b]:.2f}; torch calls through the mode per update "
        f"{calls.get(a, 0)} vs {calls.get(b, 0)}"
    )


def threads_ab(update, args: tuple, rounds: int) -> str:
    """The step's whole update (optimizer steps: timing only) on torch's intra-op threads as the process has them
    vs on one, alternated; CPU and wall seconds (spinning threads count in CPU time, a loaded machine in wall)."""
    import torch

    n = torch.get_num_threads()
    spent: dict[int, dict[str, list[float]]] = {k: {"cpu": [], "wall": []} for k in (n, 1)}
    for r in range(rounds + 1):  # round 0 warms up
        for k in (n, 1) if r % 2 else (1, n):
            torch.set_num_threads(k)
            try:
                t0, w0 = time.process_time(), time.perf_counter()
                update(*args)
                if r:
                    spent[k]["cpu"].append(time.process_time() - t0)
                    spent[k]["wall"].append(time.perf_counter() - w0)
            finally:
                torch.set_num_threads(n)
    mid = {k: {m: statistics.median(v) for m, v in d.items()} for k, d in spent.items()}
    return (
        f"one whole update of the last step ({rounds} alternated rounds, median): {n} intra-op threads CPU "
        f"{mid[n]['cpu']:.4f} s wall {mid[n]['wall']:.4f} s, 1 thread CPU {mid[1]['cpu']:.4f} s wall "
        f"{mid[1]['wall']:.4f} s; ratio {n} / 1: CPU x{mid[n]['cpu'] / mid[1]['cpu']:.2f}, "
        f"wall x{mid[n]['wall'] / mid[1]['wall']:.2f}"
    )


def update_ab(update, args: tuple, rev: str, rounds: int) -> str:
    """The step's whole update (rows, packing, Megatron steps; optimizer steps included: timing only) with the
    ``rev`` commit's row builders and a dense attention mask built per layer, vs the current code, alternated."""
    from megadare.models import attention

    def per_layer(spec, q_len, kv_len, device):  # the baseline's allowed_from_megatron: no cache
        return spec.dense(q_len, kv_len, attention._mask_batch(spec), device=device)

    old = baseline_rows(rev) + [(attention, "dense_mask", per_layer)]
    spent: dict[str, list[float]] = {"baseline": [], "current": []}
    for _ in range(rounds):
        for name, names in (("baseline", old), ("current", [])):
            with swapped(names):
                t0 = time.process_time()
                update(*args)
                spent[name].append(time.process_time() - t0)
    mid = {k: statistics.median(v) for k, v in spent.items()}
    low = {k: min(v) for k, v in spent.items()}
    return (
        f"one whole update of the last step (CPU s, {rounds} alternated rounds, median / min): baseline {rev} "
        f"{mid['baseline']:.4f} / {low['baseline']:.4f}, current {mid['current']:.4f} / {low['current']:.4f}, "
        f"speed-up x{mid['baseline'] / mid['current']:.2f} / x{low['baseline'] / low['current']:.2f}"
    )


def rollout_ab(run, before: int, rounds: int) -> str:
    """The last step's rollout on the run's engines: its prompts in requests of ``before`` prompts (the demo's
    ``rollout.chunk_size`` before this branch) vs the run's chunk size, alternated; the trajectories (tokens, commit
    steps, log-probs) must be identical."""
    from dataclasses import replace

    r, cfg = run.rollouts, run.cfg
    if r.manager.chunk_size == before:
        return f"rollout A/B skipped: the run's rollout.chunk_size is --chunk-before ({before})"
    prompts = [r.train_prompts[i].prompt_ids for i in r.sampler.batch(run.step) for _ in range(cfg.rl.n_samples)]
    params = replace(run.spec.train_sampling, seed=cfg.seed * 100_003 + run.step)
    m, now = r.manager, r.manager.chunk_size
    spent: dict[int, list[float]] = {before: [], now: []}
    seen: dict[int, list] = {}
    try:
        for _ in range(rounds):
            for size in (before, now):
                m.chunk_size = size
                t0 = time.perf_counter()
                traj = m.generate(prompts, params)
                spent[size].append(time.perf_counter() - t0)
                seen[size] = [(t.response_ids, t.commit_step, t.block_step, t.logprobs) for t in traj]
    finally:
        m.chunk_size = now
    if seen[before] != seen[now]:
        raise SystemExit(f"rollout: requests of {before} and of {now} prompts gave different trajectories")
    mid = {k: statistics.median(v) for k, v in spent.items()}
    return (
        f"one step's rollout of {len(prompts)} prompts on {len(m.actors)} engine(s) (wall s, {rounds} alternated "
        f"rounds, median): requests of {before} prompts {mid[before]:.4f}, of {now} {mid[now]:.4f}, speed-up "
        f"x{mid[before] / mid[now]:.2f}; trajectories identical"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--baseline", default="f34a189", help="commit whose row building is the baseline")
    ap.add_argument("--long", type=int, default=512, help="also rows of 16 samples of this response length (0: no)")
    ap.add_argument("--chunk-before", type=int, default=16, help="rollout request size of the rollout baseline")
    ap.add_argument(
        "--no-freeze", action="store_true", help="baseline: the steps run without the set-up heap frozen (rl.py)"
    )
    ap.add_argument("--rows-only", action="store_true", help="only the rows and packing of a demo step, no run")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    if a.rows_only:
        print(f"load average {os.getloadavg()[0]:.2f} at the start, torch threads from OMP_NUM_THREADS")
        rows_micro(a.baseline, a.rounds, a.long)
        print(f"load average {os.getloadavg()[0]:.2f} at the end")
        return
    if a.steps < 3:
        raise SystemExit(f"--steps {a.steps}: at least 3 (the first step warms up, the last runs the A/B rounds)")
    print(f"load average {os.getloadavg()[0]:.2f} at the start", flush=True)
    t0 = time.perf_counter()
    import torch

    from megadare.config import load_config
    from megadare.trainer import rl, rl_update

    imports_s = time.perf_counter() - t0
    captured: dict = {}
    update, rl_step, frozen = rl_update.update, rl.rl_step, rl.set_up_heap_frozen
    clock = PhaseClock()
    clocked(clock)

    def keep_last(su, samples, *args, **kw):
        captured.update(su=su, samples=samples)
        if su.step == a.steps - 1:  # the last step: its whole update, old code vs new, before the real one
            captured["update"] = update_ab(update, (su, samples, *args), a.baseline, a.rounds)
            captured["mode"] = mode_ab(update, (su, samples, *args), a.rounds)
            captured["threads"] = threads_ab(update, (su, samples, *args), a.rounds)
            captured["rollout"] = rollout_ab(captured["run"], a.chunk_before, a.rounds)
        return update(su, samples, *args, **kw)

    def counted_step(run):  # the clock runs over the steady steps: not the first (warm-up), not the A/B one
        captured.setdefault("first_step_s", time.perf_counter() - captured["t_run"])
        captured["run"] = run
        clock.on = 0 < run.step < a.steps - 1
        try:
            return rl_step(run)
        finally:
            clock.on = False

    rl_update.update, rl.rl_step = keep_last, counted_step
    if a.no_freeze:
        rl.set_up_heap_frozen = contextlib.nullcontext
    with tempfile.TemporaryDirectory() as tmp:
        over = [f"rl.steps={a.steps}", f"logging.run_dir={tmp}", "checkpoint.save_interval=0", "rl.eval_size=4"]
        cfg = load_config(
            os.path.join(ROOT, "megadare/configs/demo_rl.yaml"), over + ["rl.eval_interval=0"] + a.overrides
        )
        captured["t_run"] = time.perf_counter()
        out = rl.run_rl(cfg)
    rl_update.update, rl.rl_step, rl.set_up_heap_frozen = update, rl_step, frozen
    clock.close()
    print(f"torch threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.2f} after the run")
    startup_table(clock, imports_s, captured["first_step_s"])
    step_table(out["history"][1:-1], clock, a.steps)
    print(captured["update"])
    print(captured["mode"])
    print(captured["threads"])
    print(captured["rollout"])
    su = captured["su"]
    row_building(su, captured["samples"], a.baseline, a.rounds)
    if a.long:
        samples = long_samples(16, 64, a.long, su.shape.block, su.shape.arch.vocab_size)
        row_building(su, samples, a.baseline, a.rounds)
    mask_building(su, captured["samples"], a.rounds)
    reward_scoring(a.baseline, a.rounds)
    print(f"load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
