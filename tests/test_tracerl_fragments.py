"""TraceRL's fragments (which positions each training row masks in its input, which it scores) against dLLM-RL's
own construction (Gen-Verse/dLLM-RL @ 10b4fd1), transcribed below as small functions that cite file:line, fed
the same recorded trajectories as megadare's ``diffusion/trace_replay.py::replay_views``.

Coordinates: response positions k = 0..L-1; a fragment is (masked positions of its input, target positions).
dLLM-RL's step map is the sampler's *global* step per response token (jetengine's ``first_unmask_steps``,
``sample/jetengine_ext/engine/scheduler.py:147-152``; LLaDA's ``denoise_step_map``, ``llada_rl_rollout.py:231``).

Findings (each test below says why):
* block families, prompt length a multiple of the block: the same fragments, shrink 1 and > 1;
* prompt length not a multiple: dLLM-RL's training blocks start at the response (``rl_trado.py:516-522`` slice the
  step map from L0; ``make_basic_block_attention`` likewise), but its sampler's blocks start at position 0 and
  put the prompt's remainder in the first block (``jetengine_ext/engine/sequence.py:29-38``): its rows are not the
  sampler's states. megadare's (global grid) equal dLLM-RL's construction on the sampler's grid;
* post-EOS positions (``post_num: 0``, ``rl_trado.py:552-555``, ``rl_llada.py:265-276``): same targets as
  megadare's ``rl.canvas=eos``; dLLM-RL's inputs also hold the EOS block's pad positions masked in every round;
* LLaDA / Dream (``rl_llada.py:254-290``, ``rl_dream.py:260-296``): the same fragments without pad tokens; on a full
  canvas post_num=0 drops the pad targets, megadare's ``rl.canvas=full`` scores them;
* the value model's step-level aggregation runs over the *shrunk* step map (``train_trado_value.py:491-497``).
"""

from __future__ import annotations

import functools
import random
from dataclasses import replace

import pytest
import torch

from megadare.algos import REGISTRY
from megadare.algos.base import ANSWER_LENGTH, RLSample
from megadare.algos.value_model import step_advantages
from megadare.data.rows import pack_rows
from megadare.diffusion.trace_replay import replay_views, shrunk_steps
from megadare.models import get_family
from megadare.trainer.rl_update import value_advantages

MASK, PAD, EOS = 99, 98, 97


def tiny_arch(family: str, block_size: int = 4):
    fam = get_family(family)
    arch = replace(fam.arch(fam.tiny_config()), mask_token_id=MASK)
    return replace(arch, block_size=block_size) if arch.is_block_diffusion else arch


