"""MoE experts through grouped GEMMs (models/experts.py, ``train.grouped_experts``) against megatron's own
``SequentialMLP`` on the same weights and rows: outputs, the input's, the router probabilities' and every expert
weight's gradients; the parameters and their names unchanged; where it runs, and the refusal where it cannot.
The training loop under expert and tensor parallelism: tests/test_sft_train.py (grouped against sequential)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from megatron.core.transformer.moe.experts import SequentialMLP

from megadare.errors import ConfigError
from megadare.models.experts import GroupedExperts, experts_module, grouped_runs
from megadare.models.family import family_of
from megadare.models.gpt import LayerModules, build_model_chunks, transformer_config
from megadare.models.sdar import SDAR_MOE
from megadare.parallel import destroy_distributed, init_distributed


def _arch(**over):
    cfg = SDAR_MOE.tiny_config(**over)
    return family_of(cfg).arch(cfg)


@pytest.fixture
def dist():
    init_distributed()
    yield
    destroy_distributed()


def _experts(arch, experts: type, state=None, tcfg=None):
    tcfg = tcfg or transformer_config(arch)
    modules = LayerModules(experts=experts)
    chunk = build_model_chunks(arch, tcfg, attention_backend="sdpa", modules=modules)[0]
    if state is not None:
        chunk.load_state_dict(state)
    layer = next(m for m in chunk.modules() if isinstance(m, SequentialMLP))
    return chunk, layer


def _rows(arch, n_tokens: int = 96, seed: int = 0):
    """Rows sorted by expert as megatron's dispatcher hands them over, with expert 1 given none."""
    g = torch.Generator().manual_seed(seed)
    expert = torch.randint(0, arch.num_experts, (n_tokens * arch.moe_topk,), generator=g)
    expert[expert == 1] = 0
    counts = torch.bincount(expert, minlength=arch.num_experts)
    x = torch.randn(int(counts.sum()), arch.hidden_size, generator=g)
    probs = torch.rand(x.shape[0], generator=g)
    return x, counts, probs, torch.randn(x.shape, generator=g)


def _forward_backward(layer, rows):
    x, counts, probs, dy = rows
    x, probs = x.clone().requires_grad_(), probs.clone().requires_grad_()
    for p in layer.parameters():
        p.grad = None
    y, bias = layer(x, counts, probs)
    y.backward(dy)
    grads = {n: p.grad for n, p in layer.named_parameters()}
    return y.detach(), x.grad, probs.grad, grads, bias


def _ops(fn) -> list[str]:
    """The aten ops ``fn`` calls itself (not those inside another aten op: the CPU grouped GEMM runs mm per group)."""
    with torch.profiler.profile() as prof:
        fn()
    return [e.name for e in prof.events() if not (e.cpu_parent and e.cpu_parent.name.startswith("aten::"))]


def test_grouped_experts_match_sequential_mlp(dist):
    arch = _arch()
    assert arch.is_moe and arch.num_experts >= 4
    seq_chunk, seq = _experts(arch, SequentialMLP)
    grp_chunk, grp = _experts(arch, GroupedExperts, seq_chunk.state_dict())
    # the same parameters under the same names: checkpoints, converters and weight sync see one model
    assert [n for n, _ in grp_chunk.named_parameters()] == [n for n, _ in seq_chunk.named_parameters()]
    rows = _rows(arch)
    want = _forward_backward(seq, rows)
    got = _forward_backward(grp, rows)
    ops = _ops(lambda: _forward_backward(grp, rows))  # after the first call: it tried the kernel once
    assert ops.count("aten::_grouped_mm") == 6 and "aten::mm" not in ops, sorted(set(ops))  # 2 forward, 4 backward
    assert got[4] is None and want[4] is None
    for name, a, b in (("output", got[0], want[0]), ("input grad", got[1], want[1]), ("probs grad", got[2], want[2])):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    assert got[3].keys() == want[3].keys()
    empty = [n for n in want[3] if n.startswith("local_experts.1.")]
    assert empty and all(float(want[3][n].abs().max()) == 0.0 for n in empty)  # expert 1 had no rows
    for n in want[3]:
        torch.testing.assert_close(got[3][n], want[3][n], rtol=1e-5, atol=1e-6, msg=n)


def test_frozen_experts_give_input_and_router_grads_only(dist):
    """Under LoRA the experts are frozen: no weight gradient is computed, the input and router ones still are."""
    arch = _arch()
    seq_chunk, seq = _experts(arch, SequentialMLP)
    _, grp = _experts(arch, GroupedExperts, seq_chunk.state_dict())
    for layer in (seq, grp):
        layer.requires_grad_(False)
    rows = _rows(arch, seed=1)
    want, got = _forward_backward(seq, rows), _forward_backward(grp, rows)
    assert all(g is None for g in got[3].values())
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[2], want[2], rtol=1e-5, atol=1e-6)


