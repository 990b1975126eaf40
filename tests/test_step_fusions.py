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
from megadare.trainer.checks import validate
from megadare.errors import ConfigError
from megadare.models import step_fusions


LR = 1e-2
# Adam's first steps move each weight by about lr * g / (|g| + eps): with eps 1e-8 a rounding difference in a
# gradient near zero moves the weight by a sizeable fraction of lr (7e-3 of a step seen with the compiled norm).
# With eps 1e-3 a gradient difference d moves a weight by at most lr * d / eps, 1e-4 of a step for the d <= 1e-7
# of fp32 rounding here, while gradients of 1e-3..6e-2 still take Adam's normalised steps. 1e-3 of a step.
ADAM_EPS = 1e-3
WEIGHT_ATOL = 1e-3 * LR
# fp32 rounding of a gradient: fused and compiled kernels sum in another order (the GEMM's blocking, inductor's
# reductions for the norm's mean and the weight gradient's sum over tokens) and it propagates through the layers:
# a few ulps of the largest gradient (6e-7 of it seen). A wrong fusion is off by the gradient itself.
GRAD_ATOL = 4e-6


def _rows(vocab: int, n: int = 4, length: int = 10):
    from megadare.data.rows import Row, pack_rows

    g = torch.Generator().manual_seed(0)
    rows = [
        Row(
            tokens=torch.randint(0, vocab - 1, (length,), generator=g),
            labels=torch.randint(0, vocab - 1, (length,), generator=g),
            weight=torch.ones(length),
            position_ids=torch.arange(length),
            denom=float(length),
        )
        for _ in range(n)
    ]
    mbs = pack_rows(rows, 2 * length, micro_batch_size=1)
    assert len(mbs) == 2  # two micro-batches accumulate into the same main_grad
    return mbs


def _train(hf_dir: str, fused: bool, calls: list, elementwise: bool = False, length: int = 10):
    """Two optimizer steps on micro-batches of two ``length``-token rows: (losses, main_grad buffers after the first
    step, weights after the second, how many entries ``calls`` gained in the first step)."""
    from megadare.convert.hf_megatron import load_hf_into_model
    from megadare.models.family import family_of, read_hf_config
    from megadare.models.gpt import LayerModules, build_model_chunks, transformer_config
    from megadare.models.norm import FusedRMSNorm, RMSNorm
    from megadare.trainer.optim import OptimSettings, build_optimizer, wrap_ddp
    from megadare.trainer.policy import Policy
    from megadare.trainer.step import RowFormat, train_step

    hf = read_hf_config(hf_dir)
    arch = family_of(hf).arch(hf)
    tcfg = transformer_config(arch, **step_fusions.config_overrides(fused, elementwise))
    modules = LayerModules(norm=FusedRMSNorm if elementwise else RMSNorm)
    chunks = build_model_chunks(arch, tcfg, attention_backend="sdpa", modules=modules)
    load_hf_into_model(chunks, hf_dir)
    model = wrap_ddp(chunks, True)
    opt, sched = build_optimizer(model, OptimSettings(lr=LR, total_steps=2, adam_eps=ADAM_EPS))
    mbs, losses, grads, n_calls = _rows(arch.vocab_size, length=length), [], None, 0
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


def _compiled_graphs() -> dict:
    """How many graphs dynamo holds for each compiled fusion (cache entries of the function's code object)."""
    from megatron.core.models.common.embeddings import rope_utils

    from megadare.models import norm

    entries = torch._dynamo.eval_frame._debug_get_cache_entry_list
    return {"norm": len(entries(norm.rms_norm)), "rope": len(entries(rope_utils._apply_rotary_pos_emb_bshd))}


