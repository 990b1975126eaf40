"""torch.distributed + megatron parallel_state set-up for TP, SP, PP (+ virtual stages), EP, CP and DP.

nccl on GPUs, gloo on CPU (where the compatibility layer in cpu.py is installed first). A single process with no
launcher environment runs as world size 1.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from megadare.parallel.cpu import install_cpu_compat
from megadare.parallel.launch import free_port


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    vpp: Optional[int] = None
    ep: int = 1
    etp: int = 1
    cp: int = 1
    sp: bool = False
    dp: int = 1


_LAYOUT: Optional[Layout] = None


def is_cpu() -> bool:
    return not torch.cuda.is_available()


def current_layout() -> Layout:
    if _LAYOUT is None:
        raise RuntimeError("megadare.parallel.init_distributed() has not been called")
    return _LAYOUT


def check_sizes(world: int, tp: int, pp: int, ep: int, etp: int, cp: int, vpp: Optional[int], sp: bool) -> int:
    """Validate a layout against a world size (megatron's own rules); returns DP."""
    for name, v in (("tp", tp), ("pp", pp), ("ep", ep), ("etp", etp), ("cp", cp)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"parallel.{name}={v!r} must be a positive integer")
    if world % (tp * pp * cp):
        raise ValueError(
            f"world size {world} is not divisible by tp*pp*cp = {tp}*{pp}*{cp}; "
            f"launch a multiple of {tp * pp * cp} processes"
        )
    if world % (etp * ep * pp):
        raise ValueError(
            f"world size {world} is not divisible by etp*ep*pp = {etp}*{ep}*{pp}; "
            f"change parallel.ep or the number of processes"
        )
    if sp and tp == 1:
        raise ValueError("parallel.sp=true needs parallel.tp > 1")
    if vpp is not None and vpp > 1 and pp == 1:
        raise ValueError(f"parallel.vpp={vpp} needs parallel.pp > 1")
    return world // (tp * pp * cp)


def init_distributed(
    tp: int = 1,
    pp: int = 1,
    vpp: Optional[int] = None,
    ep: int = 1,
    etp: Optional[int] = None,
    cp: int = 1,
    sp: bool = False,
    seed: int = 1234,
    backend: Optional[str] = None,
    timeout_s: int = 600,
) -> Layout:
    """Initialise torch.distributed (env:// or a single process) and megatron's parallel groups."""
    global _LAYOUT
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    cpu = is_cpu()
    if cpu:
        install_cpu_compat()
    if not dist.is_initialized():
        rank = int(os.environ.get("RANK", 0))
        world = int(os.environ.get("WORLD_SIZE", 1))
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:  # a launcher sets it; alone, take a free port (no clash with a
            os.environ["MASTER_PORT"] = str(free_port() if world == 1 else 29500)  # second run here)
        if not cpu:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count())))
        dist.init_process_group(
            backend or ("gloo" if cpu else "nccl"), rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s)
        )
    world = dist.get_world_size()
    etp = tp if etp is None else etp  # megatron's default: experts split like the dense layers
    dp = check_sizes(world, tp, pp, ep, etp, cp, vpp, sp)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if (vpp or 1) > 1 else None,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
    )
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    _LAYOUT = Layout(tp=tp, pp=pp, vpp=vpp, ep=ep, etp=etp, cp=cp, sp=sp, dp=dp)
    return _LAYOUT


def destroy_distributed() -> None:
    """Tear down megatron's groups and the process group, so a process can initialise again."""
    global _LAYOUT
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    _LAYOUT = None
