"""The printed plan: parameter counts, a per-GPU memory table (GB = 2^30 bytes), the rollout engines, the verdict
and, when it does not fit, the knobs with their estimated effect."""

from __future__ import annotations

from megadare.plan.memory import GIB
from megadare.plan.report import PlanReport

ROWS = (
    ("weights", "weights ({dtype})"),
    ("grads", "gradients (fp32 buffer)"),
    ("optimizer", "optimizer ({opt})"),
    ("activations", "activations ({inflight}, recompute={recompute})"),
    ("logits", "logits + loss (last stage)"),
    ("reference", "reference model (KL)"),
    ("reserve", "reserve (context, NCCL, fragmentation)"),
)


W = 46


def _b(n: float) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(int(n))


def _gb(x: float) -> str:
    return f"{x / GIB:9.2f}"


def format_report(r: PlanReport) -> str:
    """The whole printed plan: header, per-GPU memory table, rollout engines, verdict and advice."""
    stages = _shown_stages(r)
    lines = _header(r, stages) + _memory_table(r, stages) + _rollout_lines(r) + _verdict_lines(r)
    return "\n".join(lines)


def _shown_stages(r: PlanReport) -> list:
    """The pipeline stages given a column: the first, the last and the worst (one column without PP)."""
    stages = [r.stages[0]] if r.layout.pp == 1 else [r.stages[0], r.stages[-1]]
    if r.worst_stage not in stages:
        stages.append(r.worst_stage)
    return stages


def _header(r: PlanReport, stages: list) -> list[str]:
    """The model, its parameter counts, the trainer layout and the memory table's column heads."""
    lay, pc = r.layout, r.params
    heads = ["GPU"] if lay.pp == 1 else [f"stage {s.rank}" for s in stages]
    return [
        f"megadare plan: {r.model}",
        f"  parameters: total {_b(pc.total)}, active {_b(pc.active)} (non-embedding {_b(pc.active_non_embedding)})"
        + (f", routed experts {_b(pc.experts)}" if pc.experts else ""),
        f"  trainer: {lay.world} GPUs, tp={lay.tp} pp={lay.pp}"
        + (f" vpp={lay.vpp}" if lay.vpp else "")
        + f" cp={lay.cp} ep={lay.ep} etp={lay.etp} sp={'on' if lay.sp else 'off'} -> dp={lay.dp}"
        + (f", expert-dp={lay.expert_dp}" if pc.experts else "")
        + f"; {_b(r.stages[0].params)} parameters on a first-stage GPU",
        "",
        f"  {'per GPU (GB)':{W}s}" + "".join(f"{h:>12s}" for h in heads),
    ]


def _memory_table(r: PlanReport, stages: list) -> list[str]:
    """One row per memory item (``ROWS``; logits and reference only when non-zero), the trainer total and the
    output layer's path."""
    lay, pc = r.layout, r.params
    opt = ("master+Adam" if r.dtype != "fp32" else "Adam m,v") + (
        f" /{lay.dp * lay.cp} dp" + (f", /{lay.expert_dp} edp" if pc.experts else "")
        if r.distributed_optimizer
        else ", unsharded"
    )
    lines = []
    for key, label in ROWS:
        values = [getattr(s, key) for s in stages]
        if key in ("logits", "reference") and not any(values):
            continue
        inflight = "/".join(str(s.in_flight) for s in stages) + " in flight"
        text = label.format(dtype=r.dtype, opt=opt, inflight=inflight, recompute=r.recompute)
        lines.append(f"  {text:{W}s}" + "".join(f"{_gb(v):>12s}" for v in values))
    lines.append(f"  {'trainer total':{W}s}" + "".join(f"{_gb(s.total):>12s}" for s in stages))
    if r.logits_path:
        lines.append(f"  output layer (train.logits) {r.logits_path}")
    return lines


def _rollout_lines(r: PlanReport) -> list[str]:
    """The rollout engines' memory (none without a rollout) and, colocated, the rollout phase's total."""
    ro = r.rollout
    if ro is None:
        return []
    where = "colocated with the trainer" if ro.colocated else "on GPUs of their own"
    lines = [
        "",
        f"  rollout: {ro.engines} engines x tp={ro.tp}, {where}; {ro.batch} sequences x {ro.tokens} tokens each",
        f"  {'engine weights':{W}s}{_gb(ro.weights):>12s}",
        f"  {'KV cache':{W}s}{_gb(ro.kv_cache):>12s}",
        f"  {'block logits (fp32)':{W}s}{_gb(ro.logits):>12s}",
        f"  {'engine total':{W}s}{_gb(ro.total):>12s}",
    ]
    if ro.colocated:
        static = max(s.static for s in r.stages)
        lines.append(f"  {'rollout phase (trainer state + engine)':{W}s}{_gb(static + ro.total):>12s}")
    return lines


def _verdict_lines(r: PlanReport) -> list[str]:
    """The peak against the GPU's memory and, when it does not fit, each knob with its estimated effect."""
    verdict = "fits" if r.fits else "DOES NOT FIT"
    lines = [
        "",
        f"  peak {r.peak / GIB:.2f} GB of {r.gpu_memory / GIB:.0f} GB per GPU ({r.bottleneck} phase): {verdict}",
    ]
    if not r.fits:
        if not r.advice:
            lines.append("  no single knob or chain of knobs found that fits; add GPUs (plan.nodes) or a larger GPU")
        for a in r.advice:
            mark = "fits" if a["fits"] else "    "
            lines.append(
                f"  -> {a['change']:58s} peak {a['peak_gb']:7.2f} GB (-{a['saves_gb']:.2f})  {mark}  cost: {a['cost']}"
            )
    return lines
