"""Logits only where the loss is (models/head.py): the scored, chunked output layer against the full-logits path.

Unit: ``linear_logprobs`` -- log-probs, entropies and the gradients of hidden states and weight -- against autograd
through full float64 logits, with a per-position temperature and an excluded token, in one chunk (p kept for
backward) and in many (each chunk's logits recomputed); no [tokens, vocab] tensor outlives a chunk.

Parallel: one 2-process gloo launch loops over TP2+SP, PP2, EP2 and CP2. In each layout every SFT mode's rows
(block, random, semi_ar, trace on both attention kinds, Dream-shifted, LoRA), every RL algorithm's rows (on the block
grid, on full attention and Dream-shifted where the zoo trains them), DPO pairs and TraceRL's value model go through
the real passes -- the old / reference ``store_outputs`` passes and ``train_step`` -- once with ``train.logits=full``
(the old path: logits of every position, trainer/logprob.py) and once scored; losses, entropies (an entropy bonus in
the SFT objectives, so their gradients count too), grad norms, every gradient and the stored log-probs agree within
1e-5 relative in fp32. Scored runs alternate between one chunk and many (``train.logits_chunk_mb``). A value model
under TP2+SP also matches PP2's grad norm (ValueHead's sequence-parallel gather summed the TP ranks' gradients).
"""

from __future__ import annotations

import copy
import dataclasses
import time
import types
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megadare.data.rows import PASSES
from megadare.models import head
from megadare.models.head import TokenTargets, chunk_tokens, linear_logprobs
from tiny import write_tiny_hf

pytestmark = pytest.mark.timeout(900)

TOL = 1e-5
# gradients: the backward recomputes the logits in blocks of vocabulary rows, a GEMM of another shape than the
# forward's token chunks, so z differs from the forward's by an fp32 ulp; the entropy gradient -p (z - E_p z) sums
# to 0 over the vocabulary and that cancellation lifts the ulp to ~1e-5 of the largest entry (measured: 1.5e-5 over
# 12 seeds, 3e-6 when both passes ran the same shapes). A wrong term (label, scale, exclusion) is O(1).
GRAD_TOL = 4e-5
SEQ = 64
RL_BLOCK = (
    "d1",
    "coupled_grpo",
    "random_mask_rl",
    "tracerl",
    "cj_grpo",
    "bgpo",
    "ebpo",
    "spg",
    "vrpo",
    "mdpo",
    "d_treerpo",
)
RL_FULL = ("d1", "tracerl", "justgrpo", "espo", "mdpo")
RL_SHIFT = ("coupled_grpo", "tracerl")
LAYOUTS = {"tp2_sp": dict(tp=2, sp=True), "pp2": dict(pp=2), "ep2": dict(ep=2), "cp2": dict(cp=2)}


# ----------------------------------------------------------------------------------------------- unit: one rank
def _reference(h, w, y, vocab, scale, excluded):
    """float64 log-probs and entropies from the full logits (the excluded token at -1e30: exp is 0, no NaN)."""
    z = (h.double() @ w.double().t())[:, :vocab] * scale.double()[:, None]
    hit = (excluded >= 0)[:, None]
    col = excluded.clamp(0)[:, None]
    z = z.scatter(1, col, torch.where(hit, torch.full_like(z[:, :1], -1e30), z.gather(1, col)))
    lp = torch.log_softmax(z, -1)
    return lp.gather(1, y[:, None])[:, 0], -(lp.exp() * lp).sum(-1)


