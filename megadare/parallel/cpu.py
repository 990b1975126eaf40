"""The one compatibility layer that lets megatron-core 0.16 run on CPU with gloo (tests, laptops, CI).

megatron-core assumes CUDA: ``torch.cuda.current_device()`` as the device of new tensors, literal
``device="cuda"`` / ``.cuda()`` in schedules, optimizer and MoE code, the CUDA RNG tracker, CUDA streams and
events in the MoE token dispatchers. This module answers those calls on CPU (the router's missing
``te_general_gemm`` without TE is not CPU-specific: models/mcore_fixes.py defines it on every device):

1. a ``TorchFunctionMode`` (the mechanism ``torch.set_default_device`` uses) that rewrites CUDA devices in
   ``device=`` arguments and ``Tensor.to(...)`` to CPU and makes ``Tensor.cuda()`` / ``pin_memory()`` identity;
2. stubs for the ``torch.cuda`` API that is not a torch function (current device, RNG state, synchronize,
   streams, events);
3. megatron's CUDA RNG state accessors mapped to the CPU generator;
4. ``all_to_all_single`` with tensor split sizes (the alltoall MoE dispatcher) converted to Python lists;
5. ``Tensor.type()`` (no arguments) answers ``torch.cuda.*Tensor`` as megatron's optimizers expect;
6. ``reduce_scatter_tensor`` (gloo has none; megatron's distributed optimizer uses it) as all-reduce + copy;
7. pipeline p2p with tags per direction: with PP=2 the previous and the next stage are the same peer, and
   gloo matches messages between a pair of ranks in posting order, so a batch holding an activation and a
   gradient for the same peer could swap two same-shaped tensors (NCCL groups them); activations travel
   with tag 1, gradients with tag 2;
9. the grad-buffer reduce-scatter and param all-gather of megatron's DDP / distributed optimizer on a group of
   one rank (data-parallel size 1: a laptop, one CPU process) are a local copy, or nothing when input and
   output are the same memory (they are: the shard of one rank is the whole buffer); gloo would copy the
   whole model through its buffers twice per step.

The mode costs ~2 us per torch call, so the hot sections run without it (``hot_section``): each model forward
and the loss on its output (trainer/forward.py), the RL update's row building and packing (trainer/rl_update.py)
and the optimizer's gradient copies, inner step and zero_grad. Those
sections hard-code no CUDA device in megatron-core 0.16 (their tensors come from ``torch.cuda.current_device()``,
answered by item 2, or from existing tensors); what does (the schedules' token counter, grad-norm and clipping
buffers, the optimizers' ``.type()`` checks, model build, checkpoints) runs with the mode.

It is installed only when no GPU is used, and ``install_cpu_compat`` refuses to run when CUDA is in use, so it
can never change GPU behaviour. See ../shared/reference/megatron_cpu.md.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

_INSTALLED = False
_MODE: "_CudaToCpuMode | None" = None
SCOPED = True  # False: the mode stays on in the hot sections too (tests compare the two)


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
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # megatron's optimizers check param.type() == 'torch.cuda.FloatTensor': answer as CUDA would
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if not name.startswith("torch.cuda.") else name
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


class _DoneWork:
    """A completed async collective handle."""

    def wait(self, *args) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


_ACT_TAG, _GRAD_TAG = 1, 2


# megatron's p2p tensor keywords in its order: (keyword, op, towards the next stage, tag)
_P2P_TENSORS = (
    ("tensor_send_prev", dist.isend, False, _GRAD_TAG),
    ("tensor_recv_prev", dist.irecv, False, _ACT_TAG),
    ("tensor_send_next", dist.isend, True, _ACT_TAG),
    ("tensor_recv_next", dist.irecv, True, _GRAD_TAG),
)


def _tagged_p2p_ops(*, group, prev_pipeline_rank: int, next_pipeline_rank: int, **tensors):
    """megatron's pipeline p2p with activations (forward) and gradients (backward) on separate tags. megatron's
    ``_batched_p2p_ops`` / ``_p2p_ops`` fix the keywords: the tensors arrive as tensor_{send,recv}_{prev,next}."""
    unknown = sorted(set(tensors) - {name for name, *_ in _P2P_TENSORS})
    if unknown:
        raise TypeError(f"_tagged_p2p_ops() got unexpected keyword arguments {unknown}")
    ops = []
    for name, op, towards_next, tag in _P2P_TENSORS:
        if tensors.get(name) is not None:
            peer = next_pipeline_rank if towards_next else prev_pipeline_rank
            ops.append(dist.P2POp(op, tensors[name], peer, group, tag=tag))
    return dist.batch_isend_irecv(ops) if ops else []


def _mode_on_top() -> bool:
    n = torch._C._len_torch_function_stack()
    return n > 0 and torch._C._get_function_stack_at(n - 1) is _MODE


@contextlib.contextmanager
def hot_section():
    """The block runs without the CUDA-to-CPU mode (module doc); a no-op on GPU, with ``SCOPED`` False, or when
    another torch function mode sits above it (``torch.device(...)`` as a context: the mode then stays)."""
    if _MODE is None or not SCOPED or not _mode_on_top():
        yield
        return
    torch._C._pop_torch_function_stack()
    try:
        yield
    finally:
        torch._C._push_on_torch_function_stack(_MODE)


def in_hot_section(fn):
    """``fn`` run in ``hot_section``."""

    def call(*args, **kwargs):
        with hot_section():
            return fn(*args, **kwargs)

    call.__wrapped__ = fn
    return call


# megatron optimizer methods that run per step and hard-code no CUDA device (grad norm and clipping do: they
# keep the mode); each is wrapped where its class defines it
_HOT_OPTIMIZER_METHODS = ("prepare_grads", "step_with_ready_grads", "zero_grad")


def _scope_optimizer_steps() -> None:
    import megatron.core.optimizer.distrib_optimizer as dopt  # heavy: megadare.parallel imports without megatron
    import megatron.core.optimizer.optimizer as opt  # heavy: as above

    classes = (opt.MixedPrecisionOptimizer, opt.Float16OptimizerWithFloat16Params, opt.FP32Optimizer)
    for cls in classes + (dopt.DistributedOptimizer,):
        for name in _HOT_OPTIMIZER_METHODS:
            if name in cls.__dict__:
                setattr(cls, name, in_hot_section(cls.__dict__[name]))


def cuda_in_use() -> bool:
    return torch.cuda.is_available()


def install_cpu_compat() -> bool:
    """Install the layer (idempotent). Returns True if it is active. Does nothing when CUDA is available."""
    global _INSTALLED, _MODE
    if _INSTALLED:
        return True
    if cuda_in_use():
        return False
    _MODE = _CudaToCpuMode()
    _MODE.__enter__()
    # megatron's CUDA-stream advice for sequence parallelism (set CUDA_DEVICE_MAX_CONNECTIONS=1) means nothing on CPU
    warnings.filterwarnings("ignore", message=r".*CUDA_DEVICE_MAX_CONNECTIONS")

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
    cuda.manual_seed = lambda seed: None  # the CPU generator is seeded by torch.manual_seed
    cuda.manual_seed_all = lambda seed: None
    cuda.empty_cache = lambda: None
    cuda.memory_allocated = lambda *a, **k: 0
    cuda.max_memory_allocated = lambda *a, **k: 0

    import megatron.core.tensor_parallel.random as mrandom  # heavy: megadare.parallel imports without megatron

    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)

    _orig_a2a = dist.all_to_all_single

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        if isinstance(output_split_sizes, torch.Tensor):
            output_split_sizes = output_split_sizes.tolist()
        if isinstance(input_split_sizes, torch.Tensor):
            input_split_sizes = input_split_sizes.tolist()
        return _orig_a2a(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)

    dist.all_to_all_single = all_to_all_single

    _orig_rs = dist.reduce_scatter_tensor

    def reduce_scatter_tensor(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if dist.get_backend(group) != "gloo":
            return _orig_rs(output, input, op=op, group=group, async_op=async_op)
        buf = input.clone()
        dist.all_reduce(buf, op=op, group=group)
        r = dist.get_rank(group)
        output.copy_(buf.view(-1)[r * output.numel() : (r + 1) * output.numel()].view_as(output))
        return _DoneWork() if async_op else None

    dist.reduce_scatter_tensor = reduce_scatter_tensor
    _short_circuit_single_rank_buffers()

    import megatron.core.pipeline_parallel.p2p_communication as p2p  # heavy: as above

    p2p._batched_p2p_ops = _tagged_p2p_ops
    p2p._p2p_ops = _tagged_p2p_ops
    _scope_optimizer_steps()
    _INSTALLED = True
    return True


def _short_circuit_single_rank_buffers() -> None:
    """Item 9 of the module doc: megatron's grad-buffer collectives on a group of one rank."""
    import megatron.core.distributed.param_and_grad_buffer as pgb  # heavy: megadare.parallel imports without megatron

    def single(fn):
        def call(output, input, *args, group=None, async_op=False, **kwargs):
            if dist.get_world_size(group) != 1:
                return fn(output, input, *args, group=group, async_op=async_op, **kwargs)
            if output.data_ptr() != input.data_ptr() or output.numel() != input.numel():
                output.copy_(input.view_as(output))  # one rank: the reduction and the gather are the identity
            return _DoneWork() if async_op else None

        return call

    pgb.dist_all_gather_func = single(pgb.dist_all_gather_func)
    pgb.dist_reduce_scatter_func = single(pgb.dist_reduce_scatter_func)


def is_installed() -> bool:
    return _INSTALLED
