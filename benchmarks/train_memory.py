"""Peak memory of one training step above the model: the full-logits path against the scored head, and the planner.

    python benchmarks/train_memory.py                         # vocab 32000 / 151936 / 157184, seq 2048 and 8192
    python benchmarks/train_memory.py --vocab 151936 --seq 2048 --hidden 256 --layers 2

One block-diffusion SFT step (SDAR-shaped model, fp32 on CPU, rows x_t ++ x_0 of ``seq`` tokens made by the real
block recipe: on average a quarter of the row is scored) with ``train.logits=full`` (the old path: logits of every
position) and ``train.logits=scored`` (models/head.py), each case in a fresh child process:

    build the model + DDP + distributed optimizer, one warm-up step (Adam states), gc, then
    base = VmRSS; reset the peak (``/proc/self/clear_refs`` <- 5); one step; peak = VmHWM
    step memory above the model = peak - base

glibc is told to serve every allocation above 128 KiB by mmap (MALLOC_MMAP_THRESHOLD_), so a freed tensor leaves the
resident set at once and VmHWM follows live tensors (not the allocator's cache). Beside each measured number: the
planner's activations + logits term (plan/memory.py) for the same config. A case whose planned memory does not fit
in the free RAM is skipped and says so. On a GPU the same step's CUDA peak would be the measure; Liger-Kernel's
fused linear cross entropy (Triton) is the well-kept GPU kernel for TP = 1 without temperature / entropy, not wired
in: megadare's torch path runs everywhere and is what this script measures.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
MB = 2**20
PROMPT = 64


def bench_arch(vocab: int, hidden: int, layers: int):
    from megadare.models.family import ModelArch

    return ModelArch(
        family="sdar",
        architecture="SDARForCausalLM",
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_kv_heads=max(1, hidden // 128),
        head_dim=64,
        ffn_hidden_size=3 * hidden,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        max_position_embeddings=65536,
        mask_token_id=vocab - 1,
        attention="block_causal",
        block_size=4,
        qk_norm=True,
    )


def bench_config(seq: int, logits: str, chunk_mb: float):
    from megadare.config import load_config

    return load_config(
        None,
        [
            "plan.job=sft",
            "plan.gpus_per_node=1",
            "model.dtype=fp32",
            "model.attention_backend=sdpa",
            f"train.seq_length={seq}",
            "train.micro_batch_size=1",
            "train.recompute=none",
            f"train.logits={logits}",
            f"train.logits_chunk_mb={chunk_mb}",
        ],
    )


def planned_bytes(arch, cfg) -> float:
    """The planner's step memory above the model state: activations of one micro-batch + the logits term."""
    from megadare.plan.memory import logits_bytes, stage_activation_bytes, trainer_layout

    lay = trainer_layout(cfg)
    return stage_activation_bytes(arch, lay, cfg, 1, 0) + logits_bytes(arch, lay, cfg)


