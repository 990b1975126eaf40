"""The training-step fusions without TE/apex (models/step_fusions.py): megatron's ``gradient_accumulation_fusion``
through our ``wgrad_gemm_accum_*`` gives the unfused run's gradients and weights (no double add, no skipped
add), ``fused_elementwise`` builds megatron's compiled SwiGLU, and the config keys reach megatron / refuse where
they cannot run. One gloo process on the CPU, fp32, tiny SDAR and SDAR-MoE models (the experts' linears too).

The fused backward hands autograd a dummy weight gradient made with ``device=torch.cuda.current_device()``: on the
CPU that is parallel/cpu.py's stub answering "cpu" (the CUDA stand-in every megatron test here runs under), so
megatron's own code path runs unpatched, and its DDP hook then skips ``main_grad.add_`` (``grad_added_to_main_grad``):
a double add would show in the gradients below."""

from __future__ import annotations

import pytest
import torch

from tiny import write_tiny_hf

from megadare.config import Config
from megadare.config.checks import validate
from megadare.errors import ConfigError
from megadare.models import step_fusions


LR = 1e-2
# Adam's first steps move each weight by about lr * g / |g|, whatever the gradient's size: where a gradient is
# near adam_eps a rounding difference moves the weight by a visible fraction of lr (4e-6 measured). 1e-3 of a step.
WEIGHT_ATOL = 1e-3 * LR


def _rows(vocab: int, n: int = 4):
    from megadare.data.rows import Row, pack_rows

    g = torch.Generator().manual_seed(0)
    rows = [
        Row(
            tokens=torch.randint(0, vocab - 1, (10,), generator=g),
            labels=torch.randint(0, vocab - 1, (10,), generator=g),
            weight=torch.ones(10),
            position_ids=torch.arange(10),
            denom=10.0,
        )
        for _ in range(n)
    ]
    mbs = pack_rows(rows, 20, micro_batch_size=1)
    assert len(mbs) == 2  # two micro-batches accumulate into the same main_grad
    return mbs


def _train(hf_dir: str, fused: bool, calls: list, elementwise: bool = False):
    """Two optimizer steps: (losses, main_grad buffers after the first step, weights after the second, how many
    entries ``calls`` gained in the first step)."""
    from megadare.convert import load_hf_into_model
    from megadare.models.family import family_of, read_hf_config
    from megadare.models.gpt import build_model_chunks, transformer_config
    from megadare.trainer.optim import OptimSettings, build_optimizer, wrap_ddp
    from megadare.trainer.policy import Policy
    from megadare.trainer.step import RowFormat, train_step

    hf = read_hf_config(hf_dir)
    arch = family_of(hf).arch(hf)
    chunks = build_model_chunks(
        arch, transformer_config(arch, **step_fusions.config_overrides(fused, elementwise)), attention_backend="sdpa"
    )
    load_hf_into_model(chunks, hf_dir)
    model = wrap_ddp(chunks, True)
    opt, sched = build_optimizer(model, OptimSettings(lr=LR, total_steps=2))
    mbs, losses, grads, n_calls = _rows(arch.vocab_size), [], None, 0
    for step in range(2):
        m = train_step(Policy(model, opt, sched), mbs, 40.0, RowFormat("bidirectional", 4, arch.vocab_size))
        losses.append(m["loss"])
        if step == 0:
            grads = torch.cat([b.grad_data.clone() for x in model for b in x.buffers + x.expert_parallel_buffers])
            n_calls = len(calls)
    weights = torch.cat([p.detach().flatten().clone() for c in chunks for p in c.parameters()])
    return losses, grads, weights, n_calls


def _worker(rank, world, hf_dirs):
    from megatron.core.tensor_parallel import layers

    from megadare.parallel import destroy_distributed, init_distributed

    init_distributed()
    out = {}
    try:
        for name, hf_dir in hf_dirs.items():
            plain_calls, fused_calls = [], []
            plain = _train(hf_dir, False, plain_calls)
            ext = step_fusions._EXTENSION
            original = ext.wgrad_gemm_accum_fp32

            def counted(*args):  # a spy on the fused path: each linear weight, each micro-batch
                fused_calls.append(1)
                return original(*args)

            ext.wgrad_gemm_accum_fp32 = counted
            try:
                fused = _train(hf_dir, True, fused_calls)
            finally:
                ext.wgrad_gemm_accum_fp32 = original
            out[name] = plain, fused, layers.fused_weight_gradient_mlp_cuda is ext
    finally:
        destroy_distributed()
    return out


def test_gradient_accumulation_fusion_equals_the_unfused_step(tmp_path):
    from dist import run_distributed

    hf_dirs = {"sdar": write_tiny_hf(tmp_path, "sdar", seed=1), "sdar_moe": write_tiny_hf(tmp_path, "sdar_moe", seed=2)}
    res = run_distributed(_worker, 1, hf_dirs, timeout_s=300)[0]
    for name, ((loss_p, grad_p, w_p, unfused_calls), (loss_f, grad_f, w_f, n_calls), installed) in res.items():
        assert installed and unfused_calls == 0, name
        # q, k, v (fused), o, fc1, fc2 per layer (experts: per expert), and the output layer when it is a linear
        assert n_calls >= 2 * 4, (name, n_calls)
        # fp32 throughout: the fused GEMM may sum in another order than mm + add_ (bitwise equal on this CPU at
        # these sizes; BLAS blocking differs between machines), so equal to fp32 rounding. A double add or a
        # skipped add is off by the gradient itself: relative 1
        assert torch.allclose(grad_f, grad_p, rtol=1e-5, atol=1e-7 * float(grad_p.abs().max())), name
        assert float(grad_p.abs().max()) > 0, name
        assert loss_f == pytest.approx(loss_p, rel=1e-5), name
        assert torch.allclose(w_f, w_p, rtol=1e-5, atol=WEIGHT_ATOL), (name, float((w_f - w_p).abs().max()))


