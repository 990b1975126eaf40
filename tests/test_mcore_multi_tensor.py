"""Gradient clipping without Transformer Engine or apex (models/mcore_fixes.py): megatron's local fallbacks are
swapped for torch's multi-tensor kernels. The same norm and the same clipped gradients as a float64 computation
and as ``src * scale``; the norm no longer waits on the host once per gradient (megatron's ``torch.tensor`` of
per-parameter 0-dim norms did); TE's or apex's kernels, where megatron chose them, stay."""

from __future__ import annotations

import torch
from megatron.core import utils as mcore_utils
from megatron.core.optimizer import clip_grads
from megatron.core.optimizer import optimizer as mcore_optimizer
from torch.utils._python_dispatch import TorchDispatchMode

from megadare.models import mcore_fixes
from megadare.parallel import destroy_distributed, init_distributed


def _grads(n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(7, 5), (5,), (3, 4, 2), (64, 16), (1,)]
    return [torch.randn(shapes[i % len(shapes)], generator=g) * (i + 1) for i in range(n)]


def _norm64(ts: list[torch.Tensor]) -> float:
    return sum(float(t.double().pow(2).sum()) for t in ts) ** 0.5


class _OpCount(TorchDispatchMode):
    """Counts dispatched ops by name: ``_local_scalar_dense`` is a device value read on the host (``.item()``,
    ``float(t)``), ``linalg_vector_norm`` a norm kernel."""

    def __init__(self):
        super().__init__()
        self.n: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.n[name] = self.n.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def test_megatrons_local_fallbacks_are_replaced_and_te_or_apex_kernels_kept(monkeypatch):
    mcore_fixes.apply()
    assert clip_grads.l2_norm_impl is mcore_fixes.foreach_l2_norm  # this venv has neither TE nor apex
    assert clip_grads.multi_tensor_scale_impl is mcore_fixes.foreach_scale
    assert mcore_optimizer.multi_tensor_scale_impl is mcore_fixes.foreach_scale

    def fused(*a):  # what TE's / apex's import puts there
        raise AssertionError("not called")

    monkeypatch.setattr(clip_grads, "l2_norm_impl", fused)
    monkeypatch.setattr(clip_grads, "multi_tensor_scale_impl", fused)
    monkeypatch.setattr(mcore_optimizer, "multi_tensor_scale_impl", mcore_utils.local_multi_tensor_scale)
    mcore_fixes._foreach_multi_tensor_ops()
    assert clip_grads.l2_norm_impl is fused and clip_grads.multi_tensor_scale_impl is fused
    assert mcore_optimizer.multi_tensor_scale_impl is mcore_fixes.foreach_scale


def test_the_norm_is_the_float64_norm_of_every_gradient():
    grads = _grads(23)
    norm, per_tensor = mcore_fixes.foreach_l2_norm(2048 * 32, None, [grads], False)
    assert per_tensor is None and norm.shape == (1,) and norm.dtype == torch.float32
    assert abs(float(norm) - _norm64(grads)) <= 1e-6 * _norm64(grads)
    mixed = grads[:5] + [g.to(torch.bfloat16) for g in grads[5:]]  # megatron's decoupled grads may be bf16
    norm, _ = mcore_fixes.foreach_l2_norm(2048 * 32, None, [mixed], False)
    assert norm.dtype == torch.float32 and abs(float(norm) - _norm64(mixed)) <= 1e-6 * _norm64(mixed)
    assert float(mcore_fixes.foreach_l2_norm(0, None, [[]], False)[0]) == 0.0


def test_scaling_in_place_and_into_other_tensors_rounds_as_src_times_scale():
    grads = _grads(9, seed=1)
    want = [g * 0.3137 for g in grads]
    mcore_fixes.foreach_scale(0, None, [grads, grads], 0.3137)
    assert all(torch.equal(g, w) for g, w in zip(grads, want))
    src = _grads(9, seed=2)
    dst = [torch.zeros(s.shape, dtype=torch.bfloat16) for s in src]  # the fp16 optimizer's fp32 -> bf16 copy
    mcore_fixes.foreach_scale(0, None, [src, dst], 1.0)
    assert all(torch.equal(d, s.to(torch.bfloat16)) for s, d in zip(src, dst))
    assert all(torch.equal(s, t) for s, t in zip(src, _grads(9, seed=2)))  # the source is untouched


def test_clipping_through_megatron_waits_on_the_host_once():
    """megatron's own get_grad_norm_fp32 + clip_grad_by_total_norm_fp32 on 40 gradients (world size 1, gloo): the
    float64 norm, every gradient scaled by max_norm / norm; one norm kernel launch for the 40 (a multi-tensor one)
    and one host read, megatron's ``.item()`` of the all-reduced norm. The local fallback ran a norm per gradient
    and read them back through ``torch.tensor([...])`` (on CUDA a device-to-host copy each; on this CPU the
    extra read shows once, its ``float()``)."""
    mcore_fixes.apply()
    init_distributed()
    try:
        grads = _grads(40, seed=3)
        params = [torch.nn.Parameter(torch.zeros(g.shape)) for g in grads]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        group = torch.distributed.group.WORLD
        ops = _OpCount()
        with ops:
            total = clip_grads.get_grad_norm_fp32([p.grad for p in params], grad_stats_parallel_group=group)
        clip_grads.clip_grad_by_total_norm_fp32(params, max_norm=1.0, total_norm=total)
    finally:
        destroy_distributed()
    want = _norm64(grads)
    assert abs(total - want) <= 1e-6 * want
    assert ops.n.get("_local_scalar_dense") == 1, ops.n
    assert ops.n.get("_foreach_norm") == 1 and ops.n.get("linalg_vector_norm") == 1, ops.n
    coeff = 1.0 / (total + 1.0e-6)
    assert all(torch.equal(p.grad, g * coeff) for p, g in zip(params, grads))


def test_the_fp16_optimizers_param_copy_makes_no_fp32_temporary():
    """megatron's Float16OptimizerWithFloat16Params copies its fp32 master weights into the bf16 model weights
    through ``multi_tensor_scale_impl(..., 1.0)`` every step: one ``_foreach_copy_``, the values as cast by
    ``copy_``; no ``_foreach_mul`` by 1.0 first (a temporary fp32 copy of every master weight, written and read
    once more)."""
    src = _grads(9, seed=4)
    dst = [torch.zeros(s.shape, dtype=torch.bfloat16) for s in src]
    ops = _OpCount()
    with ops:
        mcore_fixes.foreach_scale(0, None, [src, dst], 1.0)
    assert ops.n == {"_foreach_copy_": 1}, ops.n
    assert all(torch.equal(d, s.to(torch.bfloat16)) for s, d in zip(src, dst))
    ops = _OpCount()
    with ops:  # any other scale: the product, rounded once, then the copy
        mcore_fixes.foreach_scale(0, None, [src, dst], 0.5)
    assert ops.n == {"_foreach_mul": 1, "_foreach_copy_": 1}, ops.n
    assert all(torch.equal(d, (s * 0.5).to(torch.bfloat16)) for s, d in zip(src, dst))
