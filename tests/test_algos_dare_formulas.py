"""megadare's zoo against DARE's and verl's own formulas, transcribed here from their code (yjyddq/DARE @83ae8a3,
volcengine/verl), on identical random draws or on cases enumerated exactly:

* SPG ``estimator=dare``: DARE's ``_forward_process_spg`` (``verl/trainer/ppo/dllm_core_algos.py``) and the
  per-sequence value of ``llada_dp_actor_spg.py::_forward_micro_batch`` with ``compute_policy_loss_spg``, fed the
  same seed as megadare's corruption generator: the masks are identical and the loss agrees to fp32 rounding.
* d1 / Coupled-GRPO / BGPO with the DARE presets' params: the loss of DARE's LLaDA actors
  (``llada_dp_actor_{d1,coupled_grpo,bgpo}.py`` with ``compute_policy_loss`` / ``compute_policy_loss_bgpo``)
  computed on megadare's masks, off-policy with dual clip: loss and gradient agree.
* CJ-GRPO / MDPO / d-TreeRPO with the DARE presets' params: the loss of ``llada_dp_actor_cj_grpo.py``
  (per-step ``compute_policy_loss``, / steps), ``mdpo_algos.py::compute_mdpo_policy_loss`` on DARE's packed
  (sample, step) rows (and ``compute_step_wise_advantage``), ``llada_dp_actor_dtreerpo.py::update_policy``
  (local-transition PPO + its inline k3 KL) on the same traces, proposals and parent states.
* REINFORCE++-baseline: verl's ``compute_reinforce_plus_plus_baseline_outcome_advantage`` with
  ``masked_whiten`` / ``masked_var`` / ``masked_mean`` (``verl/utils/torch_functional.py``).
* GRPO / RLOO with one response per prompt: refused by the config check.
* BGPO / VRPO count stratification: the exact distribution of the masked counts of megadare's sampler (uniform)
  and of DARE's ``_forward_process_bgpo`` / ``_forward_process_vrpo`` (``round(linspace)``, half to even).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from fractions import Fraction

import pytest
import torch

from megadare.algos import REGISTRY
from megadare.algos.advantages import group_advantages
from megadare.algos.base import RLSample
from megadare.algos.policy_loss import kl_penalty

from algo_toy import one_thread  # noqa: F401  (autouse fixture)
from algo_toy import MASK, Toy, sample, synthetic_trace, toy_archs, view_logps
from test_algos_objectives import _trainer_loss


# ================================================================== DARE's SPG, transcribed
def dare_forward_process_spg(
    batch,
    attention_mask,
    prompt_len,
    seed=None,
    block_length=32,
    num_t=1,
    min_t=0,
    max_t=1,
    use_mask_prompt=True,
    p_mask_prompt=0.15,
    MASK_TOKEN_ID=126336,
):
    """``verl/trainer/ppo/dllm_core_algos.py::_forward_process_spg`` (DARE @83ae8a3, lines 962-1036), verbatim
    but for the unused ``block_mask`` and the debug comments."""
    generator = None
    if seed is not None:
        generator = torch.Generator(device=batch.device)
        generator.manual_seed(seed)
    b, l = batch.shape
    gen_length = l - prompt_len
    assert gen_length % block_length == 0
    num_blocks = gen_length // block_length
    completion_mask = attention_mask[prompt_len:].unsqueeze(0)
    p_mask = torch.zeros((b, num_t, l), device=batch.device)
    completion_num_blocks = (completion_mask.sum(-1) - 1) // block_length + 1
    assert num_t <= num_blocks
    indices = torch.arange(num_blocks, device=batch.device).repeat(b, 1)
    for i in range(b):
        indices[i] = (
            indices[i][torch.randperm(num_blocks, device=batch.device, generator=generator)] % completion_num_blocks[i]
        )
    mask_block_idx = indices[:, :num_t]
    is_mask = torch.zeros((b, num_t, l), dtype=torch.bool, device=batch.device)
    for i in range(b):
        for j in range(num_t):
            is_mask[i, j, -(num_blocks - mask_block_idx[i, j]) * block_length :] = True
    completion_length = completion_mask.sum(-1)
    is_mask_following = torch.ones((b, num_t, l), dtype=torch.bool, device=batch.device)
    for i in range(b):
        for j in range(num_t):
            block_idx = int(mask_block_idx[i, j].item())
            mask_length = min(block_length, int(completion_length[i].item()) - block_length * block_idx)
            assert mask_length > 0
            start_mask_num = max(int(mask_length * min_t), 1)
            end_mask_num = min(int(mask_length * max_t), mask_length)
            assert start_mask_num <= end_mask_num
            mask_num = torch.randint(start_mask_num, end_mask_num + 1, (1, 1), device=batch.device, generator=generator)
            mask_probability = mask_num.item() / mask_length
            indices = torch.arange(block_length, device=batch.device).repeat(1, 1, 1)
            is_mask_next = indices < mask_num.unsqueeze(2)
            if block_idx == num_blocks - 1 and mask_length == block_length:
                is_mask_following[i, j, -block_length:] = is_mask_next[0, 0][
                    torch.randperm(block_length, device=batch.device, generator=generator)
                ]
                p_mask[i, j, -block_length:] = mask_probability
            else:
                block_start = -(num_blocks - block_idx) * block_length
                block_end = block_start + mask_length
                is_mask_following[i, j, block_start:block_end] = is_mask_next[0, 0, :mask_length][
                    torch.randperm(mask_length, device=batch.device, generator=generator)
                ]
                p_mask[i, j, block_start:block_end] = mask_probability
                p_mask[i, j, block_end:] = 1
    completion_mask_append = torch.cat(
        (
            torch.ones(b, num_t, prompt_len, dtype=torch.bool, device=batch.device),
            completion_mask.unsqueeze(1).repeat(1, num_t, 1),
        ),
        dim=2,
    ).to(torch.bool)
    if use_mask_prompt:
        p_mask = torch.where(~is_mask, p_mask_prompt, p_mask)
        t_p = torch.ones(b, num_t, device=batch.device) * p_mask_prompt
        random_matrix = torch.rand((b, num_t, l), device=batch.device, generator=generator)
        is_mask_prompt = ~is_mask & (random_matrix < t_p.unsqueeze(2))
        is_mask = is_mask_prompt | (is_mask & is_mask_following) | ~completion_mask_append
    else:
        is_mask = (is_mask & is_mask_following) | ~completion_mask_append
    noisy_batch = torch.where(is_mask, MASK_TOKEN_ID, batch.unsqueeze(1).repeat(1, num_t, 1))
    return noisy_batch.view(-1, l), is_mask.view(-1, l), p_mask.view(-1, l)


def dare_spg_per_seq_logps(
    per_token_logps,
    per_token_probs,
    mask_indices,
    attention_mask,
    advantages,
    response_length,
    eubo_beta=1.5,
    mix_weight=0.5,
    logp_estimation="mix",
):
    """The per-sequence value of ``llada_dp_actor_spg.py::_forward_micro_batch`` (lines 162-220; one iteration),
    from the per-token log-probs / probs [1, B, mc, R] the actor computes on each perturbed sequence."""
    num_iterations, batch_size, mc_num, _ = per_token_logps.shape
    response_mask = attention_mask[:, -response_length:].to(advantages.dtype)
    reward_mask = (advantages[:, -response_length:] * response_mask).sum(dim=-1) > 0
    completion_mask_expanded = (
        attention_mask[:, -response_length:].unsqueeze(0).unsqueeze(2).expand(num_iterations, -1, mc_num, -1)
    )
    perturb_mask_expanded = (
        mask_indices[:, :, -response_length:].view(batch_size, num_iterations, mc_num, response_length).transpose(0, 1)
    )
    denominator = (completion_mask_expanded * perturb_mask_expanded).sum(dim=3)
    per_seq_logps = (per_token_logps * completion_mask_expanded * perturb_mask_expanded).sum(dim=3) / denominator
    empirical_t = (completion_mask_expanded * perturb_mask_expanded).sum(dim=3) / completion_mask_expanded.sum(dim=3)
    empirical_t_expanded = empirical_t.unsqueeze(3).expand(-1, -1, -1, completion_mask_expanded.size(-1))
    per_token_avg_ps = (
        per_token_probs.pow(eubo_beta)
        * perturb_mask_expanded
        * completion_mask_expanded
        / empirical_t_expanded.clamp(min=1e-8)
    ).mean(dim=2)
    per_token_avg_ps_dezero = per_token_avg_ps.clone()
    per_token_avg_ps_dezero[per_token_avg_ps_dezero == 0] = 1
    loss_mask = (per_token_avg_ps > 0).bool()
    per_seq_logps_positive = per_seq_logps.mean(dim=2)
    assert logp_estimation == "mix"
    per_seq_logps_negative = mix_weight * (per_token_avg_ps_dezero.log() * loss_mask).sum(dim=2) / loss_mask.sum(
        dim=2
    ).clamp(min=1e-8) / eubo_beta + (1 - mix_weight) * per_seq_logps.mean(dim=2)
    reward_mask_expanded = reward_mask.unsqueeze(0).expand(num_iterations, -1)
    return (
        reward_mask_expanded.float() * per_seq_logps_positive + (~reward_mask_expanded).float() * per_seq_logps_negative
    )


def dare_compute_policy_loss_spg(log_prob, advantages, response_mask):
    """``dllm_core_algos.py::compute_policy_loss_spg`` (lines 456-486)."""
    completion_length = response_mask.sum(dim=1)
    sequence_advantages = (advantages * response_mask).sum(dim=1) / completion_length.clamp_min(1)
    per_seq_loss = -sequence_advantages.unsqueeze(0) * log_prob
    return (per_seq_loss * completion_length.unsqueeze(0)).sum() / completion_length.sum().clamp_min(1)


def dare_spg_loss(toy, samples, seed_of, block, n_mc, beta, mix):
    """DARE's SPG loss over a batch of equally long responses (the full LLaDA canvas: attention mask all ones;
    the actor reads only the response columns, so prompts may differ in length), each corrupted by DARE's
    forward process seeded by ``seed_of(index)``; and the noisy sequences."""
    lps, ps, masks, noisy_all = [], [], [], []
    for s in samples:
        x0 = torch.tensor(s.prompt_ids + s.response_ids)
        P, L = len(s.prompt_ids), len(s.response_ids)
        noisy, is_mask, _ = dare_forward_process_spg(
            x0.unsqueeze(0),
            torch.ones(P + L, dtype=torch.long),
            P,
            seed=seed_of(s.index),
            block_length=block,
            num_t=n_mc,
            MASK_TOKEN_ID=MASK,
        )
        lp = view_logps(toy, x0, list(noisy))[:, P:]  # [mc, R]
        lps.append(lp)
        ps.append(lp.exp())
        masks.append(is_mask[:, P:])
        noisy_all.append(noisy)
    R = len(samples[0].response_ids)
    adv = torch.tensor([[s.advantage] * R for s in samples], dtype=torch.float64)
    attention = torch.ones(len(samples), R, dtype=torch.long)  # (the actor reads its last R columns)
    value = dare_spg_per_seq_logps(
        torch.stack(lps).unsqueeze(0),
        torch.stack(ps).unsqueeze(0),
        torch.stack(masks).unsqueeze(1),
        attention,
        adv,
        R,
        beta,
        mix,
    )
    return dare_compute_policy_loss_spg(value, adv, attention[:, -R:].to(adv.dtype)), noisy_all


SPG_BATCHES = [  # (prompt, response, advantage): equal response lengths (DARE's full canvas)
    [([1, 2], [0, 2, 1, 1], 1.0), ([0], [2, 2, 0, 1], -0.5), ([2, 1], [1, 0, 2, 0], -1.25), ([1], [0, 0, 1, 2], 0.5)],
    [([2], [0, 1, 1, 0], -1.0), ([1, 0], [2, 1, 0, 2], 0.75), ([0, 2], [1, 1, 2, 2], -0.25)],
]


@pytest.mark.parametrize("n_mc", [1, 2])
def test_spg_dare_estimator_is_dares_spg_on_identical_draws(n_mc):
    """estimator=dare with megadare's corruption generator seeded as DARE's ``_forward_process_spg(seed=...)``:
    every corrupted sequence equals DARE's (prompt AND the response blocks before the chosen one masked w.p.
    0.15, the n_mc blocks from one permutation), and the trainer loss and gradient equal DARE's loss (its
    actor's ELBO mean / 1/t EUBO / mix, ``compute_policy_loss_spg``) to fp32 rounding, over 12 seeds."""
    full, _ = toy_archs()
    algo = REGISTRY["spg"]({"estimator": "dare", "block": 2, "n_mc": n_mc})
    worst = 0.0
    for seed in range(12):
        toy = Toy(seed)
        for batch in SPG_BATCHES:
            samples = [sample(c, y, adv=a, index=i) for i, (c, y, a) in enumerate(batch)]
            seed_of = lambda index: 1000 * seed + 17 * index + n_mc  # noqa: E731
            want, noisy = dare_spg_loss(toy, samples, seed_of, 2, n_mc, algo.p["eubo_beta"], algo.p["mix"])
            rows = []
            for s, dare_views in zip(samples, noisy):
                g = torch.Generator().manual_seed(seed_of(s.index))
                views = algo.views(s, full, 0, g)
                assert torch.equal(torch.stack([v.tokens for v in views]), dare_views)
                rows += algo.rows(s, full, 0, torch.Generator().manual_seed(seed_of(s.index)))
            got, D, _ = _trainer_loss(algo, toy, rows, 0, ref=False)
            assert D == len(samples)
            worst = max(worst, abs(float(got) - float(want)))
            gw = torch.autograd.grad(want, list(toy.parameters()))
            gg = torch.autograd.grad(got, list(toy.parameters()))
            for a, b in zip(gg, gw):
                assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)
    assert worst < 1e-5, worst


