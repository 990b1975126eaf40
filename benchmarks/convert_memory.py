"""Peak memory of the HF <-> Megatron converters on a generated checkpoint of >= 2 GB.

Generates a random SDAR (Qwen3-shaped) checkpoint tensor by tensor (never holding the model), then runs
hf_to_megatron and megatron_to_hf each in a fresh child process and prints the child's peak RSS against the
largest tensor, the largest shard and the checkpoint size. A baseline child that loads the whole state dict
runs in the same script for the ratio.

    python benchmarks/convert_memory.py [--gb 2.2] [--workdir /tmp/convert_bench] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

CHILD = r"""
import sys, time, torch
sys.path.insert(0, {root!r})
def hwm_kb():  # VmHWM: peak resident set of this process (reset at exec, unlike ru_maxrss)
    return int([l for l in open("/proc/self/status") if l.startswith("VmHWM")][0].split()[1])
{imports}
base = hwm_kb()
t0 = time.time()
{body}
print("PEAK_KB", hwm_kb(), "BASE_KB", base, "SECONDS", time.time() - t0)
"""


def bench_config(target_gb: float) -> dict:
    from megadare.models import get_family

    cfg = get_family("sdar").tiny_config()
    cfg.update(
        hidden_size=2048,
        intermediate_size=6144,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=32768,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    per_layer = 4 * (2048 * 128 * (16 + 8 + 8) + 16 * 128 * 2048 + 3 * 2048 * 6144)
    embed = 4 * 2 * 32768 * 2048
    cfg["num_hidden_layers"] = max(2, int((target_gb * 2**30 - embed) // per_layer) + 1)
    for k in ("max_window_layers",):
        if k in cfg:
            cfg[k] = cfg["num_hidden_layers"]
    return cfg


def generate(cfg: dict, out_dir: str, shard_bytes: int) -> tuple[int, int]:
    """Random weights written one tensor at a time; returns (total bytes, largest tensor bytes)."""
    from megadare.models.safetensors_io import ShardedSafetensorsWriter
    from megadare.models import build_hf_model

    with torch.device("meta"):
        shapes = {k: (tuple(v.shape), v.dtype) for k, v in build_hf_model(cfg).state_dict().items()}
    total = largest = 0
    g = torch.Generator().manual_seed(0)
    with ShardedSafetensorsWriter(out_dir, max_shard_bytes=shard_bytes) as w:
        for k, (s, _) in shapes.items():
            t = torch.randn(s, generator=g) * 0.02
            w.add(k, t)
            total += t.numel() * 4
            largest = max(largest, t.numel() * 4)
        with open(os.path.join(w.staging_dir, "config.json"), "w") as f:
            json.dump(cfg, f)
    return total, largest


def run_child(imports: str, body: str) -> tuple[float, float, float]:
    code = CHILD.format(root=ROOT, imports=imports, body=body)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(out.stderr[-3000:])
    line = [x for x in out.stdout.splitlines() if x.startswith("PEAK_KB")][-1].split()
    return int(line[1]) * 1024 / 2**30, int(line[3]) * 1024 / 2**30, float(line[5])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=2.2, help="checkpoint size to generate (fp32)")
    ap.add_argument("--workdir", default="/tmp/megadare_convert_bench")
    ap.add_argument("--shard-mb", type=int, default=512, help="HF shard size on generation and export")
    ap.add_argument("--keep", action="store_true")
    a = ap.parse_args()
    os.makedirs(a.workdir, exist_ok=True)
    hf, ck, back = (os.path.join(a.workdir, x) for x in ("hf", "mcore", "hf_back"))
    cfg = bench_config(a.gb)
    t = time.time()
    total, largest = generate(cfg, hf, a.shard_mb << 20)
    print(
        f"generated {total / 2**30:.2f} GiB checkpoint ({cfg['num_hidden_layers']} layers) in {time.time() - t:.0f}s; "
        f"largest tensor {largest / 2**20:.0f} MiB, shard {a.shard_mb} MiB"
    )
    GiB = 2**30
    rows = []
    peak, base, sec = run_child(
        "from megadare.convert.hf_megatron import hf_to_megatron; from megadare.parallel.layout import Layout",
        f"hf_to_megatron({hf!r}, {ck!r}, Layout(tp=2, pp=2), progress=False)",
    )
    rows.append(("hf_to_megatron", peak, base, sec))
    peak, base, sec = run_child(
        "from megadare.convert.hf_megatron import megatron_to_hf",
        f"megatron_to_hf({ck!r}, {back!r}, max_shard_bytes={a.shard_mb << 20}, progress=False)",
    )
    rows.append(("megatron_to_hf", peak, base, sec))
    peak, base, sec = run_child(
        "from megadare.models.safetensors_io import SafetensorsReader", f"sd = dict(SafetensorsReader({hf!r}).items())"
    )
    rows.append(("baseline: load whole state dict", peak, base, sec))
    print(
        f"{'step':34s} {'peak RSS GiB':>12s} {'after imports':>13s} {'delta GiB':>9s} {'delta/largest':>13s} {'delta/model':>11s} {'s':>5s}"
    )
    for name, peak, base, sec in rows:
        delta = peak - base
        print(
            f"{name:34s} {peak:12.2f} {base:13.2f} {delta:9.2f} {delta * GiB / largest:13.1f} {delta * GiB / total:11.2f} {sec:5.0f}"
        )
    if not a.keep:
        shutil.rmtree(a.workdir)


if __name__ == "__main__":
    main()
