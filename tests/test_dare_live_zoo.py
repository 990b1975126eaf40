"""What no transcription in tests/ covered, against DARE's own code run live (``DARE_SRC``, tests/dare_source.py;
skipped without it, saying so): the masked counts of ``_forward_process_bgpo`` / ``_vrpo`` (every k) and ``_espo``
against megadare's ESPO ``stratified_counts`` (every k0) and ``_ebpo`` against megadare's EBPO cells (same
offset); megadare's ESPO antithetic estimate against ``compute_espo_sequence_elbo``; its ESPO / EBPO / VRPO slot
losses against
``compute_policy_loss_espo`` + ``compute_espo_kl``, ``compute_policy_loss_ebpo`` + ``compute_ebpo_kl`` (and
``compute_ebpo_composite_elbo``), ``compute_dpo_loss``; MDPO's ``select_top_k_steps`` and step advantages for
rl.n_samples = 1, 2, 3 (a group of one keeps its scores in DARE: megadare gave 0 until this comparison found it,
as it found EBPO's levels permuted over the cells);
d-TreeRPO's tree values and local advantages (``compute_dtreerpo_rewards_and_segments``, with ``DataProto`` and
``compute_reward`` stood in: they need ray); JustGRPO's module-level actor helpers (views and per-position PPO,
run as written by ``dare_functions``); the mask distributions of ``_forward_process_d1`` / ``_coupled_grpo``.
Each comparison prints its max |difference| (``pytest -s``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megadare.algos import REGISTRY
from megadare.algos.base import RLSample, Slots
from megadare.algos.d_treerpo import local_advantages
from megadare.algos.espo import stratified_counts
from megadare.algos.mdpo import top_steps

import test_algos_dare_formulas as formulas
from algo_toy import one_thread  # noqa: F401  (autouse fixture)
from algo_toy import MASK, Toy, sample, toy_archs
from dare_source import dare_functions, dare_module, report
from dare_source import dllm, global_rng_restored, mdpo_algos  # noqa: F401  (fixtures)


# ================================================================== what no transcription covered
@pytest.fixture
def forced_randint(monkeypatch):
    """``torch.randint`` returning ``value[0]`` (shaped as asked): the draw of k / k0 set by the test."""
    value = [0]

    def fixed(*args, **kwargs):
        size = kwargs.get("size", args[-1] if args and isinstance(args[-1], tuple) else ())
        return torch.full(size, value[0], dtype=torch.long)

    monkeypatch.setattr(torch, "randint", fixed)
    return value


def test_bgpo_vrpo_counts_are_dares_live_forward_process(dllm, forced_randint):
    """The masked counts and p_mask of DARE's ``_forward_process_bgpo`` / ``_forward_process_vrpo``, for every k,
    equal the ``round(linspace)`` lines ``formulas.dare_count_distribution`` enumerates (which pin megadare's
    deviation: uniform counts)."""
    for fn in (dllm._forward_process_bgpo, dllm._forward_process_vrpo):
        for n in (1, 2, 3, 4, 8):
            for L in range(1, 25):
                P = 2
                batch, attention = torch.zeros(n, P + L, dtype=torch.long), torch.ones(P + L, dtype=torch.long)
                for k in range(1, L + 1):
                    forced_randint[0] = k
                    _, mask, p_mask = fn(batch, attention, P, MASK_TOKEN_ID=7)
                    x = torch.round(torch.linspace(float(k), k + (n - 1) * (L / n), steps=n)).long()
                    x = ((x - 1) % L) + 1
                    assert torch.equal(mask.sum(1), x) and not mask[:, :P].any(), (fn.__name__, n, L, k)
                    assert torch.equal(p_mask[:, 0], x / L)
    report("_forward_process_bgpo / _forward_process_vrpo counts vs the enumerated transcription")


def test_espo_counts_are_dares_live_forward_process(dllm, forced_randint):
    """megadare's ESPO ``stratified_counts`` (k_i = round(k0 + i (L+1) / B) mod (L+1)) == the masked counts of
    DARE's ``_forward_process_espo`` (float32 ``linspace``, half to even) for every k0, B <= 16, L <= 40, and
    DARE's p_mask is k / (L + 1)."""
    mismatches = []
    for B in (1, 2, 3, 4, 5, 6, 8, 16):
        for L in range(1, 41):
            P = 1
            batch, attention = torch.zeros(B, P + L, dtype=torch.long), torch.ones(P + L, dtype=torch.long)
            for k0 in range(L + 1):
                forced_randint[0] = k0
                _, mask, p_mask = dllm._forward_process_espo(batch, attention, P, MASK_TOKEN_ID=7)
                want = mask.sum(1).tolist()
                got = [c[0] for c in stratified_counts([L] * B, 1, torch.Generator())]
                if got != want:
                    mismatches.append((B, L, k0, got, want))
                assert torch.allclose(p_mask[:, P], torch.tensor(want, dtype=torch.float32) / (L + 1))
    assert not mismatches, f"{len(mismatches)} (B, L, k0) differ, e.g. {mismatches[:3]}"
    report("ESPO stratified_counts vs DARE live _forward_process_espo counts (all k0, B<=16, L<=40)")