def test_spg_dare_estimator_scores_masked_earlier_blocks():
    """The case DARE's masking differs from SPG's paper form: a response token of a block before the chosen
    one, masked with the prompt's probability, is scored (with c = L / (n_mc |masked response|))."""
    full, _ = toy_archs()
    algo = REGISTRY["spg"]({"estimator": "dare", "block": 1, "n_mc": 1, "p_prompt": 0.5})
    s = sample([1], [0, 2, 1, 1, 0], adv=1.0)
    seen = 0
    for seed in range(40):
        (v,) = algo.views(s, full, 0, torch.Generator().manual_seed(seed))
        masked = v.tokens[1:] == MASK
        assert torch.equal(v.slot[1:] >= 0, masked)
        assert torch.allclose(v.coef[1:][masked], torch.full((int(masked.sum()),), 5 / float(masked.sum())))
        clean = (~masked).nonzero().flatten()  # a masked token before a clean one precedes the chosen block
        seen += bool(len(clean)) and bool(masked[: int(clean[-1])].any())
    assert seen > 0


# ================================================================== verl's REINFORCE++-baseline, transcribed
def verl_masked_mean(values, mask, axis=None):
    return (values * mask).sum(axis=axis) / (mask.sum(axis=axis) + 1e-8)


def verl_masked_var(values, mask, unbiased=True):
    mean = verl_masked_mean(values, mask)
    variance = verl_masked_mean((values - mean) ** 2, mask)
    if unbiased:
        mask_sum = mask.sum()
        variance = variance * (mask_sum / (mask_sum - 1))
    return variance