def test_accumulate_matches_the_apex_contract():
    """main_grad += grad_output^T @ total_input, in place, for a matching and an upcast (bf16 on a CPU) input."""
    g = torch.Generator().manual_seed(0)
    x, dy, acc = torch.randn(6, 5, generator=g), torch.randn(6, 3, generator=g), torch.randn(3, 5, generator=g)
    want = acc + dy.t() @ x
    ptr = acc.data_ptr()
    step_fusions.wgrad_gemm_accum_fp32(x, dy, acc)
    assert acc.data_ptr() == ptr and torch.allclose(acc, want, atol=1e-6)
    acc16 = torch.zeros(3, 5)
    step_fusions.wgrad_gemm_accum_fp32(x.bfloat16(), dy.bfloat16(), acc16)
    assert torch.allclose(acc16, dy.bfloat16().float().t() @ x.bfloat16().float(), atol=1e-5)


def _elementwise_worker(rank, world, hf_dir):
    from megatron.core.fusions import fused_bias_swiglu
    from megatron.core.transformer import mlp

    from megadare.models.family import family_of, read_hf_config
    from megadare.parallel import destroy_distributed, init_distributed
    from megadare.trainer.model_setup import training_transformer_config

    init_distributed()
    try:
        cfg = Config()
        cfg.train.fused_elementwise = cfg.train.gradient_accumulation_fusion = True
        hf = read_hf_config(hf_dir)
        arch = family_of(hf).arch(hf)
        tcfg, plain = training_transformer_config(cfg, arch), training_transformer_config(Config(), arch)
        keys = ("bias_activation_fusion", "bias_dropout_fusion", "gradient_accumulation_fusion")
        off = ("apply_rope_fusion", "masked_softmax_fusion", "persist_layer_norm")
        flags = {k: (getattr(tcfg, k), getattr(plain, k)) for k in keys + off}
        swiglu_calls = []
        original = mlp.bias_swiglu_impl

        def counted(*args):  # the MLP's fused SwiGLU (compiled by megatron's jit_fuser)
            swiglu_calls.append(fused_bias_swiglu.SwiGLUFunction)
            return original(*args)

        mlp.bias_swiglu_impl = counted
        try:
            fused = _train(hf_dir, False, [], elementwise=True)
        finally:
            mlp.bias_swiglu_impl = original
        return flags, len(swiglu_calls), _train(hf_dir, False, []), fused
    finally:
        destroy_distributed()


def test_fused_elementwise_takes_megatron_fused_swiglu(tmp_path):
    """The keys reach megatron's config through the training config, the MLP runs megatron's fused SwiGLU and the
    compiled step equals the eager one (fp32, CPU: inductor's C++ kernels)."""
    from dist import run_distributed

    hf_dir = write_tiny_hf(tmp_path, "sdar", seed=3)
    flags, swiglu_calls, (loss_p, grad_p, w_p, _), (loss_f, grad_f, w_f, _) = run_distributed(
        _elementwise_worker, 1, hf_dir, timeout_s=300
    )[0]
    assert all(on and not off for on, off in (flags[k] for k in list(flags)[:3])), flags
    assert not any(on or off for on, off in (flags[k] for k in list(flags)[3:])), flags
    assert swiglu_calls >= 2 * 2, swiglu_calls  # every layer, both micro-batches
    assert torch.allclose(grad_f, grad_p, rtol=1e-5, atol=1e-7 * float(grad_p.abs().max()))
    assert loss_f == pytest.approx(loss_p, rel=1e-5)
    assert torch.allclose(w_f, w_p, rtol=1e-5, atol=WEIGHT_ATOL), float((w_f - w_p).abs().max())


def test_config_refuses_fusions_that_cannot_run(monkeypatch):
    cfg = Config()
    cfg.data.synthetic = "addition"
    cfg.train.fused_elementwise = True
    validate(cfg, None, world_size=1)  # g++ is here
    monkeypatch.setattr(step_fusions.shutil, "which", lambda name: None)
    with pytest.raises(ConfigError, match=r"train\.fused_elementwise=true .* C\+\+ compiler"):
        validate(cfg, None, world_size=1)


def test_gradient_fusion_refused_without_out_dtype_gemm(monkeypatch):
    """On CUDA in bf16 the fusion needs torch's out_dtype GEMM (torch >= 2.8); fp32 and the CPU need none."""
    monkeypatch.setattr(step_fusions.torch.cuda, "is_available", lambda: True)
    assert step_fusions.unavailable(True, False, "bf16") is None  # this torch has it
    monkeypatch.setattr(step_fusions, "_has_out_dtype_gemm", lambda: False)
    assert "torch >= 2.8" in step_fusions.unavailable(True, False, "bf16")
    assert step_fusions.unavailable(True, False, "fp32") is None
    monkeypatch.setattr(step_fusions.torch.cuda, "is_available", lambda: False)
    assert step_fusions.unavailable(True, False, "bf16") is None
