"""Built-in engine throughput: block-diffusion decoding with the block KV cache vs the same sampler without it.

    python benchmarks/rollout_throughput.py            # GPU: SDAR-1.7B shape, bf16; CPU: a small shape
    python benchmarks/rollout_throughput.py --batch 32 --prompt 128 --new 256 --steps 4

Prints tokens/s, model forwards per generated token (the cache adds one forward per block to store it) and the
ratio cached / uncached, both measured in this run; then the engine's weight-update bandwidth (GB/s) for a full
state dict pushed through ``update_weights``.
"""
from __future__ import annotations

import argparse
import time
from dataclasses import replace

import torch

from megadare.models import get_family
from megadare.rollout.engine import SamplingParams
from megadare.rollout.native import NativeEngine


def build(gpu: bool):
    fam = get_family("sdar")
    if gpu:  # SDAR-1.7B shape (Qwen3-1.7B)
        cfg = fam.tiny_config(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                              num_attention_heads=16, num_key_value_heads=8, head_dim=128, block_size=4,
                              mask_token_id=151669, max_position_embeddings=32768)
    else:
        cfg = fam.tiny_config(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
                              num_key_value_heads=4, head_dim=32, block_size=4, max_position_embeddings=4096)
    model = fam.hf_model(cfg)
    if gpu:
        model = model.to(torch.bfloat16)
    return model, fam.arch(cfg)


def run(engine: NativeEngine, prompts, params) -> tuple[float, float, int]:
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    engine.generate(prompts[:2], replace(params, max_new_tokens=params.block_size))  # warm-up
    engine.forwards = 0
    sync()
    t0 = time.perf_counter()
    trajs = engine.generate(prompts, params)
    sync()
    dt = time.perf_counter() - t0
    tokens = sum(len(t.response_ids) for t in trajs)
    return tokens / dt, engine.forwards / (tokens / len(prompts)), tokens


def main() -> None:
    gpu = torch.cuda.is_available()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=32 if gpu else 4)
    ap.add_argument("--prompt", type=int, default=128 if gpu else 32)
    ap.add_argument("--new", type=int, default=256 if gpu else 32)
    ap.add_argument("--steps", type=int, default=4, help="denoising steps per block of 4")
    ap.add_argument("--algorithm", default="low_confidence_static")
    args = ap.parse_args()
    torch.manual_seed(0)
    model, arch = build(gpu)
    params = SamplingParams(max_new_tokens=args.new, block_size=4, steps_per_block=args.steps,
                            algorithm=args.algorithm, temperature=1.0, stop_at_eos=False)
    prompts = torch.randint(0, arch.vocab_size - 2, (args.batch, args.prompt)).tolist()
    device = torch.cuda.get_device_name() if gpu else "CPU"
    print(f"device: {device}; batch {args.batch}, prompt {args.prompt}, {args.new} new tokens, block 4, "
          f"{args.steps} steps/block, {params.algorithm}")
    results = {}
    for use_cache in (False, True):
        eng = NativeEngine(model, arch, eos_token_id=arch.vocab_size - 3, use_cache=use_cache)
        tok_s, fwd_per_tok, _ = run(eng, prompts, params)
        results[use_cache] = tok_s
        print(f"  {'block KV cache' if use_cache else 'no cache      '}: {tok_s:10.1f} tok/s   "
              f"{fwd_per_tok:.2f} forwards per token (batch-wide)")
    print(f"  cache speed-up: {results[True] / results[False]:.2f}x")
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    nbytes = sum(v.numel() * v.element_size() for v in sd.values())
    t0 = time.perf_counter()
    eng.update_weights(sd.items(), version=1)
    if gpu:
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    print(f"weight update (in-process, {nbytes / 2**20:.0f} MiB): {nbytes / dt / 1e9:.2f} GB/s")


if __name__ == "__main__":
    main()
