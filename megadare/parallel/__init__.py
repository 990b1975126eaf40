"""torch.distributed + megatron parallel_state set-up for TP, SP, PP (+ virtual stages), EP, CP and DP.

nccl on GPUs, gloo on CPU (where the compatibility layer in cpu.py is installed first). A single process with no
launcher environment runs as world size 1.
"""

from __future__ import annotations

import os
from dataclasses import replace
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from megadare.errors import ConfigError
from megadare.parallel.cpu import install_cpu_compat
from megadare.parallel import peers
from megadare.parallel.launch import free_port
from megadare.parallel.layout import Layout


def is_cpu() -> bool:
    return not torch.cuda.is_available()


def init_distributed(
    layout: Optional[Layout] = None, *, seed: int = 1234, backend: Optional[str] = None, timeout_s: int = 600
) -> Layout:
    """Initialise torch.distributed (env:// or a single process) and megatron's parallel groups for ``layout``
    (default: no model parallelism); returns it placed on the launched world."""
    from megatron.core import parallel_state  # heavy: megadare.parallel imports without megatron
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed  # heavy: as above

    cpu = is_cpu()
    if cpu:
        install_cpu_compat()
    if not dist.is_initialized():
        rank = int(os.environ.get("RANK", 0))
        world = int(os.environ.get("WORLD_SIZE", 1))
        init_method = None  # env:// (a launcher's MASTER_ADDR / MASTER_PORT)
        if "MASTER_PORT" not in os.environ and world == 1:
            # alone: a free port of its own, kept out of the environment (a process this one starts later must
            # not inherit it and find it taken)
            init_method = f"tcp://127.0.0.1:{free_port()}"
        else:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29500")
        if not cpu:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count())))
        dist.init_process_group(
            backend or ("gloo" if cpu else "nccl"),
            init_method=init_method,
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=timeout_s),
        )
    peers.record()
    layout = placed(layout or Layout(), dist.get_world_size())
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
        distributed_timeout_minutes=timeout_s / 60,  # its groups' timeout (30 min by default, whatever ours is)
    )
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    return layout


def placed(layout: Layout, world: int) -> Layout:
    """``layout`` on the launched ``world`` processes (checked; one resolved for another world size is an error)."""
    if layout.world not in (None, world):
        raise ConfigError(
            f"the layout was resolved for {layout.world} processes but {world} were launched; launch "
            f"{layout.world} or set parallel.world_size={world}"
        )
    return replace(layout, world=world)


def destroy_distributed() -> None:
    """Tear down megatron's groups and the process group, so a process can initialise again."""
    from megatron.core import parallel_state  # heavy: megadare.parallel imports without megatron

    parallel_state.destroy_model_parallel()  # peers' table stays: a failed collective is named after the teardown
    if dist.is_initialized():
        dist.destroy_process_group()
