"""Training MoE experts: megatron-core's ``SequentialMLP`` (one GEMM per expert and projection, and a host read of
the token counts per layer) against grouped GEMMs (``torch._grouped_mm``) on the same weights and rows, forward +
backward.

    python benchmarks/moe_experts.py              # GPU: the small MoE shape of train_throughput.py, bf16
                                                  # CPU: its CPU shape, fp32 (--tokens to change)

Rows are the routed copies of ``--tokens`` tokens (top-k each), spread over the experts by a random router. Three
contenders, each ``--rounds`` timed rounds after a warm-up: ``sequential`` (layer 0's ``SequentialMLP`` from
megadare's own model build), ``GroupedExperts`` (the same layer built with models/experts.py's module,
``train.grouped_experts``: grouped GEMMs over weights stacked from the experts' own parameters in the forward and
again in the backward), ``grouped`` (the weights already stacked: what a layout with one [experts, out, in] tensor
per projection would give). Prints ms per forward + backward, the ratio to ``sequential``, and how far the outputs
and gradients are from ``sequential``'s.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from megatron.core.transformer.moe.experts import SequentialMLP

from megadare.models.experts import GroupedExperts
from megadare.models.gpt import LayerModules, build_model_chunks, transformer_config
from megadare.models.hf.common import grouped_swiglu, grouped_gemm_runs
from megadare.parallel import destroy_distributed, init_distributed

import train_throughput as tt


def layer0_experts(arch, dtype: str, experts: type = SequentialMLP, like=None):
    """Layer 0's experts module of megadare's build of ``arch`` (``experts``: the module class a training step runs,
    ``like``: another such module whose weights it takes)."""
    modules = LayerModules(experts=experts)
    chunks = build_model_chunks(arch, transformer_config(arch, dtype), attention_backend="sdpa", modules=modules)
    module = chunks[0].decoder.layers[0].mlp.experts
    if like is not None:
        module.load_state_dict(like.state_dict())
    return module


def routed_rows(arch, tokens: int, dev: str, dtype: torch.dtype, seed: int = 0):
    """(rows sorted by expert [tokens * topk, hidden], tokens per expert, router probabilities per row)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    logits = torch.randn(tokens, arch.num_experts, generator=g)
    experts = logits.topk(arch.moe_topk, dim=1).indices.flatten()
    counts = torch.bincount(experts, minlength=arch.num_experts)
    n = int(counts.sum())
    x = torch.randn(n, arch.hidden_size, generator=g).to(dev, dtype)
    probs = torch.rand(n, generator=g).to(dev, torch.float32)
    return x, counts.to(dev), probs


def grouped(x, counts, probs, w1, w2):
    """SequentialMLP's math through grouped GEMMs: fc1 = [gate; up] rows, SwiGLU, the router probability, fc2."""
    f = w1.shape[1] // 2
    ends = counts.cumsum(0).to(torch.int32)
    return grouped_swiglu(x, (w1[:, :f], w1[:, f:], w2), ends) * probs.unsqueeze(1).to(x.dtype)


def contenders(experts, grouped_experts):
    """The three forwards by name, and (sequential's fc1 weights, grouped's stacked fc1) whose gradients compare."""
    fc1 = [e.linear_fc1.weight for e in experts.local_experts]
    fc2 = [e.linear_fc2.weight for e in experts.local_experts]
    w1 = torch.stack([w.detach() for w in fc1]).requires_grad_()
    w2 = torch.stack([w.detach() for w in fc2]).requires_grad_()
    return {
        "sequential": lambda x, c, p: experts(x, c, p)[0],
        "GroupedExperts": lambda x, c, p: grouped_experts(x, c, p)[0],
        "grouped": lambda x, c, p: grouped(x, c, p, w1, w2),
    }, (fc1, w1)


def fc1_weight_grads(fns, fc1, w1, rows) -> dict:
    """fc1's weight gradient of one more forward + backward of ``sequential`` and ``grouped``, from zeroed
    gradients (the timed rounds accumulated into them)."""
    x, counts, probs, dy = rows
    for w in fc1 + [w1]:
        w.grad = None
    fns["sequential"](x, counts, probs).backward(dy)
    fns["grouped"](x, counts, probs).backward(dy)
    return {"sequential": torch.stack([w.grad for w in fc1]), "grouped": w1.grad}


def timed(fn, x, counts, probs, dy, rounds: int, sync):
    """(best seconds of a forward + backward, output, grad of x)."""
    best, out, gx = None, None, None
    for r in range(rounds + 1):
        xi = x.detach().requires_grad_()
        sync()
        t0 = time.perf_counter()
        y = fn(xi, counts, probs)
        y.backward(dy)
        sync()
        dt = time.perf_counter() - t0
        if r and (best is None or dt < best):
            best = dt
        out, gx = y.detach(), xi.grad
    return best, out, gx


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    gpu = torch.cuda.is_available()
    ap.add_argument("--tokens", type=int, default=8192 if gpu else 512, help="tokens before top-k routing")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    dev, dtype = ("cuda", "bf16") if gpu else ("cpu", "fp32")
    arch = tt.SHAPES["moe"] if gpu else tt.cpu_shape(tt.SHAPES["moe"])
    init_distributed()
    try:
        experts = layer0_experts(arch, dtype)
        grouped_experts = layer0_experts(arch, dtype, GroupedExperts, like=experts)
        w = experts.local_experts[0].linear_fc1.weight
        if not grouped_gemm_runs(w):
            sys.exit(f"moe experts: grouped GEMMs do not run for {w.dtype} on {w.device} with this torch")
        x, counts, probs = routed_rows(arch, args.tokens, dev, w.dtype)
        dy = torch.randn_like(x)
        sync = torch.cuda.synchronize if gpu else (lambda: None)
        fns, (fc1, w1) = contenders(experts, grouped_experts)
        res = {name: timed(fn, x, counts, probs, dy, args.rounds, sync) for name, fn in fns.items()}
        dw = fc1_weight_grads(fns, fc1, w1, (x, counts, probs, dy))
    finally:
        destroy_distributed()
    t0, y0, g0 = res["sequential"]
    print(
        f"moe experts on {dev} ({dtype}): {arch.num_experts} experts, hidden {arch.hidden_size}, expert ffn "
        f"{arch.moe_ffn_hidden_size}, {x.shape[0]} routed rows ({args.tokens} tokens, top-{arch.moe_topk}), "
        f"forward + backward, best of {args.rounds}"
    )
    for name, (t, y, gx) in res.items():
        dy_rel = float((y - y0).abs().max() / y0.abs().max())
        dx_rel = float((gx - g0).abs().max() / g0.abs().max())
        print(f"  {name:14s} {t * 1e3:9.2f} ms  {t0 / t:6.2f}x  output rel {dy_rel:.1e}, input grad rel {dx_rel:.1e}")
    dw_rel = float((dw["grouped"] - dw["sequential"]).abs().max() / dw["sequential"].abs().max())
    print(f"  fc1 weight gradient, grouped vs sequential: rel {dw_rel:.1e}")


if __name__ == "__main__":
    main()
