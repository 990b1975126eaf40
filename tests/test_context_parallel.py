"""Ulysses context parallelism (parallel.cp=2, gloo) against cp=1: logits and parameter gradients.

Each CP rank feeds its contiguous chunk of input_ids / position_ids and the FULL-sequence MaskSpec (as
trainer/step.py does). Cases: SDAR with a block-causal mask and with a packed block-diffusion x_t ++ x_0 batch
(stream / position / segment ids; one kv head, so the GQA kv-head repetition is exercised) and LLaDA
(bidirectional, MHA). One 2-process run computes the cp=1 reference first (dp=2) and then cp=2.
"""

from __future__ import annotations

import pytest
import torch

from dist import run_distributed

SEQ = 16
BLOCK = 4


def _packed_block_diffusion(batch: int):
    """Row 0: samples of L=5 and L=3 (x_t ++ x_0 each, 16 tokens); row 1: one sample of L=8 with x_0 first."""

    def sample(L, seg, x0_first=False):
        pos = list(range(L)) * 2
        stream = [1] * L + [0] * L if x0_first else [0] * L + [1] * L
        return pos, stream, [seg] * (2 * L)

    rows = [[sample(5, 0), sample(3, 1)], [sample(8, 0, x0_first=True)]]
    pos, stream, seg = [], [], []
    for parts in rows[:batch]:
        pos.append(sum((p[0] for p in parts), []))
        stream.append(sum((p[1] for p in parts), []))
        seg.append(sum((p[2] for p in parts), []))
    return torch.tensor(pos), torch.tensor(stream), torch.tensor(seg)


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    from megadare.models import build_hf_model, get_family, save_hf_model
    from megadare.models.attention import MaskSpec, bidirectional, block_causal

    root = tmp_path_factory.mktemp("hf_cp")
    out = []
    for i, name in enumerate(["sdar", "llada"]):
        torch.manual_seed(300 + i)
        cfg = get_family(name).tiny_config()
        if name == "sdar":
            cfg["block_size"] = BLOCK
            cfg["num_key_value_heads"] = 1  # fewer kv heads than cp: repeated for the exchange
        model = build_hf_model(cfg).eval()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        d = str(root / name)
        save_hf_model(model, cfg, d)
        arch = get_family(name).arch(cfg)
        ids = torch.randint(0, arch.vocab_size, (2, SEQ))
        arange = torch.arange(SEQ).unsqueeze(0).expand(2, SEQ).contiguous()
        # per-token mean scale (as the trainer's loss): grads O(1), so fp32 summation-order noise of the
        # chunked backward stays well below the 1e-5 tolerance
        weights = torch.randn(2, SEQ, arch.vocab_size) / (2 * SEQ)
        if name == "sdar":
            out.append(
                dict(name="sdar/block_causal", hf_dir=d, ids=ids, pos=arange, mask=block_causal(BLOCK), weights=weights)
            )
            pos, stream, seg = _packed_block_diffusion(2)
            spec = MaskSpec("block_diffusion", block_size=BLOCK, segment_ids=seg, position_ids=pos, stream_ids=stream)
            out.append(dict(name="sdar/block_diffusion", hf_dir=d, ids=ids, pos=pos, mask=spec, weights=weights))
        else:
            out.append(
                dict(name="llada/bidirectional", hf_dir=d, ids=ids, pos=arange, mask=bidirectional(), weights=weights)
            )
    return out


