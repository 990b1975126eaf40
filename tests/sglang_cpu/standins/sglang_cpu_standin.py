"""STAND-IN sglang plugin (test environment only; entry point group ``sglang.srt.plugins``).

In dLLM mode sglang forces ``page_size = block_size``, so KV slots come from ``PagedTokenToKVPoolAllocator``
(``sglang/srt/mem_cache/allocator/paged.py``), whose ``alloc_extend`` / ``alloc_decode`` launch the Triton
kernels ``alloc_extend_kernel`` / ``alloc_decode_kernel``. Triton has no CPU driver ("0 active drivers"). Under
sglang's CPU engine this plugin replaces both with sglang's own torch reference ``alloc_extend_naive`` (same file):
a decode step is an extend by one token per request (prefix = seq_len - 1).
"""

from __future__ import annotations


class _Launch:
    """``kernel[grid](*args)`` -> ``fn(*args)``: the Triton launch syntax the allocator uses."""

    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, grid):
        return self.fn


def _alloc_extend(prefix_lens, seq_lens, last_loc, free_pages, out_indices, bs_upper, page_size):
    from sglang.srt.mem_cache.allocator.paged import alloc_extend_naive

    alloc_extend_naive(prefix_lens, seq_lens, last_loc, free_pages, out_indices, page_size, out_indices.device)


def _alloc_decode(seq_lens, last_loc, free_pages, out_indices, bs_upper, page_size):
    _alloc_extend(seq_lens - 1, seq_lens, last_loc, free_pages, out_indices, bs_upper, page_size)


def register() -> None:
    from sglang.srt.utils import is_cpu

    if not is_cpu():
        return
    import sglang.srt.mem_cache.allocator.paged as paged

    paged.alloc_extend_kernel = _Launch(_alloc_extend)
    paged.alloc_decode_kernel = _Launch(_alloc_decode)
