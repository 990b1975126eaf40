"""The reader's side of megadare/convert/fp8.py's formats, as a serving engine applies them (SGLang's block-fp8
linear multiplies each 128x128 tile by its ``weight_scale_inv``): the tests' reference for the quantizers and the
fp8 weight stream. Written the plain way (scales repeated to the weight's shape), not as the quantizer's tiles."""

from __future__ import annotations

from typing import Optional, Sequence

import torch


def dequantize_fp8(
    q: torch.Tensor, scale: torch.Tensor, block: Optional[Sequence[int]] = None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``W_fp8 * scale``: per tensor (``block=None``, scale of one element) or per ``block`` tile."""
    x = q.float()
    if block is None:
        return (x * scale.float().reshape(())).to(dtype)
    bn, bk = int(block[0]), int(block[1])
    s = scale.float().repeat_interleave(bn, 0).repeat_interleave(bk, 1)[: x.shape[0], : x.shape[1]]
    return (x * s).to(dtype)
