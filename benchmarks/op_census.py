"""Ops a training step dispatches, counted by family and by source (train_throughput.py ``--op-counts``; the GPU
profile's aten rows, benchmarks/GPU.md, are what these counts explain).

``OpCensus`` is a ``TorchDispatchMode``: every aten op below autograd is counted under its family (``sub_``,
``add_``, ``copy_``, ``_to_copy`` (a dtype cast or device move: the profiler's ``aten::to`` rows), ``mul_``,
``_foreach_*``, ``_fused_adamw_``, ...) and its source: the autograd node running it in a backward (``bwd:
LinearLogProbBackward``; a custom Function's backward also names its Python file), else the innermost Python
frame of megadare's or megatron's code, or torch's optimizer; with the number of elements each op wrote (a tiny
op per chunk and a pass over [tokens, vocab] look alike in a count). A ``copy_`` inside ``_to_copy`` is not
counted twice here (the profiler counts it under both). Under a dispatch mode torch.compile compiles nothing:
megadare's compiled fusions (RMSNorm, RoPE) run outside the census, one ``compiled`` op each; megatron's own
``jit_fuser`` functions (SwiGLU, the residual add) run eagerly inside it, op by op, as on a GPU they do not.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from typing import Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# the op families the H200 profile of the SDAR-1.7B step showed as avoidable non-GEMM work (GPU.md)
FAMILIES = (
    "sub_",
    "sub",
    "add_",
    "add",
    "copy_",
    "_to_copy",
    "mul_",
    "mul",
    "exp_",
    "exp",
    "zero_",
    "_foreach",
    "_fused_adamw_",
    "_fused_rms_norm",
    "native_layer_norm",
    "mm",
    "addmm",
    "compiled",
)
# frames that are not a source: this census, megadare's CPU stand-in for CUDA (a TorchFunctionMode on the stack)
_SKIPPED = ("op_census.py", os.path.join("parallel", "cpu.py"))
_MARKS = (os.sep + "megadare" + os.sep, os.sep + "megatron" + os.sep, os.sep + "torch" + os.sep + "optim" + os.sep)


def family(name: str) -> str:
    """An op's family: its overload packet name, every ``_foreach_*`` as one (the multi-tensor kernels)."""
    if name.startswith("_foreach_"):
        return "_foreach"
    if name.startswith("_fused_rms_norm"):
        return "_fused_rms_norm"
    return name


def _frame_source() -> str:
    """The innermost Python frame of megadare, megatron or torch.optim on the stack: ``file.py:function``."""
    f = sys._getframe(2)
    while f is not None:
        path = f.f_code.co_filename
        for mark in _MARKS:
            i = path.rfind(mark)
            if i >= 0 and not path.endswith(_SKIPPED):
                return f"{path[i + 1 :]}:{f.f_code.co_name}"
        f = f.f_back
    return "?"


class OpCensus(TorchDispatchMode):
    """Counts (family, source) of every dispatched op while active (module doc)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()  # ops
        self.elements: Counter = Counter()  # elements of their (first) output: a small op or a pass over a tensor

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        node = torch._C._current_autograd_node()
        source = _frame_source()
        if node is not None:
            source = f"bwd: {node.name()}" + ("" if source == "?" or "/schedules" in source else f" ({source})")
        key = (family(func.overloadpacket.__name__), source)
        out = func(*args, **(kwargs or {}))
        self.counts[key] += 1
        returns = func._schema.returns
        if returns and returns[0].alias_info is not None and not func._schema.is_mutable:
            return out  # a view (detach, slice, t, ...): nothing written
        first = out[0] if isinstance(out, (tuple, list)) and out else out
        if first is None and args and isinstance(args[0], (tuple, list)):  # an in-place multi-tensor op
            self.elements[key] += sum(t.numel() for t in args[0] if torch.is_tensor(t))
        self.elements[key] += first.numel() if torch.is_tensor(first) else 0
        return out

    def by_family(self, counter: Optional[Counter] = None) -> Counter:
        out: Counter = Counter()
        for (fam, _), n in (self.counts if counter is None else counter).items():
            out[fam] += n
        return out

    def table(self, families: Optional[tuple[str, ...]] = FAMILIES, steps: int = 1) -> str:
        """Per step: each family's ops and the elements they wrote (k: thousands), then its sources, largest
        first."""
        fams, elems = self.by_family(), self.by_family(self.elements)
        lines = [f"{'family / source':28s} {'ops':>6s} {'k elements':>11s}"]
        total = sum(self.counts.values()), sum(self.elements.values())
        lines.append(f"{'(all ops)':28s} {total[0] / steps:6.0f} {total[1] / steps / 1e3:11.1f}")
        for fam in families or sorted(fams):
            if not fams.get(fam):
                continue
            lines.append(f"{fam:28s} {fams[fam] / steps:6.0f} {elems[fam] / steps / 1e3:11.1f}")
            rows = sorted(((n, src) for (f, src), n in self.counts.items() if f == fam), reverse=True)
            lines += [f"    {n / steps:6.0f} {self.elements[(fam, src)] / steps / 1e3:11.1f}  {src}" for n, src in rows]
        return "\n".join(lines)


class StepCensus:
    """A ``run_backend(on_step=...)`` hook: counts the ops of the step after ``skip`` steps (warm-up: compilation,
    the optimizer's lazy state) with an ``OpCensus``. Functions compiled through models/step_fusions.py's
    ``run_compiled`` run outside the census (dynamo compiles nothing under a dispatch mode) and count as one
    ``compiled`` op each (their backward's kernels as ``compiled_bwd`` ... where autograd runs them: not counted)."""

    def __init__(self, skip: int = 2) -> None:
        self.skip, self.seen, self.census = skip, 0, OpCensus()

    def __call__(self) -> None:
        self.seen += 1
        if self.seen == self.skip:
            self._patch(True)
            self.census.__enter__()
        elif self.seen == self.skip + 1:
            self.census.__exit__(None, None, None)
            self._patch(False)

    def _patch(self, on: bool) -> None:
        from megadare.models import step_fusions  # heavy (megatron): as the benchmark's own imports

        if not on:
            step_fusions.run_compiled = self._real
            return
        self._real = real = step_fusions.run_compiled
        census = self.census

        def outside(fn, args, dynamic):
            census.counts[("compiled", f"{fn.__module__}.{fn.__qualname__}")] += 1
            with torch.utils._python_dispatch._disable_current_modes():
                return real(fn, args, dynamic)

        step_fusions.run_compiled = outside
