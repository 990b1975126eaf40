"""A stand-in GPU for CPU tests: tensors that live on another device, so CUDA's device rules can be checked here.

Inside ``standin_gpu()`` the process behaves as if it had one CUDA device:

* ``torch.cuda.is_available()`` is True, ``current_device()`` is 0 (GPU code paths are taken);
* every CUDA device argument (``device="cuda"``, ``device=0``, ``.cuda()``, ``.to("cuda:0")``) means the stand-in
  device, which reports itself as ``meta`` (the one extra device every torch build has);
* a tensor on the stand-in is an :class:`OnDevice`: a wrapper whose ``.device`` is ``meta`` but which holds a real
  CPU tensor, so values, data-dependent shapes (MoE routing), ``.item()`` and autograd all work;
* every op that mixes a stand-in tensor with a CPU tensor of one or more dimensions raises :class:`Mismatch`, as
  CUDA raises "Expected all tensors to be on the same device" -- except where CUDA accepts CPU tensors (copies,
  ``.to``, index tensors) -- and so does a CPU ``torch.Generator`` handed to an op on the device;
* ``.cpu()`` / ``.to("cpu")`` return plain CPU tensors; torch.distributed collectives get the tensors inside.

A tensor created without a device argument stays a plain CPU tensor, exactly as on a GPU machine, so a module
that creates a tensor on the CPU and meets the device with it fails here the way it fails on CUDA, naming the op.
Limits (named so nobody reads more into a pass): the stand-in is not ``cuda`` (``t.is_cuda`` is False, so CUDA-only
branches such as compiled FlexAttention or CUDA IPC do not run); setting a CPU tensor's ``.data`` to a GPU tensor,
legal on CUDA, raises here (a wrapper cannot become another kind of tensor); 0-dim CPU tensors pass in every op
(CUDA accepts them in elementwise ops only); nothing about speed, memory or streams is simulated.
Used by tests/test_device_placement.py; runs in a spawned process (it patches torch.cuda and torch.distributed).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

STANDIN = torch.device("meta")
_SET_DATA = torch._C.TensorBase.data.__set__
_FROM_DATA = (torch.tensor, torch.as_tensor, torch.asarray)
_aten = torch.ops.aten
# ops that CUDA runs with some arguments on the CPU: copies between devices and index tensors
_CPU_ARGS_OK = {
    _aten._to_copy.default,
    _aten.copy_.default,
    _aten.index.Tensor,
    _aten.index_put_.default,
    _aten.index_put.default,
    _aten._index_put_impl_.default,
    _aten.lift_fresh.default,
    _aten.lift_fresh_copy.default,
    _aten._has_compatible_shallow_copy_type.default,
}


class Mismatch(RuntimeError):
    """A CPU tensor met stand-in (GPU) tensors in one op: the error CUDA would raise."""


class OnDevice(torch.Tensor):
    """A tensor on the stand-in device: reports ``meta``, holds a CPU tensor ``elem`` with the values."""

    elem: torch.Tensor

    @staticmethod
    def __new__(cls, elem: torch.Tensor):
        r = torch.Tensor._make_wrapper_subclass(
            cls,
            elem.size(),
            strides=elem.stride(),
            storage_offset=elem.storage_offset(),
            dtype=elem.dtype,
            layout=elem.layout,
            device=STANDIN,
            requires_grad=elem.requires_grad,
        )
        r.elem = elem
        return r

    def __repr__(self) -> str:
        return f"OnDevice({self.elem!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"{func} on a stand-in tensor outside standin_gpu()")


def _is_standin(d: Any) -> bool:
    return d is not None and not isinstance(d, bool) and torch.device(d).type == STANDIN.type


def _plain_cpu(t: Any) -> bool:
    return type(t) is torch.Tensor and t.device.type == "cpu"


class _Device(TorchDispatchMode):
    """Runs ops on stand-in tensors on their CPU contents and checks CUDA's same-device rule."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, spec = pytree.tree_flatten((args, kwargs))
        on_device = any(isinstance(a, OnDevice) for a in flat) or _is_standin(kwargs.get("device"))
        if not on_device:
            return func(*args, **kwargs)
        if any(type(a) is torch.Tensor and a.device.type == STANDIN.type for a in flat):
            raise RuntimeError(
                f"{func}: a plain meta tensor (no values) reached the stand-in: a hole in "
                "tests/device_standin.py, not a finding about the code under test"
            )
        if func not in _CPU_ARGS_OK:
            for a in flat:
                if _plain_cpu(a) and a.dim() > 0:
                    raise Mismatch(f"{func}: a CPU tensor of shape {tuple(a.shape)} met tensors on the GPU (stand-in)")
        gen = kwargs.get("generator")
        if gen is not None and gen.device.type == "cpu":
            raise Mismatch(f"{func}: a CPU torch.Generator used for tensors on the GPU (stand-in)")
        to_cpu = (
            func is _aten._to_copy.default
            and kwargs.get("device") is not None
            and torch.device(kwargs["device"]).type == "cpu"
        )
        inner = [a.elem if isinstance(a, OnDevice) else a for a in flat]
        a2, k2 = pytree.tree_unflatten(inner, spec)
        if _is_standin(k2.get("device")):
            k2["device"] = torch.device("cpu")
        out = func(*a2, **k2)
        if to_cpu:
            return out
        if "out" in kwargs:
            return kwargs["out"]
        if func._schema.name.endswith("_") and args and isinstance(args[0], torch.Tensor):
            return args[0]  # in place: the caller's tensor, whatever its kind
        return pytree.tree_map_only(torch.Tensor, OnDevice, out)


