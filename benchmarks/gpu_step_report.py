"""The rows of a benchmarks/gpu_steps.py step: ``Report`` (saved after every row, one printed line each), the
one-line form of an error, and the relative distance the numeric checks compare."""

from __future__ import annotations

import json
import os
import time
import traceback
from typing import Any, Callable, Optional

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


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