def test_which_experts_module_a_run_gets(dist):
    arch = _arch()
    tcfg = transformer_config(arch)
    cpu = torch.empty(0)
    assert grouped_runs(tcfg, cpu)
    assert experts_module(None, tcfg, cpu) is GroupedExperts  # auto: on where measured faster, a CPU
    assert experts_module(True, tcfg, cpu) is GroupedExperts
    assert experts_module(False, tcfg, cpu) is SequentialMLP
    # an expert FFN width the kernel's 16-byte stride rule refuses (9 fp32 values per row)
    odd = transformer_config(dataclasses.replace(arch, moe_ffn_hidden_size=9))
    assert not grouped_runs(odd, cpu)
    assert experts_module(None, odd, cpu) is SequentialMLP
    with pytest.raises(ConfigError, match=r"train.grouped_experts=true: .*expert FFN width 9 .*grouped_experts=false"):
        experts_module(True, odd, cpu)
    # megatron's other activations (here: no gated unit) keep SequentialMLP's own forward, and true is refused
    plain_mlp = dataclasses.replace(tcfg, gated_linear_unit=False)
    assert not grouped_runs(plain_mlp, cpu) and experts_module(None, plain_mlp, cpu) is SequentialMLP
    with pytest.raises(ConfigError, match="not megatron's bias-free SwiGLU MLP"):
        experts_module(True, plain_mlp, cpu)


def test_auto_takes_the_grouped_experts_on_a_gpu_where_the_kernel_runs(dist, monkeypatch):
    """Measured on an H200 (benchmarks/GPU.md): the layer 6.0x, the small MoE step 3.23x; so auto is on wherever the
    grouped GEMM runs, not only on a CPU. A ``meta`` tensor stands in for the GPU's weights."""
    from megadare.models import experts

    tcfg = transformer_config(_arch())
    gpu_like = torch.empty(0, dtype=torch.bfloat16, device="meta")
    monkeypatch.setattr(experts, "grouped_gemm_runs", lambda like: like.device.type == "meta")
    assert experts_module(None, tcfg, gpu_like) is GroupedExperts
    monkeypatch.setattr(experts, "grouped_gemm_runs", lambda like: False)  # an older torch: no kernel there
    assert experts_module(None, tcfg, gpu_like) is SequentialMLP


def test_the_grouped_gemm_probe_runs_once_per_device_and_dtype(dist, monkeypatch):
    """The build's ``experts_module`` and every layer's first forward ask whether grouped GEMMs run: a tiny GEMM and
    a host read each time, until the answer was kept per device and dtype."""
    from megadare.models.hf import common

    monkeypatch.setattr(common, "_GROUPED_RUNS", {}, raising=False)
    probes = []
    real_probe = common._grouped_probe

    def counted_probe(device, dtype):
        probes.append((device.type, dtype))
        return real_probe(device, dtype)

    monkeypatch.setattr(common, "_grouped_probe", counted_probe)
    arch = _arch()
    assert experts_module(None, transformer_config(arch), torch.empty(0)) is GroupedExperts
    _, layers = zip(*(_experts(arch, GroupedExperts) for _ in range(2)))
    for layer in layers:
        _forward_backward(layer, _rows(arch))
    assert common.grouped_gemm_runs(torch.zeros(3)) and probes == [("cpu", torch.float32)]
    assert common.grouped_gemm_runs(torch.zeros(3, dtype=torch.bfloat16))  # another dtype: a probe of its own
    assert common.grouped_gemm_runs(torch.zeros(3, dtype=torch.bfloat16))
    assert probes == [("cpu", torch.float32), ("cpu", torch.bfloat16)]


def test_grouped_experts_fall_back_to_the_sequential_forward_where_the_kernel_cannot_run(dist):
    arch = _arch(moe_intermediate_size=9)
    seq_chunk, seq = _experts(arch, SequentialMLP)
    _, grp = _experts(arch, GroupedExperts, seq_chunk.state_dict())
    rows = _rows(arch, seed=2)
    ops = _ops(lambda: _forward_backward(grp, rows))
    assert "aten::_grouped_mm" not in ops
    torch.testing.assert_close(_forward_backward(grp, rows)[0], _forward_backward(seq, rows)[0])


def test_grouped_experts_take_rows_of_any_strides(dist):
    """SequentialMLP runs rows of any layout; the grouped GEMM refuses strides that are not 16-byte multiples (here
    a column slice of a wider tensor, 65 floats per row), so the forward hands it contiguous rows."""
    arch = _arch()
    seq_chunk, seq = _experts(arch, SequentialMLP)
    _, grp = _experts(arch, GroupedExperts, seq_chunk.state_dict())
    x, counts, probs, dy = _rows(arch, seed=3)
    outs = []
    for layer in (seq, grp):
        wide = torch.cat([torch.zeros(x.shape[0], 1), x], dim=1).requires_grad_()
        rows = wide[:, 1:]
        assert not rows.is_contiguous() and rows.stride(0) == x.shape[1] + 1
        y, _ = layer(rows, counts, probs)
        y.backward(dy)
        outs.append((y.detach(), wide.grad[:, 1:]))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_fused_elementwise_runs_megatrons_fused_swiglu_in_the_grouped_experts(dist):
    """Under ``train.fused_elementwise`` (``bias_activation_fusion``) SequentialMLP's experts run megatron's compiled
    weighted SwiGLU; the grouped path runs the same function (not the unfused ops), with the same results."""
    arch = _arch()
    tcfg = transformer_config(arch, bias_activation_fusion=True)
    seq_chunk, seq = _experts(arch, SequentialMLP, tcfg=tcfg)
    _, grp = _experts(arch, GroupedExperts, seq_chunk.state_dict(), tcfg)
    rows = _rows(arch, seed=3)
    want = _forward_backward(seq, rows)
    got = _forward_backward(grp, rows)
    ops = _ops(lambda: _forward_backward(grp, rows))
    assert "WeightedSwiGLUFunction" in ops and "aten::_grouped_mm" in ops, sorted(set(ops))
    for a, b in zip(got[:3], want[:3]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for n in want[3]:
        torch.testing.assert_close(got[3][n], want[3][n], rtol=1e-5, atol=1e-6, msg=n)
