"""The steps of benchmarks/gpu_steps.py that run training: ``planner`` (planned against measured memory),
``profile`` (the top kernels of a train step) and ``sft`` / ``rl`` (short runs through megadare's command line)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time


from gpu_step_report import HERE, ROOT, Report, one_line_error


# ============================================================================================== planner
def step_planner(rep: Report, args) -> None:
    """megadare's planner against torch.cuda.max_memory_allocated of the same train step (train_throughput's dense
    shape, micro-batch 1, full sequence, bf16, SDPA). The verdict: the planner does not under-estimate the
    allocations (weights, gradients, optimizer, activations, logits) by more than 10%."""
    sys.path.insert(0, HERE)
    import train_throughput as tt

    from megadare.config import load_config
    from megadare.parallel import destroy_distributed, init_distributed
    from megadare.plan import plan

    gpu = args.device == "cuda"
    arch = tt.SHAPES["dense"] if gpu else tt.cpu_shape(tt.SHAPES["dense"])
    seq, dtype = (2048, "bf16") if gpu else (128, "fp32")
    cfg = load_config(
        None,
        [
            f"model.dtype={dtype}",
            f"train.seq_length={seq}",
            "train.micro_batch_size=1",
            "train.global_batch_size=1",
            "model.attention_backend=sdpa",
            "plan.nodes=1",
            "plan.gpus_per_node=1",
        ],
    )
    report = plan(cfg, arch, advise=False)
    stage = report.worst_stage
    init_distributed()
    try:
        _, measured, _ = tt.run_backend(arch, "sdpa", 1, seq, "bidirectional", 1, dtype)
    finally:
        destroy_distributed()
    planned = (stage.total - stage.reserve) / 2**30  # what the allocator hands out; reserve: context, slack
    ratio = measured / planned
    rep.add(
        "max_memory_allocated / planned allocations (GiB)",
        ratio <= 1.1 if gpu else None,
        round(measured, 2),
        planned=round(planned, 2),
        ratio=round(ratio, 3),
        reserve=round(stage.reserve / 2**30, 2),
        activations=round(stage.activations / 2**30, 2),
        measured_is="max_memory_allocated" if gpu else "RSS (CPU): not comparable",
    )


# ============================================================================================== profile
# Kernel name -> what it is, first match wins (CUDA kernel names; on the CPU the aten op names).
KERNEL_KINDS = [
    ("optimizer", ("adam", "multi_tensor")),
    ("loss (vocab-wide)", ("logsoftmax", "log_softmax", "nll_loss", "cross_entropy", "logsumexp")),
    ("attention", ("flash", "fmha", "attention", "cudnn", "flex", "_sdpa", "softmax_warp")),
    ("matmul", ("gemm", "xmma", "cutlass", "nvjet", "cublas", "aten::mm", "aten::addmm", "aten::bmm")),
    ("communication", ("nccl", "gloo", "all_reduce", "allreduce", "reduce_scatter", "all_gather")),
    ("copies", ("memcpy", "memset", "copy", "catarray", "aten::cat")),
    ("reductions", ("reduce", "sum", "mean", "norm")),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "aten::")),
]


def kernel_kind(name: str) -> str:
    low = name.lower()
    return next((kind for kind, keys in KERNEL_KINDS if any(k in low for k in keys)), "other")


def profiled_kernels(events, key: str, gpu: bool) -> list:
    """The events that are kernels, each counted once: on CUDA the device's own events (the ops that launch them
    and the step annotations are left out), on the CPU the aten ops (self time: nested ops are not counted
    twice)."""
    from torch.autograd import DeviceType

    timed = [e for e in events if float(getattr(e, key, 0) or 0) > 0 and not e.key.startswith("ProfilerStep")]
    if not gpu:
        return [e for e in timed if e.key.startswith("aten::")]
    device = [e for e in timed if getattr(e, "device_type", None) == DeviceType.CUDA]
    return device or [e for e in timed if not e.key.startswith("aten::") and "#" not in e.key]


def step_profile(rep: Report, args) -> None:
    """Train steps of train_throughput's dense shape under torch.profiler, at the configuration issue 23's MFU
    target is about (GPU: seq 2048, batch 4, bf16, SDPA): the build and two warm-up steps are not recorded, three
    steps are. Rows: the step time, tokens/s and the device time by kind of kernel (matmul, attention, optimizer,
    copies, elementwise ...); profile_top_kernels.txt: the top kernels and the top aten ops (inclusive device
    time: which op launches them). ``args.variant``: the step fusions it runs with (train_throughput.VARIANTS)."""
    from torch.profiler import ProfilerActivity, profile, schedule

    sys.path.insert(0, HERE)
    import train_throughput as tt

    from megadare.parallel import destroy_distributed, init_distributed

    gpu = args.device == "cuda"
    arch = tt.SHAPES["dense"] if gpu else tt.cpu_shape(tt.SHAPES["dense"])
    seq, batch, dtype, backend = (2048, 4, "bf16", "sdpa") if gpu else (128, 2, "fp32", "sdpa")
    if args.variant not in tt.VARIANTS:
        raise SystemExit(f"--variant {args.variant}: not one of {sorted(tt.VARIANTS)}")
    init_distributed()
    try:
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
        with profile(activities=acts, schedule=schedule(wait=1, warmup=1, active=3)) as prof:
            dt, _, _ = tt.run_backend(
                arch, backend, batch, seq, "bidirectional", 3, dtype, on_step=prof.step, variant=args.variant
            )
    finally:
        destroy_distributed()
    key = "self_device_time_total" if gpu else "self_cpu_time_total"
    events = prof.key_averages()
    kernels = profiled_kernels(events, key, gpu)
    total = sum(float(getattr(e, key)) for e in kernels) or 1.0
    kinds: dict[str, float] = {}
    for e in kernels:
        kind = kernel_kind(e.key)
        kinds[kind] = kinds.get(kind, 0.0) + float(getattr(e, key))
    shares = sorted(((k, 100 * v / total) for k, v in kinds.items()), key=lambda kv: -kv[1])
    head = (
        f"dense shape, seq {seq}, batch {batch}, {dtype}, {backend}, step fusions: {args.variant}; "
        f"3 profiled steps, {dt:.4f} s per step\n"
    )
    by_kind = "".join(f"{k:20s} {share:5.1f}%\n" for k, share in shares)
    incl = "device_time_total" if gpu else "cpu_time_total"
    with open(os.path.join(args.out, "profile_top_kernels.txt"), "w") as f:
        f.write(head + "\nself time by kind of kernel:\n" + by_kind)
        f.write("\ntop kernels:\n" + events.table(sort_by=key, row_limit=25, max_name_column_width=80))
        f.write("\n\ntop aten ops, inclusive:\n" + events.table(sort_by=incl, row_limit=40, max_name_column_width=60))
    rep.add("profiled step time (s)", True, round(dt, 4), backend=backend, batch=batch, seq=seq, variant=args.variant)
    rep.add("profiled tokens/s", None, round(batch * seq / dt), note="profiler overhead included")
    for kind, share in shares:
        rep.add(f"device time: {kind}", None, round(share, 1), unit="%")


# ============================================================================================== sft, rl
def metrics(run_dir: str) -> list[dict]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def run_logged(cmd: list[str], log: str, timeout: float) -> tuple[int, str]:
    """Run ``cmd`` from the repository root, output to ``log``; (exit code, the last lines without progress bars)."""
    print("$ " + " ".join(cmd), flush=True)
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=max(5.0, timeout)).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    with open(log, errors="replace") as f:
        lines = [ln for ln in f.read().replace("\r", "\n").splitlines() if ln.strip() and "it/s]" not in ln]
    print("\n".join(lines[-15:]), flush=True)
    return rc, "\n".join(lines[-40:])


def sft_command(run_dir: str, steps: int, tiny: bool) -> list[str]:
    """``megadare sft`` of the tiny SDAR example (block diffusion on the addition task), as a user runs it."""
    return [
        sys.executable,
        "-m",
        "megadare",
        "sft",
        "--config",
        "examples/configs/sft_sdar_tiny.yaml",
        f"model.dtype={'fp32' if tiny else 'bf16'}",
        f"train.steps={steps}",
        f"checkpoint.save_interval={max(2, steps // 2)}",
        f"logging.run_dir={run_dir}",
    ]


def step_sft(rep: Report, args) -> None:
    """N steps of ``megadare sft`` (the loss must fall), then the same command with N + k steps: it resumes from
    the step-N checkpoint and logs exactly steps N+1 .. N+k."""
    n, extra = (6, 2) if args.tiny else (20, 4)
    run_dir = tempfile.mkdtemp(prefix="gpu_check_sft_")
    rc, tail = run_logged(sft_command(run_dir, n, args.tiny), os.path.join(run_dir, "sft.log"), args.budget)
    m = metrics(run_dir)
    losses = [x["loss"] for x in m if "loss" in x]
    k = max(1, min(3, len(losses) // 3))
    first, last = (sum(losses[:k]) / k, sum(losses[-k:]) / k) if losses else (None, None)
    rep.add(
        f"sft {n} steps ({'fp32' if args.tiny else 'bf16'})",
        rc == 0 and len(losses) == n and last < first,
        f"loss {first:.4f} -> {last:.4f}" if losses else None,
        rc=rc,
        steps_logged=len(losses),
        tokens_per_s=m[-1].get("tokens_per_s") if m else None,
        memory_gib=m[-1].get("memory_gib") if m else None,
        **({} if rc == 0 else {"error": tail[-600:]}),
    )
    if rc != 0:
        return
    rc, tail = run_logged(sft_command(run_dir, n + extra, args.tiny), os.path.join(run_dir, "resume.log"), args.budget)
    steps = [x.get("step") for x in metrics(run_dir)]
    rep.add(
        f"sft resume {n} -> {n + extra}",
        rc == 0 and steps == list(range(1, n + extra + 1)),
        steps[-extra - 1 :] if steps else None,
        rc=rc,
        **({} if rc == 0 else {"error": tail[-600:]}),
    )
    shutil.rmtree(run_dir, ignore_errors=True)


# (rollout.weight_transport, where the engine runs, more overrides): first the colocated engine with
# rollout.compile=true (CUDA graphs inside the RL loop: weight pushes into the graphed model; a GPU only, the CPU
# compiles for minutes; the other cases passed on an H200 already), then each transport with the engine on the
# trainer's GPU (auto, colocated, object_store) or on the CPU (distributed: NCCL cannot put two ranks of one group
# on one GPU, so on one GPU it goes to a CPU engine)
RL_CASES = [
    ("colocated", "gpu", ("rollout.compile=true",)),
    ("auto", "gpu", ()),
    ("colocated", "gpu", ()),
    ("object_store", "gpu", ()),
    ("distributed", "cpu", ()),
]


def rl_command(
    run_dir: str, transport: str, engine_on: str, tiny: bool, steps: int = 2, extra: tuple = ()
) -> list[str]:
    """``megadare rl`` of the demo task (tiny SDAR, TraceRL, a Ray-managed built-in engine), a few small steps."""
    cmd = [
        sys.executable,
        "-m",
        "megadare",
        "rl",
        "--config",
        "megadare/configs/demo_rl.yaml",
        f"rl.steps={steps}",
        "rl.prompts_per_step=4",
        "rl.n_samples=4",
        "rl.eval_size=8",
        f"model.dtype={'fp32' if tiny else 'bf16'}",
        f"rollout.weight_transport={transport}",
        f"logging.run_dir={run_dir}",
        "model.attention_backend=sdpa",
    ]
    if engine_on == "gpu" and not tiny:
        cmd += ["rollout.device=cuda", "rollout.engine_resources={num_gpus: 0.5, num_cpus: 1}"]
    else:
        cmd += ["rollout.device=cpu"]
    return cmd + list(extra)


def step_rl(rep: Report, args) -> None:
    """Two ``megadare rl`` steps per weight transport; the transport the sync took is read from its log line."""
    try:
        import ray  # noqa: F401
    except ImportError as e:
        rep.add(
            "rl",
            False,
            "ray does not import: carry benchmarks/carry/ray (see benchmarks/GPU.md)",
            error=one_line_error(e),
        )
        return
    cases = [c for c in RL_CASES if not (args.tiny and c[2])]
    start = time.perf_counter()
    for transport, engine_on, extra in cases:
        engine_on = "cpu" if args.tiny else engine_on
        run_dir = tempfile.mkdtemp(prefix=f"gpu_check_rl_{transport}_")
        t0 = time.perf_counter()
        share = args.budget / len(cases) * (3.0 if extra else 1.5)  # a compiled engine compiles first (~80 s)
        rc, tail = run_logged(
            rl_command(run_dir, transport, engine_on, args.tiny, extra=extra),
            os.path.join(run_dir, "rl.log"),
            max(1.0, min(share, args.budget - (t0 - start))),
        )
        steps = [x for x in metrics(run_dir) if "reward" in x]
        took = [
            ln.split("weight sync transport: ", 1)[1].split()[0]
            for ln in open(os.path.join(run_dir, "rl.log"), errors="replace")
            if "weight sync transport: " in ln
        ]
        last = steps[-1] if steps else {}
        rep.add(
            f"rl 2 steps, weight_transport={transport}, engine on {engine_on}{''.join(', ' + e for e in extra)}",
            rc == 0 and len(steps) >= 2,
            f"transport {took[0] if took else '?'}",
            rc=rc,
            s=round(time.perf_counter() - t0, 1),
            sync_gbps=last.get("sync_gbps"),
            sync_s=last.get("sync_s"),
            rollout_s=last.get("rollout_s"),
            **({} if rc == 0 else {"error": tail[-600:]}),
        )
        shutil.rmtree(run_dir, ignore_errors=True)