def verl_masked_whiten(values, mask, shift_mean=True):
    mean, var = verl_masked_mean(values, mask), verl_masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened += mean
    return whitened


def verl_reinforce_pp_baseline(token_level_rewards, response_mask, index):
    """``verl/trainer/ppo/core_algos.py::compute_reinforce_plus_plus_baseline_outcome_advantage``."""
    response_length = token_level_rewards.shape[-1]
    scores = token_level_rewards.sum(dim=-1)
    id2score, id2mean = defaultdict(list), {}
    with torch.no_grad():
        bsz = scores.shape[0]
        for i in range(bsz):
            id2score[index[i]].append(scores[i])
        for idx in id2score:
            if len(id2score[idx]) == 1:
                id2mean[idx] = torch.tensor(0.0)
            else:
                id2mean[idx] = torch.mean(torch.stack(id2score[idx]))
        for i in range(bsz):
            scores[i] = scores[i] - id2mean[index[i]]
        scores = scores.unsqueeze(-1).tile([1, response_length]) * response_mask
        scores = verl_masked_whiten(scores, response_mask) * response_mask
    return scores


@pytest.mark.parametrize("G", [1, 2, 4])
def test_reinforce_pp_is_verls_reinforce_pp_baseline(G):
    """rl.advantage=reinforce_pp == verl's REINFORCE++-baseline (group mean removed, a group of one keeps its
    reward, then token-weighted masked whitening with Bessel over tokens) on random batches with varied response
    lengths, and a response of no tokens gets 0 as in verl."""
    g = torch.Generator().manual_seed(G)
    for _ in range(20):
        n, R = 4 * G, 12
        rewards = torch.randint(0, 3, (n,), generator=g).float() / 2
        lengths = torch.randint(0, R + 1, (n,), generator=g)
        lengths[0] = R
        mask = (torch.arange(R).unsqueeze(0) < lengths.unsqueeze(1)).float()
        token_rewards = torch.zeros(n, R)
        token_rewards[torch.arange(n), (lengths - 1).clamp(min=0)] = rewards * (lengths > 0)
        want = verl_reinforce_pp_baseline(token_rewards, mask, [i // G for i in range(n)])[:, 0]
        scores = token_rewards.sum(-1)  # the reward verl sees (0 for an empty response)
        got = group_advantages(scores, G, "reinforce_pp", lengths=lengths.tolist())
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), (got - want).abs().max()
    with pytest.raises(ValueError, match="token counts"):
        group_advantages(scores, G, "reinforce_pp")


# ================================================================== verl's k3 KL
def verl_kl_penalty_forward(logprob, ref_logprob):
    """``verl/trainer/ppo/core_algos.py::kl_penalty_forward``, ``low_var_kl`` / ``k3`` (DARE's is the same)."""
    kl = ref_logprob - logprob
    kl = torch.clamp(kl, min=-20, max=20)
    ratio = torch.exp(kl)
    kld = (ratio - kl - 1).contiguous()
    return torch.clamp(kld, min=-10, max=10)


def test_k3_kl_is_verls_low_var_kl():
    """The loss's k3 == verl's low_var_kl on d = ref - logp over [-30, 30], value and gradient: beyond
    d ~ 2.6 (k3 = 10) a slot adds 10 and no gradient, where the unclamped weight 1 - exp(d) reached -e^20; the
    metric form (``k3_bound=None``) is the plain estimator."""
    d = torch.linspace(-30, 30, 601, dtype=torch.float64)
    logp = torch.full_like(d, -1.0, requires_grad=True)
    got = kl_penalty(logp, logp.detach() + d, "k3")
    want = verl_kl_penalty_forward(logp, logp.detach() + d)
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)
    (g,) = torch.autograd.grad(got.sum(), logp)
    (gw,) = torch.autograd.grad(want.sum(), logp)
    assert torch.equal(g, gw) and float(g.abs().max()) < 13.5 and float(got.max()) == 10.0
    plain = kl_penalty(logp, logp.detach() + d, "k3", k3_bound=None)
    dc = d.clamp(-20, 20)
    assert torch.allclose(plain, torch.exp(dc) - dc - 1) and float(plain.max()) > 1e8


