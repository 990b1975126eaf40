"""Training throughput of one train step (forward + backward + optimizer) per core-attention backend, and against
the publisher's SDAR model on DARE's loss path.

    python benchmarks/train_throughput.py                 # GPU: 1.8B dense + small MoE, bf16; CPU: tiny shapes
    python benchmarks/train_throughput.py --shape dense --batch 1 4 --backends local sdpa flex
    python benchmarks/train_throughput.py --shape dense --batch 4 --backends sdpa --variants base gradfusion fused all
    python benchmarks/train_throughput.py --peer-repo /path/to/DARE --peer-python /path/to/dare-env/bin/python

Prints tokens/s, model TFLOP/s and MFU (GPU) for each backend, each case in a fresh process (its peak memory its
own), and the ratio against megatron's local DotProductAttention (the baseline that materialises the score
matrix). The mask is bidirectional (LLaDA-style) or block diffusion (x_t ++ x_0, --mask block_diffusion); a
batch that runs out of memory is reported as OOM. FLOPs as in megadare/trainer/flops.py (dense attention count, also for block masks).
``--variants`` times the training-step fusions of models/step_fusions.py per backend (``train.*`` keys): ``base``
(none), ``gradfusion`` (gradient_accumulation_fusion), ``fused`` (fused_elementwise), ``all`` (both), each against
the same backend's ``base`` ("vs base"); with gradfusion on CUDA the row names the accumulation path that ran,
with fused the RMSNorm (torch's fused CUDA kernel or compiled) and RoPE (compiled, or TE's) that ran.
``grouped`` / ``fusedgrouped`` are ``base`` / ``fused`` with MoE experts through grouped GEMMs (models/experts.py,
``train.grouped_experts``; the row says which expert forward ran). ``fusedcnorm`` is ``fused`` with every RMSNorm
compiled where CUDA would take torch's fused kernel (its backward, ``GammaBetaBackward`` and
``layer_norm_grad_input``, was 4.5% of the H200's SDAR-1.7B step: GPU.md); the same on a CPU, where norms are
compiled anyway.

``--op-counts`` counts instead of timing: the ops of one step after two warm-up ones, per case, by family (``sub_``,
``add_``, ``copy_``, ``_to_copy``, ``_foreach``, ...) and by source (megadare's, megatron-core's or torch's
optimizer code; the autograd node in a backward): benchmarks/op_census.py. ``--logits-chunk-mb`` sets the scored
head's ``train.logits_chunk_mb`` (on a CPU's tiny vocabulary a small value gives the GPU's many chunks).

``--peer-repo PATH`` (a DARE checkout, read in place: benchmarks/dare_peer.py) times one block-diffusion SFT step
of megadare (``train.logits`` full and scored) and of the publisher's ``modeling_sdar.py`` on DARE's loss path:
the same SDAR-shaped weights (one HF checkpoint both load), the same rows (megadare's block recipe; DARE gets the
same noisy tokens, target mask and t), fp32, ``--threads`` threads each. Every contender runs in its own process,
``--rounds`` rounds alternated in order, and the table gives the median over rounds of the mean step, split into
forward (everything before the last hidden state), head (output layer + loss), head backward, backward (the rest)
and optimizer, plus tokens/s and the ratio to the peer. Default shape: hidden 512, 8 layers, vocab 32k, seq 1024.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from dataclasses import replace
from typing import Callable, Optional

import torch

from megadare.models import step_fusions
from megadare.models.family import ModelArch
from megadare.trainer.flops import peak_tflops, step_flops

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from op_census import StepCensus  # noqa: E402  (a benchmarks/ module beside this script)

SHAPES = {
    # SDAR-1.7B-like dense (Qwen3 1.7B shape, ~1.8B params with embeddings)
    "dense": ModelArch(
        family="sdar",
        architecture="SDARForCausalLM",
        vocab_size=151936,
        hidden_size=2048,
        num_layers=28,
        num_attention_heads=16,
        num_kv_heads=8,
        head_dim=128,
        ffn_hidden_size=6144,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        max_position_embeddings=32768,
        mask_token_id=151669,
        attention="block_causal",
        block_size=4,
        qk_norm=True,
    ),
    # a small MoE (SDAR-MoE / Qwen3-MoE layout): 12 layers, 32 experts top-4
    "moe": ModelArch(
        family="sdar_moe",
        architecture="SDARMoeForCausalLM",
        vocab_size=151936,
        hidden_size=1024,
        num_layers=12,
        num_attention_heads=16,
        num_kv_heads=4,
        head_dim=64,
        ffn_hidden_size=3072,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        max_position_embeddings=32768,
        mask_token_id=151669,
        attention="block_causal",
        block_size=4,
        qk_norm=True,
        num_experts=32,
        moe_ffn_hidden_size=768,
        moe_topk=4,
    ),
}
# --variants: (train.gradient_accumulation_fusion, train.fused_elementwise)
VARIANTS = {
    "base": (False, False),
    "gradfusion": (True, False),
    "fused": (False, True),
    "all": (True, True),
    "fusedcnorm": (False, True),  # fused, with every RMSNorm compiled (below)
    "grouped": (False, False),  # base, MoE experts through grouped GEMMs (below)
    "fusedgrouped": (False, True),  # fused and grouped
}
# variants whose MoE experts run through grouped GEMMs (models/experts.py, ``train.grouped_experts``)
GROUPED_EXPERTS = {"grouped", "fusedgrouped"}
RAN: dict[str, str] = {}  # what the last run_backend's model ran where a module decides it (its experts' forward)
# variants that time another RMSNorm than the one models/step_fusions.py picks (its ``norm_path``)
NORM_PATHS = {"fusedcnorm": "compiled"}
HEAD_CHUNK_MB: Optional[float] = None  # --logits-chunk-mb: the scored head's chunk (None: HeadSettings' default)
CPU_SHAPE = dict(
    vocab_size=4096,
    hidden_size=256,
    num_layers=4,
    num_attention_heads=8,
    num_kv_heads=4,
    head_dim=32,
    ffn_hidden_size=768,
    moe_ffn_hidden_size=128,
    num_experts=8,
    moe_topk=2,
)


def cpu_shape(arch: ModelArch) -> ModelArch:
    """The same family at a size a CPU runs in seconds."""
    moe_keys = ("moe_ffn_hidden_size", "num_experts", "moe_topk")
    return replace(arch, **{k: v for k, v in CPU_SHAPE.items() if arch.is_moe or k not in moe_keys})


def run_backend(
    arch: ModelArch,
    backend: str,
    batch: int,
    seq: int,
    mask: str,
    steps: int,
    dtype: str,
    *,
    on_step: Optional[Callable[[], None]] = None,
    variant: str = "base",
    micro_batches: int = 1,
):
    """``steps`` timed train steps after two warm-up ones; (seconds per timed step, peak GiB, the first step's
    gradient norm: the same for every variant up to rounding, a check that a fusion neither doubles nor drops a
    gradient). ``on_step``: called after every step, warm-up ones included (a profiler's ``step``); ``variant``: a
    key of VARIANTS; ``micro_batches``: micro-batches of ``batch`` rows accumulated into one optimizer step (a real
    run's global batch: the optimizer's and clipping's passes, once a step, spread over more tokens)."""
    from megadare.models.experts import GroupedExperts
    from megadare.models.gpt import LayerModules, build_model_chunks, transformer_config
    from megadare.models.norm import FusedRMSNorm, RMSNorm
    from megadare.data.rows import Row, pack_rows
    from megadare.trainer.optim import OptimSettings, build_optimizer, wrap_ddp
    from megadare.trainer.policy import Policy
    from megadare.trainer.step import RowFormat, train_step

    grad_fusion, elementwise = VARIANTS[variant]
    tcfg = transformer_config(arch, dtype, **step_fusions.config_overrides(grad_fusion, elementwise))
    modules = LayerModules(
        norm=FusedRMSNorm if elementwise else RMSNorm,
        experts=GroupedExperts if variant in GROUPED_EXPERTS else LayerModules.experts,
    )
    chunks = build_model_chunks(arch, tcfg, attention_backend=backend, head=head_settings(), modules=modules)
    model = wrap_ddp(chunks, True)
    opt, sched = build_optimizer(model, OptimSettings(lr=1e-5, total_steps=steps + 2, dtype=dtype))
    g = torch.Generator().manual_seed(0)
    n = seq // 2 if mask == "block_diffusion" else seq
    rows = []
    for _ in range(batch * micro_batches):
        toks = torch.randint(0, arch.vocab_size - 1, (n,), generator=g)
        if mask == "block_diffusion":
            rows.append(
                Row(
                    tokens=torch.cat([toks, toks]),
                    labels=torch.cat([toks, toks]),
                    weight=torch.cat([torch.ones(n), torch.zeros(n)]),
                    position_ids=torch.cat([torch.arange(n), torch.arange(n)]),
                    stream_ids=torch.cat([torch.zeros(n, dtype=torch.long), torch.ones(n, dtype=torch.long)]),
                    denom=float(n),
                )
            )
        else:
            rows.append(
                Row(tokens=toks, labels=toks, weight=torch.ones(n), position_ids=torch.arange(n), denom=float(n))
            )
    mbs = pack_rows(rows, seq, micro_batch_size=batch)
    mask_fn = (lambda mb: mb.megatron_mask(mask, arch.block_size)) if backend == "local" else None
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    try:
        for i in range(steps + 2):
            if i == 2:  # two warm-up steps (compilation, allocator)
                sync()
                t0 = time.perf_counter()
            metrics = train_step(
                Policy(model, opt, sched),
                mbs,
                float(batch * micro_batches * n),
                RowFormat(mask, arch.block_size, arch.vocab_size, mask_fn),
            )
            if i == 0:
                grad_norm = metrics["grad_norm"]
            if on_step is not None:
                on_step()
        sync()
        dt = (time.perf_counter() - t0) / steps
        RAN["experts"] = experts_forward(chunks)
        if torch.cuda.is_available():
            mem = torch.cuda.max_memory_allocated() / 2**30
        else:
            import psutil

            mem = psutil.Process().memory_info().rss / 2**30
        return dt, mem, grad_norm
    finally:
        del model, opt, chunks
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()


def head_settings():
    """The scored head's settings: ``--logits-chunk-mb`` where given, else None (the model's default)."""
    from megadare.models.head import HeadSettings

    return None if HEAD_CHUNK_MB is None else HeadSettings(chunk_mb=HEAD_CHUNK_MB)


# ---------------------------------------------------------------------------------------------- against DARE
PEER_PHASES = ("forward", "head", "head_bwd", "backward", "optimizer")


def peer_shape(args) -> dict:
    """The HF config.json of the compared model (SDAR / Qwen3 layout, head_dim 64)."""
    h = args.hidden
    return dict(
        vocab_size=args.vocab,
        hidden_size=h,
        num_hidden_layers=args.layers,
        intermediate_size=3 * h,
        num_attention_heads=h // 64,
        num_key_value_heads=max(1, h // 128),
        head_dim=64,
        mask_token_id=args.vocab - 1,
        block_size=4,
        tie_word_embeddings=False,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        max_position_embeddings=32768,
    )


def write_checkpoint(args, out_dir: str) -> str:
    """One random HF checkpoint (megadare's hf/ SDAR, the publisher's key layout) both contenders load."""
    from megadare.models import build_hf_model, get_family, save_hf_model

    cfg = get_family("sdar").tiny_config(**peer_shape(args))
    torch.manual_seed(0)
    model = build_hf_model(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return save_hf_model(model, cfg, out_dir)


def block_samples(arch: ModelArch, seq: int, batch: int) -> list[dict]:
    """Block-diffusion rows by megadare's recipe (prompt 16, t per block) and the same corruption as DARE's inputs
    (x_0, x_t, target mask, p_mask = t, labels -100 on the prompt)."""
    from megadare.algos.sft import SFTRecipe, example_generator, example_rows
    from megadare.data.sft_data import SFTExample

    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(batch):
        ids = torch.randint(0, arch.vocab_size - 1, (seq // 2,), generator=g).tolist()
        row = example_rows(
            SFTExample(ids[:16], ids[16:]),
            arch,
            SFTRecipe("block", block_size=arch.block_size),
            example_generator(1, 0, i),
        )[0]
        n, L = seq // 2, seq // 2 - 16
        w = row.weight[:n]
        target = w > 0
        out.append(
            {
                "row": row,
                "x0": row.labels[:n],
                "xt": row.tokens[:n],
                "target": target,
                "p_mask": torch.where(target, 1.0 / (w * L).clamp_min(1e-30), torch.ones(n)),
                "labels": torch.cat([torch.full((16,), -100), row.labels[16:n]]),
            }
        )
    return out


def megadare_steps(hf_dir: str, logits: str, seq: int, batch: int, steps: int) -> list[dict]:
    """Timed train steps of megadare with per-phase marks (hooks on the decoder, the objective, the optimizer step)."""
    from megadare.convert.hf_megatron import load_hf_into_model
    from megadare.data.rows import pack_rows
    from megadare.models.family import family_of, read_hf_config
    from megadare.models.gpt import build_model_chunks, transformer_config
    from megadare.models.head import HeadSettings
    from megadare.trainer.optim import OptimSettings, build_optimizer, wrap_ddp
    from megadare.trainer.policy import Policy
    from megadare.trainer.step import RowFormat, train_step, weighted_nll

    cfg = read_hf_config(hf_dir)
    arch = family_of(cfg).arch(cfg)
    chunks = build_model_chunks(arch, transformer_config(arch), attention_backend="sdpa", head=HeadSettings(logits))
    load_hf_into_model(chunks, hf_dir)
    model = wrap_ddp(chunks, True)
    opt, sched = build_optimizer(model, OptimSettings(lr=1e-5, total_steps=steps + 2, lr_decay_style="constant"))
    mbs = pack_rows([s["row"] for s in block_samples(arch, seq, batch)], seq, batch)
    marks: dict[str, float] = {}

    def trunk_done(module, inputs, output):
        marks["trunk"] = time.perf_counter()
        output.register_hook(lambda g: marks.__setitem__("head_bwd", time.perf_counter()))

    chunks[-1].decoder.register_forward_hook(trunk_done)

    def objective(mb, logp):
        out = weighted_nll(mb, logp)
        marks["loss"] = time.perf_counter()
        return out

    optimizer_step = opt.step

    def marked_step():  # the backward is done: the optimizer step starts
        marks["bwd"] = time.perf_counter()
        return optimizer_step()

    opt.step = marked_step
    out, first = [], 0.0
    for i in range(steps + 1):
        t0 = time.perf_counter()
        m = train_step(
            Policy(model, opt, sched),
            mbs,
            float(sum(mb.denom for mb in mbs)),
            RowFormat("block_diffusion", arch.block_size, arch.vocab_size),
            objective=objective,
        )
        t1 = time.perf_counter()
        first = first if i else m["loss"]
        if i:
            out.append(
                {
                    "forward": marks["trunk"] - t0,
                    "head": marks["loss"] - marks["trunk"],
                    "head_bwd": marks["head_bwd"] - marks["loss"],
                    "backward": marks["bwd"] - marks["head_bwd"],
                    "optimizer": t1 - marks["bwd"],
                    "step": t1 - t0,
                    "loss0": first,
                }
            )
    return out


def child(args) -> None:
    """One contender in this process: prints its timed steps as JSON."""
    from megadare.parallel import destroy_distributed, init_distributed

    torch.set_num_threads(args.threads)
    init_distributed()
    res = megadare_steps(args.ckpt, args.child.split(":")[1], args.seq, args.batch[0], args.steps)
    destroy_distributed()
    print("RESULT " + json.dumps(res), flush=True)


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2


def against_peer(args) -> None:
    """Rounds of (megadare full, megadare scored, peer), each in a fresh process, alternated; the phase table."""
    import subprocess
    import tempfile

    from megadare.models.family import family_of, read_hf_config

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from dare_peer import dare_batch

    who = ["megadare:full", "megadare:scored", "peer"]
    here = os.path.dirname(os.path.abspath(__file__))
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = write_checkpoint(args, os.path.join(tmp, "hf"))
        cfg = read_hf_config(ckpt)
        batch_file = os.path.join(tmp, "dare_batch.pt")
        torch.save(dare_batch(block_samples(family_of(cfg).arch(cfg), args.seq, args.batch[0])), batch_file)
        runs: dict[str, list[dict]] = {w: [] for w in who}
        for r in range(args.rounds):
            for w in who if r % 2 == 0 else who[::-1]:
                cmd = (
                    [
                        args.peer_python,
                        os.path.join(here, "dare_peer.py"),
                        args.peer_repo,
                        ckpt,
                        batch_file,
                        str(args.steps),
                        str(args.threads),
                    ]
                    if w == "peer"
                    else [
                        sys.executable,
                        os.path.abspath(__file__),
                        "--child",
                        w,
                        "--ckpt",
                        ckpt,
                        "--seq",
                        str(args.seq),
                        "--batch",
                        str(args.batch[0]),
                        "--steps",
                        str(args.steps),
                        "--threads",
                        str(args.threads),
                    ]
                )
                p = subprocess.run(
                    cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS=str(args.threads))
                )
                res = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
                if p.returncode or not res:
                    raise SystemExit(f"{w} failed (exit {p.returncode}):\n{p.stderr[-4000:]}")
                steps = json.loads(res[-1][len("RESULT ") :])
                runs[w].append({k: sum(s[k] for s in steps) / len(steps) for k in steps[0]})
                print(
                    f"round {r + 1}/{args.rounds} {w:16s} step {runs[w][-1]['step']:.3f} s "
                    f"(first step's loss {runs[w][-1]['loss0']:.6f})",
                    flush=True,
                )
    print_phase_table(args, runs)


def print_phase_table(args, runs: dict[str, list[dict]]) -> None:
    tokens = args.seq * args.batch[0]
    med = {w: {k: _median([r[k] for r in rs]) for k in rs[0]} for w, rs in runs.items()}
    # ratios per round (same round, alternated order), then their median: robust to a shared machine's drift
    ratio = {w: _median([p["step"] / m["step"] for m, p in zip(rs, runs["peer"])]) for w, rs in runs.items()}
    print(
        f"\nper step (s), median of {args.rounds} rounds; {tokens} tokens per step; shared CPU, "
        f"{args.threads} thread(s) each; the first step's loss is the same for all (same weights, same rows)"
    )
    print(f"{'':18s}" + "".join(f"{k:>10s}" for k in PEER_PHASES + ("step", "tok/s", "vs peer")))
    for w, m in med.items():
        print(
            f"{w:18s}"
            + "".join(f"{m[k]:10.3f}" for k in PEER_PHASES + ("step",))
            + f"{tokens / m['step']:10.0f}{ratio[w]:9.2f}x"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    gpu = torch.cuda.is_available()
    ap.add_argument("--shape", nargs="+", default=["dense", "moe"], choices=sorted(SHAPES))
    ap.add_argument("--backends", nargs="+", default=["local", "sdpa", "flex"] if gpu else ["local", "sdpa"])
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 4] if gpu else [2])
    ap.add_argument(
        "--seq", type=int, default=None, help="tokens per row (default: 2048 GPU, 256 CPU; 1024 against the peer)"
    )
    ap.add_argument("--mask", default="bidirectional", choices=["bidirectional", "block_diffusion"])
    ap.add_argument("--variants", nargs="+", default=["base"], choices=list(VARIANTS), help="step fusions to time")
    ap.add_argument("--steps", type=int, default=5 if gpu else 3)
    ap.add_argument("--op-counts", action="store_true", help="count one step's ops by family and source (no timing)")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], help="model dtype (default: bf16 on a GPU, fp32 on a CPU)")
    ap.add_argument("--logits-chunk-mb", type=float, help="the scored head's train.logits_chunk_mb")
    ap.add_argument(
        "--micro-batches",
        type=int,
        default=1,
        help="micro-batches of --batch rows a step (gradient accumulation: a real run's global batch)",
    )
    ap.add_argument("--peer-repo", help="a DARE checkout: time megadare against its SDAR model on DARE's loss path")
    ap.add_argument("--peer-python", default=sys.executable, help="python of the DARE environment (transformers 4.52)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--case", help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    if args.peer_repo:
        args.seq = args.seq or 1024
        if args.batch == ap.get_default("batch"):
            args.batch = [1]
        return against_peer(args)
    args.seq = args.seq or (2048 if gpu else 256)
    if args.case:
        return case(args)
    dtype = args.dtype or ("bf16" if gpu else "fp32")
    device = torch.cuda.get_device_name() if gpu else "CPU"
    print(
        f"device: {device}; dtype {dtype}; seq {args.seq}; mask {args.mask}; "
        + ("one counted step after two; " if args.op_counts else f"{args.steps} timed steps; ")
        + "each case in a fresh process"
    )
    print(
        f"{'shape':6} {'backend':8} {'variant':12} {'batch':>5} {'tok/s':>10} {'TFLOP/s':>8} {'MFU':>6} "
        f"{'mem GiB' if gpu else 'RSS GiB':>8} {'vs local':>8} {'vs base':>8} {'gnorm 1':>10}",
        flush=True,
    )
    for name in args.shape:
        arch = SHAPES[name] if gpu else cpu_shape(SHAPES[name])
        for batch in args.batch:
            label = f"{batch}x{args.micro_batches}" if args.micro_batches > 1 else str(batch)  # rows x micro-batches
            local = None
            for backend in args.backends:
                base = None
                for variant in args.variants:
                    res = run_case(args, name, f"{backend}:{variant}", batch)
                    if "error" in res:
                        print(
                            f"{name:6} {backend:8} {variant:12} {label:>5} {res['error']:>10} {res.get('detail', '')}",
                            flush=True,
                        )
                        continue
                    if args.op_counts:
                        print(
                            f"{name:6} {backend:8} {variant:12} {label:>5} ops of one step:\n{res['ops']}", flush=True
                        )
                        continue
                    tok_s = res["rows"] * args.seq / res["dt"]
                    local = local or (tok_s if backend == "local" and variant == "base" else None)
                    base = base or (tok_s if variant == "base" else None)
                    print(f"{name:6} {backend:8} {variant:12} {label:>5} " + _measures(arch, args, res, local, base))


def _measures(arch: ModelArch, args, res: dict, local: Optional[float], base: Optional[float]) -> str:
    """tok/s, TFLOP/s, MFU, memory and the ratios of one case's table row (and the fusion paths it ran)."""
    tok_s = res["rows"] * args.seq / res["dt"]
    tflops = step_flops(arch, [args.seq] * res["rows"]) / res["dt"] / 1e12
    peak = peak_tflops()
    mfu = f"{tflops / peak:6.1%}" if peak else "   n/a"
    ratios = "".join(f"{tok_s / r:8.2f}x" if r else "       -" for r in (local, base))
    gnorm = f"{res['grad_norm']:10.5g}"
    return f"{tok_s:10.0f} {tflops:8.2f} {mfu} {res['mem']:8.1f} {ratios} {gnorm} {res.get('paths', '')}".rstrip()


def run_case(args, shape: str, backend: str, batch: int) -> dict:
    """One (shape, backend[:variant], batch) in a fresh process: a case's peak memory is its own (in one process a
    finished case's allocations inflated the next one's peak: 75.9 GiB for SDPA at batch 1 on an H200 where
    alone it takes 41.7), and an OOM does not poison the cases after it."""
    import subprocess

    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--case",
        f"{shape}:{backend}:{batch}",
        "--seq",
        str(args.seq),
        "--mask",
        args.mask,
        "--steps",
        str(args.steps),
        "--threads",
        str(args.threads),
    ]
    cmd += ["--op-counts"] if args.op_counts else []
    cmd += ["--dtype", args.dtype] if args.dtype else []
    cmd += [] if args.logits_chunk_mb is None else ["--logits-chunk-mb", str(args.logits_chunk_mb)]
    cmd += ["--micro-batches", str(args.micro_batches)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("CASE ")]
    if lines:
        return json.loads(lines[-1][5:])
    err = (p.stderr.strip().splitlines() or [f"exit {p.returncode}"])[-1]
    return {"error": "FAILED", "detail": err[:200]}


def experts_forward(chunks) -> str:
    """Which forward the MoE experts of ``chunks`` ran (models/experts.py ``GroupedExperts`` decides at its first
    forward), or '' for a dense model."""
    from megadare.models.experts import GroupedExperts
    from megatron.core.transformer.moe.experts import SequentialMLP

    ran = {
        "grouped GEMMs" if isinstance(m, GroupedExperts) and getattr(m, "_grouped", False) else "sequential"
        for c in chunks
        for m in c.modules()
        if isinstance(m, SequentialMLP)
    }
    return ", ".join(sorted(ran))


def case(args) -> None:
    """The child of run_case: one case, its result as a ``CASE {json}`` line."""
    from megadare.parallel import destroy_distributed, init_distributed

    gpu = torch.cuda.is_available()
    if not gpu:
        torch.set_num_threads(args.threads)
    shape, backend, variant, batch = args.case.split(":")
    arch = SHAPES[shape] if gpu else cpu_shape(SHAPES[shape])
    if variant in NORM_PATHS:  # this process only (each case has its own)
        step_fusions.norm_path = lambda device, path=NORM_PATHS[variant]: path
    global HEAD_CHUNK_MB
    HEAD_CHUNK_MB = args.logits_chunk_mb
    init_distributed()
    try:
        dtype = args.dtype or ("bf16" if gpu else "fp32")
        census = StepCensus() if args.op_counts else None  # counts the third step (steps=1 below)
        steps = 1 if census else args.steps
        dt, mem, gnorm = run_backend(
            arch,
            backend,
            int(batch),
            args.seq,
            args.mask,
            steps,
            dtype,
            on_step=census,
            variant=variant,
            micro_batches=args.micro_batches,
        )
        res = {"dt": dt, "mem": mem, "rows": int(batch) * args.micro_batches, "grad_norm": gnorm}
        if census:
            res["ops"] = census.census.table()
        paths = []
        if gpu and VARIANTS[variant][0]:
            paths.append(f"accum: {step_fusions.cuda_accum_path()}")
        if VARIANTS[variant][1]:
            device = torch.device("cuda" if gpu else "cpu")
            paths.append(f"norm: {step_fusions.norm_path(device)}, rope: {step_fusions.rope_path()}")
        if variant in GROUPED_EXPERTS and arch.is_moe:
            paths.append(f"experts: {RAN['experts']}")
        res["paths"] = ", ".join(paths)
    except torch.OutOfMemoryError:
        res = {"error": "OOM"}
    destroy_distributed()
    print("CASE " + json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
