"""The built-in engine's samplers: cache vs no cache, batch invariance, independent re-implementations of the
SDAR block-diffusion and LLaDA semi-AR samplers, recorded log-probs, the trajectory contract."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from megadare.rollout.dllm_step import commit_counts
from megadare.rollout.engine import SamplingParams, Trajectory, prompt_seed
from megadare.rollout.decoders import SemiARDecoder
from megadare.rollout.native import NativeEngine, NativeSettings
from megadare.rollout.sampling import (
    REMASK,
    CommitRule,
    filter_logits,
    select_commits,
    stream_uniforms,
)

from native_traces import build

EOS, MASK = 253, 255
PROMPTS = [[5, 17, 99, 3, 42, 7], [11, 2], [8, 8, 8, 8, 21, 60, 61, 62, 63], [4, 5, 6, 7]]


def _engine(
    family: str, use_cache: bool = True, seed: int = 0, full_attention_cache: str = "none", **over
) -> NativeEngine:
    model, arch = build(family, seed, **over)  # tiny, perturbed: peaked predictions, confidences differ clearly
    return NativeEngine(
        model,
        arch,
        eos_token_id=EOS,
        device="cpu",
        settings=NativeSettings(use_cache=use_cache, full_attention_cache=full_attention_cache),
    )


BLOCK_FAMILIES = ["sdar", "llada2"]
PARAMS = [
    SamplingParams(max_new_tokens=10, block_size=4, steps_per_block=4, stop_at_eos=False),
    SamplingParams(
        max_new_tokens=10,
        block_size=4,
        steps_per_block=2,
        algorithm="low_confidence_dynamic",
        threshold=0.3,
        stop_at_eos=False,
    ),
]


@pytest.mark.parametrize("family", BLOCK_FAMILIES)
@pytest.mark.parametrize("params", PARAMS, ids=["static", "dynamic"])
def test_block_diffusion_cache_equals_no_cache(family, params):
    cached = _engine(family, True).generate(PROMPTS, params)
    plain = _engine(family, False).generate(PROMPTS, params)
    for a, b in zip(cached, plain):
        assert a.response_ids == b.response_ids and a.commit_step == b.commit_step
        assert len(a.response_ids) == 10 and a.finish_reason == "length"


BATCH_PARAMS = [
    SamplingParams(max_new_tokens=8, block_size=4, steps_per_block=4, stop_at_eos=False),
    SamplingParams(
        max_new_tokens=8,
        block_size=4,
        steps_per_block=2,
        temperature=1.0,
        top_k=20,
        algorithm="random",
        seed=5,
        stop_at_eos=False,
    ),
    SamplingParams(
        max_new_tokens=12,
        block_size=4,
        steps_per_block=4,
        temperature=0.9,
        threshold=0.05,
        algorithm="low_confidence_dynamic",
        seed=9,
    ),
]


@pytest.mark.parametrize("params", BATCH_PARAMS, ids=["greedy", "sampled-random", "sampled-dynamic-eos"])
@pytest.mark.parametrize("family", ["sdar", "llada", "dream"])
def test_batch_does_not_change_any_sample(family, params):
    """Prompt i of a batch draws from its own stream, seeded prompt_seed(seed, i): alone with that seed (prompt 0
    gets the seed itself) or in a reversed batch, its trajectory is the same (rows that finish a block early, or
    stop at EOS, draw nothing more, so they do not shift anyone's stream)."""
    eng = _engine(family)
    batch = eng.generate(PROMPTS, params)
    rev = eng.generate(PROMPTS[::-1], params)
    for i, (p, t) in enumerate(zip(PROMPTS, batch)):
        alone = eng.generate([p], dataclasses.replace(params, seed=prompt_seed(params.seed, i)))[0]
        assert (alone.response_ids, alone.commit_step) == (t.response_ids, t.commit_step)
        assert alone.logprobs == pytest.approx(t.logprobs, abs=1e-5)  # padded batch vs alone: float rounding
    if params.temperature > 0:  # reversed order: other indices, other streams
        assert [t.response_ids for t in rev[::-1]] != [t.response_ids for t in batch]
        assert any(lp < 0 for t in batch for lp in t.logprobs)


# ------------------------------------------------------------------ independent re-implementations
def _reference_block_diffusion(model, prompt, params) -> tuple[list[int], list[int]]:
    """SDAR generate.py, one sample, no cache: the whole grid of blocks is re-run every step."""
    B, S = params.block_size, params.steps_per_block
    P = len(prompt)
    n_blocks = math.ceil((P + params.max_new_tokens) / B)
    x = torch.full((1, n_blocks * B), MASK)
    x[0, :P] = torch.tensor(prompt)
    blocks = torch.arange(n_blocks * B) // B
    mask = (blocks[None, :] <= blocks[:, None])[None, None]
    steps = torch.full((n_blocks * B,), -1)
    step = 0
    quota = [B // S + (1 if s < B % S else 0) for s in range(S)]
    for k in range(P // B, n_blocks):
        lo, hi = k * B, (k + 1) * B
        for s in range(S):
            masked = x[0, lo:hi] == MASK
            if not masked.any():
                break
            logits = model(x[:, :hi], attention_mask=mask[..., :hi, :hi])[0, lo:hi].float()
            logits[:, MASK] = -math.inf
            probs = F.softmax(logits, -1)
            tok = probs.argmax(-1)
            conf = torch.where(masked, probs.gather(-1, tok[:, None])[:, 0], torch.tensor(-math.inf))
            n = min(quota[s], int(masked.sum()))
            high = conf > params.threshold
            if params.algorithm == "low_confidence_dynamic" and int(high.sum()) >= n:
                pick = high
            else:
                pick = torch.zeros(B, dtype=torch.bool)
                pick[torch.topk(conf, n).indices] = True
            x[0, lo:hi] = torch.where(pick, tok, x[0, lo:hi])
            steps[lo:hi][pick] = step
            step += 1
    resp = x[0, P : P + params.max_new_tokens]
    return resp.tolist(), steps[P : P + params.max_new_tokens].tolist()


@pytest.mark.parametrize("params", PARAMS, ids=["static", "dynamic"])
def test_block_sampler_matches_reference_implementation(params):
    eng = _engine("sdar")
    for p, t in zip(PROMPTS, eng.generate(PROMPTS, params)):
        tokens, steps = _reference_block_diffusion(eng.model, p, params)
        assert t.response_ids == tokens and t.commit_step == steps


def _reference_llada(model, prompt, params, shift: bool) -> tuple[list[int], list[int]]:
    """LLaDA generate(): prompt ++ masks, semi-AR blocks, low-confidence remasking, greedy, no cache."""
    B, S, G = params.block_size, params.steps_per_block, params.max_new_tokens
    P = len(prompt)
    x = torch.full((1, P + G), MASK)
    x[0, :P] = torch.tensor(prompt)
    steps = torch.full((G,), -1)
    step = 0
    for k in range(G // B):
        lo, hi = P + k * B, P + (k + 1) * B
        n_mask = int((x[0, lo:hi] == MASK).sum())
        quota = [n_mask // S + (1 if s < n_mask % S else 0) for s in range(S)]
        for s in range(S):
            logits = model(x)[0].float()
            if shift:
                logits = torch.cat([logits[:1], logits[:-1]])
            logits[:, MASK] = -math.inf
            probs = F.softmax(logits, -1)
            tok = probs.argmax(-1)
            conf = probs.gather(-1, tok[:, None])[:, 0]
            conf[:lo] = -math.inf
            conf[hi:] = -math.inf
            conf[x[0] != MASK] = -math.inf
            idx = torch.topk(conf, quota[s]).indices
            x[0, idx] = tok[idx]
            steps[idx - P] = step
            step += 1
    return x[0, P:].tolist(), steps.tolist()


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_semi_ar_sampler_matches_llada_reference(family):
    params = SamplingParams(max_new_tokens=8, block_size=4, steps_per_block=2, stop_at_eos=False)
    eng = _engine(family)
    for p, t in zip(PROMPTS, eng.generate(PROMPTS, params)):
        tokens, steps = _reference_llada(eng.model, p, params, shift=family == "dream")
        assert t.response_ids == tokens and t.commit_step == steps


# ------------------------------------------------------------------ log-probs of temperature sampling
@pytest.mark.parametrize("family", ["sdar", "llada"])
def test_recorded_logprobs_equal_the_model_at_the_recorded_step(family):
    # lengths on the block grid (prompts of 6 and 2 tokens), so the trajectory holds every decoded token
    params = SamplingParams(
        max_new_tokens=10 if family == "sdar" else 8,
        block_size=4,
        steps_per_block=4,
        temperature=0.7,
        top_k=40,
        top_p=0.95,
        seed=3,
        stop_at_eos=False,
    )
    eng = _engine(family)
    trajs = eng.generate(PROMPTS[:2], params)
    block_family = eng.arch.attention == "block_causal"
    for t in trajs:
        P, resp = len(t.prompt_ids), torch.tensor(t.response_ids)
        steps = torch.tensor(t.commit_step)
        for k, (tok, s, lp) in enumerate(zip(t.response_ids, t.commit_step, t.logprobs)):
            state = torch.where(steps < s, resp, torch.full_like(resp, MASK))
            if block_family:  # the grid up to the end of the token's block, block-causal
                end = ((P + k) // 4 + 1) * 4
                ids = torch.cat([torch.tensor(t.prompt_ids), state])[:end]
                bl = torch.arange(end) // 4
                logits = eng.model(ids[None], attention_mask=(bl[None, :] <= bl[:, None])[None, None])[0, P + k]
            else:  # whole sequence (the response region is max_new_tokens long), bidirectional
                ids = torch.cat([torch.tensor(t.prompt_ids), state])
                logits = eng.model(ids[None])[0, P + k]
            logits = logits.float()
            logits[MASK] = -math.inf
            ref = F.log_softmax(filter_logits(logits[None] / 0.7, 40, 0.95), -1)[0, tok]
            assert abs(float(ref) - lp) < 1e-4, (k, float(ref), lp)
        # top-p can leave one candidate (log-prob 0); the sampled stream must still show real draws
        assert len(set(t.commit_step)) > 1 and all(lp <= 0 for lp in t.logprobs) and any(lp < 0 for lp in t.logprobs)


# ------------------------------------------------------------------ contract, EOS, weights
@pytest.mark.parametrize("family", ["sdar", "llada"])
def test_eos_stops_after_its_block(family):
    eng = _engine(family)
    free = eng.generate([[1, 2, 3]], SamplingParams(max_new_tokens=12, block_size=4, stop_at_eos=False))[0]
    eng.eos = free.response_ids[5]  # pretend the 6th response token is EOS
    first = free.response_ids.index(eng.eos)
    t = eng.generate([[1, 2, 3]], SamplingParams(max_new_tokens=12, block_size=4))[0]
    assert t.finish_reason == "eos" and t.response_ids == free.response_ids[: first + 1]
    assert t.commit_step == free.commit_step[: first + 1]


def test_trajectory_contract():
    eng = _engine("sdar")
    params = SamplingParams(max_new_tokens=12, block_size=4, steps_per_block=4)
    bad = Trajectory(
        prompt_ids=[1],
        response_ids=[2, 3],
        commit_step=[0],
        block_step=[0, 0],
        logprobs=[0.0, 0.0],
        finish_reason="eos",
        num_forwards=1,
        params=params,
    )
    with pytest.raises(ValueError, match="commit_step has 1 entries for 2"):
        bad.validate()
    with pytest.raises(ValueError, match="block_size=8 differs"):
        eng.generate([[1]], SamplingParams(block_size=8, steps_per_block=4))


def test_update_weights_changes_generation_and_checks_names():
    a, b = _engine("sdar", seed=0), _engine("sdar", seed=1)
    params = SamplingParams(max_new_tokens=8, block_size=4, steps_per_block=4, stop_at_eos=False)
    before = a.generate(PROMPTS, params)
    info = a.update_weights(b.model.state_dict().items(), version=7)
    assert info["version"] == 7 and a.health()["version"] == 7
    after, ref = a.generate(PROMPTS, params), b.generate(PROMPTS, params)
    assert [t.response_ids for t in after] == [t.response_ids for t in ref] != [t.response_ids for t in before]
    assert after[0].policy_version == 7
    with pytest.raises(KeyError, match="no tensor 'nope'"):
        a.update_weights([("nope", torch.zeros(1))], 8)


def test_commit_selection_rules():
    conf = torch.tensor([[0.9, 0.1, 0.95, 0.5], [0.2, 0.3, 0.1, 0.4]])
    masked = torch.tensor([[True, True, True, False], [True, True, True, True]])
    n = torch.tensor([1, 2])
    assert select_commits(conf, masked, n, CommitRule("low_confidence_static")).tolist() == [
        [False, False, True, False],
        [False, True, False, True],
    ]
    dyn = select_commits(conf, masked, n, CommitRule("low_confidence_dynamic", threshold=0.8))
    assert dyn[0].tolist() == [True, False, True, False]  # both above threshold (>= n)
    assert dyn[1].tolist() == [False, True, False, True]  # none above: top-n
    even = SamplingParams(block_size=10, steps_per_block=4)  # LLaDA's get_num_transfer_tokens: remainder first
    assert commit_counts(torch.ones(4, 10, dtype=torch.bool), torch.arange(4), even).tolist() == [3, 3, 2, 2]
    u = stream_uniforms(torch.tensor([0, 1]), torch.tensor([0, 0]), REMASK, 4)
    rnd = select_commits(conf, masked, torch.tensor([2, 3]), CommitRule("random"), uniforms=u)
    assert rnd.sum(1).tolist() == [2, 3] and not (rnd & ~masked).any()
    assert rnd[0].tolist() == [bool(i in u[0, :3].argsort()[:2]) for i in range(4)]  # the smallest keys
    assert rnd[1].tolist() == u[1].argsort().argsort().lt(3).tolist()


@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("mode", ["prefix", "dual"])
def test_full_attention_cache_reproduces_the_state_it_was_built_from(family, mode):
    """Fast-dLLM caches: right after the block-start forward (no token committed since), recomputing only the
    block (and the suffix for 'prefix') against the cache gives exactly the full forward's logits; after a commit
    the cached approximation differs from an exact forward."""
    params = SamplingParams(max_new_tokens=8, block_size=4, steps_per_block=4, stop_at_eos=False)
    prompts = [[5, 17, 99, 3, 42, 7], [11, 2, 9, 4]]  # the second row is left-padded
    decoders = []
    for m in (mode, "none"):
        dec = SemiARDecoder(_engine(family, full_attention_cache=m), prompts, params)
        dec.admit(0, [0, 1])
        decoders.append(dec)
    cached, exact = decoders
    cols = cached.dev["start"][:2, None] + torch.arange(4)
    cur = cached.dev["tokens"][:2].gather(1, cols)
    first = cached.block_logits(2, cols, 0, cur)
    assert torch.allclose(first, cached.block_logits(2, cols, 1, cur), atol=1e-5)
    assert torch.allclose(first, exact.block_logits(2, cols, 1, cur), atol=1e-5)
    cur = cur.clone()
    cur[:, 0] = 5  # a commit at the block's first position
    assert not torch.allclose(exact.block_logits(2, cols, 1, cur), cached.block_logits(2, cols, 1, cur), atol=1e-6)


@pytest.mark.parametrize("mode", ["prefix", "dual"])
def test_full_attention_cache_decodes_valid_trajectories(mode):
    params = SamplingParams(max_new_tokens=8, block_size=4, steps_per_block=4, stop_at_eos=False)
    eng = _engine("llada", full_attention_cache=mode)
    trajs = eng.generate(PROMPTS, params)
    plain = _engine("llada").generate(PROMPTS, params)
    assert all(len(t.response_ids) == 8 for t in trajs)
    assert eng.forwards > 0
    # the first commit happens before any cache is used: identical to exact decoding
    for t, p in zip(trajs, plain):
        first = [k for k in range(8) if t.commit_step[k] == 0]
        assert first and [t.response_ids[k] for k in first] == [p.response_ids[k] for k in first]


def test_generate_refuses_asleep_and_empty_prompts():
    """An asleep engine and an empty prompt list / prompt are refused (engine.check_generate_call), not decoded."""
    eng = _engine("sdar")
    params = PARAMS[0]
    for bad in ([], [[5, 6], []]):
        with pytest.raises(ValueError, match="non-empty prompts"):
            eng.generate(bad, params)
    eng.sleep()
    with pytest.raises(RuntimeError, match="asleep: call wake"):
        eng.generate(PROMPTS[:1], params)
    eng.wake()
    assert len(eng.generate(PROMPTS[:1], params)[0].response_ids) == params.max_new_tokens