# ================================================================== one response per prompt
def test_group_relative_advantages_with_one_sample_are_refused():
    """rl.n_samples=1 with grpo / rloo: every advantage would be 0 -- the config check refuses it naming both
    keys; reinforce_pp (verl: a group of one keeps its reward) and TraceRL with a value model still run; online
    VRPO needs two responses to pair."""
    from megadare.config import load_config
    from megadare.trainer.checks import validate
    from megadare.errors import ConfigError

    for adv in ("grpo", "rloo"):
        for algo in ("d1", "tracerl", "bgpo"):
            with pytest.raises(ConfigError, match=f"rl.n_samples=1 with rl.advantage={adv}"):
                validate(load_config(None, [f"algo.name={algo}", "rl.n_samples=1", f"rl.advantage={adv}"]), None)
    validate(load_config(None, ["algo.name=d1", "rl.n_samples=1", "rl.advantage=reinforce_pp"]), None)
    validate(load_config(None, ["algo.name=tracerl", "rl.n_samples=1", "algo.params={value_model: true}"]), None)
    validate(load_config(None, ["algo.name=d1", "rl.n_samples=2"]), None)
    with pytest.raises(ConfigError, match="rl.n_samples=1: online VRPO pairs"):
        validate(load_config(None, ["algo.name=vrpo", "rl.n_samples=1", "rl.advantage=reinforce_pp"]), None)