def block_rows(arch, seq: int, n_rows: int = 1):
    """Block-diffusion SFT rows of ``seq`` tokens (x_t ++ x_0 of a PROMPT + response example), the real recipe."""
    import torch

    from megadare.algos.sft import SFTRecipe, example_generator, example_rows
    from megadare.data.sft_data import SFTExample

    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(n_rows):
        ids = torch.randint(0, arch.vocab_size - 1, (seq // 2,), generator=g).tolist()
        ex = SFTExample(prompt_ids=ids[:PROMPT], response_ids=ids[PROMPT:])
        rows += example_rows(ex, arch, SFTRecipe("block", block_size=arch.block_size), example_generator(1, 0, i))
    return rows


def _status_kb(key: str) -> int:
    return int([ln for ln in open("/proc/self/status") if ln.startswith(key)][0].split()[1])


def child(vocab: int, seq: int, hidden: int, layers: int, logits: str, chunk_mb: float) -> dict:
    """One case in this (fresh) process: the step's peak resident memory above the built model (module doc)."""
    import gc

    from megadare.data.rows import global_denominator, pack_rows
    from megadare.models.gpt import build_model_chunks, transformer_config
    from megadare.models.head import HeadSettings
    from megadare.parallel import destroy_distributed, init_distributed
    from megadare.trainer.optim import OptimSettings, build_optimizer, wrap_ddp
    from megadare.trainer.policy import Policy
    from megadare.trainer.step import RowFormat, train_step

    init_distributed()
    arch = bench_arch(vocab, hidden, layers)
    chunks = build_model_chunks(
        arch, transformer_config(arch), attention_backend="sdpa", head=HeadSettings(logits, chunk_mb)
    )
    model = wrap_ddp(chunks, True)
    opt, sched = build_optimizer(model, OptimSettings(lr=1e-5, total_steps=4))
    mbs = pack_rows(block_rows(arch, seq), seq, 1)
    step = lambda: train_step(  # noqa: E731
        Policy(model, opt, sched), mbs, global_denominator(mbs), RowFormat("block_diffusion", arch.block_size, vocab)
    )
    step()
    gc.collect()
    base = _status_kb("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    m = step()
    peak = _status_kb("VmHWM")
    destroy_distributed()
    return {
        "step_mb": (peak - base) / 1024,
        "base_mb": base / 1024,
        "loss": m["loss"],
        "scored": int(sum(int(mb.scored.sum()) for mb in mbs)),
    }


def run_case(args, vocab: int, seq: int, logits: str) -> dict:
    env = dict(
        os.environ, MALLOC_MMAP_THRESHOLD_="131072", MALLOC_TRIM_THRESHOLD_="131072", OMP_NUM_THREADS=str(args.threads)
    )
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--child",
        str(vocab),
        str(seq),
        logits,
        "--hidden",
        str(args.hidden),
        "--layers",
        str(args.layers),
        "--chunk-mb",
        str(args.chunk_mb),
    ]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    if out.returncode or not lines:
        raise RuntimeError(
            f"case vocab={vocab} seq={seq} {logits} failed (exit {out.returncode}):\n" + out.stderr[-3000:]
        )
    return json.loads(lines[-1][len("RESULT ") :])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", nargs="+", type=int, default=[32000, 151936, 157184])
    ap.add_argument("--seq", nargs="+", type=int, default=[2048, 8192], help="row length (x_t ++ x_0)")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--chunk-mb", type=float, default=64.0, help="train.logits_chunk_mb of the scored path")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--child", nargs=3, metavar=("VOCAB", "SEQ", "LOGITS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        v, s, path = args.child
        print("RESULT " + json.dumps(child(int(v), int(s), args.hidden, args.layers, path, args.chunk_mb)), flush=True)
        return

    import psutil

    print(
        f"one block-diffusion SFT step, fp32 CPU, hidden {args.hidden}, {args.layers} layers; memory above the "
        f"model (MB, peak RSS - RSS before the step, fresh process per case); chunk {args.chunk_mb} MB"
    )
    print(
        f"{'vocab':>7} {'seq':>5} {'scored':>6} {'full MB':>9} {'plan':>9} {'scored MB':>9} {'plan':>9} "
        f"{'full/scored':>11}",
        flush=True,
    )
    for vocab in args.vocab:
        arch = bench_arch(vocab, args.hidden, args.layers)
        for seq in args.seq:
            res = {}
            for path in ("full", "scored"):
                plan = planned_bytes(arch, bench_config(seq, path, args.chunk_mb)) / MB
                free = psutil.virtual_memory().available / MB
                if plan * 1.5 > free:
                    res[path] = {
                        "step_mb": float("nan"),
                        "plan": plan,
                        "skipped": f"needs ~{plan:.0f} MB, {free:.0f} MB free",
                    }
                    continue
                res[path] = {**run_case(args, vocab, seq, path), "plan": plan}
            full, scored = res["full"], res["scored"]
            ratio = full["step_mb"] / scored["step_mb"] if scored["step_mb"] == scored["step_mb"] else float("nan")
            n = scored.get("scored", full.get("scored", 0))
            print(
                f"{vocab:7d} {seq:5d} {n:6d} {full['step_mb']:9.0f} {full['plan']:9.0f} {scored['step_mb']:9.0f} "
                f"{scored['plan']:9.0f} {ratio:10.1f}x"
                + "".join(f"  ({p} skipped: {r['skipped']})" for p, r in res.items() if "skipped" in r),
                flush=True,
            )


if __name__ == "__main__":
    main()