def _standin_device(d: Any) -> Any:
    if isinstance(d, str) and d.startswith("cuda"):
        return STANDIN
    if isinstance(d, torch.device) and d.type == "cuda":
        return STANDIN
    if isinstance(d, int) and not isinstance(d, bool):
        return STANDIN  # an int device argument is a CUDA ordinal
    return d


class _CudaToStandin(TorchFunctionMode):
    """Every CUDA device argument means the stand-in."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _standin_device(kwargs["device"])
        if func is torch.Tensor.cuda:
            return args[0].to(STANDIN, non_blocking=kwargs.get("non_blocking", False))
        if func is torch.Tensor.pin_memory:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs and isinstance(args[0], OnDevice):
            name = args[0].elem.type()  # megatron's optimizers ask for torch.cuda.*
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        if func is torch.Tensor.tolist and isinstance(args[0], OnDevice):
            return args[0].elem.tolist()  # a device-to-host copy, as on CUDA
        if func is torch.Tensor.to:
            args = tuple(_standin_device(a) if isinstance(a, (str, torch.device)) else a for a in args)
        if func in _FROM_DATA:  # torch.tensor([...]) reads values, as CUDA does
            args = tuple(
                pytree.tree_map_only(OnDevice, lambda t: t.elem, a) if isinstance(a, (list, tuple)) else a for a in args
            )
            if _is_standin(kwargs.get("device")):
                return OnDevice(func(*args, **{**kwargs, "device": "cpu"}))
        if func == _SET_DATA and not isinstance(args[0], OnDevice) and isinstance(args[1], OnDevice):
            raise RuntimeError(
                "a CPU tensor's .data set to a GPU tensor: legal on CUDA (the tensor moves), not "
                "representable by the stand-in; move the module to the GPU first"
            )
        out = func(*args, **kwargs)
        if func == _SET_DATA and isinstance(args[0], OnDevice) and isinstance(args[1], OnDevice):
            args[0].elem = args[1].elem  # ``t.data = u`` swaps the wrapper; keep the contents
        return out


def _unwrapped(fn):
    """A torch.distributed function that hands the CPU tensors inside stand-in tensors to the backend."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        un = lambda t: t.elem if isinstance(t, OnDevice) else t  # noqa: E731
        return fn(*pytree.tree_map(un, args), **pytree.tree_map(un, kwargs))

    return call


_CUDA_STUBS = {
    "is_available": lambda: True,
    "device_count": lambda: 1,
    "current_device": lambda: 0,
    "set_device": lambda *a: None,
    "synchronize": lambda *a, **k: None,
    "get_device_name": lambda *a: "stand-in GPU (CPU tensors reporting 'meta')",
    "empty_cache": lambda: None,
    "memory_allocated": lambda *a, **k: 0,
    "max_memory_allocated": lambda *a, **k: 0,
    "reset_peak_memory_stats": lambda *a, **k: None,
    "is_bf16_supported": lambda *a, **k: True,
}
_DIST = (
    "all_reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "send",
    "recv",
    "isend",
    "irecv",
    "all_to_all_single",
    "_all_gather_base",
    "_reduce_scatter_base",
)


@contextlib.contextmanager
def standin_gpu():
    """The process has one (stand-in) GPU inside this block; everything is restored after it."""
    saved_cuda = {k: getattr(torch.cuda, k) for k in _CUDA_STUBS}
    saved_dist = {k: getattr(dist, k) for k in _DIST if hasattr(dist, k)}
    for k, v in _CUDA_STUBS.items():
        setattr(torch.cuda, k, v)
    for k, v in saved_dist.items():
        setattr(dist, k, _unwrapped(v))
    try:
        with _CudaToStandin(), _Device():
            yield
    finally:
        for k, v in saved_cuda.items():
            setattr(torch.cuda, k, v)
        for k, v in saved_dist.items():
            setattr(dist, k, v)


def cpu_tensors(module: torch.nn.Module) -> list[str]:
    """Names of the module's parameters and buffers that are not on the stand-in (left on the CPU)."""
    named = list(module.named_parameters()) + list(module.named_buffers())
    return sorted(n for n, t in named if t is not None and not isinstance(t, OnDevice))
