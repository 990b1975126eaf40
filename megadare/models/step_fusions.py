"""The training-step fusions that run without Transformer Engine or apex (``train.gradient_accumulation_fusion``,
``train.fused_elementwise``), measured on an H200 (benchmarks/GPU.md): the elementwise fusions are on by default
for dense models on CUDA (``elementwise_on``), the gradient-accumulation fusion stays off (1.01x).

**Gradient accumulation fusion.** Unfused, every linear layer's backward returns its weight gradient as a new
tensor in the compute dtype and megatron's DDP hook adds it to the fp32 ``main_grad`` buffer: one GEMM output and
one more elementwise pass over every weight, per micro-batch (1% of a bf16 SDAR-1.7B step at batch 4 on an H200;
the 17% ``add_`` an earlier profile showed was the output layer's, models/head.py). With ``TransformerConfig.gradient_accumulation_fusion`` megatron-core 0.16 (``tensor_parallel/layers.py``,
``LinearWithGradAccumulationAndAsyncCommunication.backward``) instead calls apex's CUDA extension,
``fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(total_input, grad_output, weight.main_grad)`` (``_fp16``
when main_grad is bf16/fp16), that is ``main_grad += grad_output^T @ total_input`` on 2-D views, returns a dummy
gradient and sets ``weight.grad_added_to_main_grad``, so DDP's hook skips its ``add_``. The layers refuse the flag
when that extension does not import (``_grad_accum_fusion_available``).

torch has the GEMM itself: on CUDA, ``torch.addmm(c, a, b, out_dtype=torch.float32, out=c)`` multiplies bf16/fp16
``a, b`` into an fp32 ``c`` in one cuBLAS call (``aten::addmm.dtype_out``, torch >= 2.8; a CPU kernel does not
exist). This module is that extension's two functions, installed into megatron's layers module as the extension
would be (apex's own, where it imports, is kept); nothing else of megatron changes. Paths, per call:
  * ``main_grad`` in the inputs' dtype (fp32 training; an fp16/bf16 main_grad): ``main_grad.addmm_(g^T, x)``;
  * CUDA, bf16/fp16 inputs, fp32 main_grad: ``addmm(..., out_dtype=fp32, out=main_grad)`` where this torch's
    CUDA kernel accepts an fp32 ``self`` (checked once, against an fp32 reference, by ``cuda_accum_path``),
    else ``main_grad.add_(mm(g^T, x, out_dtype=fp32))`` (fp32 products, but no saving: ``cuda_accum_path`` says
    which one ran, the benchmark records it);
  * anywhere else (bf16 on a CPU): the inputs upcast, then ``addmm_``.

**Elementwise fusions.** megatron's ``bias_activation_fusion`` (SwiGLU forward and backward as one kernel each,
``fusions/fused_bias_swiglu.py``) and ``bias_dropout_fusion`` (the residual add, ``fusions/fused_bias_dropout.py``)
are plain torch functions under megatron's ``jit_fuser``, which is ``torch.compile`` on torch >= 2.2: they need
a compiler backend (triton on CUDA, a C++ compiler on a CPU), no TE or apex. Our models have no biases and no
dropout: the first is the fused SwiGLU, the second the compiled residual add. The same key also fuses:
  * **RoPE.** megatron's ``apply_rope_fusion`` routes ``rope_utils.apply_rotary_pos_emb`` (bshd, no mscale) to the
    module global ``fused_apply_rotary_pos_emb``, TE's function, None without TE (the config then refuses the
    flag). ``install_rope`` puts ``fused_rope`` there: megatron's own unfused ``_apply_rotary_pos_emb_bshd``
    through ``torch.compile`` (cos, sin, rotate-half, multiply-add and the pass-through concat as one kernel each
    way instead of ~10). TE's function, where it imports, is kept. The packed ``thd`` format stays unfused (it
    would assert in megatron; our attention refuses ``packed_seq_params`` anyway).
  * **RMSNorm** (models/norm.py ``FusedRMSNorm``, chosen in the layer spec: input, pre-MLP, final and the q/k
    norms). On CUDA, where torch has ``aten::_fused_rms_norm``'s CUDA kernel (torch's ``F.rms_norm`` dispatches
    to it; its backward is ``_fused_rms_norm_backward``), that kernel: one pass each way as inductor would
    generate, with no compile, no guards and no recompiles. It applies the weight before its one rounding (as
    torch's layer-norm kernels do), where HF's op order rounds first (bf16: about one ulp apart). Elsewhere (a
    CPU, a torch without the kernel) HF's op order (``norm.rms_norm``) through ``torch.compile``.
Compiled functions run with ``fullgraph=True`` and their token dimensions marked dynamic: a new micro-batch length
reuses the graph, and a recompile past dynamo's ``recompile_limit`` raises (``run_compiled``) instead of falling
back to eager silently. megatron's other fusion flags have no path without TE/apex and stay off:
``masked_softmax_fusion`` (megatron's CUDA softmax extensions, and only in its ``local`` attention),
``persist_layer_norm`` (apex's FusedLayerNorm).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import types
import warnings
from typing import Callable, Optional

import torch


def add_matmul_(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``out += a @ b`` in place, summed in ``out``'s dtype: bf16/fp16 ``a, b`` into an fp32 ``out`` on CUDA in
    one cuBLAS call where this torch can (module doc), never a bf16 product rounded before the sum."""
    if a.dtype == out.dtype:
        out.addmm_(a, b)
    elif out.is_cuda and out.dtype == torch.float32 and a.dtype in (torch.bfloat16, torch.float16):
        if cuda_accum_path() == "addmm_out_dtype":
            torch.addmm(out, a, b, out_dtype=torch.float32, out=out)
        else:
            out.add_(torch.mm(a, b, out_dtype=torch.float32))
    else:
        out.addmm_(a.to(out.dtype), b.to(out.dtype))


