"""LoRA on megatron's TP linears (models/lora.py), on a tiny dense SDAR model, at TP=1 and TP=2 + SP (gloo).

One worker per layout (TP=1, TP=2 + SP, TP=2 without SP) does everything:
(a) LoRA logits (random non-zero B) == merged-model logits, != base logits; merged sharded_state_dict keys ==
    the plain model's; LoRA logits agree across layouts (the random B is built layout-independently).
(b) 3 train_step's change every adapter and leave every base parameter bitwise unchanged.
    Replicated adapters (column A, row B) stay identical on all TP ranks.
(c) the per-step losses at TP=2 (+SP) equal those at TP=1 (same data, same layout-independent init).
(d) save_checkpoint / load_checkpoint round-trips the adapters (same layout and TP=2 -> TP=1).
"""

from __future__ import annotations

import pytest
import torch

from dist import run_distributed

SEQ = 16
RANK, ALPHA = 4, 8.0
STEPS = 3
LAYOUTS = ["tp1", "tp2_sp", "tp2"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from megadare.models import build_hf_model, get_family, save_hf_model
    from megadare.data.rows import Row

    root = tmp_path_factory.mktemp("lora")
    torch.manual_seed(0)
    cfg = get_family("sdar").tiny_config()
    cfg["block_size"] = 4
    model = build_hf_model(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    hf_dir = str(root / "hf")
    save_hf_model(model, cfg, hf_dir)
    ids = torch.randint(0, 250, (2, SEQ))
    g = torch.Generator().manual_seed(1)
    steps = []
    for _ in range(STEPS):
        rows = []
        for n in (16, 12, 9, 7):
            tok = torch.randint(0, 250, (n,), generator=g)
            w = (torch.rand(n, generator=g) < 0.6).float()
            w[0] = 1.0
            rows.append(
                Row(
                    tokens=tok,
                    labels=torch.randint(0, 250, (n,), generator=g),
                    weight=w,
                    position_ids=torch.arange(n),
                    denom=float(w.sum()),
                )
            )
        steps.append(rows)
    return {"hf_dir": hf_dir, "ids": ids, "steps": steps, "root": root}


def _random_b(m, name: str) -> torch.Tensor:
    """A non-zero B for module ``name``, built full and then sharded like the model: same function at any TP."""
    g = torch.Generator().manual_seed(sum(map(ord, name)) * 7919)
    base = m.base
    if m.kind == "row":
        return torch.randn(base.output_size, m.r, generator=g) * 0.1
    full = torch.randn(base.output_size, m.r, generator=g) * 0.1
    tp, r = base.tp_group.size(), base.tp_group.rank()
    n = base.output_size_per_partition
    if m.glu:  # per rank [gate shard; up shard]
        gate, up = full.chunk(2)
        h = n // 2
        return torch.cat([gate[r * h : (r + 1) * h], up[r * h : (r + 1) * h]])
    assert full.shape[0] == n * tp
    return full[r * n : (r + 1) * n]


def _worker(rank, world, runs, hf_dir, ids, steps):
    """runs: [(name, layout, ckpt_dir, checkpoint of another layout to load or None)], one after the other in
    the same processes (only megatron's parallel groups are rebuilt). Returns {name: results} from TP rank 0."""
    from megatron.core import parallel_state as ps

    from megadare.parallel import destroy_distributed

    results = {}
    try:
        for i, (name, layout, ckpt_dir, load_other) in enumerate(runs):
            if i:
                ps.destroy_model_parallel()
            out = _one_layout(layout, hf_dir, ids, steps, ckpt_dir, load_other)
            if ps.get_tensor_model_parallel_rank() == 0:
                results[name] = out
    finally:
        destroy_distributed()
    return results


def _one_layout(layout, hf_dir, ids, steps, ckpt_dir, load_other):
    from megatron.core import parallel_state as ps

    from megadare.convert.hf_megatron import load_checkpoint, load_hf_into_model, save_checkpoint
    from megadare.convert.mcore_ckpt import model_sharded_state_dict
    from megadare.models.attention import family_mask
    from megadare.trainer.verify import _build
    from megadare.models.lora import (
        LoRALinear,
        apply_lora,
        lora_modules,
        lora_parameters,
        lora_state_dict,
        merge_lora,
    )
    from megadare.parallel import Layout, init_distributed
    from megadare.data.rows import pack_rows, global_denominator, split_for_data_parallel
    from megadare.trainer.forward import forward_logits
    from megadare.trainer.optim import OptimSettings, build_optimizer, wrap_ddp
    from megadare.trainer.policy import Policy
    from megadare.trainer.step import RowFormat, train_step

    init_distributed(Layout(**layout))
    sp = layout.get("sp", False)
    out = {}
    # ------------------------------------------------ (a) LoRA == merged != base, keys, (d) checkpoints
    arch, chunks = _build(hf_dir, sp)
    mask = family_mask(arch)
    load_hf_into_model(chunks, hf_dir)
    plain_keys = sorted(model_sharded_state_dict(chunks)["model"].keys())
    out["base"] = forward_logits(chunks, ids, arch.vocab_size, mask)
    wrapped = apply_lora(chunks, RANK, ALPHA)
    assert len(wrapped) == 4 * arch.num_layers, wrapped
    assert all(not p.requires_grad for n, p in chunks[0].named_parameters() if "lora_" not in n)
    assert sorted(n for n, p in chunks[0].named_parameters() if p.requires_grad) == sorted(lora_parameters(chunks))
    with torch.no_grad():
        for name, m in lora_modules(chunks):
            m.lora_B.copy_(_random_b(m, name))
    # state_dict keeps the plain keys and adds the adapters
    sd_keys = set(chunks[0].state_dict().keys())
    assert not any(".base." in k for k in sd_keys)
    lora_keys = sorted(model_sharded_state_dict(chunks)["model"].keys())
    assert sorted(set(lora_keys) - set(plain_keys)) == sorted(lora_parameters(chunks))
    out["lora"] = forward_logits(chunks, ids, arch.vocab_size, mask)
    saved = {k: v.clone() for k, v in lora_state_dict(chunks).items()}
    save_checkpoint(chunks, ckpt_dir, meta={"family": arch.family}, hf_files_from=hf_dir)
    assert merge_lora(chunks)
    assert not any(isinstance(m, LoRALinear) for m in chunks[0].modules())
    assert sorted(model_sharded_state_dict(chunks)["model"].keys()) == plain_keys
    out["merged"] = forward_logits(chunks, ids, arch.vocab_size, mask)

    # (d) load into a fresh LoRA model with zeroed adapters (same layout, and another layout's checkpoint)
    for tag, src in (("ckpt", ckpt_dir), ("ckpt_other", load_other)):
        if src is None:
            continue
        _, chunks2 = _build(hf_dir, sp)
        apply_lora(chunks2, RANK, ALPHA)
        with torch.no_grad():
            for _, m in lora_modules(chunks2):
                m.lora_A.zero_()
                m.lora_B.zero_()
        load_checkpoint(chunks2, src)
        got = lora_state_dict(chunks2)
        assert got.keys() == saved.keys()
        for k in saved:
            assert torch.equal(got[k], saved[k]), (tag, k)
        out[tag] = forward_logits(chunks2, ids, arch.vocab_size, mask)

    # ------------------------------------------------ (b, c) training changes only adapters; losses
    _, chunks = _build(hf_dir, sp)
    load_hf_into_model(chunks, hf_dir)
    apply_lora(chunks, RANK, ALPHA)
    before = {n: p.detach().clone() for n, p in chunks[0].named_parameters()}
    ddp = wrap_ddp(chunks, distributed_optimizer=True)
    opt, sched = build_optimizer(ddp, OptimSettings(lr=1e-2, lr_decay_style="constant", total_steps=STEPS))
    losses = []
    for rows in steps:
        mbs = pack_rows(rows, SEQ, micro_batch_size=1)
        denom = global_denominator(mbs)
        mine = split_for_data_parallel(mbs, ps.get_data_parallel_world_size(), ps.get_data_parallel_rank())
        m = train_step(
            Policy(ddp, opt, sched), mine, denom, RowFormat("block_causal", arch.block_size, arch.vocab_size)
        )
        assert m["skipped"] == 0.0
        losses.append(m["loss"])
    after = dict(chunks[0].named_parameters())
    for n, p in before.items():
        if "lora_" in n:
            assert not torch.equal(after[n].detach(), p), f"adapter {n} did not change"
        else:
            assert torch.equal(after[n].detach(), p), f"frozen {n} changed"
    out["losses"] = losses
    # replicated adapters (column A, row B) must stay identical on every TP rank
    for name, m in lora_modules(chunks):
        rep = m.lora_A if m.kind == "column" else m.lora_B
        peers = [torch.empty_like(rep) for _ in range(ps.get_tensor_model_parallel_world_size())]
        torch.distributed.all_gather(peers, rep.detach().contiguous(), group=ps.get_tensor_model_parallel_group())
        assert all(torch.equal(q, peers[0]) for q in peers), f"{name}: replicated adapter diverged over TP"
    merge_lora(ddp)
    out["trained_merged"] = forward_logits(chunks, ids, arch.vocab_size, mask)
    return out


@pytest.fixture(scope="module")
def runs(setup):
    root = setup["root"]
    args = (setup["hf_dir"], setup["ids"], setup["steps"])
    two = [
        ("tp2_sp", dict(tp=2, sp=True), str(root / "ck_tp2_sp"), None),
        ("tp2", dict(tp=2), str(root / "ck_tp2"), None),
    ]
    out = run_distributed(_worker, 2, two, *args)[0]
    one = [("tp1", dict(tp=1), str(root / "ck_tp1"), str(root / "ck_tp2_sp"))]
    out.update(run_distributed(_worker, 1, one, *args)[0])
    return out


def _maxdiff(a, b):
    assert a.shape == b.shape
    return (a - b).abs().max().item()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_lora_equals_merged_and_differs_from_base(runs, layout):
    r = runs[layout]
    assert _maxdiff(r["lora"], r["merged"]) < 1e-5
    assert _maxdiff(r["merged"], r["base"]) > 1e-3


@pytest.mark.parametrize("layout", ["tp2_sp", "tp2"])
def test_lora_forward_is_layout_independent(runs, layout):
    assert _maxdiff(runs["tp1"]["lora"], runs[layout]["lora"]) < 1e-4
    assert _maxdiff(runs["tp1"]["base"], runs[layout]["base"]) < 1e-4


@pytest.mark.parametrize("layout", LAYOUTS)
def test_checkpoint_roundtrip(runs, layout):
    r = runs[layout]
    assert torch.equal(r["ckpt"], r["lora"])


def test_checkpoint_tp2_sp_loads_at_tp1(runs):
    assert _maxdiff(runs["tp1"]["ckpt_other"], runs["tp1"]["lora"]) < 1e-5


@pytest.mark.parametrize("layout", ["tp2_sp", "tp2"])
def test_training_losses_match_across_layouts(runs, layout):
    a, b = runs["tp1"]["losses"], runs[layout]["losses"]
    assert len(a) == STEPS
    assert max(abs(x - y) for x, y in zip(a, b)) < 1e-5, (a, b)
    assert a[0] != a[-1]  # the adapters do change the model between steps


@pytest.mark.parametrize("layout", ["tp2_sp", "tp2"])
def test_trained_merged_models_match_across_layouts(runs, layout):
    assert _maxdiff(runs["tp1"]["trained_merged"], runs[layout]["trained_merged"]) < 1e-4
    assert _maxdiff(runs["tp1"]["trained_merged"], runs["tp1"]["base"]) > 1e-4
