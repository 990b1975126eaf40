"""Training throughput of one train step (forward + backward + optimizer) per core-attention backend.

    python benchmarks/train_throughput.py                 # GPU: 1.8B dense + small MoE, bf16; CPU: tiny shapes
    python benchmarks/train_throughput.py --shape dense --batch 1 4 --backends local sdpa flex

Prints tokens/s, model TFLOP/s and MFU (GPU) for each backend in the same process, and the ratio against
megatron's local DotProductAttention (the baseline that materialises the score matrix). The mask is
bidirectional (LLaDA-style) or block diffusion (x_t ++ x_0, --mask block_diffusion); a batch that runs out of
memory is reported as OOM. FLOPs as in megadare/trainer/flops.py (dense attention count, also for block masks).
"""
from __future__ import annotations

import argparse
import gc
import time
from dataclasses import replace

import torch

from megadare.models.family import ModelArch
from megadare.trainer.flops import peak_tflops, step_flops

SHAPES = {
    # SDAR-1.7B-like dense (Qwen3 1.7B shape, ~1.8B params with embeddings)
    "dense": ModelArch(family="sdar", architecture="SDARForCausalLM", vocab_size=151936, hidden_size=2048,
                       num_layers=28, num_attention_heads=16, num_kv_heads=8, head_dim=128, ffn_hidden_size=6144,
                       rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=32768, mask_token_id=151669,
                       attention="block_causal", block_size=4, qk_norm=True),
    # a small MoE (SDAR-MoE / Qwen3-MoE layout): 12 layers, 32 experts top-4
    "moe": ModelArch(family="sdar_moe", architecture="SDARMoeForCausalLM", vocab_size=151936, hidden_size=1024,
                     num_layers=12, num_attention_heads=16, num_kv_heads=4, head_dim=64, ffn_hidden_size=3072,
                     rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=32768, mask_token_id=151669,
                     attention="block_causal", block_size=4, qk_norm=True, num_experts=32,
                     moe_ffn_hidden_size=768, moe_topk=4),
}
CPU_SHAPE = dict(vocab_size=4096, hidden_size=256, num_layers=4, num_attention_heads=8, num_kv_heads=4,
                 head_dim=32, ffn_hidden_size=768, moe_ffn_hidden_size=128, num_experts=8, moe_topk=2)


def cpu_shape(arch: ModelArch) -> ModelArch:
    """The same family at a size a CPU runs in seconds."""
    moe_keys = ("moe_ffn_hidden_size", "num_experts", "moe_topk")
    return replace(arch, **{k: v for k, v in CPU_SHAPE.items() if arch.is_moe or k not in moe_keys})


def run_backend(arch: ModelArch, backend: str, batch: int, seq: int, mask: str, steps: int, dtype: str):
    from megadare.models.gpt import build_model_chunks, transformer_config
    from megadare.data.rows import Row, pack_rows
    from megadare.trainer.optim import OptimSettings, build_optimizer, wrap_ddp
    from megadare.trainer.step import train_step

    tcfg = transformer_config(arch, dtype)
    chunks = build_model_chunks(arch, tcfg, attention_backend=backend)
    model = wrap_ddp(chunks, True)
    opt, sched = build_optimizer(model, OptimSettings(lr=1e-5, total_steps=steps + 2, dtype=dtype))
    g = torch.Generator().manual_seed(0)
    n = seq // 2 if mask == "block_diffusion" else seq
    rows = []
    for _ in range(batch):
        toks = torch.randint(0, arch.vocab_size - 1, (n,), generator=g)
        if mask == "block_diffusion":
            rows.append(Row(tokens=torch.cat([toks, toks]), labels=torch.cat([toks, toks]),
                            weight=torch.cat([torch.ones(n), torch.zeros(n)]),
                            position_ids=torch.cat([torch.arange(n), torch.arange(n)]),
                            stream_ids=torch.cat([torch.zeros(n, dtype=torch.long), torch.ones(n, dtype=torch.long)]),
                            denom=float(n)))
        else:
            rows.append(Row(tokens=toks, labels=toks, weight=torch.ones(n), position_ids=torch.arange(n),
                            denom=float(n)))
    mbs = pack_rows(rows, seq, micro_batch_size=batch)
    mask_fn = (lambda mb: mb.megatron_mask(mask, arch.block_size)) if backend == "local" else None
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    try:
        for i in range(steps + 2):
            if i == 2:  # two warm-up steps (compilation, allocator)
                sync()
                t0 = time.perf_counter()
            train_step(model, opt, sched, mbs, float(batch * n), mask, arch.block_size, arch.vocab_size,
                       mask_fn=mask_fn)
        sync()
        dt = (time.perf_counter() - t0) / steps
        if torch.cuda.is_available():
            mem = torch.cuda.max_memory_allocated() / 2**30
        else:
            import psutil

            mem = psutil.Process().memory_info().rss / 2**30
        return dt, mem
    finally:
        del model, opt, chunks
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    gpu = torch.cuda.is_available()
    ap.add_argument("--shape", nargs="+", default=["dense", "moe"], choices=sorted(SHAPES))
    ap.add_argument("--backends", nargs="+", default=["local", "sdpa", "flex"] if gpu else ["local", "sdpa"])
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 4] if gpu else [2])
    ap.add_argument("--seq", type=int, default=2048 if gpu else 256)
    ap.add_argument("--mask", default="bidirectional", choices=["bidirectional", "block_diffusion"])
    ap.add_argument("--steps", type=int, default=5 if gpu else 3)
    args = ap.parse_args()

    from megadare.parallel import destroy_distributed, init_distributed

    init_distributed()
    dtype = "bf16" if gpu else "fp32"
    device = torch.cuda.get_device_name() if gpu else "CPU"
    print(f"device: {device}; dtype {dtype}; seq {args.seq}; mask {args.mask}; {args.steps} timed steps")
    print(f"{'shape':6} {'backend':8} {'batch':>5} {'tok/s':>10} {'TFLOP/s':>8} {'MFU':>6} {'mem GiB' if gpu else 'RSS GiB':>8} {'vs local':>8}")
    for name in args.shape:
        arch = SHAPES[name] if gpu else cpu_shape(SHAPES[name])
        for batch in args.batch:
            base = None
            for backend in args.backends:
                try:
                    dt, mem = run_backend(arch, backend, batch, args.seq, args.mask, args.steps, dtype)
                except torch.OutOfMemoryError:
                    print(f"{name:6} {backend:8} {batch:5d} {'OOM':>10}")
                    continue
                tok_s = batch * args.seq / dt
                tflops = step_flops(arch, [args.seq] * batch) / dt / 1e12
                peak = peak_tflops()
                mfu = f"{tflops / peak:6.1%}" if peak else "   n/a"
                base = base or (tok_s if backend == "local" else None)
                ratio = f"{tok_s / base:7.2f}x" if base else "      -"
                print(f"{name:6} {backend:8} {batch:5d} {tok_s:10.0f} {tflops:8.2f} {mfu} {mem:8.1f} {ratio}")
    destroy_distributed()


if __name__ == "__main__":
    main()