def test_mdpo_batch_top_k_is_dares_select_top_k_steps(mdpo_algos):
    """megadare's ``top_steps(scope=batch)`` keeps the steps DARE's ``select_top_k_steps`` keeps (continuous
    advantages: no ties)."""
    g = torch.Generator().manual_seed(3)
    for _ in range(50):
        adv = torch.randn(6, 9, generator=g, dtype=torch.float64)
        for K in (1, 3, 9, 12):
            samples = [RLSample([1], [0], 0.0, 0.0, extra={"step_adv": dict(enumerate(row))}) for row in adv.tolist()]
            top_steps(samples, K, "batch")
            want = mdpo_algos.select_top_k_steps(adv, K).tolist()
            assert all(s.extra["steps"] == want for s in samples), (K, want, samples[0].extra["steps"])
    report("mdpo top_steps(batch) vs DARE live select_top_k_steps")


def _slots(logp, old, adv, ref=None, **extra) -> Slots:
    return Slots(logp=logp, old=old, ref=ref, adv=adv, weight=torch.ones(len(logp), dtype=torch.float64), extra=extra)


def _random_sequences(g, B):
    """Sequence values l, l_old, l_ref (log-ratios up to +-1.5: both clip sides), advantages of both signs."""
    old = -3 * torch.rand(B, generator=g, dtype=torch.float64)
    new = (old + 1.5 * (2 * torch.rand(B, generator=g, dtype=torch.float64) - 1)).requires_grad_(True)
    ref = old + 0.8 * torch.randn(B, generator=g, dtype=torch.float64)
    return new, old, ref, torch.randn(B, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("eps", [0.2, 0.0])
def test_espo_slot_loss_is_dares_live_espo_loss_and_kl(dllm, eps):
    """megadare's ESPO slot loss (mean over the sequences) == ``compute_policy_loss_espo`` on the per-token ELBO
    l expanded over the canvas R + beta ``compute_espo_kl`` (k2 of R l vs R l_ref, / R), value and gradient in l."""
    g = torch.Generator().manual_seed(4)
    beta, worst = 1e-2, 0.0
    algo = REGISTRY["espo"]({"eps_low": eps, "kl_coef": beta})
    for _ in range(40):
        B, R = 6, 5
        new, old, ref, adv = _random_sequences(g, B)
        canvas = torch.full((B,), float(R), dtype=torch.float64)
        got = algo.slot_loss(_slots(new, old, adv, ref, canvas=canvas))[0].mean()
        expand = lambda v: v.unsqueeze(-1).expand(B, R)  # noqa: E731
        pg = dllm.compute_policy_loss_espo(expand(old), expand(new), expand(adv), torch.ones(B, R), cliprange=eps)[0]
        want = pg + beta * dllm.compute_espo_kl(new * R, ref * R, R, kl_estimator="k2").mean()
        worst = max(worst, abs(float(got - want)))
        (gg,), (gw,) = torch.autograd.grad(got, new), torch.autograd.grad(want, new)
        assert torch.allclose(gg, gw, rtol=1e-10, atol=1e-12)
    assert worst < 1e-12
    report(f"espo slot_loss vs DARE live compute_policy_loss_espo + compute_espo_kl (eps {eps})", worst)


def test_ebpo_slot_loss_is_dares_live_ebpo_loss_and_kl(dllm):
    """megadare's EBPO slot loss == ``compute_policy_loss_ebpo`` (log-domain clip, no dual clip, mean over the
    samples) + beta ``compute_ebpo_kl`` (k2 of the composite ELBOs) on the composite ELBOs, value and gradient."""
    g = torch.Generator().manual_seed(5)
    beta, worst = 0.05, 0.0
    algo = REGISTRY["ebpo"]({"kl_coef": beta})
    for _ in range(40):
        B = 6
        new, old, ref, adv = _random_sequences(g, B)
        got = algo.slot_loss(_slots(new, old, adv, ref))[0].mean()
        pg = dllm.compute_policy_loss_ebpo(old, new, adv, torch.ones(B, dtype=torch.bool), cliprange=0.2)[0]
        want = pg + beta * dllm.compute_ebpo_kl(new, ref, kl_estimator="k2").mean()
        worst = max(worst, abs(float(got - want)))
        (gg,), (gw,) = torch.autograd.grad(got, new), torch.autograd.grad(want, new)
        assert torch.allclose(gg, gw, rtol=1e-10, atol=1e-12)
    assert worst < 1e-12
    report("ebpo slot_loss vs DARE live compute_policy_loss_ebpo + compute_ebpo_kl", worst)


def test_ebpo_composite_elbo_is_dares_live(dllm):
    """DARE's ``compute_ebpo_composite_elbo`` (mean over the N rows of the sum over the blocks' token terms) is
    the l of megadare's EBPO docstring: (1/N) sum_n sum_b (|b| / count) sum_{masked} log p, on random terms."""
    g = torch.Generator().manual_seed(6)
    B, N, R = 3, 4, 8
    token_elbo = torch.randn(B, N, R, generator=g, dtype=torch.float64)
    mask = (torch.arange(R) < torch.tensor([[8], [5], [1]])).double()
    want = dllm.compute_ebpo_composite_elbo(token_elbo, contribution_mask=mask[:, None, :])
    got = (token_elbo * mask[:, None, :]).sum(-1).mean(-1)
    worst = float((got - want).abs().max())
    assert worst < 1e-12
    report("compute_ebpo_composite_elbo vs (1/N) sum_n sum_tokens", worst)


def test_vrpo_slot_loss_is_dares_live_dpo_loss(dllm):
    """megadare's VRPO slot loss with ``margin_norm=canvas`` == ``compute_dpo_loss`` on the ELBOs B / R expanded
    over the canvas (DARE's actor), per pair, value and gradient."""
    g = torch.Generator().manual_seed(7)
    R, worst = 6, 0.0
    algo = REGISTRY["vrpo"]({"margin_norm": "canvas", "canvas_length": R})
    for _ in range(40):
        P = 4
        B = (-8 * torch.rand(P, 2, generator=g, dtype=torch.float64)).requires_grad_(True)
        B_ref = B.detach() + torch.randn(P, 2, generator=g, dtype=torch.float64)
        sign = torch.tensor([1.0, -1.0], dtype=torch.float64).repeat(P)
        loss = algo.slot_loss(_slots(B.view(-1), B_ref.view(-1), sign, B_ref.view(-1)))[0]
        got = loss.sum() / P
        per_token = lambda v: (v / R).unsqueeze(-1).expand(P, R)  # noqa: E731
        want = dllm.compute_dpo_loss(
            per_token(B[:, 0]), per_token(B[:, 1]), per_token(B_ref[:, 0]), per_token(B_ref[:, 1]), beta=0.2
        )
        worst = max(worst, abs(float(got - want)))
        (gg,), (gw,) = torch.autograd.grad(got, B), torch.autograd.grad(want, B)
        assert torch.allclose(gg, gw, rtol=1e-10, atol=1e-12)
    assert worst < 1e-12
    report("vrpo slot_loss (margin_norm=canvas) vs DARE live compute_dpo_loss", worst)


@pytest.mark.parametrize("G", [1, 2, 3])
def test_mdpo_step_advantages_are_dares_live_for_any_group_size(mdpo_algos, G):
    """megadare's MDPO step advantages == DARE's ``compute_step_wise_advantage`` on the same step rewards, with
    rl.n_samples = G (DARE's uid grouping: a group of one keeps its score, / (1 + 1e-6))."""
    g = torch.Generator().manual_seed(8)
    algo, worst = REGISTRY["mdpo"]({"top_k_steps": 2}), 0.0
    for _ in range(20):
        groups = [i // G for i in range(3 * G)]
        rewards = torch.randint(0, 3, (len(groups), 4), generator=g).double() / 2
        samples = [formulas.mdpo_trace_sample(i, [1], [0, 2, 1, 1], i) for i in range(len(groups))]
        for s, u in zip(samples, groups):
            s.group = u
        table = iter(rewards.tolist())
        algo.prepare(samples, lambda answers, idx: next(table), group_size=G)
        got = torch.tensor([[s.extra["step_adv"][t] for t in range(4)] for s in samples], dtype=torch.float64)
        want = mdpo_algos.compute_step_wise_advantage(rewards.clone(), np.array(groups))
        worst = max(worst, float((got - want).abs().max()))
    assert worst < (1e-6 if G == 1 else 1e-12), worst  # DARE's std of a uid of one is fp32 ones: 1 + 1e-6 in fp32
    report(f"mdpo step advantages vs DARE live compute_step_wise_advantage (n_samples={G})", worst)


class DataProtoStandIn:
    """Stand-in for ``verl.DataProto`` (ray / tensordict): ``from_dict`` keeps the tensors, as ``.batch``."""

    def __init__(self, tensors, non_tensors=None, meta_info=None):
        self.batch, self.non_tensor_batch, self.meta_info = tensors, non_tensors or {}, meta_info or {}

    @classmethod
    def from_dict(cls, tensors, non_tensors=None, meta_info=None):
        return cls(tensors, non_tensors, meta_info)


def compute_reward_stand_in(data, reward_fn):
    """Stand-in for ``verl.trainer.ppo.ray_trainer.compute_reward``: (token rewards, extra infos)."""
    return reward_fn(data), {}


def dare_tree_output(leaf_rewards: torch.Tensor, fanout: int, branch: int, depth: int, P: int = 2, R: int = 4):
    """A tree as ``dtreerpo_llada_rollout.py:85-215`` serialises it (nodes breadth-first, root first, branch points
    [T, T - T/d, ..., 0] with T = d), each leaf's reward written into its response's first token."""
    B = leaf_rewards.shape[0]
    nodes = [{"parent": -1, "step": depth, "children": []}]
    level = [0]
    for k in range(1, depth + 1):
        nxt = []
        for parent in level:
            for _ in range(fanout if parent == 0 else branch):
                nodes[parent]["children"].append(len(nodes))
                nxt.append(len(nodes))
                nodes.append({"parent": parent, "step": depth - k, "children": []})
        level = nxt
    leaves = [i for i, n in enumerate(nodes) if n["step"] == 0]
    gen = torch.zeros(B, len(nodes), P + R, dtype=torch.long)
    for j, leaf in enumerate(leaves):
        gen[:, leaf, P] = leaf_rewards[:, j]
    children = torch.full((len(nodes), max(fanout, branch)), -1, dtype=torch.long)
    for i, n in enumerate(nodes):
        children[i, : len(n["children"])] = torch.tensor(n["children"], dtype=torch.long)
    every = lambda t: t.unsqueeze(0).expand(B, *t.shape)  # noqa: E731
    tensors = {
        "node_generations": gen,
        "node_steps": every(torch.tensor([n["step"] for n in nodes])),
        "node_is_leaf": every(torch.tensor([n["step"] == 0 for n in nodes])),
        "node_parent_idx": every(torch.tensor([n["parent"] for n in nodes])),
        "node_children_idx": every(children),
        "leaf_input_ids": gen[:, leaves],
        "leaf_responses": gen[:, leaves, P:],
        "leaf_attn": torch.ones(B, len(leaves), P + R, dtype=torch.long),
    }
    meta = {"prompt_length": P, "num_leaves": len(leaves), "num_nodes": len(nodes)}
    meta["branch_points"] = list(range(depth, -1, -1))
    return DataProtoStandIn(tensors, meta_info=meta)


def test_d_treerpo_local_advantages_are_dares_live(monkeypatch):
    """megadare's ``local_advantages`` (node value = mean of its children's, minus the mean of its other siblings)
    == DARE's ``compute_dtreerpo_rewards_and_segments`` on the same trees and leaf rewards, every node, with
    ``DataProto`` and ``compute_reward`` stood in (they need ray); fan-outs and depths of DARE's recipe and more."""
    module = dare_module(
        "verl.trainer.ppo.dtreerpo_algos",
        {
            "verl": {"DataProto": DataProtoStandIn},
            "verl.trainer.ppo.ray_trainer": {"compute_reward": compute_reward_stand_in},
        },
    )

    def reward_fn(data):
        rewards = torch.zeros(data.batch["responses"].shape, dtype=torch.float32)
        rewards[:, -1] = data.batch["responses"][:, 0].float() / 2
        return rewards

    g, worst = torch.Generator().manual_seed(9), 0.0
    for fanout, branch, depth in [(4, 4, 2), (2, 3, 2), (3, 2, 3), (1, 2, 2), (2, 1, 2)]:
        B = 3
        leaf_rewards = torch.randint(0, 3, (B, fanout * branch ** (depth - 1)), generator=g)
        segments, _ = module.compute_dtreerpo_rewards_and_segments(
            dare_tree_output(leaf_rewards, fanout, branch, depth), DataProtoStandIn({}), reward_fn, 4, 1, 1.0
        )
        want = segments.batch["local_advantages"].view(-1, B).T.double()
        for b in range(B):
            got = sum(local_advantages((leaf_rewards[b] / 2).tolist(), branch, depth, fanout), [])
            worst = max(worst, float((torch.tensor(got, dtype=torch.float64) - want[b]).abs().max()))
    assert worst < 1e-6, worst
    report("d_treerpo local_advantages vs DARE live compute_dtreerpo_rewards_and_segments", worst)


JUSTGRPO = "verl/workers/actor/llada_dp_actor_justgrpo.py"


def test_justgrpo_views_and_loss_are_dares_live():
    """DARE's JustGRPO actor helpers (module-level in ``llada_dp_actor_justgrpo.py``, run as written):
    ``build_justgrpo_ar_position_pack`` (left-padded prompts, right-padded responses) packs, for every valid
    response position t, exactly megadare's view t (c ++ y_<t ++ M..M, padding removed) with its target at P + t;
    ``_compute_ppo_token_terms`` + ``_aggregate_position_chunk`` (token-mean), summed over position chunks, equal
    megadare's JustGRPO slot loss (eps 0.2, dual clip 3) averaged over the response tokens."""
    dare = dare_functions(
        JUSTGRPO, ("build_justgrpo_ar_position_pack", "_aggregate_position_chunk", "_compute_ppo_token_terms")
    )
    full, _ = toy_archs()
    algo = REGISTRY["justgrpo"]()
    prompts, responses = [[1, 2, 0], [2], [0, 1]], [[0, 2, 1, 1], [2, 1], [1, 1, 0]]
    Pm, R = 3, 4
    ids = torch.full((3, Pm + R), 7)
    attention = torch.zeros(3, Pm + R, dtype=torch.long)
    for b, (c, y) in enumerate(zip(prompts, responses)):
        ids[b, Pm - len(c) : Pm], ids[b, Pm : Pm + len(y)] = torch.tensor(c), torch.tensor(y)
        attention[b, Pm - len(c) : Pm + len(y)] = 1
    pack = dare.build_justgrpo_ar_position_pack(ids, attention, R, 0, R, MASK)
    bounds, n = pack["cu_seqlens"].tolist(), 0
    for t in range(R):
        for b, (c, y) in enumerate(zip(prompts, responses)):
            if t >= len(y):
                continue
            view = algo.views(sample(c, y), full, 0, torch.Generator())[t]
            assert torch.equal(pack["packed_input"][0, bounds[n] : bounds[n + 1]], view.tokens), (t, b)
            assert int(pack["target_offsets"][n]) - bounds[n] == len(c) + t and int(pack["batch_indices"][n]) == b
            n += 1
    assert n == len(bounds) - 1 == sum(map(len, responses))
    g, worst = torch.Generator().manual_seed(10), 0.0
    for _ in range(30):
        old = -3 * torch.rand(3, R, generator=g, dtype=torch.float64)
        new = old + 0.9 * (2 * torch.rand(3, R, generator=g, dtype=torch.float64) - 1)
        adv = torch.randn(3, 1, generator=g, dtype=torch.float64).expand(3, R)
        mask = attention[:, Pm:].double()
        want = sum(
            dare._aggregate_position_chunk(
                dare._compute_ppo_token_terms(old[:, [t]], new[:, [t]], adv[:, [t]], 0.2, 0.2, 3.0)[0],
                mask[:, [t]],
                mask,
                "token-mean",
            )
            for t in range(R)
        )
        keep = mask.bool()
        got = algo.slot_loss(_slots(new[keep], old[keep], adv[keep]))[0].sum() / keep.sum()
        worst = max(worst, abs(float(got - want)))
    assert worst < 1e-8  # DARE's token-mean divides by (count + 1e-8)
    report("justgrpo views (pack) exact; slot loss vs DARE live _compute_ppo_token_terms + token-mean", worst)


def test_d1_and_coupled_masks_are_distributed_as_dares_live(dllm):
    """d1: DARE's ``_forward_process_d1`` and megadare's views mask every response token and each prompt token with
    probability p = 0.15 (per-position frequencies over 3000 draws each agree within 0.03); Coupled-GRPO: DARE's
    ``_forward_process_coupled_grpo`` and megadare's three views have the same structure (all of the response;
    a subset; exactly its complement in the response; the prompt clean) and masked fractions of the second view
    spread alike over [0.2, 0.8] (mean and quartiles within 0.03)."""
    full, _ = toy_archs()
    c, y = [1, 2, 0, 1], [0, 2, 1, 1, 2, 0]
    P, L, n = len(c), len(y), 3000
    x0, attention = torch.tensor([c + y]), torch.ones(P + L, dtype=torch.long)
    d1 = REGISTRY["d1"]()
    torch.manual_seed(0)
    dare = torch.stack([dllm._forward_process_d1(x0, attention, P, p=0.15, MASK_TOKEN_ID=MASK)[1][0] for _ in range(n)])
    ours = torch.stack(
        [d1.views(sample(c, y), full, 0, torch.Generator().manual_seed(i))[0].tokens == MASK for i in range(n)]
    )
    assert dare[:, P:].all() and ours[:, P:].all()
    worst = float((dare.double().mean(0) - ours.double().mean(0)).abs().max())
    assert worst < 0.03, worst
    coupled, fractions = REGISTRY["coupled_grpo"](), {"dare": [], "ours": []}
    for i in range(n // 3):
        _, m, _ = dllm._forward_process_coupled_grpo(x0, attention, P, seed=i, MASK_TOKEN_ID=MASK)
        ours_m = torch.stack(
            [v.tokens == MASK for v in coupled.views(sample(c, y), full, 0, torch.Generator().manual_seed(i))]
        )
        for who, masks in (("dare", m), ("ours", ours_m)):
            assert not masks[:, :P].any() and masks[0, P:].all(), who
            assert torch.equal(masks[1, P:] ^ masks[2, P:], torch.ones(L, dtype=torch.bool)), who
            fractions[who].append(float(masks[1, P:].double().mean()))
    q = torch.tensor([0.25, 0.5, 0.75], dtype=torch.float64)
    stats = {
        w: torch.cat(
            [torch.tensor(f, dtype=torch.float64).mean().view(1), torch.tensor(f, dtype=torch.float64).quantile(q)]
        )
        for w, f in fractions.items()
    }
    spread = float((stats["dare"] - stats["ours"]).abs().max())
    assert spread < 0.03, stats
    report("d1 per-position mask frequencies (3000 draws each)", worst)
    report("coupled_grpo view-2 masked fraction: mean and quartiles (1000 draws each)", spread)


def test_ebpo_cell_counts_are_dares_live_forward_process(dllm, monkeypatch):
    """megadare's EBPO ``block_elbo_views`` masks, in row n and block b, the count DARE's ``_forward_process_ebpo``
    masks there (n_l = mc_num rows in one call, its recipes' setting; ``block_origin='global'``) for the same
    cyclic offset: prompts on and off the block grid, blocks of 4 and 2, 1 to 16 rows."""
    from megadare.algos.ebpo import block_elbo_views

    rand, cells = torch.rand, 0
    for c, y, block, n_mc in [
        ([1, 2, 0], [0, 2, 1, 1, 2, 0, 1], 4, 16),
        ([1], [2, 2, 0, 1, 1], 2, 3),
        ([0, 1], [1] * 9, 4, 1),
    ]:
        for seed in range(20):
            g = torch.Generator().manual_seed(seed)
            offset = float(rand((), generator=torch.Generator().manual_seed(seed), dtype=torch.float64))
            ours = torch.stack([v.tokens == MASK for v in block_elbo_views(c, y, MASK, g, block, n_mc)])
            monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.tensor(offset, dtype=torch.float32))
            batch = torch.tensor([c + y]).repeat(n_mc, 1)
            _, dare, _ = dllm._forward_process_ebpo(
                batch, torch.ones(len(c + y)), len(c), block_length=block, MASK_TOKEN_ID=MASK
            )
            monkeypatch.setattr(torch, "rand", rand)
            grid = torch.arange(len(c + y)) // block
            for b in grid[len(c) :].unique():
                in_block = grid == b
                assert torch.equal(ours[:, in_block].sum(1), dare[:, in_block].sum(1)), (c, y, seed, int(b))
                cells += n_mc
    report(f"ebpo (row, block) mask counts vs DARE live _forward_process_ebpo, {cells} cells")


def test_espo_antithetic_estimate_is_dares_live_sequence_elbo(dllm):
    """megadare's ESPO slot estimate (antithetic views: (L+1)/k on the k masked, (L+1)/(L-k) on the complement,
    / (2 n_mc R)) == the mean over the draws of DARE's ``compute_espo_sequence_elbo`` (variance-reduced, the
    complement scored by ``coupled_logits``, p_mask = k / (L+1)) / R, on a toy model's logits, same masks."""
    from megadare.diffusion.corruption import CleanSequence, antithetic_views

    toy, worst = Toy(0), 0.0
    for c, y, counts in [
        ([1, 2], [0, 2, 1, 1], [1, 3]),
        ([0], [2, 2, 0, 1, 1], [3, 2, 4]),
        ([2, 1, 0], [1, 0], [1]),
    ]:
        P, L = len(c), len(y)
        x0 = torch.tensor(c + y)
        views = antithetic_views(CleanSequence.of(c, y, MASK), counts, torch.Generator().manual_seed(P + L), L)
        assert len(views) == 2 * len(counts)
        with torch.no_grad():
            logits = [toy(v.tokens.unsqueeze(0))[0, : P + L] for v in views]
            lp = [torch.log_softmax(z, -1).gather(-1, x0.unsqueeze(-1)).squeeze(-1) for z in logits]
        ours = sum(float((v.coef * lp_v)[v.tokens == MASK].sum()) for v, lp_v in zip(views, lp))
        want = 0.0
        for d, k in enumerate(counts):
            masked = views[2 * d].tokens == MASK
            elbo = dllm.compute_espo_sequence_elbo(
                logits[2 * d],
                x0,
                masked,
                torch.full((P + L,), k / (L + 1), dtype=torch.float64),
                torch.arange(P + L) >= P,
                coupled_logits=logits[2 * d + 1],
            )
            want += float(elbo) / len(counts) / L
        worst = max(worst, abs(ours - want))
    assert worst < 1e-6, worst  # megadare's view coefficients are fp32
    report("espo antithetic slot estimate vs DARE live compute_espo_sequence_elbo", worst)
