"""FP8 (e4m3) weights with torch alone: per-tensor and 128x128-block casts, and the rollout-weight stream for SGLang.

Formats (``F = 448``, the largest finite float8_e4m3fn value; every scale is float32):

* per-tensor: ``scale = amax(|W|) / F``, ``W_fp8 = clamp(W / scale, -F, F)`` cast to float8_e4m3fn, and
  ``W ~= W_fp8 * scale``. SGLang/vLLM name the scale ``<linear>.weight_scale`` (what modelopt's FP8 export and
  per-tensor fp8 checkpoints carry).
* per-block (DeepSeek-V3 / Qwen3-FP8 layout, SGLang ``quantization="fp8"`` with ``weight_block_size [128, 128]``):
  ``W`` [N, K] is cut into ``bn x bk`` tiles (the last row/column of tiles may be partial); for tile (i, j)
  ``s[i, j] = amax(|W_ij|) / F`` and ``W_ij ~= W_fp8_ij * s[i, j]``. ``s`` [ceil(N/bn), ceil(K/bk)] is stored as
  ``<linear>.weight_scale_inv`` (the name says "inverse" because it multiplies the fp8 values back up: it is
  the inverse of the quantization scale F / amax). config.json then has
  ``quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
  "weight_block_size": [128, 128]}`` (``fp8_block_quant_config``).

Error bound (round to nearest): e4m3 keeps 3 mantissa bits, so a value in the normal range (|W / s| >= 2^-6) is
off by at most 2^-4 of itself, and a subnormal one by at most half the subnormal step, 2^-10 * s:
``|W_fp8 * s - W| <= max(2^-4 * |W|, 2^-10 * s)``.

Only the linear layers of the transformer are cast (attention q/k/v/o or fused qkv, dense and expert MLPs);
embeddings, norms, routers, biases and the LM head stay in their dtype. Which HF names those are comes from the
family's HF <-> Megatron table (``linear_hf_names``), not from name patterns that differ between families.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from typing import Optional, Union

import torch

from megadare.convert.hf_megatron import mapping_for
from megadare.models.family import read_hf_config

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0
BLOCK = (128, 128)
_TINY = 1e-12  # amax floor: an all-zero tile gets scale 1e-12 / 448 instead of 0 (no division by zero)
# Megatron keys (ends) of the linear layers of the family table (mapping.build_table)
_LINEAR_MCORE = (
    "linear_qkv.weight",
    "linear_proj.weight",
    "linear_fc1.weight_w",
    "linear_fc1.weight_v",
    "linear_fc2.weight",
)

LinearSpec = Union[Collection[str], Callable[[str], bool]]


def fp8_block_quant_config(block: Sequence[int] = BLOCK) -> dict:
    """config.json ``quantization_config`` of a block-fp8 checkpoint, as SGLang's ``Fp8Config`` reads it."""
    return {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [int(block[0]), int(block[1])],
    }


def quantize_fp8_per_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(W_fp8, scale [1] float32) with ``scale = amax(|W|) / 448`` and ``W ~= W_fp8 * scale``."""
    w32 = w.detach().float()
    scale = w32.abs().amax().clamp(min=_TINY) / FP8_MAX
    q = (w32 / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale.reshape(1)


def quantize_fp8_block(w: torch.Tensor, block: Sequence[int] = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(W_fp8 [N, K], scale_inv [ceil(N/bn), ceil(K/bk)] float32): per tile ``s = amax(|W_tile|) / 448``,
    ``W_tile ~= W_fp8_tile * s``. Partial edge tiles are padded with zeros for the amax only."""
    if w.dim() != 2:
        raise ValueError(f"block fp8 needs a 2-D weight [out, in], got shape {tuple(w.shape)}")
    bn, bk = int(block[0]), int(block[1])
    n, k = w.shape
    nb, kb = -(-n // bn), -(-k // bk)
    w32 = w.detach().float()
    padded = torch.nn.functional.pad(w32, (0, kb * bk - k, 0, nb * bn - n))
    tiles = padded.view(nb, bn, kb, bk)
    scale = tiles.abs().amax(dim=(1, 3)).clamp(min=_TINY) / FP8_MAX  # [nb, kb]
    q = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(nb * bn, kb * bk)[:n, :k].contiguous(), scale


def linear_hf_names(table_or_config) -> frozenset[str]:
    """HF names of the linear weights that get fp8: from a family table (list of ``ParamMap``, what
    ``weight_sync.sync_weights`` holds) or a config.json dict / checkpoint dir (the family's table is built)."""
    table = table_or_config
    if isinstance(table_or_config, (dict, str)) or hasattr(table_or_config, "__fspath__"):
        table = mapping_for(read_hf_config(table_or_config))[2]
    return frozenset(h for r in table if r.mcore.endswith(_LINEAR_MCORE) for h in r.hf)


def _scale_name(name: str, suffix: str) -> str:
    if not name.endswith(".weight"):
        raise ValueError(
            f"fp8: {name!r} is selected as a linear weight but does not end in '.weight'; "
            "the scale could not be named (SGLang expects <module>.weight + <module>.weight_scale*)"
        )
    return name[: -len("weight")] + suffix


def fp8_rollout_weights(
    named_tensors: Iterable[tuple[str, torch.Tensor]], linear: LinearSpec, block: Optional[Sequence[int]] = BLOCK
) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named tensors -> the same stream with every linear weight replaced by its fp8 pair, for an SGLang engine
    that serves a block-fp8 checkpoint (``quantize_export(..., fmt="fp8-block")``).

    ``linear``: the names to cast (``linear_hf_names(table)``) or a predicate. For each of them yields
    ``(name, W_fp8)`` then ``(name[:-6] + "weight_scale_inv", s)`` with ``block`` tiles (default 128x128), or
    ``weight_scale`` (one element) with ``block=None``; every other tensor passes through unchanged. The cast
    runs on the tensor's device (keep the bucket on the GPU to make it cheap).
    """
    chosen = linear if callable(linear) else set(linear).__contains__
    for name, t in named_tensors:
        if not chosen(name):
            yield name, t
            continue
        if t.dim() != 2 or not t.is_floating_point():
            raise ValueError(
                f"fp8: linear weight {name!r} has shape {tuple(t.shape)} / dtype {t.dtype}; expected a "
                "2-D floating-point [out, in] matrix"
            )
        if block is None:
            q, s = quantize_fp8_per_tensor(t)
            yield name, q
            yield _scale_name(name, "weight_scale"), s
        else:
            q, s = quantize_fp8_block(t, block)
            yield name, q
            yield _scale_name(name, "weight_scale_inv"), s