def _elementwise_worker(rank, world, hf_dirs):
    from megatron.core.fusions import fused_bias_swiglu
    from megatron.core.transformer import mlp

    from megadare.models.family import family_of, read_hf_config
    from megadare.parallel import destroy_distributed, init_distributed
    from megadare.trainer.model_setup import training_transformer_config

    init_distributed()
    swiglu_calls, compiled_calls = [], []
    original_swiglu, original_run = mlp.bias_swiglu_impl, step_fusions.run_compiled

    def counted_swiglu(*args):  # the MLP's fused SwiGLU (compiled by megatron's jit_fuser)
        swiglu_calls.append(fused_bias_swiglu.SwiGLUFunction)
        return original_swiglu(*args)

    def counted_run(fn, *args):  # our compiled RMSNorm and RoPE
        compiled_calls.append(fn.__name__)
        return original_run(fn, *args)

    mlp.bias_swiglu_impl, step_fusions.run_compiled = counted_swiglu, counted_run
    out = {}
    try:
        cfg = Config()
        cfg.train.fused_elementwise = cfg.train.gradient_accumulation_fusion = True
        for name, hf_dir in hf_dirs.items():
            hf = read_hf_config(hf_dir)
            arch = family_of(hf).arch(hf)
            tcfg, plain_cfg = training_transformer_config(cfg, arch), training_transformer_config(Config(), arch)
            keys = (
                "bias_activation_fusion",
                "bias_dropout_fusion",
                "gradient_accumulation_fusion",
                "apply_rope_fusion",
            )
            off = ("masked_softmax_fusion", "persist_layer_norm")
            flags = {k: (getattr(tcfg, k), getattr(plain_cfg, k)) for k in keys + off}
            del swiglu_calls[:], compiled_calls[:]
            plain = _train(hf_dir, False, [])
            plain_calls = len(swiglu_calls) + len(compiled_calls)
            fused = _train(hf_dir, False, [], elementwise=True)
            calls = (plain_calls, len(swiglu_calls), compiled_calls.count("rms_norm"))
            calls += (compiled_calls.count("_apply_rotary_pos_emb_bshd"),)
            graphs = _compiled_graphs()
            # another micro-batch length (rows of 7 tokens: 14 per micro-batch, 20 before): no new graph
            other = _train(hf_dir, False, [], length=7), _train(hf_dir, False, [], elementwise=True, length=7)
            out[name] = dict(
                flags=flags,
                calls=calls,
                plain=plain,
                fused=fused,
                other=other,
                layers=arch.num_layers,
                qk_norm=arch.qk_norm,
                graphs=(graphs, _compiled_graphs()),
            )
    finally:
        mlp.bias_swiglu_impl, step_fusions.run_compiled = original_swiglu, original_run
        destroy_distributed()
    return out


def test_fused_elementwise_takes_fused_swiglu_norm_and_rope(tmp_path):
    """The keys reach megatron's config through the training config; the MLP runs megatron's fused SwiGLU, every
    norm (q/k norms too) our FusedRMSNorm and RoPE our compiled function; the compiled step equals the eager one
    (fp32, CPU: inductor's C++ kernels: losses, the first step's gradients, the weights after two steps) at two
    micro-batch lengths, and the second length compiles no new graph."""
    from dist import run_distributed

    hf_dirs = {"sdar": write_tiny_hf(tmp_path, "sdar", seed=3), "llada": write_tiny_hf(tmp_path, "llada", seed=4)}
    res = run_distributed(_elementwise_worker, 1, hf_dirs, timeout_s=400)[0]
    assert res["sdar"]["qk_norm"] and not res["llada"]["qk_norm"]  # q/k norms are covered by SDAR
    for name, r in res.items():
        flags = r["flags"]
        assert all(on and not off for on, off in (flags[k] for k in list(flags)[:4])), (name, flags)
        assert not any(on or off for on, off in (flags[k] for k in list(flags)[4:])), (name, flags)
        plain_calls, swiglu, norms, ropes = r["calls"]
        forwards, n = 2 * 2, r["layers"]  # two steps of two micro-batches
        assert plain_calls == 0, name
        assert swiglu == forwards * n, (name, swiglu)
        assert norms == forwards * ((4 if r["qk_norm"] else 2) * n + 1), (name, norms)  # + the final norm
        assert ropes == forwards * 2 * n, (name, ropes)  # q and k
        for (loss_p, grad_p, w_p, _), (loss_f, grad_f, w_f, _) in (r["plain"], r["fused"]), r["other"]:
            assert torch.allclose(grad_f, grad_p, rtol=1e-5, atol=GRAD_ATOL * float(grad_p.abs().max())), name
            assert loss_f == pytest.approx(loss_p, rel=1e-5), name
            assert torch.allclose(w_f, w_p, rtol=1e-5, atol=WEIGHT_ATOL), (name, float((w_f - w_p).abs().max()))
        before, after = r["graphs"]
        assert before == after and 1 <= after["rope"] <= 2 and 1 <= after["norm"] <= 6, (name, r["graphs"])


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


