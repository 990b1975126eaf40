"""The in-process steps of benchmarks/gpu_check.py (each runs in its own process, started by gpu_check.py).

    python benchmarks/gpu_steps.py STEP --out DIR [--rows DIR] --device cuda|cpu [--tiny] [--families sdar,llada]

Every step appends result rows to ``ROWS/STEP.json`` as it goes (a step cut off by its timeout leaves what it
measured) and prints one line per row. A row: ``check`` (what), ``ok`` (True / False / None = a measurement
without a verdict), ``value`` and details. A failing check records its error in one line and the next check runs.

``env`` is here; the numeric steps are in gpu_steps_numerics.py, the training runs in gpu_steps_runs.py, the rows
in gpu_step_report.py.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys

import torch

from gpu_step_report import Report, one_line_error
from gpu_steps_numerics import step_attention, step_engine, step_parity
from gpu_steps_runs import step_planner, step_profile, step_rl, step_sft

FAMILIES = ["sdar", "sdar_moe", "llada", "llada2", "dream"]


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
            optional = optional or (mod == "ray" and args.ray_optional)  # only the rl step starts Ray
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
    ap.add_argument("--ray-optional", action="store_true", help="env: Ray missing is no failure (no rl step runs)")
    ap.add_argument("--variant", default="base", help="profile: the step fusions (train_throughput.py VARIANTS)")
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
