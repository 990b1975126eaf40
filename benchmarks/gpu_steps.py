"""The in-process steps of benchmarks/gpu_check.py (each runs in its own process, started by gpu_check.py).

    python benchmarks/gpu_steps.py STEP --out DIR [--rows DIR] --device cuda|cpu [--tiny] [--families sdar,llada]

Every step appends result rows to ``ROWS/STEP.json`` as it goes (a step cut off by its timeout leaves what it
measured) and prints one line per row. A row: ``check`` (what), ``ok`` (True / False / None = a measurement
without a verdict), ``value`` and details. A failing check records its error in one line and the next check runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Optional

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
FAMILIES = ["sdar", "sdar_moe", "llada", "llada2", "dream"]
BLOCK = 4
# head_dim 64 shapes (the GPU attention kernels' own path) for the parity and attention checks on a GPU
QWEN_MEDIUM = dict(  # the Qwen3-layout families (SDAR, SDAR-MoE, LLaDA2) share it
    vocab_size=4096,
    hidden_size=512,
    intermediate_size=1024,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    mask_token_id=4095,
)
MEDIUM = {
    "sdar": QWEN_MEDIUM,
    "sdar_moe": {**QWEN_MEDIUM, "moe_intermediate_size": 256},
    "llada": dict(
        d_model=512,
        n_heads=8,
        n_kv_heads=8,
        n_layers=2,
        mlp_hidden_size=1024,
        vocab_size=4090,
        embedding_size=4096,
        mask_token_id=4095,
    ),
    "llada2": {**QWEN_MEDIUM, "num_hidden_layers": 3, "moe_intermediate_size": 256},
    "dream": dict(
        vocab_size=4096,
        hidden_size=512,
        intermediate_size=1024,
        num_attention_heads=8,
        num_key_value_heads=4,
        mask_token_id=4095,
        pad_token_id=4094,
    ),
}
# bf16 verdict: the Megatron model's distance to the float64 reference may be at most BF16_FACTOR times the
# distance of the plain hf/ model run in bf16 on the CPU (what bf16 rounding alone does to this model on these
# inputs), plus BF16_FLOOR. A different but correct kernel rounds in another order: errors of the same size, not
# the same values (factor 2 leaves room for that); a real bug (mask, RoPE, routing) is O(1) relative.
BF16_FACTOR, BF16_FLOOR = 2.0, 1e-3
FP32_REL = 1e-4


class Report:
    """Rows of one step, saved after every row."""

    def __init__(self, out_dir: str, step: str):
        self.path = os.path.join(out_dir, f"{step}.json")
        self.rows: list[dict[str, Any]] = []
        self.t0 = time.perf_counter()

    def add(self, check: str, ok: Optional[bool], value: Any = None, **detail: Any) -> dict:
        row = {"check": check, "ok": ok, "value": value, **detail}
        self.rows.append(row)
        with open(self.path, "w") as f:
            json.dump({"rows": self.rows}, f, indent=1, default=str)
        tag = {True: "ok  ", False: "FAIL", None: "--  "}[ok]
        shown = f"{value:.4g}" if isinstance(value, float) else value
        extra = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in detail.items())
        print(f"[+{time.perf_counter() - self.t0:5.0f}s] {tag} {check}: {shown} {extra}", flush=True)
        return row

    def attempt(self, check: str, fn: Callable[[], dict]) -> Optional[dict]:
        """``fn()`` returns the row's fields (``ok``, ``value``, details); an exception is a failed row."""
        try:
            return self.add(check, **fn())
        except Exception as e:  # noqa: BLE001 - recorded, and the next check runs
            return self.add(check, False, error=one_line_error(e))


