"""Is ``rollout.compile`` the same decoder as eager, and how much faster? The built-in engine on the SDAR-1.7B shape
(GPU; a small shape on a CPU), eager and compiled (CUDA graphs on CUDA), on the same prompts and seeds.

    python benchmarks/rollout_compile.py --dtype fp32 --new 64     # the trace: compiled == eager, token for token
    python benchmarks/rollout_compile.py --dtype bf16 --profile    # the speed, and where a compiled call's time goes

A random model's next-token distributions are flat: over 151,936 near-equal probabilities the inverse-CDF draw
moves to another token on any rounding change, so two correct implementations that round differently part at
the first step. ``--head-scale`` (default 10) multiplies the tied embedding / LM head so the distributions are
peaked like a trained model's (mean -log p of the sampled tokens is printed); in fp32 the compiled decoder must
then reproduce eager's tokens and commit steps exactly; in bf16 fused kernels round differently and trajectories
part at near-ties, as they do between any two bf16 engines.

Every result line starts with ``rollout compile`` (benchmarks/gpu_check.py keeps them): tok/s of both (best of
``--rounds`` calls after the compiling one), the compile call's seconds, tokens / commit steps / whole rows equal.
``--profile``: one compiled call under torch.profiler, wall vs GPU-busy time and the top ops by GPU time; then
the ``--ops`` count. ``--ops``: one more compiled call, the aten ops that run outside the compiled graphs (in the
block loop per denoising step, and outside it: admission, eager prefill, results) and the host syncs among them
(``tolist``, ``item``, ``bool``, ``tensor(list)``), by source function (a ``rollout compile ops`` line and two
tables); on a CPU through dynamo's ``aot_eager`` with the CUDA-graph path's static shapes, so a small shape counts
in a minute (``--dtype fp32 --batch 4 --prompt 8 --new 16 --rounds 1 --ops``). ``--compiled-only``: no eager baseline.
``--algorithm`` (the commit rule: ``low_confidence_dynamic``, threshold decoding, and ``editing``, LLaDA2.1's token
editing, read a flag per step) and ``--record-steps`` (MDPO's per-step records) time and count those decoders.
``--unfused``: the layout's separate q/k/v and gate/up GEMMs (``DecoderLM.unfuse_projections``; the engine fuses
them by default), the A/B of that fusion. ``--sdpa``: which kernel SDPA may pick, for eager and compiled alike
(``auto``: torch's choice, cuDNN on an H200, 32 us per layer for a 4-query block in the 2026-11-27 profile;
``efficient``, ``math``: the alternatives to time). Then ``stop_at_eos`` (RL's 'eos' canvas): the flags read a block
late, as on CUDA (``decoders.StopFlags``), must decode what reading them at once decodes, eager and compiled (its
``stop at eos`` line). Then the weights are pushed (every parameter moved by 10% of its spread, in place, as RL's
sync does) and the compiled engine put to sleep and woken (a colocated engine's cycle): its ``after a weight push``
line says whether it still decodes what eager decodes, and how long its first call took after each (a re-recorded
CUDA graph shows). Each phase prints a ``[rollout_compile]`` line with its seconds as it ends (a run cut by a
timeout still says how far it got and how fast eager was). Exit status 1 when fp32 trajectories differ (before or
after the push, or read a block late), or (one line) when the kernel ``--sdpa`` holds SDPA to cannot run the
engine's attention call (torch's "No available kernel").
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import platform
import sys
import time
from dataclasses import replace

import torch

from megadare.rollout import decoders
from megadare.rollout.choices import ALGORITHMS
from megadare.rollout.engine import SamplingParams
from megadare.rollout.native import NativeEngine, NativeSettings

import rollout_timing as rt

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
SDPA = ("auto", "cudnn", "efficient", "math")


def sdpa_kernels(name: str):
    """A context that limits SDPA to one kernel (``auto``: no limit)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kinds = {"cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
    return contextlib.nullcontext() if name == "auto" else sdpa_kernel([kinds[name]])


def peaked_model(gpu: bool, dtype: torch.dtype, scale: float):
    """The SDAR benchmark shape (rollout_timing.build) in ``dtype`` with its LM head scaled by ``scale``."""
    model, arch = rt.build("sdar", gpu, vocab=None if gpu else 1024)
    model = model.to(dtype)
    with torch.no_grad():
        params = dict(model.named_parameters())
        params.get("lm_head.weight", params["model.embed_tokens.weight"]).mul_(scale)  # SDAR-1.7B ties them
    return model, arch


def best_call(engine: NativeEngine, prompts, params, rounds: int):
    """(seconds of the fastest of ``rounds`` calls, that call's trajectories)."""
    best = None
    for _ in range(rounds):
        rt.sync()
        t0 = time.perf_counter()
        out = engine.generate(prompts, params)
        rt.sync()
        dt = time.perf_counter() - t0
        if best is None or dt < best[0]:
            best = (dt, out)
    return best


def agreement(eager, compiled) -> str:
    n = sum(len(t.response_ids) for t in eager)
    tokens = sum(a == b for x, y in zip(eager, compiled) for a, b in zip(x.response_ids, y.response_ids))
    steps = sum(a == b for x, y in zip(eager, compiled) for a, b in zip(x.commit_step, y.commit_step))
    rows = sum(x.response_ids == y.response_ids and x.commit_step == y.commit_step for x, y in zip(eager, compiled))
    return f"tokens equal {tokens}/{n}, commit steps equal {steps}/{n}, rows identical {rows}/{len(eager)}"


def profile_call(engine: NativeEngine, prompts, params) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        rt.sync()
        t0 = time.perf_counter()
        engine.generate(prompts, params)
        rt.sync()
        wall = time.perf_counter() - t0
    ops = prof.key_averages()
    busy = kernel_ms(ops)
    print(
        f"rollout compile profile: wall {wall * 1e3:.0f} ms (profiled), GPU kernels {busy:.0f} ms "
        f"({busy / (wall * 1e3):.0%} of the wall)",
        flush=True,
    )
    print(ops.table(sort_by="self_device_time_total", row_limit=20, max_name_column_width=60), flush=True)


def kernel_ms(ops) -> float:
    """The device's own events (kernels, copies), the way the profiler's table totals them: the rows of CPU-side
    records are not device time (the sixth session summed every row and printed 6,103 ms of "device busy" for a
    481 ms call: ``Command Buffer Full``, the CUPTI record of a launch queue that filled, held 5,261 ms, and each
    ``## Call CompiledFxGraph`` annotation repeats its graph's kernels)."""
    from torch.autograd import DeviceType

    return (
        sum(
            e.self_device_time_total
            for e in ops
            if e.device_type in (DeviceType.CUDA, DeviceType.PrivateUse1) and not e.is_user_annotation
        )
        / 1e3
    )


def pushed_weights(model: torch.nn.Module):
    """Every parameter moved by 10% of its spread: a weight push whose trajectories differ from the old weights'."""
    out = []
    for name, p in model.named_parameters():
        g = torch.Generator(device=p.device).manual_seed(2)
        noise = torch.randn(p.shape, generator=g, device=p.device, dtype=torch.float32)
        out.append((name, (p.float() + 0.1 * p.float().std() * noise).to(p.dtype)))
    return out


def after_push(eager: NativeEngine, compiled: NativeEngine, prompts, params, before) -> bool:
    """RL's weight sync into a compiled engine: the push copies in place into the parameters the CUDA graphs
    captured, and sleep / wake (colocated engines) moves them away and back. After each, the compiled engine must
    decode what eager decodes with the new weights (both engines share one model). Prints one line; True when the
    trajectories agree and the push changed them."""
    compiled.update_weights(pushed_weights(compiled.model), version=1)
    rt.sync()
    t0 = time.perf_counter()
    got = compiled.generate(prompts, params)
    rt.sync()
    t_push = time.perf_counter() - t0
    want = eager.generate(prompts, params)
    changed = sum((x.response_ids, x.commit_step) != (y.response_ids, y.commit_step) for x, y in zip(before, want))
    compiled.sleep()
    compiled.wake()
    rt.sync()
    t0 = time.perf_counter()
    woken = compiled.generate(prompts, params)
    rt.sync()
    t_wake = time.perf_counter() - t0
    print(
        f"rollout compile after a weight push: first call {t_push:.2f} s, {agreement(want, got)}, rows changed by "
        f"the push {changed}/{len(want)}; after sleep / wake: first call {t_wake:.2f} s, {agreement(want, woken)}",
        flush=True,
    )
    return changed > 0 and all(same_traces(want, x) for x in (got, woken))


def stop_at_eos(eager: NativeEngine, compiled: NativeEngine, prompts, params, before) -> bool:
    """``stop_at_eos`` (RL's 'eos' canvas) with the stop flags read a block late (``decoders.StopFlags``, what
    CUDA does; forced here on any device) against read at once: the engines' EOS set to a token their trajectories
    hold early, so rows stop at different blocks. Prints one line; True when eager and compiled, deferred, decode
    what eager decodes reading at once (tokens, commit steps, finish reasons, forwards)."""
    eos = before[0].response_ids[len(before[0].response_ids) // 4]
    eos_params = replace(params, stop_at_eos=True)
    runs = {}
    for name, engine, deferred in (
        ("at once", eager, ()),
        ("eager", eager, ("cpu", "cuda")),
        ("compiled", compiled, ("cpu", "cuda")),
    ):
        engine.eos, kept = eos, engine.eos
        decoders.DEFERRED_STOP_READS, kept_reads = deferred, decoders.DEFERRED_STOP_READS
        try:
            runs[name] = [
                (t.response_ids, t.commit_step, t.finish_reason, t.num_forwards)
                for t in engine.generate(prompts, eos_params)
            ]
        finally:
            engine.eos, decoders.DEFERRED_STOP_READS = kept, kept_reads
    want = runs["at once"]
    stopped = sum(finish == "eos" for _, _, finish, _ in want)
    same = {k: sum(x == y for x, y in zip(want, v)) for k, v in runs.items() if k != "at once"}
    print(
        f"rollout compile stop at eos (token {eos}; {stopped}/{len(want)} rows stopped at it): read a block late == "
        f"read at once: eager {same['eager']}/{len(want)} rows, compiled {same['compiled']}/{len(want)} rows",
        flush=True,
    )
    return all(n == len(want) for n in same.values())


def same_traces(a, b) -> bool:
    return [(t.response_ids, t.commit_step) for t in a] == [(t.response_ids, t.commit_step) for t in b]


GRAPH_CALL = "## Call CompiledFxGraph"  # inductor's record_function around a compiled graph (a CUDA graph replay)
READS = {
    "aten::item": "item/int",
    "aten::is_nonzero": "bool",
    "aten::resolve_conj": "tolist",
    "aten::lift_fresh": "tensor(list)",
}


def _outside_graphs(events) -> list:
    """The aten ops of ``events`` that run eagerly: not inside a compiled graph nor inside another aten op."""
    out = []
    for e in events:
        if not e.name.startswith("aten::"):
            continue
        p, nested = e.cpu_parent, False
        while p is not None and not nested:
            nested = p.name.startswith(("aten::", GRAPH_CALL))
            p = p.cpu_parent
        if not nested:
            out.append(e)
    return out


def _site(e) -> tuple[str, bool]:
    """(innermost megadare function of an op, whether it runs inside the block loop ``Decoder.round``)."""
    p, site, in_loop = e.cpu_parent, "", False
    while p is not None:
        if "megadare/" in p.name:
            site = site or p.name.split("megadare/")[-1]
            in_loop = in_loop or p.name.endswith(": round")
        p = p.cpu_parent
    return site or "?", in_loop


def emulate_graphs_on_cpu(engine: NativeEngine) -> None:
    """``--ops`` on a CPU: the engine's CUDA-graph path (static shapes, rows and key lengths bucketed) through dynamo
    with the ``aot_eager`` backend (inductor's C++ build takes minutes here), each graph call marked as inductor
    marks it, so that the counts are those of the GPU's path."""
    compile_ = torch.compile

    def backend(gm, inputs):
        def call(*args):
            with torch.profiler.record_function(f"{GRAPH_CALL} (aot_eager)"):
                return gm.forward(*args)

        return call

    def marked(fn, **kw):
        return compile_(fn, backend=backend, dynamic=kw.get("dynamic") if kw.get("mode") is None else False)

    torch.compile = marked
    try:
        engine.graphs = True
        engine.use_compiled()
    finally:
        torch.compile = compile_


def count_ops(engine: NativeEngine, prompts, params) -> None:
    """One generate call under the profiler (CPU events, Python frames): the aten ops that run outside the
    compiled graphs, in the block loop (per denoising step: divided by the call's forwards) and outside it
    (admission, prefill, results), and the host reads among them (``tolist``, ``item`` / ``int``, ``bool``;
    ``tensor(list)``: a host-to-device copy, blocking on CUDA, when made on the device): each a sync on CUDA."""
    from torch.profiler import ProfilerActivity, profile

    forwards, blocks = engine.forwards, -(-params.max_new_tokens // params.block_size)
    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        engine.generate(prompts, params)
    events = prof.events()
    forwards = engine.forwards - forwards - 1  # the prefill is one eager forward
    graphs = sum(e.name.startswith(GRAPH_CALL) for e in events)
    ops = [(e.name, *_site(e)) for e in _outside_graphs(events)]
    loop = [o for o in ops if o[2]]
    reads = [o for o in ops if o[0] in READS]
    print(
        f"rollout compile ops: {forwards} decode forwards, {blocks} blocks/row, {graphs} compiled-graph calls; "
        f"eager ops outside graphs {len(ops)}: block loop {len(loop)} ({len(loop) / max(forwards, 1):.1f} per "
        f"denoising step), outside it {len(ops) - len(loop)}; host syncs {len(reads)}: block loop "
        f"{sum(o[2] for o in reads)} ({sum(o[2] for o in reads) / blocks:.1f} per block), outside it "
        f"{sum(not o[2] for o in reads)}",
        flush=True,
    )
    for title, chosen, top in (("block loop", loop, 20), ("host syncs", reads, 10)):
        print(f"  {title}, by site (count; per denoising step):", flush=True)
        for (site, name), k in collections.Counter((site, name) for name, site, _ in chosen).most_common(top):
            sync = f"  (a sync on CUDA: {READS[name]})" if name in READS else ""
            print(f"  {k:6d} {k / max(forwards, 1):6.2f}  {name:24s} {site}{sync}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--head-scale", type=float, default=10.0, help="peaked distributions (see above)")
    ap.add_argument("--profile", action="store_true", help="one compiled call under torch.profiler")
    ap.add_argument("--ops", action="store_true", help="count eager ops and host syncs of one compiled call")
    ap.add_argument("--compiled-only", action="store_true", help="skip the eager baseline (saves device time)")
    ap.add_argument("--unfused", action="store_true", help="q/k/v and gate/up as separate GEMMs (see above)")
    ap.add_argument("--sdpa", choices=SDPA, default="auto", help="the one SDPA kernel allowed (see above)")
    ap.add_argument("--algorithm", choices=ALGORITHMS, default="low_confidence_static", help="the commit rule")
    ap.add_argument("--record-steps", action="store_true", help="MDPO's per-step records (keep_history)")
    args = ap.parse_args()
    try:
        with sdpa_kernels(args.sdpa):
            run(args)
    except RuntimeError as e:
        if not any(m in str(e) for m in ("No available kernel", "No viable backend")):  # CUDA's, the CPU's
            raise
        sys.exit(
            f"rollout compile: SDPA held to {args.sdpa!r} has no kernel for the engine's attention call here "
            f"(torch: {str(e).splitlines()[0].strip()}); time another --sdpa (on the H200, 2026-11-27, 'efficient' "
            "had none: the engine passes grouped KV heads, enable_gqa)"
        )


def host() -> str:
    """The host CPU and its load: eager decoding is bound by the host launching kernels, and a busy or slower host
    moved eager and compiled alike on the H200 (GPU.md, 2026-11-27)."""
    model = platform.processor() or "?"
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), model)
    return f"{model}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}"


def run_words(args, device) -> str:
    """The result line's opening: what ran, on which device, with which kernels and shapes."""
    projections = "unfused" if args.unfused else "fused"
    return (
        f"rollout compile {args.dtype} on {device}, sdpa {args.sdpa}, projections {projections}, batch {args.batch}, "
        f"prompt {args.prompt}, {args.new} new, block 4, 4 steps/block, {args.algorithm}"
        + (", record_steps" if args.record_steps else "")
    )


def progress(t0: float, what: str) -> None:
    print(f"[rollout_compile] {time.perf_counter() - t0:6.1f} s  {what}", file=sys.stderr, flush=True)


def compiled_only(args, compiled: NativeEngine, prompts, params, start: float) -> None:
    """``--compiled-only``: the compiled engine's speed and op counts without the eager baseline (device time)."""
    compiled.generate(prompts, params)
    rt.sync()
    progress(start, "compiled: first call (compiling) done")
    t_compiled, _ = best_call(compiled, prompts, params, args.rounds)
    n = args.batch * args.new
    print(
        f"{run_words(args, compiled.device)}: compiled {n / t_compiled:.0f} tok/s "
        f"({t_compiled * 1e3:.0f} ms per call; no eager baseline: --compiled-only)",
        flush=True,
    )
    if args.profile and compiled.device.type == "cuda":
        profile_call(compiled, prompts, params)
    if args.ops or args.profile:
        count_ops(compiled, prompts, params)


def run(args) -> None:
    gpu, start = torch.cuda.is_available(), time.perf_counter()
    dev, dtype = ("cuda" if gpu else "cpu"), DTYPES[args.dtype]
    model, arch = peaked_model(gpu, dtype, args.head_scale)
    progress(start, f"model built ({args.dtype}, sdpa {args.sdpa}); host {host()}")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 1000, (args.prompt,), generator=g).tolist() for _ in range(args.batch)]
    params = SamplingParams(
        max_new_tokens=args.new,
        block_size=4,
        steps_per_block=4,
        temperature=1.0,
        stop_at_eos=False,
        seed=1,
        algorithm=args.algorithm,
        record_steps=args.record_steps,
    )
    eager = NativeEngine(model, arch, eos_token_id=-1, device=dev, dtype=dtype)
    compiled = NativeEngine(
        model, arch, eos_token_id=-1, device=dev, dtype=dtype, settings=NativeSettings(compile=True)
    )
    if args.unfused:  # both engines decode the one model
        model.unfuse_projections()
    if args.ops and not gpu:
        emulate_graphs_on_cpu(compiled)
    if args.compiled_only:
        return compiled_only(args, compiled, prompts, params, start)
    n = args.batch * args.new
    eager.generate(prompts, params)
    progress(start, "eager: first call done")
    t_eager, want = best_call(eager, prompts, params, args.rounds)
    progress(start, f"eager: best of {args.rounds} calls {n / t_eager:.0f} tok/s; compiling")
    t0 = time.perf_counter()
    compiled.generate(prompts, params)
    rt.sync()
    t_compile = time.perf_counter() - t0
    progress(start, f"compiled: first call (compiling) {t_compile:.1f} s")
    t_compiled, got = best_call(compiled, prompts, params, args.rounds)
    nll = sum(-lp for t in want for lp in t.logprobs) / n
    print(
        f"{run_words(args, dev)}, head x{args.head_scale:g} (mean -log p {nll:.2f}): compiled {n / t_compiled:.0f} tok/s, "
        f"eager {n / t_eager:.0f} tok/s ({t_eager / t_compiled:.2f}x); compile call {t_compile:.1f} s; "
        f"{agreement(want, got)}",
        flush=True,
    )
    if args.profile and gpu:
        profile_call(compiled, prompts, params)
    if args.ops or args.profile:
        count_ops(compiled, prompts, params)
    if args.dtype == "fp32" and not same_traces(want, got):
        sys.exit("rollout compile: in fp32 the compiled engine's trajectories differ from eager's (see above)")
    if not stop_at_eos(eager, compiled, prompts, params, want) and args.dtype == "fp32":
        sys.exit("rollout compile: in fp32, stop_at_eos's flags read a block late decode otherwise than read at once")
    pushed = after_push(eager, compiled, prompts, params, want)
    progress(start, "compiled: after a weight push and a sleep / wake")
    if args.dtype == "fp32" and not pushed:
        sys.exit(
            "rollout compile: in fp32, after a weight push or a sleep / wake the compiled engine decodes otherwise "
            "than eager with the new weights, or the push changed nothing (see above)"
        )


if __name__ == "__main__":
    main()