def test_fused_elementwise_default_is_on_where_a_gpu_measured_it_faster(monkeypatch):
    """``train.fused_elementwise`` unset (None): on for a dense bf16/fp16 model on CUDA with triton (an H200: 1.17-1.23x
    at the SDAR-1.7B shape), off on a CPU, for MoE (0.68-0.81x) and fp32; a value the config sets wins (the
    trainer's TransformerConfig and norms follow it: the elementwise test below, its unset config unfused here)."""
    assert Config().train.fused_elementwise is None
    assert not step_fusions.elementwise_on(None, False, "bf16")  # this CPU
    monkeypatch.setattr(step_fusions.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(step_fusions.importlib.util, "find_spec", lambda name: object())
    assert step_fusions.elementwise_on(None, False, "bf16") and step_fusions.elementwise_on(None, False, "fp16")
    assert not step_fusions.elementwise_on(None, True, "bf16") and not step_fusions.elementwise_on(None, False, "fp32")
    assert not step_fusions.elementwise_on(False, False, "bf16") and step_fusions.elementwise_on(True, True, "fp32")
    monkeypatch.setattr(step_fusions.importlib.util, "find_spec", lambda name: None)
    assert not step_fusions.elementwise_on(None, False, "bf16")  # no triton: no compile on CUDA


def test_compiled_rope_and_norm_equal_eager_and_fail_loudly():
    """The compiled RoPE on a partial rotary dim (LLaDA2's 0.5) and the F.rms_norm op of the CUDA path (its CPU
    composite here: the CUDA kernel needs a GPU) equal megatron's / HF-order eager functions, forward and
    gradients; a compiled fusion that runs out of dynamo's recompile budget raises, naming the key."""
    from megatron.core.models.common.embeddings import rope_utils

    from megadare.models.norm import rms_norm

    g = torch.Generator().manual_seed(0)
    t, freqs = torch.randn(5, 2, 3, 8, generator=g), torch.randn(5, 1, 1, 4, generator=g)
    dy = torch.randn(5, 2, 3, 8, generator=g)
    x, w, dx = torch.randn(6, 16, generator=g), torch.randn(16, generator=g), torch.randn(6, 16, generator=g)
    cases = [
        ((t, freqs), lambda a, b: rope_utils._apply_rotary_pos_emb_bshd(a, b), step_fusions.fused_rope, dy),
        ((x, w), lambda a, b: rms_norm(a, b, 1e-6), lambda a, b: torch.nn.functional.rms_norm(a, (16,), b, 1e-6), dx),
    ]
    for inputs, eager, fused, grad_out in cases:
        results = []
        for fn in (eager, fused):
            leaves = [a.clone().requires_grad_() for a in inputs]
            y = fn(*leaves)
            y.backward(grad_out)
            results.append([y.detach()] + [a.grad for a in leaves if a.grad is not None])
        for want, got in zip(*results):
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), fused
    # the RoPE graph above is dynamo's one entry for megatron's function in this process: another dtype needs a
    # second graph, past a limit of 1 (dynamo's default is 8; a silent eager fallback would return a result)
    with torch._dynamo.config.patch(recompile_limit=1):
        with pytest.raises(step_fusions.CompileLimitError, match=r"recompile_limit=1 .* train\.fused_elementwise"):
            step_fusions.fused_rope(t.double(), freqs.double())