def one_line_error(e: BaseException) -> str:
    frames = [f for f in traceback.extract_tb(e.__traceback__) if "megadare" in f.filename or ROOT in f.filename]
    at = f" at {os.path.relpath(frames[-1].filename, ROOT)}:{frames[-1].lineno}" if frames else ""
    return f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}{at}"


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| (float64, on the CPU)."""
    o, r = out.detach().double().cpu(), ref.detach().double().cpu()
    if o.shape != r.shape:
        raise ValueError(f"shape {tuple(o.shape)} vs reference {tuple(r.shape)}")
    if not torch.isfinite(o).all():
        raise ValueError("non-finite values")
    return float((o - r).norm() / r.norm())


# ============================================================================================== env
OPTIONAL = ("transformer_engine", "flash_attn", "sglang", "apex")


def step_env(rep: Report, args) -> None:
    """Versions, the GPU, and which of megadare's requirements import (the image lacks some: they travel)."""
    import importlib
    import platform

    rep.add("python", True, sys.version.split()[0], platform=platform.platform(), executable=sys.executable)
    for mod in (
        (
            "torch",
            "triton",
            "transformers",
            "megatron.core",
            "omegaconf",
            "math_verify",
            "safetensors",
            "numpy",
            "yaml",
            "tqdm",
            "psutil",
            "tensorboard",
            "pyarrow",
            "matplotlib",
            "ray",
        )
        + OPTIONAL
        + ("megadare",)
    ):
        try:
            m = importlib.import_module(mod)
            rep.add(f"import {mod}", True, getattr(m, "__version__", "?"), where=os.path.dirname(m.__file__ or ""))
        except Exception as e:  # noqa: BLE001
            optional = mod in OPTIONAL or (mod == "triton" and args.device != "cuda")  # FlexAttention on CUDA
            rep.add(f"import {mod}", None if optional else False, "missing", error=one_line_error(e))
    import megatron.core.transformer.moe.moe_utils as mu  # before megadare's fixes are applied

    rep.add("megatron moe_utils defines te_general_gemm (TE present)", None, hasattr(mu, "te_general_gemm"))
    rep.add("torch.cuda.is_available", args.device != "cuda" or torch.cuda.is_available(), torch.cuda.is_available())
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        v = torch.cuda.nccl.version()
        rep.add(
            "gpu",
            True,
            torch.cuda.get_device_name(0),
            capability=f"{p.major}.{p.minor}",
            mem_gib=round(p.total_memory / 2**30, 1),
            sms=p.multi_processor_count,
            cuda=torch.version.cuda,
            bf16=torch.cuda.is_bf16_supported(),
            nccl=".".join(map(str, v)) if isinstance(v, tuple) else str(v),
        )
    smi = shutil.which("nvidia-smi")
    if smi:
        q = "name,memory.total,memory.used,driver_version,clocks.max.sm,power.limit"
        out = subprocess.run([smi, f"--query-gpu={q}", "--format=csv,noheader"], capture_output=True, text=True)
        rep.add("nvidia-smi", out.returncode == 0, out.stdout.strip() or out.stderr.strip()[:200])


