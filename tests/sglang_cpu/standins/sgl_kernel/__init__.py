"""STAND-IN for sgl-kernel's CPU build (test environment only).

sglang's CPU engine (``SGLANG_USE_CPU_ENGINE=1``) imports a few ``*_cpu`` functions from ``sgl_kernel`` at module
level (``srt/mem_cache/allocation.py``, ``kernels/ops/kvcache/cache_move.py``, the speculative modules). No CPU
build of sgl-kernel is published as a wheel, and the ``sglang-kernel`` wheel has CUDA ops only. The one function a
plain run calls (torch_native attention, no AMX, no speculative decoding) is written here in torch; every other
name imports but raises ``NotImplementedError`` when called, so a path that needs the real kernel fails loudly.
``torch.ops.sgl_kernel`` stays empty, so sglang's ``cpu_has_amx_support()`` is False and its layers run their
``forward_native`` paths.
"""

import torch

__version__ = "0.0.0+megadare.standin"


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """``req_to_token[r, start:end] = out_cache_loc[...]`` for each request, consuming out_cache_loc in order."""
    pos = 0
    for i in range(req_pool_indices.shape[0]):
        r, s, e = int(req_pool_indices[i]), int(start_offset[i]), int(end_offset[i])
        req_to_token[r, s:e] = out_cache_loc[pos : pos + e - s].to(req_to_token.dtype)
        pos += e - s


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)

    def missing(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel stand-in: {name} needs the CPU build of sgl-kernel "
            "(megadare's test stand-in has only assign_req_to_token_pool_cpu)"
        )

    missing.__name__ = name
    return missing