@pytest.mark.parametrize("chunk_mb", [1.0, 4e-4])
def test_linear_logprobs_match_full_logits(chunk_mb):
    g = torch.Generator().manual_seed(0)
    n, hid, vocab, padded = 37, 16, 300, 384
    h = torch.randn(n, hid, generator=g).requires_grad_()
    w = torch.randn(padded, hid, generator=g).requires_grad_()
    y = torch.randint(0, vocab, (n,), generator=g)
    scale = torch.rand(n, generator=g) + 0.5
    excluded = torch.randint(-1, vocab, (n,), generator=g)
    excluded[excluded == y] = -1
    a, b = torch.randn(n, generator=g, dtype=torch.float64), torch.randn(n, generator=g, dtype=torch.float64)
    assert (chunk_tokens(padded, chunk_mb) >= n) == (chunk_mb == 1.0)  # one chunk, or several
    lp0, ent0 = _reference(h, w, y, vocab, scale, excluded)
    rel = lambda x, ref: float((x.double() - ref).abs().max() / ref.abs().max())  # noqa: E731
    for wa, wb in ((1.0, 0.0), (0.0, 1.0), (1.0, 1.0)):
        h.grad = w.grad = None
        lp, ent = linear_logprobs(h, w, TokenTargets(y, scale, excluded), vocab, chunk_mb, entropy=wb != 0)
        assert rel(lp, lp0) < TOL and (ent is None or rel(ent, ent0) < TOL)
        ((wa * a * lp).sum() + (0.0 if ent is None else (wb * b * ent).sum())).backward()
        got = h.grad.clone(), w.grad.clone()
        h.grad = w.grad = None
        lp0, ent0 = _reference(h, w, y, vocab, scale, excluded)
        ((wa * a * lp0).sum() + (wb * b * ent0).sum()).backward()
        assert rel(got[0], h.grad) < GRAD_TOL and rel(got[1], w.grad) < GRAD_TOL, (wa, wb)
        assert float(got[1][vocab:].abs().max()) == 0.0  # vocabulary padding rows get no gradient


def test_bf16_weight_gradient_goes_into_main_grad():
    """A bf16 weight with megatron DDP's fp32 ``main_grad``: the gradient lands there (no ``.grad`` tensor), built
    a few vocabulary rows at a time, and matches float64 autograd through the full logits to bf16 precision."""
    g = torch.Generator().manual_seed(1)
    n, hid, vocab = 29, 32, 256
    h = torch.randn(n, hid, generator=g).bfloat16().requires_grad_()
    w = torch.randn(vocab, hid, generator=g).bfloat16().requires_grad_()
    w.main_grad = torch.zeros(vocab, hid)
    y = torch.randint(0, vocab, (n,), generator=g)
    lp, _ = linear_logprobs(h, w, TokenTargets(y), vocab, chunk_mb=0.004)  # 4 tokens per chunk, 128 rows per block
    lp.sum().backward()
    assert w.grad is None and float(w.main_grad.abs().max()) > 0
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = torch.log_softmax(h64 @ w64.t(), -1).gather(1, y[:, None]).sum()
    ref.backward()
    assert float((lp.double() - torch.log_softmax(h64 @ w64.t(), -1).gather(1, y[:, None])[:, 0]).abs().max()) < 0.1
    assert float((w.main_grad.double() - w64.grad).abs().max() / w64.grad.abs().max()) < 2e-2
    assert float((h.grad.double() - h64.grad).abs().max() / h64.grad.abs().max()) < 2e-2


class _BigOps(TorchDispatchMode):
    """(op, output dtype) of every op whose output has at least ``size`` elements: the passes over [tokens, rows]."""

    def __init__(self, size: int):
        super().__init__()
        self.size, self.ops = size, Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if torch.is_tensor(out) and out.numel() >= self.size:
            self.ops[(func.overloadpacket.__name__, out.dtype)] += 1
        return out


def test_bf16_backward_writes_the_logit_gradient_in_bf16_by_its_product_pass():
    """bf16 weights, logits recomputed in blocks: each block's gradient a (e_y - p) is written in bf16 by the product
    itself (``torch.mul(..., out=bf16)``), not ``mul_`` in fp32 and then a cast (an H200 profile: 75 of each per
    SDAR-1.7B step, [8192, 2048] fp32 each), and the results are the old ones bit for bit: every value rounds once
    from the same fp32 value (the label's column, fp32 beside, overwrites its entry). The gradient of an fp32 head
    is not cast at all."""
    g = torch.Generator().manual_seed(3)
    n, hid, vocab, chunk_mb = 40, 8, 512, 0.01
    h = torch.randn(n, hid, generator=g).bfloat16().requires_grad_()
    w = torch.randn(vocab, hid, generator=g).bfloat16().requires_grad_()
    w.main_grad = torch.zeros(vocab, hid)
    y = torch.randint(0, vocab, (n,), generator=g)
    a = torch.randn(n, generator=g)
    lp, _ = linear_logprobs(h, w, TokenTargets(y), vocab, chunk_mb)
    blocks = len(
        head._row_blocks(
            types.SimpleNamespace(saved_tensors=(h, None), v=types.SimpleNamespace(n_real=vocab, chunk_mb=chunk_mb))
        )
    )
    assert blocks > 1
    ops = _BigOps(n * 16)
    with ops:
        (lp * a).sum().backward()
    assert ops.ops[("mul", torch.bfloat16)] == blocks and ops.ops[("mul_", torch.float32)] == 0, ops.ops
    assert ops.ops[("_to_copy", torch.bfloat16)] == 0, ops.ops  # (the recomputed logits' fp32 cast stays)
    # the old formula: p * (-a) in fp32, a at the label, then the cast; the same GEMMs after it
    h64 = h.detach().float()
    z = (h.detach() @ w.detach().t()).float()
    p = (z - torch.logsumexp(z, 1, keepdim=True)).exp()
    old = p * -a[:, None]
    old.scatter_add_(1, y[:, None], a[:, None])
    old = old.bfloat16()
    got = head._cast_label_grad(p, -a[:, None], y[:, None], a[:, None], torch.bfloat16)
    assert torch.equal(got, old) and got.dtype == torch.bfloat16
    assert float((w.main_grad - old.float().t() @ h64).abs().max()) <= 1e-2 * float(w.main_grad.abs().max())