# ============================================================================================== parity
def make_case(name: str, root: str, seed: int, medium: bool) -> dict:
    """A perturbed random HF checkpoint of the family, inputs holding mask tokens, the float64 CPU reference logits
    of its hf/ model, and what bf16 alone does to that model (the hf/ model in bf16 on the CPU)."""
    from megadare.models import build_hf_model, get_family, perturb_, save_hf_model
    from megadare.models.attention import family_mask

    torch.manual_seed(seed)
    fam = get_family(name)
    over = dict(MEDIUM[name]) if medium else {}
    if "block_size" in fam.tiny_config():
        over["block_size"] = BLOCK
    cfg = fam.tiny_config(**over)
    model = perturb_(build_hf_model(cfg).eval())
    hf_dir = os.path.join(root, name)
    save_hf_model(model, cfg, hf_dir)
    arch = fam.arch(cfg)
    S = 128 if medium else 16
    ids = torch.randint(0, arch.vocab_size, (2, S))
    if arch.mask_token_id < arch.vocab_size:
        ids[:, S // 2 : S // 2 + 3] = arch.mask_token_id
    mask = family_mask(arch)
    with torch.no_grad():
        ref = model.double()(ids, attention_mask=mask.dense(S, S)).double()
        cpu_bf16 = model.to(torch.bfloat16)(ids, attention_mask=mask.dense(S, S))
    return {
        "name": name,
        "hf_dir": hf_dir,
        "arch": arch,
        "ids": ids,
        "mask": mask,
        "ref": ref,
        "hf_bf16_cpu_rel": rel(cpu_bf16, ref),
    }


def verdict(dtype: str, r: float, case: dict) -> dict:
    if dtype == "fp32":
        return {"ok": r < FP32_REL, "value": r, "tol": FP32_REL}
    tol = BF16_FACTOR * case["hf_bf16_cpu_rel"] + BF16_FLOOR
    return {"ok": r <= tol, "value": r, "tol": tol, "hf_bf16_cpu_rel": case["hf_bf16_cpu_rel"]}


def megatron_logits(case: dict, dtype: str, backend: str, mask=None, position_ids=None, ids=None) -> torch.Tensor:
    from megadare.convert import load_hf_into_model
    from megadare.models import gpt
    from megadare.trainer.forward import forward_logits

    arch = case["arch"]
    chunks = gpt.build_model_chunks(arch, gpt.transformer_config(arch, dtype), attention_backend=backend)
    load_hf_into_model(chunks, case["hf_dir"])
    ids = case["ids"] if ids is None else ids
    return forward_logits(chunks, ids, arch.vocab_size, case["mask"] if mask is None else mask, position_ids)


def step_parity(rep: Report, args) -> None:
    """Per family: the Megatron model (world size 1; NCCL on a GPU) and the hf/ model on the device, fp32 and bf16,
    against the float64 hf/ reference on the CPU."""
    from megadare.models import load_hf_model
    from megadare.parallel import destroy_distributed, init_distributed

    dev = args.device
    init_distributed()
    root = tempfile.mkdtemp(prefix="gpu_check_parity_")
    try:
        for i, name in enumerate(args.families):
            try:
                case = make_case(name, root, 100 + i, medium=not args.tiny)
            except Exception as e:  # noqa: BLE001
                rep.add(f"{name} checkpoint", False, error=one_line_error(e))
                continue
            S = case["ids"].shape[1]
            for dtype, tdt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):

                def hf(tdt=tdt, dtype=dtype):
                    model = load_hf_model(case["hf_dir"], dtype=tdt, device=dev)
                    with torch.no_grad():
                        out = model(case["ids"].to(dev), attention_mask=case["mask"].dense(S, S, device=dev))
                    return verdict(dtype, rel(out, case["ref"]), case)

                rep.attempt(f"{name} hf/ {dtype} on {dev}", hf)
                rep.attempt(
                    f"{name} megatron sdpa {dtype} on {dev}",
                    lambda dtype=dtype: verdict(dtype, rel(megatron_logits(case, dtype, "sdpa"), case["ref"]), case),
                )
    finally:
        destroy_distributed()
        shutil.rmtree(root, ignore_errors=True)


