"""Fill a live sharded Megatron model from global tensors -- an HF checkpoint, without a conversion pass.

Megatron's own ``sharded_state_dict`` says, for every parameter of this rank, which global key it belongs to
and which slice of the global tensor it holds (TP offsets, SwiGLU halves, experts of this EP rank, layers of
this PP/VPP stage). We produce each global tensor through the family's mapping table and copy that slice in:
the same slicing megatron's checkpoint loader does, with HF safetensors as the source.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megadare.convert.mcore_ckpt import _drop_extra_state, load_into_chunks, model_sharded_state_dict


def _local_slice(global_t: torch.Tensor, sh) -> torch.Tensor:
    """The part of a global tensor that a ShardedTensor describes."""
    if sh.prepend_axis_num:
        raise ValueError(f"{sh.key}: prepended axes are not expected with singleton_local_shards")
    if list(global_t.shape) != list(sh.global_shape):
        raise ValueError(
            f"{sh.key}: source tensor has shape {tuple(global_t.shape)}, model expects {tuple(sh.global_shape)}"
        )
    idx = tuple(slice(o, o + n) for o, n in zip(sh.global_offset, sh.local_shape))
    return global_t[idx]


def fill_model_from_global(chunks: list[torch.nn.Module], produce: Callable[[str], torch.Tensor]) -> set[str]:
    """Copy into this rank's chunks the slices of the global tensors ``produce(key)``. Returns keys used."""
    from megatron.core.dist_checkpointing.dict_utils import (  # heavy: megatron
        dict_list_map_inplace,
        extract_matching_values,
    )
    from megatron.core.dist_checkpointing.mapping import (
        ShardedObject,
        ShardedTensor,
        ShardedTensorFactory,
        apply_factories,
        apply_factory_merges,
    )

    sd = _drop_extra_state(model_sharded_state_dict(chunks))
    factories, _ = extract_matching_values(sd, lambda x: isinstance(x, ShardedTensorFactory))
    apply_factories(sd)
    used: set[str] = set()

    def load_one(x):
        if isinstance(x, ShardedTensor):
            used.add(x.key)
            src = _local_slice(produce(x.key), x)
            return src.to(dtype=x.data.dtype).clone()
        if isinstance(x, ShardedObject):
            raise ValueError(f"{x.key}: cannot fill a ShardedObject from an HF checkpoint")
        return x

    dict_list_map_inplace(load_one, sd)
    load_into_chunks(chunks, apply_factory_merges(sd, factories), "HF checkpoint")
    return used