def _run(cases: list[dict]) -> dict:
    """Logits of this rank's chunk and CP-summed parameter gradients of sum(logits * weights), per case."""
    from megatron.core import parallel_state as ps
    import torch.distributed as dist

    from megadare.convert.hf_megatron import load_hf_into_model
    from megadare.models import gpt
    from megadare.models.family import family_of, read_hf_config

    cp, r = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
    res = {}
    for case in cases:
        cfg = read_hf_config(case["hf_dir"])
        arch = family_of(cfg).arch(cfg)
        chunks = gpt.build_model_chunks(arch, gpt.transformer_config(arch), attention_backend="sdpa")
        load_hf_into_model(chunks, case["hf_dir"])
        model = chunks[0]
        model.train()
        S = case["ids"].shape[1]
        sl = slice(r * S // cp, (r + 1) * S // cp)
        logits = model(case["ids"][:, sl], case["pos"][:, sl], case["mask"])[..., : arch.vocab_size]
        (logits * case["weights"][:, sl]).sum().backward()
        grads = {}
        for n, p in model.named_parameters():
            g = p.main_grad if getattr(p, "main_grad", None) is not None else p.grad
            g = g.detach().clone()
            if cp > 1:
                dist.all_reduce(g, group=ps.get_context_parallel_group())
            grads[n] = g
        res[case["name"]] = dict(logits=logits.detach(), grads=grads)
    return res


def _exchange_checks() -> None:
    """seq<->head all-to-all round trip, its all_gather fallback, gradients and the head-count error."""
    from types import SimpleNamespace

    from megatron.core import parallel_state as ps

    from megadare.models import attention as A

    group = ps.get_context_parallel_group()
    r = ps.get_context_parallel_rank()
    gen = torch.Generator().manual_seed(7)
    full = torch.randn(8, 2, 4, 3, generator=gen)  # [S, B, h, D], same on every rank
    x = full[r * 4 : (r + 1) * 4].clone().requires_grad_(True)
    y = A.seq_to_head_parallel(x, group)
    torch.testing.assert_close(y, full[:, :, r * 2 : (r + 1) * 2], rtol=0, atol=0)
    z = A.head_to_seq_parallel(y * 3.0, group)
    torch.testing.assert_close(z, 3.0 * x, rtol=0, atol=0)
    z.sum().backward()
    torch.testing.assert_close(x.grad, torch.full_like(x, 3.0), rtol=0, atol=0)
    saved = dict(A._A2A_SUPPORTED)
    A._A2A_SUPPORTED["gloo"] = False  # force the all_gather fallback
    try:
        torch.testing.assert_close(A.seq_to_head_parallel(x, group), y, rtol=0, atol=0)
    finally:
        A._A2A_SUPPORTED.clear()
        A._A2A_SUPPORTED.update(saved)
    cfg = SimpleNamespace(
        context_parallel_size=2, num_attention_heads=3, kv_channels=8, softmax_scale=None, attention_dropout=0.0
    )
    with pytest.raises(ValueError, match="parallel.cp=2"):
        A.DLLMCoreAttention(cfg, layer_number=1)


def _worker(rank: int, world: int, cases: list[dict]) -> dict:
    from megatron.core import parallel_state

    from megadare.parallel import Layout, destroy_distributed, init_distributed

    init_distributed(Layout(cp=1))  # reference: dp=2, full sequence
    try:
        ref = _run(cases)
        parallel_state.destroy_model_parallel()
        init_distributed(Layout(cp=2))
        out = _run(cases)
        _exchange_checks()
    finally:
        destroy_distributed()
    return {"ref": ref, "cp": out}


@pytest.fixture(scope="module")
def results(cases):
    return run_distributed(_worker, 2, cases, timeout_s=300)


@pytest.mark.parametrize("name", ["sdar/block_causal", "sdar/block_diffusion", "llada/bidirectional"])
def test_cp_logits_match(results, name):
    ref = results[0]["ref"][name]["logits"]
    got = torch.cat([results[r]["cp"][name]["logits"] for r in range(2)], dim=1)
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["sdar/block_causal", "sdar/block_diffusion", "llada/bidirectional"])
def test_cp_grads_match(results, name):
    ref = results[0]["ref"][name]["grads"]
    for r in range(2):
        got = results[r]["cp"][name]["grads"]
        assert got.keys() == ref.keys()
        for n in ref:
            torch.testing.assert_close(got[n], ref[n], rtol=1e-5, atol=1e-5, msg=lambda m: f"{name} {n}: {m}")
        assert any(float(g.abs().sum()) > 0 for g in got.values())


def test_cp_masks_are_nontrivial(cases):
    """The block-diffusion case splits a sample across the CP chunk boundary and crosses segments."""
    spec = cases[1]["mask"]
    dense = spec.dense(SEQ, SEQ, 2)[:, 0]
    assert bool(dense[:, : SEQ // 2, SEQ // 2 :].any()) and not bool(dense.all())