# ============================================================================================== attention
def packed_block_diffusion(arch, rows: int, n: int, seed: int):
    """Two samples x_t ++ x_0 packed per row (the block-diffusion training mask): ids, positions, the MaskSpec."""
    from megadare.models.attention import MaskSpec

    g = torch.Generator().manual_seed(seed)
    half = [n // 2 - 4, n // 2 + 4]
    ids, pos, seg, stream = [], [], [], []
    for _ in range(rows):
        i, p, s, t = [], [], [], []
        for k, L in enumerate(half):
            x0 = torch.randint(0, arch.vocab_size - 1, (L // 2,), generator=g)
            xt = x0.clone()
            xt[torch.rand(L // 2, generator=g) < 0.5] = arch.mask_token_id % arch.vocab_size
            i += [xt, x0]
            p += [torch.arange(L // 2)] * 2
            s += [torch.full((L,), k)]
            t += [torch.zeros(L // 2, dtype=torch.long), torch.ones(L // 2, dtype=torch.long)]
        ids.append(torch.cat(i))
        pos.append(torch.cat(p))
        seg.append(torch.cat(s))
        stream.append(torch.cat(t))
    ids, pos, seg, stream = (torch.stack(x) for x in (ids, pos, seg, stream))
    spec = MaskSpec("block_diffusion", block_size=BLOCK, segment_ids=seg, position_ids=pos, stream_ids=stream)
    return ids, pos, spec


def exact_attention(q, k, v, allowed: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(q k^T scale, masked) v in float64 (GQA: each kv head serves H/G query heads)."""
    H, G = q.shape[1], k.shape[1]
    k, v = (t.double().repeat_interleave(H // G, dim=1) for t in (k, v))
    scores = torch.einsum("bhqd,bhkd->bhqk", q.double(), k) * scale
    return torch.einsum("bhqk,bhkd->bhqd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), v)


def _kernels(rep: Report, dev: str) -> None:
    """flex == sdpa == the float64 reference on the training mask (packed x_t ++ x_0) and the inference mask
    (block-causal, queries of one block after a KV-cached prefix)."""
    from megadare.models.attention import MaskSpec, flex_attention, sdpa_attention

    g = torch.Generator().manual_seed(0)
    seg = torch.cat([torch.zeros(2, 96, dtype=torch.long), torch.ones(2, 160, dtype=torch.long)], dim=1)
    pos = torch.cat([torch.arange(48).repeat(2), torch.arange(80).repeat(2)]).repeat(2, 1)
    stream = torch.cat([torch.zeros(48), torch.ones(48), torch.zeros(80), torch.ones(80)]).long().repeat(2, 1)
    cases = {
        "train: packed block diffusion": (
            MaskSpec("block_diffusion", block_size=BLOCK, segment_ids=seg, position_ids=pos, stream_ids=stream),
            256,
            256,
        ),
        "infer: block-causal after a 124-token cache": (
            MaskSpec("block_causal", block_size=BLOCK, q_offset=124),
            4,
            128,
        ),
    }
    for name, (spec, Q, K) in cases.items():
        for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):
            q = torch.randn(2, 8, Q, 64, generator=g).to(dev, dtype)
            k, v = (torch.randn(2, 4, K, 64, generator=g).to(dev, dtype) for _ in range(2))
            allowed = spec.dense(Q, K, 2).to(dev)
            ref = exact_attention(q, k, v, allowed, 0.125)
            backends = [("sdpa", lambda: sdpa_attention(q, k, v, allowed, 0.125))]
            if dtype == torch.bfloat16 or dev != "cuda":  # on a GPU each dtype is a compile (~20 s): bf16
                backends.append(("flex", lambda: flex_attention(q, k, v, spec.to(dev), 0.125)))
            for backend, fn in backends:
                rep.attempt(
                    f"kernel {backend} {name} {str(dtype)[6:]}",
                    lambda fn=fn, tol=tol: (lambda d: {"ok": d < tol, "value": d, "tol": tol})(
                        float((fn().double() - ref).abs().max())
                    ),
                )


def _compiles(rep: Report, dev: str) -> None:
    """Compiled FlexAttention over 10 micro-batches of each mask structure with fresh MaskSpecs: one graph per
    structure (a recompile per micro-batch would reach dynamo's limit and fall back to the unfused kernel)."""
    from torch._dynamo.utils import counters

    from megadare.models.attention import MaskSpec, flex_attention

    if dev != "cuda":
        rep.add("flex compiled graphs over 30 micro-batches", None, "eager on CPU (compiled only on CUDA)")
        return
    unique0 = counters["stats"]["unique_graphs"]
    g = torch.Generator().manual_seed(1)
    for i in range(10):
        seg = torch.cumsum(torch.rand(2, 256, generator=g) < 0.02, dim=1)
        for spec in (
            MaskSpec("block_causal", block_size=BLOCK, segment_ids=seg, position_ids=torch.arange(256).repeat(2, 1)),
            MaskSpec("block_causal", block_size=BLOCK, q_offset=4 * i),
            MaskSpec("bidirectional", segment_ids=seg),
        ):
            q = torch.randn(2, 8, 256, 64, device=dev, dtype=torch.bfloat16)
            flex_attention(q, q, q, spec.to(dev), 0.125)
    graphs = counters["stats"]["unique_graphs"] - unique0
    rep.add("flex compiled graphs over 30 micro-batches (3 structures)", graphs <= 3, graphs)


def step_attention(rep: Report, args) -> None:
    """Kernels (flex, sdpa vs float64), flex's compile count, and a Megatron model (SDAR) with megatron's local
    attention vs sdpa vs flex on the training and the inference mask (fp32 logits; flex's in bf16 on a GPU, where
    each compile costs time, against sdpa in bf16)."""
    from megadare.parallel import destroy_distributed, init_distributed

    dev = args.device
    _kernels(rep, dev)
    _compiles(rep, dev)
    init_distributed()
    root = tempfile.mkdtemp(prefix="gpu_check_attn_")
    try:
        case = make_case("sdar", root, 7, medium=not args.tiny)
        ids, pos, spec = packed_block_diffusion(case["arch"], 2, 96 if args.tiny else 256, 3)
        S = ids.shape[1]
        masks = {"train (packed x_t ++ x_0)": (spec, pos, ids), "infer (block-causal)": (case["mask"], None, None)}
        runs = [("local", "fp32"), ("sdpa", "fp32")] + ([("flex", "bf16"), ("sdpa", "bf16")] if dev == "cuda" else [])
        for mname, (m, p, x) in masks.items():
            outs = {}
            for b, dtype in runs:
                n = (x if x is not None else case["ids"]).shape[1]
                mm = ~m.dense(n, n, 2) if b == "local" else m  # megatron's own convention
                try:
                    outs[b, dtype] = megatron_logits(case, dtype, b, mask=mm, position_ids=p, ids=x)
                except Exception as e:  # noqa: BLE001
                    rep.add(f"megatron {b} {dtype} {mname}", False, error=one_line_error(e))
            for b, dtype in [r for r in runs if r[0] != "sdpa" and r in outs and ("sdpa", r[1]) in outs]:
                r, tol = rel(outs[b, dtype], outs["sdpa", dtype]), FP32_REL if dtype == "fp32" else 2e-2
                rep.add(f"megatron {b} == sdpa, {mname}, {dtype} logits", r < tol, r, tol=tol, seq=S)
    finally:
        destroy_distributed()
        shutil.rmtree(root, ignore_errors=True)


# ============================================================================================== engine
def step_engine(rep: Report, args) -> None:
    """The built-in engine on the device vs on the CPU (greedy tokens), and cached vs uncached on the device."""
    from megadare.models import build_hf_model, get_family
    from megadare.rollout.engine import SamplingParams
    from megadare.rollout.native import NativeEngine, NativeSettings

    dev = args.device
    prompts = [[5, 17, 99, 3, 42, 7], [11, 2], [8, 8, 8, 8, 21, 60, 61, 62, 63]]
    params = SamplingParams(max_new_tokens=12, block_size=BLOCK, steps_per_block=4, stop_at_eos=False)

    def model_of(family):
        torch.manual_seed(0)
        fam = get_family(family)
        cfg = fam.tiny_config(**({"block_size": BLOCK} if "block_size" in fam.tiny_config() else {}))
        m = build_hf_model(cfg)
        with torch.no_grad():
            for p in m.parameters():
                p.add_(torch.randn_like(p) * 0.3)
        return m, fam.arch(cfg)

    for family in args.families:

        def run(family=family):
            # float32 on both devices: a greedy token is an argmax, and the engine's default on CUDA (bfloat16)
            # flips near-ties of a random tiny model; its bfloat16 agreement is the measured row below
            m, arch = model_of(family)
            ref = NativeEngine(m, arch, eos_token_id=253, device="cpu").generate(prompts, params)
            fp32 = {"device": dev, "dtype": torch.float32}
            got = NativeEngine(model_of(family)[0], arch, eos_token_id=253, **fp32).generate(prompts, params)
            plain = NativeEngine(
                model_of(family)[0], arch, eos_token_id=253, settings=NativeSettings(use_cache=False), **fp32
            ).generate(prompts, params)
            same = sum(a.response_ids == b.response_ids for a, b in zip(ref, got))
            same_nc = sum(a.response_ids == b.response_ids for a, b in zip(got, plain))
            return {
                "ok": same == same_nc == len(prompts),
                "value": f"{same}/{len(prompts)} == CPU",
                "cached_eq_uncached": f"{same_nc}/{len(prompts)}",
            }

        def run_bf16(family=family):
            m, arch = model_of(family)
            ref = NativeEngine(m, arch, eos_token_id=253, device="cpu").generate(prompts, params)
            got = NativeEngine(model_of(family)[0], arch, eos_token_id=253, device=dev, dtype=torch.bfloat16).generate(
                prompts, params
            )
            agree = sum(x == y for a, b in zip(ref, got) for x, y in zip(a.response_ids, b.response_ids))
            return {"ok": None, "value": f"{agree}/{sum(len(a.response_ids) for a in ref)} tokens == CPU float32"}

        rep.attempt(f"engine {family} greedy float32 on {dev}", run)
        rep.attempt(f"engine {family} greedy bfloat16 on {dev} (measured)", run_bf16)


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
        _, measured = tt.run_backend(arch, "sdpa", 1, seq, "bidirectional", 1, dtype)
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
def step_profile(rep: Report, args) -> None:
    """One training run of train_throughput's dense shape (build + 3 steps) under torch.profiler: the top kernels
    by self device time (CPU: self CPU time), written to profile_top_kernels.txt."""
    from torch.profiler import ProfilerActivity, profile

    sys.path.insert(0, HERE)
    import train_throughput as tt

    from megadare.parallel import destroy_distributed, init_distributed

    gpu = args.device == "cuda"
    arch = tt.SHAPES["dense"] if gpu else tt.cpu_shape(tt.SHAPES["dense"])
    seq, dtype, backend = (2048, "bf16", "flex") if gpu else (128, "fp32", "sdpa")
    init_distributed()
    try:
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
        with profile(activities=acts) as prof:
            dt, _ = tt.run_backend(arch, backend, 1, seq, "bidirectional", 1, dtype)
    finally:
        destroy_distributed()
    key = "self_device_time_total" if gpu else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=80)
    with open(os.path.join(args.out, "profile_top_kernels.txt"), "w") as f:
        f.write(f"dense shape, seq {seq}, batch 1, {dtype}, {backend}; step {dt:.4f} s\n{table}\n")
    events = sorted(prof.key_averages(), key=lambda e: -float(getattr(e, key, 0) or 0))[:8]
    total = sum(float(getattr(e, key, 0) or 0) for e in prof.key_averages()) or 1.0
    for e in events:
        rep.add(f"top: {e.key[:70]}", None, round(100 * float(getattr(e, key, 0) or 0) / total, 1), unit="% self time")
    rep.add("profiled step time (s)", True, round(dt, 4), backend=backend)


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


# rollout.weight_transport -> where the engine runs: on the trainer's GPU (colocated, auto, object_store) or on the
# CPU (distributed: NCCL cannot put two ranks of one group on one GPU, so on one GPU it goes to a CPU engine)
TRANSPORTS = {"auto": "gpu", "colocated": "gpu", "object_store": "gpu", "distributed": "cpu"}


def rl_command(run_dir: str, transport: str, engine_on: str, tiny: bool, steps: int = 2) -> list[str]:
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
    return cmd


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
    for transport, engine_on in TRANSPORTS.items():
        engine_on = "cpu" if args.tiny else engine_on
        run_dir = tempfile.mkdtemp(prefix=f"gpu_check_rl_{transport}_")
        t0 = time.perf_counter()
        rc, tail = run_logged(
            rl_command(run_dir, transport, engine_on, args.tiny),
            os.path.join(run_dir, "rl.log"),
            min(args.budget / len(TRANSPORTS) * 1.5, args.budget),
        )
        steps = [x for x in metrics(run_dir) if "reward" in x]
        took = [
            ln.split("weight sync transport: ", 1)[1].split()[0]
            for ln in open(os.path.join(run_dir, "rl.log"), errors="replace")
            if "weight sync transport: " in ln
        ]
        last = steps[-1] if steps else {}
        rep.add(
            f"rl 2 steps, weight_transport={transport}, engine on {engine_on}",
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


STEPS = {
    "env": step_env,
    "parity": step_parity,
    "attention": step_attention,
    "engine": step_engine,
    "sft": step_sft,
    "planner": step_planner,
    "profile": step_profile,
    "rl": step_rl,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("step", choices=sorted(STEPS))
    ap.add_argument("--out", required=True, help="where files meant for people go (the profile table)")
    ap.add_argument("--rows", help="where this step's rows go (STEP.json); default --out")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--budget", type=float, default=600, help="seconds this step may take (its subprocesses)")
    args = ap.parse_args()
    args.families = [f for f in args.families.split(",") if f]
    args.rows = args.rows or args.out
    for d in (args.out, args.rows):
        os.makedirs(d, exist_ok=True)
    rep = Report(args.rows, args.step)
    STEPS[args.step](rep, args)
    sys.exit(0 if all(r["ok"] is not False for r in rep.rows) else 1)


if __name__ == "__main__":
    main()