# ================================================================== count stratification, enumerated
def megadare_count_distribution(L: int, n: int) -> list[Fraction]:
    """P(m = 1..L) pooled over the n draws of ``stratified``, exactly: the offset u ~ U[0, 1) is cut where
    (j + u) L / n crosses an integer, and ``stratified_count`` is read at each piece's midpoint."""
    from megadare.diffusion.corruption import stratified_count

    prob = [Fraction(0)] * (L + 1)
    for j in range(n):
        cuts = sorted(
            {Fraction(0), Fraction(1)}
            | {Fraction(i * n, L) - j for i in range(L * (j + 2) // n + 2) if 0 < Fraction(i * n, L) - j < 1}
        )
        for a, b in zip(cuts, cuts[1:]):
            prob[stratified_count(j, float((a + b) / 2), L, n)] += (b - a) / n
    return prob[1:]


def dare_count_distribution(L: int, n: int) -> list[Fraction]:
    """P(m = 1..L) pooled over the n masks of DARE's ``_forward_process_bgpo`` / ``_forward_process_vrpo``
    (b = n rows, target_len = L), exactly: k ~ U{1..L} enumerated through DARE's own lines."""
    prob = [Fraction(0)] * (L + 1)
    for k in range(1, L + 1):
        x = torch.round(torch.linspace(float(k), k + (n - 1) * (L / n), steps=n)).long()
        x = ((x - 1) % L) + 1
        for m in x.tolist():
            prob[m] += Fraction(1, L * n)
    return prob[1:]


def test_count_stratification_megadare_uniform_dare_as_stated():
    """The statement of diffusion/corruption.py ``stratified``: megadare's pooled counts are exactly uniform on
    1..L; DARE's are uniform iff n / gcd(n, L) is odd, else they take the probabilities (1 +- gcd(n, L) / n) / L
    (VRPO's n = 4 at L = 6: 0.5x and 1.5x), for every L <= 40 and n in {1, 2, 3, 4, 8, 16}."""
    from math import gcd

    for n in (1, 2, 3, 4, 8, 16):
        for L in range(1, 41):
            assert megadare_count_distribution(L, n) == [Fraction(1, L)] * L, (L, n)
            factors = Counter(p * L for p in dare_count_distribution(L, n))
            d = gcd(n, L)
            if (n // d) % 2 or L == 1:
                assert factors == Counter({1: L}), (L, n)
            else:
                lo, hi = 1 - Fraction(d, n), 1 + Fraction(d, n)
                assert set(factors) <= {lo, 1, hi} and factors[lo] == factors[hi] > 0, (L, n, factors)
    assert Counter(p * 6 for p in dare_count_distribution(6, 4)) == {Fraction(1, 2): 3, Fraction(3, 2): 3}


# ================================================================== DARE's actor losses on injected masks
def dare_masked_mean(values, mask):
    return (values * mask).sum() / (mask.sum() + 1e-8)  # verl_F.masked_mean = agg_loss "token-mean"


def dare_ppo_terms(ratio, advantages, clip=0.2, clip_ratio_c=3.0):
    """``dllm_core_algos.py::compute_policy_loss`` / ``compute_policy_loss_bgpo`` after the ratio (dual clip)."""
    clip_pg_losses1 = torch.maximum(-advantages * ratio, -advantages * torch.clamp(ratio, 1 - clip, 1 + clip))
    clip_pg_losses2 = torch.min(-advantages * clip_ratio_c, clip_pg_losses1)
    return torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)


def dare_actor_loss(name, toy, old, s, views, R):
    """One sample's loss as DARE's LLaDA actor computes it from the stored masks (one sample per micro-batch):
    d1 ``llada_dp_actor_d1.py`` (-CE on the view, token-mean over the masked canvas), Coupled-GRPO
    ``llada_dp_actor_coupled_grpo.py`` ((log p^a + log p^b / t + log p^c / (1-t)) / 2, token-mean over R),
    BGPO ``llada_dp_actor_bgpo.py`` (l_j = sum log p / p_mask / R, ``compute_policy_loss_bgpo`` per MC, / mc_num)."""
    x0 = torch.tensor(s.prompt_ids + s.response_ids)
    masks = [v.tokens[-R:] == MASK for v in views]
    adv = torch.full((R,), s.advantage, dtype=torch.float64)

    lp = view_logps(toy, x0, [v.tokens for v in views])[:, -R:]
    with torch.no_grad():
        olp = view_logps(old, x0, [v.tokens for v in views])[:, -R:]
    if name == "d1":
        return dare_masked_mean(dare_ppo_terms(torch.exp(lp[0] - olp[0]), adv), masks[0].double())
    if name == "coupled_grpo":
        t = s.extra["t"]
        est = lambda x: (
            (  # noqa: E731
                torch.where(masks[0], x[0], 0.0)
                + torch.where(masks[1], x[1] / t, 0.0)
                + torch.where(masks[2], x[2] / (1 - t), 0.0)
            )
            / 2
        )
        return dare_masked_mean(dare_ppo_terms(torch.exp(est(lp) - est(olp)), adv), torch.ones(R))
    total = 0.0  # bgpo
    for j, m in enumerate(masks):
        p_mask = m.sum() / R
        lj, oj = (lp[j][m] / p_mask).sum() / R, (olp[j][m] / p_mask).sum() / R
        ratio = torch.exp(torch.log(1 + lj - oj)) if s.advantage > 0 else torch.exp(lj - oj)
        total = total + dare_masked_mean(dare_ppo_terms(ratio.expand(R), adv), torch.ones(R)) / len(masks)
    return total


def perturbed(toy: Toy, seed: int, scale: float) -> Toy:
    other = Toy(0, nmax=toy.nmax)
    other.load_state_dict(toy.state_dict())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return other


def assert_same_loss_and_grad(got, want, toy):
    assert torch.isfinite(want)
    assert abs(float(got) - float(want)) <= 1e-5 * abs(float(want)) + 1e-6, (float(got), float(want))
    gw = torch.autograd.grad(want, list(toy.parameters()))
    gg = torch.autograd.grad(got, list(toy.parameters()))
    for a, b in zip(gg, gw):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name", ["d1", "coupled_grpo", "bgpo"])
def test_dare_preset_loss_is_dares_actor_loss_on_the_same_masks(name):
    """With the DARE preset's params (examples/configs/dare/<name>_llada.yaml: eps 0.2, dual clip 3, no KL,
    DARE's aggregation), megadare's trainer loss and gradient equal DARE's actor loss computed from megadare's
    masks, off-policy (old weights perturbed: ratios far outside the clip, dual clip active on A < 0). BGPO's
    perturbation is smaller: DARE's log(1 + l - l_old) is NaN once l - l_old < -1 for A > 0 (megadare keeps the
    tangent 1 + d there, a finite surrogate), so the two are compared where DARE's is defined."""
    params = {
        "d1": {"eps_low": 0.2, "dual_clip": 3.0, "kl_coef": 0.0, "loss_agg": "seq_mean_token_mean"},
        "coupled_grpo": {"eps_low": 0.2, "dual_clip": 3.0, "kl_coef": 0.0, "loss_agg": "seq_mean_token_mean"},
        "bgpo": {"eps_low": 0.2, "dual_clip": 3.0, "n_mc": 4},
    }[name]
    full, _ = toy_archs()
    algo = REGISTRY[name](params)
    R = 4
    for seed in range(3):
        toy = Toy(seed)
        old = perturbed(toy, seed + 99, 0.03 if name == "bgpo" else 0.15)
        batch = [
            ([1, 2], [0, 2, 1, 1], 1.25),
            ([0], [2, 2, 0, 1], -0.5),
            ([2, 1], [1, 0, 2, 0], -1.5),
            ([1], [0, 0, 1, 2], 0.75),
        ]
        rows, want = [], 0.0
        for i, (c, y, a) in enumerate(batch):
            s = sample(c, y, adv=a, index=i)
            rows += algo.rows(s, full, 0, torch.Generator().manual_seed(10 * seed + i))
            gen = torch.Generator().manual_seed(10 * seed + i)
            views = algo.views(s, full, 0, gen)
            t_gen = torch.Generator().manual_seed(10 * seed + i)  # coupled's t: the first draw (0.2 + 0.6 u)
            s.extra["t"] = 0.2 + 0.6 * float(torch.rand((), generator=t_gen, dtype=torch.float64))
            want = want + dare_actor_loss(name, toy, old, s, views, R) / len(batch)
        got, _, _ = _trainer_loss(algo, toy, rows, 0, old_toy=old, ref=False)
        assert_same_loss_and_grad(got, want, toy)


# ================================================================== trace / step / tree algorithms (DARE's actors)
TRACE_BATCH = [([1, 2], [0, 2, 1, 1], 1.25), ([0], [2, 2, 0, 1], -0.5), ([2, 1], [1, 0, 2, 0], -1.5)]


def dare_cj_grpo_loss(toy, old, s) -> torch.Tensor:
    """``llada_dp_actor_cj_grpo.py::update_policy`` (lines 384-434) for one sample: for step i of the trajectory,
    the state with the tokens of steps < i clean (``_step_forward_micro_batch``), -CE on the next state,
    ``compute_policy_loss`` (dual clip 3, token-mean over the tokens unmasked at step i: 0 for a step that
    unmasks nothing), / steps = the trajectory's slices, one per decoding step, empty ones included
    (``generate.py::reversed_process_llada`` appends a slice every step, lines 569-572)."""
    P, R = len(s.prompt_ids), len(s.response_ids)
    x0 = torch.tensor(s.prompt_ids + s.response_ids)
    commit = torch.tensor(s.commit_step)
    steps = max(s.commit_step) + 1
    adv = torch.full((R,), float(s.advantage), dtype=torch.float64)
    total = 0.0
    for t in range(steps):
        cur = torch.cat([x0[:P], torch.where(commit < t, x0[P:], torch.full((R,), MASK))])
        lp = view_logps(toy, x0, [cur])[0, -R:]
        with torch.no_grad():
            olp = view_logps(old, x0, [cur])[0, -R:]
        total = total + dare_masked_mean(dare_ppo_terms(torch.exp(lp - olp), adv), (commit == t).double()) / steps
    return total


def test_cj_grpo_preset_loss_is_dares_actor_loss_on_the_same_trace():
    """CJ-GRPO with the preset's params (cj_grpo_llada.yaml: eps 0.2, dual clip 3, no KL): megadare's trainer loss
    and gradient equal DARE's step-by-step actor loss on the same decoding traces (1 and 2 tokens per step),
    off-policy (ratios outside the clip, dual clip active)."""
    full, _ = toy_archs()
    algo = REGISTRY["cj_grpo"]({"eps_low": 0.2, "dual_clip": 3.0, "kl_coef": 0.0, "loss_agg": "seq_mean_token_mean"})
    for seed in range(2):
        toy = Toy(seed)
        old = perturbed(toy, seed + 99, 0.15)
        rows, want = [], 0.0
        for i, (c, y, a) in enumerate(TRACE_BATCH):
            commit, bstep = synthetic_trace(len(c), len(y), 0, seed=10 * seed + i, per_step=1 + (i + seed) % 2)
            s = sample(c, y, adv=a, index=i, commit_step=commit, block_step=bstep)
            rows += algo.rows(s, full, 0, torch.Generator().manual_seed(i))
            want = want + dare_cj_grpo_loss(toy, old, s) / len(TRACE_BATCH)  # one sample per micro-batch
        got, _, _ = _trainer_loss(algo, toy, rows, 0, old_toy=old, ref=False)
        assert_same_loss_and_grad(got, want, toy)


def dare_step_wise_advantage(rewards: torch.Tensor, uid: list[int], eps: float = 1e-6) -> torch.Tensor:
    """``mdpo_algos.py::compute_step_wise_advantage`` (GRPO-normalised by uid, torch's unbiased std; a uid of one:
    mean 0, std 1)."""
    T = rewards.shape[1]
    diffs = torch.cat([rewards[:, :1], rewards[:, 1:] - rewards[:, :-1]], -1) + 1.0
    avg_future = (rewards[:, 1:].flip(-1).cumsum(-1) / torch.arange(1, T, dtype=rewards.dtype)).flip(-1)
    scores = diffs + torch.cat([avg_future, rewards[:, -1:]], -1)
    out = scores.clone()
    for u in set(uid):
        rows = [i for i in range(len(uid)) if uid[i] == u]
        one = len(rows) == 1
        out[rows] = (scores[rows] - (0 if one else scores[rows].mean(0))) / ((1 if one else scores[rows].std(0)) + eps)
    return out


def dare_mdpo_row_loss(toy, old, s, t: int, adv: float) -> torch.Tensor:
    """One (sample, step t) row of DARE's packed MDPO batch, ``compute_mdpo_policy_loss``: input x_t, target the
    step's proposal, completion_mask = (x_t == MASK), the step's confidences, lambda = R / |M_t|."""
    R = len(s.response_ids)
    commit, y = torch.tensor(s.commit_step), torch.tensor(s.response_ids)
    x_resp = torch.where(commit < t, y, torch.full((R,), MASK))
    target = torch.cat(
        [torch.tensor(s.prompt_ids), torch.where(commit < t, y, torch.tensor(s.extra["step_predictions"][t]))]
    )
    inp = torch.cat([torch.tensor(s.prompt_ids), x_resp])
    mask = (x_resp == MASK).double()
    conf = torch.tensor(s.extra["step_confidences"][t], dtype=torch.float64)
    lp = view_logps(toy, target, [inp])[0, -R:]
    with torch.no_grad():
        olp = view_logps(old, target, [inp])[0, -R:]
    ratio = torch.exp(lp - olp)
    lam = R / mask.sum().clamp(min=1.0)
    per_token = torch.maximum(-adv * ratio * lam, -adv * ratio.clamp(0.8, 1.2) * lam)
    return (per_token * mask * conf).sum() / mask.sum().clamp(min=1e-4)


def mdpo_trace_sample(i: int, c: list[int], y: list[int], seed: int) -> RLSample:
    """One token per step over the whole canvas (one block): proposals at every still-masked position."""
    commit, bstep = synthetic_trace(len(c), len(y), 0, seed=seed, per_step=1)
    g = torch.Generator().manual_seed(seed + 1000)
    preds = [
        [
            y[k] if commit[k] == t else int(torch.randint(0, 3, (), generator=g)) if commit[k] > t else -1
            for k in range(len(y))
        ]
        for t in range(len(y))
    ]
    confs = [
        [0.2 + 0.8 * float(torch.rand((), generator=g)) if commit[k] >= t else 0.0 for k in range(len(y))]
        for t in range(len(y))
    ]
    extra = {"step_predictions": preds, "step_confidences": confs}
    return RLSample(c, y, 0.0, 0.0, index=i, group=i // 2, commit_step=commit, block_step=bstep, extra=extra)


def test_mdpo_preset_loss_is_dares_mdpo_loss_on_the_same_steps():
    """MDPO with the preset's params (mdpo_llada.yaml: eps 0.2, top-K over the batch): the step advantages equal
    DARE's ``compute_step_wise_advantage`` of the same step rewards, and megadare's trainer loss and gradient equal
    DARE's ``compute_mdpo_policy_loss`` over the packed (sample, kept step) rows, one row per micro-batch, scaled
    by 1 / (G K) (one mini-batch of all rows; DARE splits them into verl mini-batches, stated in mdpo.py),
    off-policy, on full-canvas traces with a proposal at every masked position (where the two contracts agree)."""
    full, _ = toy_archs()
    K = 2
    algo = REGISTRY["mdpo"]({"eps_low": 0.2, "top_k_steps": K, "top_k_scope": "batch"})
    batch = TRACE_BATCH + [([1], [0, 0, 1, 2], 0.0)]
    for seed in range(2):
        toy = Toy(seed)
        old = perturbed(toy, seed + 99, 0.15)
        samples = [mdpo_trace_sample(i, c, y, 10 * seed + i) for i, (c, y, _) in enumerate(batch)]
        rewards = torch.randint(0, 2, (len(samples), 4), generator=torch.Generator().manual_seed(seed)).double()
        table = iter(rewards.tolist())
        algo.prepare(samples, lambda answers, idx: next(table), group_size=2)
        adv = dare_step_wise_advantage(rewards, [s.group for s in samples])
        ours = torch.tensor([[s.extra["step_adv"][t] for t in range(4)] for s in samples], dtype=torch.float64)
        assert torch.allclose(ours, adv, rtol=1e-9, atol=1e-9)
        rows, want = [], 0.0
        for s in samples:
            assert len(s.extra["steps"]) == K
            rows += algo.rows(s, full, 0, torch.Generator().manual_seed(0))
            for t in s.extra["steps"]:
                want = want + dare_mdpo_row_loss(toy, old, s, t, float(adv[s.index, t])) / (len(samples) * K)
        got, _, _ = _trainer_loss(algo, toy, rows, 0, old_toy=old, ref=False)
        assert_same_loss_and_grad(got, want, toy)


def dare_d_treerpo_loss(toy, old, ref, parent_state, segment, adv) -> torch.Tensor:
    """``llada_dp_actor_dtreerpo.py::update_policy`` for one segment (its own micro-batch): local transition
    log-probs where the parent is masked and the child is not, PPO-clip (eps 0.4) averaged over the active tokens,
    + 0.01 x the actor's inline k3 exp(d) - d - 1 (d = ref - new, no clamp) averaged the same way."""
    parent = torch.tensor(parent_state + [MASK] * len(segment))
    child = torch.tensor(parent_state + segment)
    active = ((parent == MASK) & (child != MASK)).double()
    lp = view_logps(toy, child, [parent])[0] * active
    with torch.no_grad():
        olp = view_logps(old, child, [parent])[0] * active
        rlp = view_logps(ref, child, [parent])[0] * active
    ratio = torch.exp(lp - olp)
    L_eff = active.sum().clamp_min(1)
    policy = -(torch.min(ratio * adv, ratio.clamp(0.6, 1.4) * adv) * active).sum() / L_eff
    d = rlp - lp
    return policy + 0.01 * ((torch.exp(d) - d - 1.0) * active).sum() / L_eff


def test_d_treerpo_preset_loss_is_dares_actor_loss_with_its_unclamped_k3():
    """d-TreeRPO with the preset's params (d_treerpo_llada.yaml: eps 0.4, KL 0.01, self-distillation off at step
    0): megadare's trainer loss and gradient equal DARE's actor loss on the same parent states and segments, with
    a reference far enough that some token's k3 exceeds verl's bound of 10 (DARE's actor computes the plain k3,
    whatever ``kl_loss_type`` says; verl's clamped low_var_kl gives a 14% lower loss here). It is also the default."""
    full, _ = toy_archs()
    params = {"eps_low": 0.4, "branch": 4, "depth": 2, "root_fanout": 4, "kl_coef": 0.01, "kl_estimator": "k3_plain"}
    assert REGISTRY["d_treerpo"]().p["kl_estimator"] == params["kl_estimator"]
    algo = REGISTRY["d_treerpo"](params)
    nodes = [([1, 2], [0, 2], 0.5), ([1, 2], [1, 1], -0.25), ([1, 2, 0, 2], [1, 1], 0.75), ([0], [2, 2, 0, 1], -1.0)]
    toy = Toy(0)
    old, ref = perturbed(toy, 99, 0.15), perturbed(toy, 199, 0.3)
    samples = [
        sample(pre, seg, adv=a, index=i, extra={"parent": (0, 0, i // 2), "rollout_step": 0})
        for i, (pre, seg, a) in enumerate(nodes)
    ]
    rows = algo.batch_rows(samples, full, 0, lambda index: torch.Generator().manual_seed(index))
    want = sum(dare_d_treerpo_loss(toy, old, ref, pre, seg, a) for pre, seg, a in nodes) / len(nodes)
    got, _, _ = _trainer_loss(algo, toy, rows, 0, old_toy=old, ref=True, ref_toy=ref)
    assert_same_loss_and_grad(got, want, toy)