# ------------------------------------------------------------------ dLLM-RL, transcribed
def collapse_k_unique(lst, k: int):
    """``train/rl_trado.py:219-231`` (= ``rl_llada.py:203-215``, ``rl_dream.py``): every k consecutive distinct
    values -> the last of them."""
    uniq = sorted(set(lst))
    n = len(uniq)
    mapping = {val: uniq[min((idx // k + 1) * k - 1, n - 1)] for idx, val in enumerate(uniq)}
    return [mapping[x] for x in lst]


def shrink_per_block(step_map: list[int], block_size: int, shrink: int) -> list[int]:
    """``rl_trado.py:516-522``: collapse inside each block of the *response* (blocks from position L0). Entries < 0
    (``lead`` prompt positions of :func:`trado_fragments`) are no steps and kept."""
    out = list(step_map)
    for start in range(0, len(out), block_size):
        idx = [i for i in range(start, min(len(out), start + block_size)) if out[i] >= 0]
        for i, v in zip(idx, collapse_k_unique([out[i] for i in idx], shrink) if idx else []):
            out[i] = v
    return out


def one_round(step_map: list[int], block_size: int):
    """``rl_trado.py:366-424`` (``one_round_vectorized``) in response coordinates: per block, the smallest step
    not yet taken is the target set; positions whose step is >= it are masked in the block's noisy copy; taken
    positions become -1. None when nothing is left."""
    masked, targets, new = set(), set(), list(step_map)
    for start in range(0, len(step_map), block_size):
        block = range(start, min(len(step_map), start + block_size))
        valid = [i for i in block if step_map[i] >= 0]
        if not valid:
            continue
        low = min(step_map[i] for i in valid)
        targets |= {i for i in valid if step_map[i] == low}
        masked |= {i for i in valid if step_map[i] >= low}
    if not targets:
        return None
    for i in targets:
        new[i] = -1
    return masked, targets, new


def trado_fragments(step_map: list[int], block_size: int, shrink: int, lead: int = 0) -> list[tuple[set, set]]:
    """``rl_trado.py:514-547``: shrink per block, then rounds until none is left. ``lead`` > 0 is *not* dLLM-RL:
    it puts that many prompt positions (no step) in front so that the blocks follow the sampler's grid."""
    steps = shrink_per_block([-1] * lead + list(step_map), block_size, shrink)
    out = []
    while (r := one_round(steps, block_size)) is not None:
        masked, targets, steps = r
        out.append(({k - lead for k in masked}, {k - lead for k in targets}))
    return out


def trado_padded_step_map(step_map: list[int], L1: int) -> list[int]:
    """``rl_trado.py:280-287``: cut to L1, or pad with max + 1 (the step's longest response sets L1)."""
    return step_map[:L1] if len(step_map) > L1 else step_map + [max(step_map) + 1] * (L1 - len(step_map))


def drop_pad_targets(frags, tokens: list[int], post_num: int, per_row: bool):
    """post_num: a pad target beyond the first ``post_num`` pads is dropped, then rows without a target
    (``rl_trado.py:552-555, 566-571``: pads counted among the row's targets; ``rl_llada.py:265-276, 401-406``:
    among the response's tokens)."""
    pads = [k for k, t in enumerate(tokens) if t == PAD]
    out = []
    for masked, targets in frags:
        counted = sorted(k for k in targets if tokens[k] == PAD) if per_row else pads
        drop = set(counted[post_num:])
        if targets - drop:
            out.append((masked, targets - drop))
    return out


def llada_fragments(step_map: list[int], shrink: int) -> list[tuple[set, set]]:
    """``rl_llada.py:254-290`` (``rl_dream.py:260-296`` the same): collapse over the whole response, one row per
    distinct step: targets = that step, masked = every position whose step is >= it."""
    order = collapse_k_unique(list(step_map), shrink)
    return [
        ({k for k, v in enumerate(order) if v >= st}, {k for k, v in enumerate(order) if v == st})
        for st in sorted(set(order))
    ]


# ------------------------------------------------------------------ trajectories and megadare's fragments
def trace(P: int, L: int, block_size: int, seed: int) -> tuple[list[int], list[int]]:
    """A sampler's (global step, step inside the block) per response token: blocks of the grid from position 0
    (the prompt's remainder fills the first one, as jetengine and megadare's engine decode), left to right,
    inside a block 1-3 tokens per step in random order (a dynamic-threshold sampler)."""
    rng = random.Random(seed)
    blocks: dict[int, list[int]] = {}
    for k in range(L):
        blocks.setdefault((P + k) // block_size, []).append(k)
    commit, bstep, step = [0] * L, [0] * L, 0
    for b in sorted(blocks):
        left = blocks[b][:]
        rng.shuffle(left)
        j = 0
        while left:
            n = rng.choice([1, 1, 2, 3])
            for k in left[:n]:
                commit[k], bstep[k] = step, j
            left, step, j = left[n:], step + 1, j + 1
    return commit, bstep


def make_sample(P: int, response: list[int], block_size: int, seed: int) -> RLSample:
    commit, bstep = trace(P, len(response), block_size, seed)
    s = RLSample(prompt_ids=list(range(10, 10 + P)), response_ids=response, reward=1.0, advantage=0.0)
    s.commit_step, s.block_step = commit, bstep
    return s


def fragments_of(views, P: int) -> list[tuple[set, set]]:
    """(masked response positions of the input, scored response positions) of every view."""
    out = []
    for view in views:
        tok, coef = view.tokens[P:].tolist(), view.coef[P:].tolist()
        out.append(({k for k, t in enumerate(tok) if t == MASK}, {k for k, c in enumerate(coef) if c != 0}))
    return out


def megadare_fragments(s: RLSample, block_size: int, shrink: int, block_family: bool) -> list[tuple[set, set]]:
    return fragments_of([v for v, _ in replay_views(s, MASK, block_size, shrink, block_family)], len(s.prompt_ids))


def response(L: int, seed: int) -> list[int]:
    return [random.Random(seed).randrange(0, 50) for _ in range(L)]


# ------------------------------------------------------------------ block families
@pytest.mark.parametrize("shrink", [1, 2, 3])
@pytest.mark.parametrize("P,L,bs", [(8, 13, 4), (12, 16, 4), (16, 21, 8)])
def test_block_fragments_are_dllm_rls_when_the_prompt_fills_whole_blocks(P, L, bs, shrink):
    for seed in range(4):
        s = make_sample(P, response(L, seed), bs, seed)
        ours = megadare_fragments(s, bs, shrink, block_family=True)
        assert ours == trado_fragments(s.commit_step, bs, shrink)
        per_block = [
            {t for k, t in enumerate(s.commit_step) if (P + k) // bs == b} for b in range((P + L - 1) // bs + 1)
        ]
        assert len(ours) == max(-(-len(d) // shrink) for d in per_block)  # one row per round (all blocks at once)


@pytest.mark.parametrize("shrink", [1, 2])
@pytest.mark.parametrize("P,L,bs", [(5, 13, 4), (7, 16, 4), (13, 21, 8)])
def test_block_fragments_follow_the_samplers_grid_when_the_prompt_does_not(P, L, bs, shrink):
    """dLLM-RL's rows put response token 0 at the start of a block although its sampler decoded it in the block
    holding the prompt's remainder: they differ from megadare's; megadare's are dLLM-RL's construction on the
    sampler's grid (``lead`` = P mod bs prompt positions in the first block)."""
    differs = 0
    for seed in range(4):
        s = make_sample(P, response(L, seed), bs, seed)
        ours = megadare_fragments(s, bs, shrink, block_family=True)
        assert ours == trado_fragments(s.commit_step, bs, shrink, lead=P % bs)
        differs += ours != trado_fragments(s.commit_step, bs, shrink)
        # the sampler's state: a position is masked in a row iff its block's group of that row is not before it
        for masked, targets in ours:
            blocks = {(P + k) // bs for k in targets}
            first = {b: min(s.commit_step[k] for k in targets if (P + k) // bs == b) for b in blocks}
            assert masked == {
                k for k in range(L) if (P + k) // bs in blocks and s.commit_step[k] >= first[(P + k) // bs]
            }
    assert differs == 4


@pytest.mark.parametrize("shrink", [1, 2])
def test_block_fragments_with_post_eos_pads(shrink):
    """A response shorter than the step's longest (L1): dLLM-RL pads it with pad tokens at step max + 1
    (``rl_trado.py:286``) and post_num=0 drops their targets; megadare's ``rl.canvas=eos`` response ends at the EOS.
    Same targets; dLLM-RL's inputs also mask the EOS block's pad positions (in every round of that block)."""
    P, L, bs, L1 = 8, 10, 4, 17
    for seed in range(4):
        s = make_sample(P, response(L, seed), bs, seed)
        ours = megadare_fragments(s, bs, shrink, block_family=True)
        tokens = s.response_ids + [PAD] * (L1 - L)
        theirs = drop_pad_targets(
            trado_fragments(trado_padded_step_map(s.commit_step, L1), bs, shrink), tokens, 0, True
        )
        assert [t for _, t in ours] == [t for _, t in theirs]
        eos_block_tail = set(range(L, -(-L // bs) * bs))
        for (m_ours, t), (m_theirs, _) in zip(ours, theirs):
            touches_eos_block = any(k // bs == (L - 1) // bs for k in t)
            assert m_theirs & set(range(L)) == m_ours
            assert m_theirs - set(range(L)) >= (eos_block_tail if touches_eos_block else set())


# ------------------------------------------------------------------ LLaDA / Dream
@pytest.mark.parametrize("shrink", [1, 2, 8])
def test_full_attention_fragments_are_dllm_rls(shrink):
    P, L, bs = 7, 24, 8  # LLaDA's semi-autoregressive blocks: the grouping is over the whole response either way
    for seed in range(4):
        s = make_sample(P, response(L, seed), bs, seed)
        ours = megadare_fragments(s, bs, shrink, block_family=False)
        assert ours == llada_fragments(s.commit_step, shrink)
        assert len(ours) == -(-len(set(s.commit_step)) // shrink)


@pytest.mark.parametrize("post_num", [0, 2])
@pytest.mark.parametrize("family", ["llada", "dream"])
def test_full_canvas_drops_targets_after_the_answer_as_dllm_rl(family, post_num):
    """rl.canvas=full replays the whole canvas, as dLLM-RL does; its post_num drops the pad targets after the
    first ``post_num`` (``rl_llada.py:265-276``, rows left without a target dropped, 401-406); megadare drops the
    positions after the answer's EOS beyond ``post_num`` (the trainer stamps the answer's length). Fails before:
    megadare scored every position of the canvas."""
    P, L, bs, answer = 7, 24, 8, 15
    algo, arch = REGISTRY["tracerl"]({"shrink": 2, "post_num": post_num}), tiny_arch(family)
    s = make_sample(P, response(answer - 1, 1) + [EOS] + [PAD] * (L - answer), bs, 1)
    s.extra[ANSWER_LENGTH] = answer
    ours = fragments_of(algo.views(s, arch, bs, None), P)
    theirs = drop_pad_targets(llada_fragments(s.commit_step, 2), s.response_ids, post_num, False)
    assert ours == theirs
    assert set().union(*(t for _, t in ours)) == set(range(answer + post_num))
    assert len(ours) < len(megadare_fragments(s, bs, 2, block_family=False))  # rows of pads only are gone


@pytest.mark.parametrize("family", ["llada", "sdar"])
def test_random_masking_drops_targets_after_the_answer(family):
    """dLLM-RL's random masking on LLaDA / Dream scores no pad beyond post_num and masks those pads in every input
    (``rl_llada.py:312-331``); on block families it masks them at random like any token (``rl_trado.py:552-555``
    only drops their targets)."""
    P, L, answer, post_num = 8, 16, 9, 1
    algo, arch = REGISTRY["random_mask_rl"]({"n_views": 12, "post_num": post_num}), tiny_arch(family)
    s = RLSample(
        prompt_ids=list(range(10, 10 + P)),
        response_ids=response(answer - 1, 2) + [EOS] + [PAD] * (L - answer),
        reward=1.0,
        advantage=1.0,
    )
    s.extra[ANSWER_LENGTH] = answer
    views = algo.views(s, arch, 4, torch.Generator().manual_seed(0))
    tail = P + answer + post_num
    assert views and all(bool((v.coef[tail:] == 0).all()) and bool((v.coef != 0).any()) for v in views)
    forced = [bool((v.tokens[tail:] == MASK).all()) for v in views]
    assert all(forced) if family == "llada" else not all(forced)
    s.extra.pop(ANSWER_LENGTH)  # a sample without it (eos canvas, tests): the whole response is the answer
    assert any(bool((v.coef[tail:] != 0).any()) for v in algo.views(s, arch, 4, torch.Generator().manual_seed(0)))


# ------------------------------------------------------------------ value model: step-level aggregation
def dllm_rl_step_returns(values, step_map, reward, gamma, lam):
    """``train_trado_value.py:752-848`` (one sequence, outcome reward, every position trainable): the reward on
    the last step's tokens, per-step means of r and V, R*, delta*, A* backwards, then token A_j, R_j."""
    steps = sorted(set(step_map))
    S = len(steps)
    r = [reward if st == steps[-1] else 0.0 for st in step_map]
    r_star = [sum(r[k] for k in range(len(r)) if step_map[k] == st) / step_map.count(st) for st in steps]
    v_star = [sum(values[k] for k in range(len(r)) if step_map[k] == st) / step_map.count(st) for st in steps]
    R, A = [0.0] * (S + 1), [0.0] * (S + 1)
    V = v_star + [0.0]
    for i in range(S - 1, -1, -1):
        R[i] = r_star[i] + gamma * R[i + 1]
        A[i] = r_star[i] - V[i] + gamma * V[i + 1] + gamma * lam * A[i + 1]
    rank = {st: i for i, st in enumerate(steps)}
    adv = [
        (r[k] - values[k]) + gamma * V[rank[st] + 1] + gamma * lam * A[rank[st] + 1] for k, st in enumerate(step_map)
    ]
    ret = [r[k] + gamma * R[rank[st] + 1] for k, st in enumerate(step_map)]
    return adv, ret


@pytest.mark.parametrize("block_family", [True, False])
@pytest.mark.parametrize("shrink", [1, 3])
def test_value_step_means_run_over_the_shrunk_trace(shrink, block_family):
    P, L, bs = 8, 14, 4
    for seed in range(3):
        s = make_sample(P, response(L, seed), bs, seed)
        steps = shrunk_steps(s, bs, shrink, block_family)
        theirs = (
            shrink_per_block(s.commit_step, bs, shrink) if block_family else collapse_k_unique(s.commit_step, shrink)
        )
        assert steps == theirs  # P a multiple of bs: dLLM-RL's blocks are the sampler's
        # one group per replayed fragment of each block (full attention: per fragment)
        for _, targets in megadare_fragments(s, bs, shrink, block_family):
            assert len({steps[k] for k in targets}) == (len({(P + k) // bs for k in targets}) if block_family else 1)
        values = [random.Random(seed).uniform(-1, 1) for _ in range(L)]
        for gamma, lam in [(1.0, 1.0), (0.9, 0.8)]:
            adv, ret = step_advantages(values, steps, 1.0, gamma, lam)
            ref_adv, ref_ret = dllm_rl_step_returns(values, theirs, 1.0, gamma, lam)
            assert adv == pytest.approx(ref_adv, abs=1e-12) and ret == pytest.approx(ref_ret, abs=1e-12)


@pytest.mark.parametrize("family,bs,tail", [("llada", 8, 0), ("sdar", 4, 0), ("llada", 8, 5)])
def test_trainer_value_advantages_are_dllm_rls(family, bs, tail):
    """The trainer's value_advantages on TraceRL's rows (shrink 3, gamma 0.9, lambda 0.8; packed micro-batches,
    V_old at the scored positions) against train_trado_value.py's aggregation over the shrunk step map and the
    trainable tokens (``tail`` pads after the answer on a full canvas, post_num 0: not trainable, 759-790). Over
    the raw steps (megadare before) the advantages differ."""
    block = family == "sdar"
    arch, algo = (
        tiny_arch(family, bs),
        REGISTRY["tracerl"]({"shrink": 3, "value_model": True, "gamma": 0.9, "lam": 0.8}),
    )
    P, L = 8, 14
    samples = []
    for i in range(3):
        s = make_sample(P, response(L - tail - 1, i) + [EOS] + [PAD] * tail, bs, 40 + i)
        s.index, s.reward = i, (1.0, 0.0, -1.0)[i]
        s.extra[ANSWER_LENGTH] = L - tail
        samples.append(s)
    values = {(i, k): random.Random(100 * i + k).uniform(-1, 1) for i in range(3) for k in range(L)}
    rows = algo.batch_rows(samples, arch, bs, lambda i: torch.Generator().manual_seed(i))
    mbs = pack_rows(rows, seq_length=max(len(r) for r in rows) + 4, micro_batch_size=2)
    for mb in mbs:
        keys = zip(mb.sample.flatten().tolist(), mb.tok.flatten().tolist(), (mb.head != 0).flatten().tolist())
        v = [values[(i, k)] if scored and k >= 0 else 0.0 for i, k, scored in keys]
        mb.extras["v_old"] = torch.tensor(v).view_as(mb.tok)
    value_advantages(algo.value_model, samples, mbs, functools.partial(algo.value_steps, arch=arch, block_size=bs))
    got = {}
    for mb in mbs:
        sel = (mb.head != 0) & (mb.tok >= 0)
        for i, k, a in zip(mb.sample[sel].tolist(), mb.tok[sel].tolist(), mb.adv[sel].tolist()):
            got[(i, k)] = a
    trainable = [k for k in range(L) if k < L - tail]  # is_pad / post_num 0 (train_trado_value.py:759-766)
    assert set(got) == {(i, k) for i in range(3) for k in trainable}
    for s in samples:
        full = shrink_per_block(s.commit_step, bs, 3) if block else collapse_k_unique(s.commit_step, 3)
        vs, steps = [values[(s.index, k)] for k in trainable], [full[k] for k in trainable]
        want, _ = dllm_rl_step_returns(vs, steps, s.reward, 0.9, 0.8)
        assert [got[(s.index, k)] for k in trainable] == pytest.approx(want, abs=1e-6)  # fp32 in the micro-batch
        if s.reward:
            raw, _ = dllm_rl_step_returns(vs, [s.commit_step[k] for k in trainable], s.reward, 0.9, 0.8)
            assert max(abs(a - b) for a, b in zip(raw, want)) > 1e-3
