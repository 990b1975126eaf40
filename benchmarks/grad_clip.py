"""Gradient clipping without Transformer Engine or apex: megatron-core's local fallbacks against the multi-tensor
versions megadare installs (models/mcore_fixes.py), on the gradients of the SDAR-1.7B shape, in one process.

    python benchmarks/grad_clip.py                  # GPU: 28 layers; CPU: 4 layers (--layers to change)

megatron's own ``get_grad_norm_fp32`` + ``clip_grad_by_total_norm_fp32`` (max norm below the gradients' norm,
so every gradient is scaled, as in a step that clips), ``--rounds`` timed rounds per implementation, alternated;
prints ms per clip for each, the ratio, and that both give the same norm and the same clipped gradients.
"""

from __future__ import annotations

import argparse
import time

import torch
from megatron.core import utils as mcore_utils
from megatron.core.optimizer import clip_grads

from megadare.models import mcore_fixes
from megadare.parallel import destroy_distributed, init_distributed


def sdar_grad_shapes(layers: int, hidden: int = 2048, ffn: int = 6144, vocab: int = 151936) -> list[tuple]:
    """The parameter shapes of an SDAR-1.7B-like model (train_throughput.SHAPES["dense"]): megatron's fused qkv
    (16 query, 8 KV heads of 128) and gate/up, q/k norms, two RMSNorms a layer, the tied embedding, final norm."""
    qkv = (16 + 2 * 8) * 128
    layer = [(qkv, hidden), (hidden, 16 * 128), (2 * ffn, hidden), (hidden, ffn), (hidden,), (hidden,), (128,), (128,)]
    return [(vocab, hidden)] + layer * layers + [(hidden,)]


def clip_once(grads: list[torch.Tensor], params: list[torch.nn.Parameter], group) -> float:
    for p, g in zip(params, grads):
        p.grad.copy_(g)
    total = clip_grads.get_grad_norm_fp32([p.grad for p in params], grad_stats_parallel_group=group)
    clip_grads.clip_grad_by_total_norm_fp32(params, max_norm=0.5 * total, total_norm=total)
    return total


def use(impl: str) -> None:
    local = impl == "local"
    clip_grads.l2_norm_impl = mcore_utils.local_multi_tensor_l2_norm if local else mcore_fixes.foreach_l2_norm
    clip_grads.multi_tensor_scale_impl = mcore_utils.local_multi_tensor_scale if local else mcore_fixes.foreach_scale


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    gpu = torch.cuda.is_available()
    ap.add_argument("--layers", type=int, default=28 if gpu else 4)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    dev = "cuda" if gpu else "cpu"
    mcore_fixes.apply()
    init_distributed()
    try:
        g = torch.Generator(device=dev).manual_seed(0)
        shapes = sdar_grad_shapes(args.layers)
        grads = [torch.randn(s, generator=g, device=dev) * 1e-3 for s in shapes]
        params = [torch.nn.Parameter(torch.zeros(s, device=dev)) for s in shapes]
        for p in params:
            p.grad = torch.empty_like(p)
        group = torch.distributed.group.WORLD
        sync = torch.cuda.synchronize if gpu else (lambda: None)
        times: dict[str, list[float]] = {"local": [], "foreach": []}
        result = {}
        for r in range(args.rounds + 1):  # round 0 warms up
            for impl in times:
                use(impl)
                sync()
                t0 = time.perf_counter()
                total = clip_once(grads, params, group)
                sync()
                if r:
                    times[impl].append(time.perf_counter() - t0)
                result[impl] = (total, [p.grad.clone() for p in params[:3]])
    finally:
        use("foreach")
        destroy_distributed()
    n = sum(p.numel() for p in params)
    ms = {k: 1e3 * min(v) for k, v in times.items()}
    (t_l, g_l), (t_f, g_f) = result["local"], result["foreach"]
    same = all(torch.allclose(a, b, rtol=1e-6, atol=0) for a, b in zip(g_l, g_f))
    print(
        f"grad clip on {dev}, {len(shapes)} gradients, {n / 1e6:.0f}M fp32 values ({args.layers} layers of the "
        f"SDAR-1.7B shape), best of {args.rounds}: megatron local {ms['local']:.1f} ms, foreach "
        f"{ms['foreach']:.1f} ms ({ms['local'] / ms['foreach']:.2f}x); norms {t_l:.6g} / {t_f:.6g} "
        f"(rel {abs(t_l - t_f) / t_l:.1e}), clipped gradients {'equal' if same else 'DIFFER'} to 1e-6"
    )


if __name__ == "__main__":
    main()