class _AllOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def test_the_forward_runs_few_small_kernels_per_chunk():
    """Many token chunks without TP (an H200's SDAR-1.7B step: 75 chunks of 110 tokens per micro-batch, each small
    op a kernel launch): the labels' columns are found once for all tokens (not ``sub, ge, lt, and, clamp`` per
    chunk), no ``stack`` of the sums where no all-reduce needs them together, and the results are written into
    their slices by the ops themselves (no ``copy_``); the values are those of test_linear_logprobs_match_full_logits
    (the same ops on the same values)."""
    g = torch.Generator().manual_seed(4)
    n, hid, vocab, chunk_mb = 40, 8, 512, 0.01
    h = torch.randn(n, hid, generator=g)
    w = torch.randn(vocab, hid, generator=g)
    y = torch.randint(0, vocab, (n,), generator=g)
    chunks = -(-n // chunk_tokens(vocab, chunk_mb))
    assert chunks > 4
    ops = _AllOps()
    with ops:
        lp, _ = linear_logprobs(h, w, TokenTargets(y), vocab, chunk_mb)
    assert ops.ops["clamp"] == 1 and ops.ops["ge"] == 1 and ops.ops["lt"] == 1, ops.ops
    assert ops.ops["copy_"] == 0 and ops.ops["stack"] == 0, ops.ops
    assert ops.ops["mm"] == chunks and ops.ops["exp_"] == chunks, ops.ops
    ref = torch.log_softmax(h.double() @ w.double().t(), -1).gather(1, y[:, None])[:, 0]
    assert float((lp.double() - ref).abs().max() / ref.abs().max()) < TOL


def test_backward_writes_each_weight_row_once_over_every_token(monkeypatch):
    """Many token chunks (the logits recomputed in backward): the weight gradient is summed into ``main_grad`` a
    block of vocabulary rows at a time, each block one product over every scored token (K = n), each row written
    once -- not once per token chunk, which made the bf16 head's backward memory-bound (an H200 profile: 23% of a
    step in ``add_``); each block's [n, rows] logits stay within ``chunk_mb``."""
    calls = []
    real = head.add_matmul_

    def spy(out, a, b):
        calls.append((out, a.shape))
        real(out, a, b)

    monkeypatch.setattr(head, "add_matmul_", spy)
    g = torch.Generator().manual_seed(2)
    n, hid, vocab, chunk_mb = 40, 8, 512, 0.01
    h = torch.randn(n, hid, generator=g).requires_grad_()
    w = torch.randn(vocab, hid, generator=g).requires_grad_()
    w.main_grad = torch.zeros(vocab, hid)
    y = torch.randint(0, vocab, (n,), generator=g)
    assert chunk_tokens(vocab, chunk_mb) < n  # several chunks: backward recomputes
    lp, _ = linear_logprobs(h, w, TokenTargets(y), vocab, chunk_mb)
    lp.sum().backward()
    base = w.main_grad.data_ptr()
    wgrad = [(out, shape) for out, shape in calls if out.data_ptr() - base in range(vocab * hid * 4)]
    starts = sorted((out.data_ptr() - base) // (hid * 4) for out, _ in wgrad)
    sizes = {(out.data_ptr() - base) // (hid * 4): out.shape[0] for out, _ in wgrad}
    assert len(wgrad) > 1 and len(calls) == 2 * len(wgrad)  # one dh and one dW product per block
    assert starts[0] == 0 and all(a + sizes[a] == b for a, b in zip(starts, starts[1:]))
    assert starts[-1] + sizes[starts[-1]] == vocab  # the rows tiled exactly once
    assert all(shape[1] == n for _, shape in wgrad)  # K = every token
    assert all(4 * n * sizes[a] <= chunk_mb * 2**20 for a in starts)
    ref = torch.log_softmax(h.detach().double() @ w.detach().double().t(), -1)
    want = (torch.nn.functional.one_hot(y, vocab).double() - ref.exp()).t() @ h.detach().double()
    assert float((w.main_grad.double() - want).abs().max() / want.abs().max()) < GRAD_TOL


# ----------------------------------------------------------------------------------------------- the cases
def _samples(arch, n: int = 6, seed: int = 0):
    """Synthetic rollouts: random prompts / responses, a decoding trace and per-step predictions (MDPO), two
    prompt groups, advantages of both signs."""
    from algo_toy import synthetic_trace
    from megadare.algos.base import RLSample

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        P, L = 2 + i % 3, 6 + i % 3
        rnd = lambda k: torch.randint(4, 200, (k,), generator=g).tolist()  # noqa: E731
        commit, bstep = synthetic_trace(P, L, arch.block_size if arch.attention == "block_causal" else 4, seed + i)
        T = max(commit) + 1
        preds = [[int(t) if commit[k] >= s else -1 for k, t in enumerate(rnd(L))] for s in range(T)]
        confs = [torch.rand(L, generator=g).tolist() for _ in range(T)]
        out.append(
            RLSample(
                prompt_ids=rnd(P),
                response_ids=rnd(L),
                reward=float(i % 2),
                advantage=(-1.0) ** i,
                index=i,
                group=i // 3,
                commit_step=commit,
                block_step=bstep,
                extra={
                    "sampling_temperature": 0.7,
                    "parent": (i // 3, 0, 0),
                    "step_predictions": preds,
                    "step_confidences": confs,
                },
            )
        )
    return out


def _algo(name: str):
    from megadare.algos import REGISTRY, build_algorithm

    over = {"n_mc": 2} if "n_mc" in REGISTRY[name].defaults else {}
    if name == "d_treerpo":
        over.update(branch=2, depth=1)
    return build_algorithm(name, over)


def _rl_rows(name: str, arch, samples):
    from megadare.algos.sft import example_generator

    algo = _algo(name)
    samples = copy.deepcopy(samples)
    if hasattr(algo, "prepare"):  # MDPO: a toy reward on every intermediate answer
        algo.prepare(samples, lambda rs, idx: [sum(t % 2 == 0 for t in r) / max(len(r), 1) for r in rs], 3)
    block = arch.block_size if arch.attention == "block_causal" else 4
    return algo.batch_rows(samples, arch, block, lambda i: example_generator(7, 0, i))


def _sft_rows(mode: str, arch, n: int = 6):
    from megadare.algos.sft import SFTRecipe, example_generator, example_rows
    from megadare.data.sft_data import SFTExample

    g = torch.Generator().manual_seed(3)
    rows = []
    for i in range(n):
        P, L = 2 + i % 3, 6 + i % 4
        prompt = torch.randint(4, 200, (P,), generator=g).tolist()
        response = torch.randint(4, 200, (L,), generator=g).tolist()
        ex = SFTExample(prompt, response, steps=torch.randperm(L, generator=g).tolist())
        rows += example_rows(ex, arch, SFTRecipe(mode, block_size=4), example_generator(5, 0, i))
    return rows


def _dpo_rows(arch, samples):
    from megadare.algos.sft import example_generator

    vrpo = _algo("vrpo")
    return [
        vrpo.pair_row(samples[i], samples[i + 1], arch, example_generator(1, 0, i), example_generator(1, 0, i + 1))
        for i in range(0, len(samples) - 1, 2)
    ]


def _value_rows(arch, samples):
    rows = _rl_rows("tracerl", arch, samples)
    g = torch.Generator().manual_seed(11)
    for r in rows:
        r.extras["v_old"] = torch.randn(len(r), generator=g) * 0.1
        r.extras["ret"] = torch.randn(len(r), generator=g)
    return rows


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """(hf dirs, [(case name, model kind, mask kind, block, micro-batches, spec)]) built once in the parent."""
    from megadare.data.rows import pack_rows
    from megadare.models.family import family_of, read_hf_config

    root = tmp_path_factory.mktemp("hf")
    hf = {
        "block": write_tiny_hf(root, "sdar", seed=1),
        "full": write_tiny_hf(root, "dream", seed=2),
        "moe": write_tiny_hf(root, "sdar_moe", seed=3),
    }
    arch = {k: family_of(read_hf_config(d)).arch(read_hf_config(d)) for k, d in hf.items()}
    block, shift = arch["block"], arch["full"]
    full = dataclasses.replace(shift, logits_shift=0)  # LLaDA-style rows: full attention, no shift
    smp = {"block": _samples(block), "full": _samples(full), "shift": _samples(shift)}
    out = []

    def add(name, model, kind, rows, **spec):
        out.append((name, model, kind, 4, pack_rows(rows, SEQ, 2), spec))

    for mode, a, kind in (
        ("block", block, "block_diffusion"),
        ("trace", block, "block_causal"),
        ("random", full, "bidirectional"),
        ("semi_ar", full, "bidirectional"),
        ("trace", full, "bidirectional"),
        ("random", shift, "bidirectional"),
    ):
        tag = "block" if a is block else "shift" if a is shift else "full"
        add(f"sft {mode} ({tag})", "block" if a is block else "full", kind, _sft_rows(mode, a), sft=True)
    add("sft block LoRA", "block", "block_diffusion", _sft_rows("block", block), sft=True, lora=True)
    for names, tag, a, kind in (
        (RL_BLOCK, "block", block, "block_diffusion"),
        (RL_FULL, "full", full, "bidirectional"),
        (RL_SHIFT, "shift", shift, "bidirectional"),
    ):
        for name in names:
            add(f"rl {name} ({tag})", "block" if a is block else "full", kind, _rl_rows(name, a, smp[tag]), algo=name)
    add("dpo vrpo pairs", "block", "block_diffusion", _dpo_rows(block, smp["block"]), dpo=True)
    add("value model (tracerl)", "block", "block_diffusion", _value_rows(block, smp["block"]), value=True)
    return hf, out


# ----------------------------------------------------------------------------------------------- the worker
def _entropy_bonus(base, coef: float = 0.1):
    def objective(mb, logp):
        loss, report = base(mb, logp)
        return loss - coef * (mb.weight * mb.extras["entropy"]).sum(), report

    return objective


def _build(hf_dir: str, sp: bool, lora: bool, value: bool):
    from megadare.convert.hf_megatron import load_hf_into_model
    from megadare.models.family import family_of, read_hf_config
    from megadare.models.gpt import build_model_chunks, transformer_config
    from megadare.trainer.optim import OptimSettings, build_optimizer, wrap_ddp

    cfg = read_hf_config(hf_dir)
    arch = family_of(cfg).arch(cfg)
    chunks = build_model_chunks(arch, transformer_config(arch, sequence_parallel=sp), attention_backend="sdpa")
    load_hf_into_model(chunks, hf_dir)
    if lora:
        from megadare.models.lora import apply_lora

        apply_lora(chunks, 4, 8.0)
        for c in chunks:  # B starts at zero: move it so the adapters' path matters
            for n, p in c.named_parameters():
                if n.endswith("lora_B"):
                    p.data.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(len(n)))
    if value:
        from megadare.algos.value_model import attach_value_head

        attach_value_head(chunks)
        for c in chunks:
            if c.post_process:  # a zero head would give the backbone no gradient
                c.output_layer.weight.data.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(9))
    model = wrap_ddp(chunks, True)
    # lr ~ 0 and no clipping: the weights stay bitwise the same, the grad buffers keep the step's gradients
    opt, sched = build_optimizer(model, OptimSettings(lr=1e-30, clip_grad=0.0, total_steps=10_000))
    return chunks, model, opt, sched, arch


def _run_case(chunks, model, opt, sched, arch, case, head):
    """(metrics, flat gradients, stored old / ref log-probs) of one case under ``head``."""
    from megatron.core import parallel_state as ps

    from megadare.algos.value_model import ValueObjective, values_of
    from megadare.data.rows import global_denominator, split_for_data_parallel
    from megadare.trainer.policy import Policy
    from megadare.trainer.step import Readout, RowFormat, store_outputs, train_step, weighted_nll

    name, _, kind, block, mbs, spec = case
    for c in chunks:
        c.head_settings = head
    denom = global_denominator(mbs)
    mine = copy.deepcopy(
        split_for_data_parallel(list(mbs), ps.get_data_parallel_world_size(), ps.get_data_parallel_rank())
    )
    vocab, stored, per_position = arch.vocab_size, [], None
    if spec.get("sft"):
        objective, entropy = _entropy_bonus(weighted_nll), True
    elif spec.get("value"):
        objective, entropy, per_position = ValueObjective(0.2), False, values_of
        store_outputs(model, mine, "v_pass", RowFormat(kind, block, vocab), Readout(per_position=values_of))
        stored.append("v_pass")
    else:
        algo = _algo("vrpo" if spec.get("dpo") else spec["algo"])
        on_policy = bool(spec.get("dpo"))
        objective, entropy = algo.objective(on_policy=on_policy), True
        if not on_policy:
            store_outputs(model, mine, "old", RowFormat(kind, block, vocab))
            stored.append("old")
        if algo.needs_ref:
            store_outputs(model, mine, "ref", RowFormat(kind, block, vocab))
            stored.append("ref")
    m = train_step(
        Policy(model, opt, sched),
        mine,
        denom,
        RowFormat(kind, block, vocab),
        objective=objective,
        readout=Readout(per_position=per_position, entropy=entropy),
    )
    grads = torch.cat(
        [b.grad_data.detach().float().clone() for x in model for b in x.buffers + x.expert_parallel_buffers]
    )
    column = lambda mb, k: getattr(mb, k) if k in PASSES else mb.extras.get(k)  # noqa: E731
    logps = [(column(mb, k) * mb.scored).flatten() for k in stored for mb in mine if column(mb, k) is not None]
    return m, grads, torch.cat(logps) if logps else torch.zeros(0)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = float(b.abs().max()) if b.numel() else 0.0
    return float((a - b).abs().max()) / scale if scale > 0 else float((a - b).abs().max()) if a.numel() else 0.0


def _compare(full, scored) -> dict:
    (mf, gf, lf), (ms, gs, ls) = full, scored
    keys = sorted(k for k in mf if k in ("loss", "pg_loss", "value_loss", "entropy", "grad_norm"))
    out = {k: _rel(torch.tensor(ms[k]), torch.tensor(mf[k])) for k in keys}
    out.update(
        grads=_rel(gs, gf),
        logp=_rel(ls, lf),
        grad_norm_value=mf["grad_norm"],
        loss_value=mf.get("loss", mf.get("pg_loss", mf.get("value_loss"))),
    )
    return out


def _worker(rank, world, hf, cases, layouts):
    from megatron.core import parallel_state as ps

    from megadare.models.head import HeadSettings
    from megadare.parallel import Layout, destroy_distributed, init_distributed

    out = {}
    try:
        for lname, layout in layouts.items():
            init_distributed(Layout(**layout))
            built = {}
            for i, case in enumerate(cases):
                t0 = time.time()
                name, model_kind, _, _, _, spec = case
                key = ("moe" if lname == "ep2" else model_kind, spec.get("lora", False), spec.get("value", False))
                if key not in built:
                    built[key] = _build(hf[key[0]], layout.get("sp", False), key[1], key[2])
                chunks, model, opt, sched, arch = built[key]
                full = _run_case(chunks, model, opt, sched, arch, case, HeadSettings("full"))
                scored = _run_case(
                    chunks, model, opt, sched, arch, case, HeadSettings("scored", 64.0 if i % 2 else 4e-4)
                )
                out[(lname, name)] = _compare(full, scored)
                print(lname, name, f"{time.time() - t0:.1f}s", flush=True)
            ps.destroy_model_parallel()
    finally:
        destroy_distributed()
    return out


def test_scored_head_equals_full_logits_in_every_layout(cases):
    from dist import run_distributed

    hf, built = cases
    res = run_distributed(_worker, 2, hf, built, LAYOUTS, timeout_s=900)[0]
    assert len(res) == len(LAYOUTS) * len(built)
    bad = {
        k: v
        for k, v in res.items()
        if max(x for key, x in v.items() if key not in ("grad_norm_value", "loss_value")) >= TOL
    }
    assert not bad, bad
    for (layout, name), v in res.items():  # every case moved something and scored something
        assert v["grad_norm_value"] > 0, (layout, name, v)
    # the value model: TP2+SP and PP2 give the same gradient (ValueHead's SP gather used to sum TP's copies)
    v_tp, v_pp = res[("tp2_sp", "value model (tracerl)")], res[("pp2", "value model (tracerl)")]
    assert abs(v_tp["grad_norm_value"] - v_pp["grad_norm_value"]) < 1e-4 * v_pp["grad_norm_value"]
