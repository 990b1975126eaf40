"""CJ-GRPO on the block families (SDAR, LLaDA2) against DARE's block-parallel CJ actor, and CJ-GRPO when a
decoding step commits nothing (yjyddq/DARE @83ae8a3, transcribed here from its code).

DARE's ``sdar_dp_actor_cj_grpo.py`` and ``llada2_dp_actor_cj_grpo.py`` are both ``CJGRPOActorMixin`` over the
family's BGPO actor (lines 24-25 of each): the loss is ``cj_grpo_sglang_mixin.py::update_policy`` with the state
of ``block_diffusion_utils.py::build_block_parallel_cj_step_inputs``, the weights of
``compute_cj_block_step_token_weights`` and the family's block-diffusion forward (``[noisy, clean]`` under
``build_block_diffusion_mask``; CJ-GRPO requires ``block_origin='global'``, ``dllm_fsdp_workers.py:197-205``).
The two families differ only in the model, so one transcription serves both; megadare's side runs with each
family's arch. The model is the float64 toy of algo_toy.py with a 10-token context (block 4, several blocks).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from megadare.algos import REGISTRY
from megadare.models import get_family

from algo_toy import one_thread  # noqa: F401  (autouse fixture)
from algo_toy import MASK, V, Toy, sample, toy_archs, view_logps
from test_algos_dare_formulas import assert_same_loss_and_grad, dare_cj_grpo_loss, dare_ppo_terms, perturbed
from test_algos_objectives import _trainer_loss

B = 4  # SDAR's preset block (examples/configs/dare/cj_grpo_sdar_8b.yaml)
NMAX = 10
PRESET = {"eps_low": 0.2, "dual_clip": 3.0}  # cj_grpo_{sdar_8b,llada2_mini}.yaml; DARE: clip 0.2, clip_ratio_c 3


def block_arch(family: str):
    if family == "sdar":
        return toy_archs(B)[1]
    fam = get_family(family)
    return replace(fam.arch(fam.tiny_config()), mask_token_id=MASK, vocab_size=V + 1, block_size=B)


def block_trace(P: int, L: int, seed: int, gap: tuple[int, int] | None = None) -> tuple[list[int], list[int]]:
    """(commit_step, block_step) of a block decoder on the global grid: blocks left to right, inside a block a
    random order committing 1 or 2 tokens per step. ``gap=(b, j)``: in the b-th response block, a step that
    commits nothing comes before local step j (later local and global steps shift by one)."""
    g = torch.Generator().manual_seed(seed)
    blocks: dict[int, list[int]] = {}
    for k in range(L):
        blocks.setdefault((P + k) // B, []).append(k)
    commit, bstep, step = [0] * L, [0] * L, 0
    for nb, b in enumerate(sorted(blocks)):
        order = [blocks[b][i] for i in torch.randperm(len(blocks[b]), generator=g).tolist()]
        local, i = 0, 0
        while i < len(order):
            if gap == (nb, local):
                local, step = local + 1, step + 1  # the empty step: nothing committed
            n = 1 + int(torch.randint(2, (), generator=g))
            for k in order[i : i + n]:
                commit[k], bstep[k] = step, local
            i, local, step = i + n, local + 1, step + 1
    return commit, bstep


# ================================================================== DARE's block-parallel CJ actor, transcribed
def dare_trajectory(s) -> torch.Tensor:
    """``cj_trajectory.py::build_block_parallel_cj_trajectory`` (lines 573-653): [K, P + R] booleans,
    traj[k, P + r] = response token r was unmasked at block-local step k (SGLang's 1-based step map - 1)."""
    P, R = len(s.prompt_ids), len(s.response_ids)
    traj = torch.zeros(max(s.block_step) + 1, P + R, dtype=torch.bool)
    traj[torch.tensor(s.block_step), P + torch.arange(R)] = True
    return traj


def dare_cj_token_weights(traj: torch.Tensor, P: int) -> torch.Tensor:
    """``block_diffusion_utils.py::compute_cj_block_step_token_weights`` (lines 369-534) for one sample without
    padding, ``block_origin='global'`` (``build_padded_token_block_ids``, lines 335-342: compact position // B):
    1 / (tokens of the (block, local step) transition * transitions of the sample); each block's local steps
    must be 0..max without a hole (lines 500-504)."""
    resp = traj[:, P:]
    K, R = resp.shape
    block = (P + torch.arange(R)) // B
    count: dict[tuple[int, int], int] = {}
    for k, r in resp.nonzero().tolist():
        count[(int(block[r]), k)] = count.get((int(block[r]), k), 0) + 1
    for b in set(block.tolist()):
        steps = sorted(k for bb, k in count if bb == b)
        if steps != list(range(len(steps))):
            raise ValueError("Each CJ sample/block trajectory must use contiguous local steps starting at zero")
    w = torch.zeros(K, R, dtype=torch.float64)
    for k, r in resp.nonzero().tolist():
        w[k, r] = 1.0 / (count[(int(block[r]), k)] * len(count))
    return w


def dare_step_state(x0: torch.Tensor, traj: torch.Tensor, P: int, k: int) -> torch.Tensor:
    """``build_block_parallel_cj_step_inputs`` (lines 287-303): every block at its own local step k -- tokens of
    local steps < k clean, the rest of the response masked, the prompt clean."""
    noisy = torch.where(traj[:k].any(0), x0, torch.full_like(x0, MASK))
    noisy[:P] = x0[:P]
    return noisy


def dare_block_cj_loss(toy, old, samples) -> torch.Tensor:
    """``cj_grpo_sglang_mixin.py::update_policy`` (lines 497-595) on one mini-batch held in one micro-batch: for
    local step k, log-probs of the step's state under the block-diffusion mask (``sdar_dp_actor_bgpo.py:100-173``:
    a noisy block sees itself and the clean earlier blocks -- algo_toy.contexts), ``compute_policy_loss`` with
    the step's token weights as ``response_mask`` (token-mean: sum(w l) / (sum(w) + 1e-8), dual clip 3) times
    (sum(w) + 1e-8) / N; old log-probs from the same replay (``_forward_micro_batch``, lines 173-217)."""
    per = []
    for s in samples:
        P, R = len(s.prompt_ids), len(s.response_ids)
        x0, traj = torch.tensor(s.prompt_ids + s.response_ids), dare_trajectory(s)
        states = [dare_step_state(x0, traj, P, k) for k in range(len(traj))]
        lp = view_logps(toy, x0, states, B)[:, P:]
        with torch.no_grad():
            olp = view_logps(old, x0, states, B)[:, P:]
        adv = torch.full((R,), float(s.advantage), dtype=torch.float64)
        terms = torch.stack([dare_ppo_terms(torch.exp(lp[k] - olp[k]), adv) for k in range(len(traj))])
        per.append((terms, dare_cj_token_weights(traj, P)))
    total = 0.0
    for k in range(max(len(w) for _, w in per)):
        num = sum((t[k] * w[k]).sum() for t, w in per if k < len(w))
        mass = sum(float(w[k].sum()) for _, w in per if k < len(w))
        if mass > 0:
            total = total + num / (mass + 1e-8) * (mass + 1e-8) / len(samples)
    return total


# ================================================================== block families: megadare == DARE
BLOCK_BATCH = [  # (prompt, response, advantage): prompts of 4 (a multiple of B) and of 1, 2, 3 tokens
    ([1, 2, 0, 1], [0, 2, 1, 1, 2, 0], 1.25),  # two response blocks, the last one cut (rl.canvas=eos)
    ([0], [2, 2, 0, 1, 1, 0, 2], -0.5),  # prompt tail shares the first block; response ends on the grid
    ([2, 1], [1, 0, 2, 0, 0, 1, 2, 1], -1.5),  # three response blocks, the first of two tokens
    ([1, 0, 2], [2, 1, 0, 0, 1], 0.75),  # one prompt-tail block of one token, then a full block
]


@pytest.mark.parametrize("family", ["sdar", "llada2"])
def test_cj_grpo_block_loss_is_dares_block_parallel_actor_loss(family):
    """CJ-GRPO with the block presets' params: megadare's trainer loss and gradient equal DARE's block-parallel
    CJ actor loss on the same traces -- block 4, several blocks, prompts on and off the block grid, steps
    committing 1 or 2 tokens (blocks finishing after different numbers of local steps), off-policy with the
    dual clip active."""
    arch, algo = block_arch(family), REGISTRY["cj_grpo"](PRESET)
    for seed in range(2):
        toy = Toy(seed, nmax=NMAX)
        old = perturbed(toy, seed + 99, 0.15)
        samples, rows = [], []
        for i, (c, y, a) in enumerate(BLOCK_BATCH):
            commit, bstep = block_trace(len(c), len(y), seed=10 * seed + i)
            s = sample(c, y, adv=a, index=i, commit_step=commit, block_step=bstep)
            samples.append(s)
            rows += algo.rows(s, arch, B, torch.Generator().manual_seed(i))
        got, _, _ = _trainer_loss(algo, toy, rows, B, old_toy=old, ref=False)
        assert_same_loss_and_grad(got, dare_block_cj_loss(toy, old, samples), toy)


def test_dare_block_weights_are_one_objective_per_sample_and_refuse_a_hole():
    """The transcription's guards, as DARE's: the weights sum to 1 per sample (lines 517-529), and a local step
    that commits nothing inside a block is refused (lines 500-504)."""
    c, y, _ = BLOCK_BATCH[2]
    commit, bstep = block_trace(2, 8, 0)
    s = sample(c, y, commit_step=commit, block_step=bstep)
    assert float(dare_cj_token_weights(dare_trajectory(s), 2).sum()) == pytest.approx(1.0)
    commit, bstep = block_trace(2, 8, 0, gap=(1, 1))
    s = sample(c, y, commit_step=commit, block_step=bstep)
    with pytest.raises(ValueError, match="contiguous local steps"):
        dare_cj_token_weights(dare_trajectory(s), 2)


# ================================================================== a decoding step that commits nothing
def compressed(s):
    """The same trace with the empty steps taken out (global and block-local ids renumbered densely)."""
    glob = {t: i for i, t in enumerate(sorted(set(s.commit_step)))}
    per_block: dict[int, list[int]] = {}
    P = len(s.prompt_ids)
    for k, j in enumerate(s.block_step):
        per_block.setdefault((P + k) // B, []).append(j)
    local = {b: {t: i for i, t in enumerate(sorted(set(js)))} for b, js in per_block.items()}
    bstep = [local[(P + k) // B][j] for k, j in enumerate(s.block_step)]
    return replace(s, commit_step=[glob[t] for t in s.commit_step], block_step=bstep)


@pytest.mark.parametrize("family", ["sdar", "llada2"])
def test_cj_grpo_block_step_committing_nothing_is_skipped(family):
    """A block-local step that commits nothing changes no state and is no transition: megadare's loss on such a
    trace is DARE's loss on the trace without it (DARE's actor refuses the trace itself, see above)."""
    arch, algo = block_arch(family), REGISTRY["cj_grpo"](PRESET)
    toy = Toy(3, nmax=NMAX)
    old = perturbed(toy, 7, 0.15)
    samples, rows = [], []
    gaps = [(0, 1), (1, 0), (1, 1)]  # (response block, local step): in blocks of 3-4 tokens (2+ local steps)
    for i, (c, y, a) in enumerate(BLOCK_BATCH[:3]):
        commit, bstep = block_trace(len(c), len(y), seed=i, gap=gaps[i])
        s = sample(c, y, adv=a, index=i, commit_step=commit, block_step=bstep)
        assert compressed(s).block_step != s.block_step  # the trace does hold an empty step
        samples.append(compressed(s))
        rows += algo.rows(s, arch, B, torch.Generator().manual_seed(i))
    got, _, _ = _trainer_loss(algo, toy, rows, B, old_toy=old, ref=False)
    assert_same_loss_and_grad(got, dare_block_cj_loss(toy, old, samples), toy)


def test_cj_grpo_full_attention_step_committing_nothing_is_not_counted():
    """LLaDA (full attention), a trace with empty steps (DARE's LLaDA sampler makes them when steps_per_block
    exceeds the block's masks: ``get_num_transfer_tokens`` gives 0): megadare averages over the steps that
    commit, as DARE's own paper-exact reference does (``tests/test_cj_grpo_paper_exact.py::paper_exact_cj_loss``,
    lines 99-138: only non-empty transitions) and DARE's block actor. DARE's LLaDA actor also counts the empty
    steps in its divisor, which scales a sample's loss by (steps that commit) / (all steps): not copied."""
    full, _ = toy_archs()
    algo = REGISTRY["cj_grpo"]({"eps_low": 0.2, "dual_clip": 3.0, "kl_coef": 0.0, "loss_agg": "seq_mean_token_mean"})
    toy = Toy(5)
    old = perturbed(toy, 11, 0.15)
    c, y, a = [1, 2], [0, 2, 1, 1], -1.25
    s = sample(c, y, adv=a, commit_step=[0, 3, 3, 5], block_step=[0, 3, 3, 5])  # steps 1, 2, 4 commit nothing
    rows = algo.rows(s, full, 0, torch.Generator().manual_seed(0))
    got, _, _ = _trainer_loss(algo, toy, rows, 0, old_toy=old, ref=False)
    dense = replace(s, commit_step=[0, 1, 1, 2], block_step=[0, 1, 1, 2])
    assert_same_loss_and_grad(got, dare_cj_grpo_loss(toy, old, dense), toy)  # == DARE's actor without holes
    actor = dare_cj_grpo_loss(toy, old, s)
    assert abs(float(got) - float(actor)) > 0.1 * abs(float(got))
    assert float(actor) == pytest.approx(float(got) * 3 / 6, rel=1e-5)  # 3 committing steps of 6
