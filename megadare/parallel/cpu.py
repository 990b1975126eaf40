"""The one compatibility layer that lets megatron-core 0.16 run on CPU with gloo (tests, laptops, CI).

megatron-core assumes CUDA: ``torch.cuda.current_device()`` as the device of new tensors, literal
``device="cuda"`` / ``.cuda()`` in schedules, optimizer and MoE code, the CUDA RNG tracker, CUDA streams and
events in the MoE token dispatchers, and (without TE) a ``te_general_gemm`` name in the router. This module
answers those calls on CPU:

1. a ``TorchFunctionMode`` (the mechanism ``torch.set_default_device`` uses) that rewrites CUDA devices in
   ``device=`` arguments and ``Tensor.to(...)`` to CPU and makes ``Tensor.cuda()`` / ``pin_memory()`` identity;
2. stubs for the ``torch.cuda`` API that is not a torch function (current device, RNG state, synchronize,
   streams, events);
3. megatron's CUDA RNG state accessors mapped to the CPU generator;
4. ``moe_utils.te_general_gemm = None`` where megatron forgot to define it;
5. ``all_to_all_single`` with tensor split sizes (the alltoall MoE dispatcher) converted to Python lists.

It is installed only when no GPU is used, and ``install_cpu_compat`` refuses to run when CUDA is in use, so it
can never change GPU behaviour. See ../shared/reference/megatron_cpu.md.
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

_INSTALLED = False
_MODE: "_CudaToCpuMode | None" = None


def _cpu_device(d: Any) -> Any:
    if isinstance(d, str) and d.startswith("cuda"):
        return torch.device("cpu")
    if isinstance(d, torch.device) and d.type == "cuda":
        return torch.device("cpu")
    if isinstance(d, int) and not isinstance(d, bool):
        return torch.device("cpu")  # an int device argument is a CUDA ordinal
    return d


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device arguments to CPU for every torch function call."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        if func is torch.Tensor.cuda or func is torch.Tensor.pin_memory:
            return args[0]
        if func is torch.Tensor.to:
            args = tuple(_cpu_device(a) if isinstance(a, (str, torch.device)) else a for a in args)
        return func(*args, **kwargs)


class _NullStream:
    """Stands in for torch.cuda.Stream / Event: CPU work is synchronous."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def wait_stream(self, *args) -> None:
        pass

    def wait_event(self, *args) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record(self, *args) -> None:
        pass

    def record_event(self, *args) -> "_NullStream":
        return _NullStream()

    def query(self) -> bool:
        return True

    def __eq__(self, other) -> bool:
        return isinstance(other, _NullStream)

    def __hash__(self) -> int:
        return 0


def cuda_in_use() -> bool:
    return torch.cuda.is_available()


def install_cpu_compat(force: bool = False) -> bool:
    """Install the layer (idempotent). Returns True if it is active. Does nothing when CUDA is available."""
    global _INSTALLED, _MODE
    if _INSTALLED:
        return True
    if cuda_in_use() and not force:
        return False
    _MODE = _CudaToCpuMode()
    _MODE.__enter__()

    cuda = torch.cuda
    cuda.current_device = lambda: "cpu"
    cuda.synchronize = lambda *a, **k: None
    cuda.Stream = _NullStream
    cuda.Event = _NullStream
    cuda.current_stream = lambda *a, **k: _NullStream()
    cuda.default_stream = lambda *a, **k: _NullStream()
    cuda.stream = lambda *a, **k: contextlib.nullcontext()
    cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    cuda.manual_seed = lambda seed: None          # the CPU generator is seeded by torch.manual_seed
    cuda.manual_seed_all = lambda seed: None
    cuda.empty_cache = lambda: None
    cuda.memory_allocated = lambda *a, **k: 0
    cuda.max_memory_allocated = lambda *a, **k: 0

    import megatron.core.tensor_parallel.random as mrandom

    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)

    import megatron.core.transformer.moe.moe_utils as moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None

    _orig_a2a = dist.all_to_all_single

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                          async_op=False):
        if isinstance(output_split_sizes, torch.Tensor):
            output_split_sizes = output_split_sizes.tolist()
        if isinstance(input_split_sizes, torch.Tensor):
            input_split_sizes = input_split_sizes.tolist()
        return _orig_a2a(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)

    dist.all_to_all_single = all_to_all_single
    _INSTALLED = True
    return True


def is_installed() -> bool:
    return _INSTALLED
