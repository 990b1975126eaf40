"""`megadare demo --foundation`: the conversion/parallelism foundation end to end on CPU, in about a minute.

For every family: a tiny random checkpoint in the publisher's HF layout -> the converter -> a Megatron
distributed checkpoint -> loaded by a sharded Megatron model on 2 CPU processes (TP=2 with sequence
parallelism; EP=2 for the MoE families) -> logits compared with the hf/ reference model -> saved again from the
shards -> exported back to HF and compared bitwise with the source. Prints one row per family.
(The main demo, ``megadare demo``, is SFT -> RL: megadare/demo.py.)
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
import warnings

import torch

from megadare.convert.hf_megatron import hf_to_megatron, megatron_to_hf
from megadare.files import owned_tempdir
from megadare.models import build_hf_model, get_family, save_hf_model, load_hf_model
from megadare.models.attention import family_mask
from megadare.models.safetensors_io import SafetensorsReader
from megadare.parallel.launch import spawn
from megadare.parallel.layout import Layout
from megadare.trainer.verify import megatron_logits, resave

FAMILIES = ("sdar", "sdar_moe", "llada2", "llada", "dream")


def _make_checkpoint(name: str, root: str, seed: int) -> tuple[str, dict]:
    torch.manual_seed(seed)
    cfg = get_family(name).tiny_config()
    model = build_hf_model(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    path = os.path.join(root, "hf", name)
    save_hf_model(model, cfg, path, max_shard_bytes=256 << 10)
    return path, cfg


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="megadare demo --foundation", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--workdir", default=None, help="keep outputs here (default: a temp dir)")
    ap.add_argument("--seq", type=int, default=32)
    a = ap.parse_args(argv)
    os.environ.setdefault("PYTHONWARNINGS", "ignore")  # megatron's TE/apex fallback notices, in every worker
    warnings.filterwarnings("ignore")

    root = a.workdir or owned_tempdir("megadare_demo_")  # what killed demos left goes
    print(f"megadare demo: working in {root}" + ("" if a.workdir else " (removed at the end; --workdir keeps it)"))
    try:
        ok = _families(a.families.split(","), root, a.seq)
    finally:
        if not a.workdir:  # a temp dir: each run left a dir of checkpoints (13 MB for every family) in /tmp
            shutil.rmtree(root, ignore_errors=True)
    print("all families match their reference models" if ok else "MISMATCH: see the table above")
    return 0 if ok else 1


def _families(names: list[str], root: str, seq: int) -> bool:
    """Every family's row of the table (working in ``root``); whether all match."""
    print(f"{'family':9s} {'layout':12s} {'params':>8s} {'max |logit diff|':>17s} {'HF round trip':>14s} {'s':>5s}")
    ok = True
    for i, name in enumerate(names):
        t0 = time.time()
        hf_dir, cfg = _make_checkpoint(name, root, seed=i)
        arch = get_family(name).arch(cfg)
        layout = dict(ep=2) if arch.is_moe else dict(tp=2, sp=True)
        ck = os.path.join(root, "mcore", name)
        hf_to_megatron(hf_dir, ck, Layout(**{k: v for k, v in layout.items() if k != "sp"}), progress=False)
        ids = torch.randint(0, arch.vocab_size, (2, seq))
        case = {"name": name, "hf_dir": hf_dir, "input_ids": ids}
        res = {}
        for r in spawn(megatron_logits, 2, layout, [case], None, {name: ck}):
            res.update(r)
        ref_model = load_hf_model(hf_dir)
        with torch.no_grad():
            ref = ref_model(ids, attention_mask=family_mask(arch).dense(seq, seq))
        diff = max((res[name] - ref).abs().max().item(), (res[name + "/ckpt"] - ref).abs().max().item())
        ck2, back = os.path.join(root, "mcore_resaved", name), os.path.join(root, "hf_back", name)
        spawn(resave, 2, layout, hf_dir, ck, ck2)
        megatron_to_hf(ck2, back, progress=False)
        src, out = SafetensorsReader(hf_dir), SafetensorsReader(back)
        bitwise = sorted(src.keys()) == sorted(out.keys()) and all(
            torch.equal(src.get(k), out.get(k)) for k in src.keys()
        )
        n = sum(p.numel() for p in ref_model.parameters())
        lay = ",".join(f"{k}={v}" for k, v in layout.items())
        print(
            f"{name:9s} {lay:12s} {n:8d} {diff:17.2e} {'bitwise' if bitwise else 'DIFFERS':>14s} "
            f"{time.time() - t0:5.1f}"
        )
        ok &= diff < 1e-4 and bitwise
    return ok
