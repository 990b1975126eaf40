"""Fixes for megatron-core 0.16.1 bugs that affect megadare on every device (not only CPU).

* ``TopKRouter._apply_expert_bias`` masks padding with ``routing_map & ~padding_mask`` where routing_map is
  [tokens, experts] and padding_mask is [tokens]: the shapes do not broadcast, so passing a padding mask (to keep
  packing padding out of the expert-bias load statistics) crashes. Replaced by the same update with the mask
  broadcast over experts.
* ``DistributedOptimizer._set_main_param_and_optimizer_states`` copies every key of the torch-Adam state,
  including the ``step`` entry megatron itself adds on the non-TE/non-Apex path, from tensors that never
  hold ``step`` (it travels in the param groups): loading a distributed-optimizer checkpoint raises
  ``KeyError: 'step'``. The fix keeps the (already restored) step.
* ``tensor_parallel.checkpoint`` (``train.recompute=full``) hands every argument to ``save_for_backward``, so a
  non-tensor attention mask (megadare's ``MaskSpec``, every backend but ``local``) raises ``TypeError``. The fix
  binds non-tensor arguments into the recomputed function and checkpoints only the tensors.
* ``moe_utils`` defines ``te_general_gemm`` only when Transformer Engine imports, yet
  ``RouterGatingLinearFunction`` reads the name whatever the router dtype: without TE (CPU, and GPU images
  without it) every MoE forward raises ``NameError``. The fix assigns None, what megatron itself assigns when TE
  lacks the function (the gating then takes its plain ``torch.mm`` path).
* Without Transformer Engine or apex, gradient clipping (``optimizer/clip_grads.py``, every step with
  ``optim.clip_grad``) takes megatron's ``local_multi_tensor_l2_norm`` and ``local_multi_tensor_scale``
  (``utils.py``): the first builds ``torch.tensor([...])`` from one 0-dim norm per parameter, a device-to-host
  copy and wait each (a few hundred per step: the GPU idles while the host collects them); the second scales each
  gradient as ``dst.copy_(src * scale)``, a temporary as large as the gradient and two passes over it where one
  in-place pass does. Replaced where megatron chose its local versions by the same operations through torch's
  multi-tensor kernels: ``_foreach_norm`` then the norm of the norms, on the gradients' device; ``_foreach_mul_``
  in place (``_foreach_copy_`` of the product when source and destination differ, as in the fp16 optimizer's
  param copy; with megatron's scale 1.0 there, the copy alone: the product was a temporary fp32 copy of every
  master weight, written and read once more per step). The same values (the product rounds once either way,
  x * 1.0 is x; the norm to fp32 summation order).

Applied once, at import of models/gpt.py.
"""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core import tensor_parallel
from megatron.core import utils as mcore_utils
from megatron.core.optimizer import clip_grads
from megatron.core.optimizer import optimizer as mcore_optimizer
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.router import TopKRouter

_APPLIED = False


def _apply_expert_bias(self, routing_map: torch.Tensor, padding_mask: Optional[torch.Tensor] = None) -> None:
    if self.enable_expert_bias and torch.is_grad_enabled():
        with torch.no_grad():
            if padding_mask is not None:
                routing_map = routing_map & (~padding_mask.reshape(-1, 1))
            self.local_tokens_per_expert += routing_map.sum(dim=0)


def _keep_step(original):
    def set_main_param_and_optimizer_states(self, model_param, tensors):
        if not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            group_index, group_order = self.model_param_group_index_map[model_param]
            main_param = self.optimizer.param_groups[group_index]["params"][group_order]
            state = self.optimizer.state[main_param]
            if "step" in state and "step" not in tensors:
                tensors = {**tensors, "step": state["step"]}
        return original(self, model_param, tensors)

    return set_main_param_and_optimizer_states


def _checkpoint_tensors_only(original):
    def checkpoint(function, distribute_saved_activations, *args):
        saved = [i for i, a in enumerate(args) if a is None or torch.is_tensor(a)]
        if len(saved) == len(args):
            return original(function, distribute_saved_activations, *args)

        def bound(*tensors):  # hidden_states stays the first argument (distribute_saved_activations splits it)
            full = list(args)
            for i, t in zip(saved, tensors):
                full[i] = t
            return function(*full)

        return original(bound, distribute_saved_activations, *(args[i] for i in saved))

    return checkpoint


def foreach_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """``local_multi_tensor_l2_norm``'s contract (the l2 norm of ``tensor_lists[0]`` as a [1] fp32 tensor, no
    per-tensor norms) without a host round trip per tensor."""
    if not tensor_lists[0]:  # megatron calls it only with gradients; the local version's answer all the same
        return torch.zeros(1, device="cuda" if torch.cuda.is_available() else "cpu"), None
    norms = torch._foreach_norm(tensor_lists[0], 2, dtype=torch.float32)  # bf16 (decoupled) grads summed in fp32
    return torch.linalg.vector_norm(torch.stack(norms)).reshape(1), None


def foreach_scale(chunk_size, noop_flag, tensor_lists, scale) -> None:
    """``local_multi_tensor_scale``'s contract (``dst = src * scale`` for each pair), in place when the two lists
    hold the same tensors (clipping), else the product copied (and cast) into ``dst``."""
    src, dst = tensor_lists
    if len(src) == len(dst) and all(a is b for a, b in zip(src, dst)):
        torch._foreach_mul_(dst, scale)
    elif scale == 1.0:  # the fp16 optimizer's main -> model param copy: x * 1.0 is x, no fp32 temporary
        torch._foreach_copy_(dst, src)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, scale))


def _foreach_multi_tensor_ops() -> None:
    """Swap megatron's local multi-tensor fallbacks (module doc) where it chose them: TE's or apex's fused
    kernels, when imported, stay."""
    if clip_grads.l2_norm_impl is mcore_utils.local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = foreach_l2_norm
    for module in (clip_grads, mcore_optimizer):
        if module.multi_tensor_scale_impl is mcore_utils.local_multi_tensor_scale:
            module.multi_tensor_scale_impl = foreach_scale


def apply() -> None:
    global _APPLIED
    if _APPLIED:
        return
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    TopKRouter._apply_expert_bias = _apply_expert_bias
    tensor_parallel.checkpoint = _checkpoint_tensors_only(tensor_parallel.checkpoint)
    DistributedOptimizer._set_main_param_and_optimizer_states = _keep_step(
        DistributedOptimizer._set_main_param_and_optimizer_states
    )
    _foreach_multi_tensor_ops()
    _APPLIED = True