def _accumulate(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """main_grad += grad_output^T @ total_input ([tokens, out]^T @ [tokens, in] -> [out, in])."""
    add_matmul_(main_grad, grad_output.t(), total_input)


def wgrad_gemm_accum_fp32(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """apex's ``wgrad_gemm_accum_fp32``: an fp32 main_grad."""
    _accumulate(total_input, grad_output, main_grad)


def wgrad_gemm_accum_fp16(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """apex's ``wgrad_gemm_accum_fp16``: a bf16/fp16 main_grad (DDP with ``grad_reduce_in_fp32=False``)."""
    _accumulate(total_input, grad_output, main_grad)


@functools.lru_cache(maxsize=None)
def cuda_accum_path() -> str:
    """``addmm_out_dtype`` when this torch's CUDA ``addmm`` accumulates bf16 products into an fp32 ``self`` in place
    and matches an fp32 reference, else ``mm_out_dtype_add`` (torch 2.8's kernel wants ``self`` in the inputs'
    dtype). Probed once on the current CUDA device (at ``install``, not inside a backward)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(64, 96, device="cuda", generator=g).bfloat16()
    b = torch.randn(96, 32, device="cuda", generator=g).bfloat16()
    c = torch.randn(64, 32, device="cuda", generator=g)
    want = c.double() + a.double() @ b.double()  # float64: no TF32 in the reference
    try:
        torch.addmm(c, a, b, out_dtype=torch.float32, out=c)
        # fp32 accumulation of exact bf16 products over k=96: ~1e-6 of the values' scale (~10); a bf16-rounded
        # result is off by up to 0.03, one that drops ``c`` by ~1
        if torch.allclose(c.double(), want, rtol=0, atol=1e-3):
            return "addmm_out_dtype"
        why = f"it is off by {float((c.double() - want).abs().max()):.3g}"
    except (RuntimeError, NotImplementedError, TypeError) as e:
        why = f"{type(e).__name__}: {str(e).splitlines()[0]}"
    warnings.warn(
        f"torch {torch.__version__}'s CUDA addmm does not accumulate bf16 products into an fp32 tensor ({why}): "
        "weight gradients (train.gradient_accumulation_fusion, the output layer's) take mm(out_dtype=float32) + add_"
    )
    return "mm_out_dtype_add"


def install() -> None:
    """Make megatron's linear layers accept ``gradient_accumulation_fusion`` and run it through this module
    (idempotent; the flag stays per TransformerConfig: installing alone changes nothing)."""
    from megatron.core.tensor_parallel import layers  # heavy: megadare.models imports megatron lazily here

    if layers._grad_accum_fusion_available:
        return  # apex's extension imported (or this one is installed already)
    layers.fused_weight_gradient_mlp_cuda = _EXTENSION
    layers._grad_accum_fusion_available = True
    if torch.cuda.is_available():
        cuda_accum_path()


_EXTENSION = types.SimpleNamespace(
    wgrad_gemm_accum_fp32=wgrad_gemm_accum_fp32, wgrad_gemm_accum_fp16=wgrad_gemm_accum_fp16
)


def config_overrides(gradient_accumulation: bool, elementwise: bool) -> dict:
    """TransformerConfig keys for the fusions asked for (installs the extension, or the RoPE function, first: the
    config refuses either flag without one). The fused RMSNorm is a layer-spec choice (``gpt.build_model_chunks``'
    ``norm``), not a config key."""
    over: dict = {}
    if gradient_accumulation:
        install()
        over["gradient_accumulation_fusion"] = True
    if elementwise:
        install_rope()
        over.update(bias_activation_fusion=True, bias_dropout_fusion=True, apply_rope_fusion=True)
    return over


class CompileLimitError(RuntimeError):
    """A compiled fusion recompiled past dynamo's ``recompile_limit`` (with ``fullgraph=True`` dynamo raises
    rather than run the function eagerly)."""


@functools.lru_cache(maxsize=None)
def _compiled(fn: Callable) -> Callable:
    return torch.compile(fn, fullgraph=True)


def run_compiled(fn: Callable, args: tuple, dynamic: tuple[tuple[int, ...], ...]):
    """``fn(*args)`` through ``torch.compile`` (one graph: inductor's kernels forward and backward). ``dynamic``:
    per tensor argument (in order), the dimensions that vary between micro-batches (tokens, rows, heads), marked
    dynamic so that a new length reuses the graph (a dimension of size 1 is still specialised: one more graph)."""
    for a, dims in zip(args, dynamic):
        for d in dims:
            torch._dynamo.maybe_mark_dynamic(a, d)
    try:
        return _compiled(fn)(*args)
    except torch._dynamo.exc.FailOnRecompileLimitHit as e:
        limit = torch._dynamo.config.recompile_limit
        shapes = [tuple(a.shape) for a in args if torch.is_tensor(a)]
        raise CompileLimitError(
            f"train.fused_elementwise: torch.compile of {fn.__module__}.{fn.__qualname__} compiled more than "
            f"torch._dynamo.config.recompile_limit={limit} graphs (now shapes {shapes}); raise that limit or "
            "set train.fused_elementwise=false"
        ) from e


def fused_rope(
    t: torch.Tensor, freqs: torch.Tensor, transpose_output_memory: bool = False, interleaved: bool = False
) -> torch.Tensor:
    """megatron's ``fused_apply_rotary_pos_emb`` (TE's signature; ``transpose_output_memory`` is ignored, as TE
    does): megatron's ``_apply_rotary_pos_emb_bshd(t, freqs, interleaved)`` compiled. ``t`` [s, b, heads, dim],
    ``freqs`` [s, 1 or b, 1, rot_dim]; s, b and heads dynamic (q and k share the graph)."""
    from megatron.core.models.common.embeddings import rope_utils

    return run_compiled(rope_utils._apply_rotary_pos_emb_bshd, (t, freqs, interleaved), ((0, 1, 2), (0, 1)))


def install_rope() -> None:
    """Put ``fused_rope`` into megatron's RoPE dispatch (idempotent; TE's fused function, where it imports, is
    kept). Only configs with ``apply_rope_fusion`` take it."""
    from megatron.core.models.common.embeddings import rope_utils

    if rope_utils.fused_apply_rotary_pos_emb is None:
        rope_utils.fused_apply_rotary_pos_emb = fused_rope


def rope_path() -> str:
    """Which RoPE ``apply_rope_fusion`` runs in this process (for benchmark rows)."""
    from megatron.core.models.common.embeddings import rope_utils

    return "compiled" if rope_utils.fused_apply_rotary_pos_emb is fused_rope else "te"


@functools.lru_cache(maxsize=None)
def has_cuda_rms_norm_kernel() -> bool:
    """torch has CUDA kernels for ``aten::_fused_rms_norm`` and its backward (``F.rms_norm``'s fused path)."""
    ops = ("_fused_rms_norm", "_fused_rms_norm_backward")  # a CPU build registers no CUDA kernel for either
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    return all(hasattr(torch.ops.aten, op) and has(f"aten::{op}", "CUDA") for op in ops)


def norm_path(device: torch.device) -> str:
    """Which RMSNorm ``FusedRMSNorm`` runs on ``device`` (bf16/fp16/fp32 weights in the input's dtype)."""
    return "aten_fused_rms_norm" if device.type == "cuda" and has_cuda_rms_norm_kernel() else "compiled"


def elementwise_on(setting: Optional[bool], moe: bool, dtype: str) -> bool:
    """``train.fused_elementwise`` as it runs: what the config says, or (None) on where an H200 measured it faster
    (benchmarks/GPU.md, 2026-11-27): CUDA with triton, a dense model in bf16 / fp16 (SDAR-1.7B shape 1.17-1.23x,
    same gradients; 1.27-1.29x once the head's backward stopped dominating). Off on a CPU (compiling costs more
    than it saves on a short run) and for MoE models (the small SDAR-MoE shape: 0.68-1.16x over five runs, the
    base step itself moving 10.0-12.4k tok/s: no measured gain, measured with megatron's SequentialMLP, which
    calls the compiled SwiGLU once per expert per layer on a few tokens; models/experts.py's grouped experts call
    it once per layer: ``train_throughput.py --variants fusedgrouped`` is the GPU's next measurement)."""
    if setting is not None:
        return bool(setting)
    gpu = torch.cuda.is_available() and importlib.util.find_spec("triton") is not None
    return gpu and not moe and dtype in ("bf16", "fp16")


def unavailable(gradient_accumulation: bool, elementwise: bool, dtype: str) -> Optional[str]:
    """Why the fusions asked for cannot run in this process (None: they can), naming the key."""
    cuda = torch.cuda.is_available()
    if gradient_accumulation and cuda and dtype != "fp32" and not _has_out_dtype_gemm():
        return (
            f"train.gradient_accumulation_fusion=true with model.dtype={dtype} needs torch >= 2.8 "
            f"(torch.addmm(out_dtype=...)); this is torch {torch.__version__}: set it to false"
        )
    if elementwise and cuda and importlib.util.find_spec("triton") is None:
        return "train.fused_elementwise=true compiles with torch.compile, which needs triton on CUDA: set it to false"
    if elementwise and not cuda and shutil.which(os.environ.get("CXX") or "g++") is None:
        return (
            "train.fused_elementwise=true compiles with torch.compile, which needs a C++ compiler on a CPU "
            "(g++, or $CXX): install one or set it to false"
        )
    return None


def _has_out_dtype_gemm() -> bool:
    """torch >= 2.8: ``addmm`` / ``mm`` with ``out_dtype`` (bf16/fp16 inputs, an fp32 result)."""
    return hasattr(torch.ops.aten.addmm, "dtype_out") and hasattr(torch.ops.aten.mm, "dtype")
