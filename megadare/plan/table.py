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
    lay, pc = r.layout, r.params
    stages = [r.stages[0]] if lay.pp == 1 else [r.stages[0], r.stages[-1]]
    worst = r.worst_stage
    if worst not in stages:
        stages.append(worst)
    heads = ["GPU"] if lay.pp == 1 else [f"stage {s.rank}" for s in stages]
    opt = ("master+Adam" if r.dtype != "fp32" else "Adam m,v") + (
        f" /{lay.dp * lay.cp} dp" + (f", /{lay.expert_dp} edp" if pc.experts else "")
        if r.distributed_optimizer
        else ", unsharded"
    )
    lines = [
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
    if r.rollout is not None:
        ro = r.rollout
        where = "colocated with the trainer" if ro.colocated else "on GPUs of their own"
        lines += [
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
    verdict = "fits" if r.fits else "DOES NOT FIT"
    lines += [
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
    return "\n".join(lines)
