"""The shared block denoising step and the SGLang plugin's core loop, without sglang:

(a) ``dllm_step`` against an independent re-implementation of SDAR-style static / dynamic low-confidence decoding;
(b) the plugin's core loop (``BlockDenoiser``), driven block by block the way sglang's scheduler drives a request,
    reproduces the built-in engine (tokens, global and block-local steps, log-probs) and its output converts into
    a validated Trajectory.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from megadare.rollout import dllm_step as ds
from megadare.rollout import sglang_engine as se
from megadare.rollout import sglang_plugin as sp
from megadare.rollout.dllm_step import BlockState, BlockTrace, Streams, dllm_step
from megadare.rollout.engine import SamplingParams, prompt_seed
from megadare.rollout.native import NativeEngine, NativeSettings
from megadare.rollout.sampling import SAMPLE, stream_uniforms

from block_toy import V, MASK, EOS, B, PROMPTS, ToyBlockLM, toy_arch, block_logits


# ---------------------------------------------------------------------------------------------- (a) the step
def _ref_filter(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    out = logits.clone()
    if top_k > 0:
        kth = logits.sort(dim=-1, descending=True).values[..., top_k - 1 : top_k]
        out[logits < kth] = -math.inf
    if top_p < 1.0:
        probs, order = F.softmax(out, -1).sort(dim=-1, descending=True)
        before = probs.cumsum(-1) - probs  # mass of strictly more likely tokens
        drop_sorted = before > top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        out[drop] = -math.inf
    return out


def _ref_draw(probs: torch.Tensor, u: float) -> int:
    """Inverse CDF in float64: the first index whose cumulative probability exceeds u."""
    cum = probs.double().cumsum(0)
    return min(int((cum <= u * float(cum[-1])).sum()), int(probs.nonzero().max()))


def _ref_step(logits, tokens, masked, s, params, keys, counters):
    """SDAR generate.py's step (block of B, S steps) with LLaDA-style temperature/top-k/top-p sampling; row b
    draws from its own stream (key keys[b], at its step count counters[b]), and only while it has a masked
    position."""
    logits = logits.clone().float()
    logits[..., MASK] = -math.inf
    n, Bn, _ = logits.shape
    if params.temperature == 0:
        tok = logits.argmax(-1)
        logp = torch.zeros(n, Bn)
    else:
        lp_all = F.log_softmax(_ref_filter(logits / params.temperature, params.top_k, params.top_p), -1)
        u = stream_uniforms(torch.tensor(keys), torch.tensor(counters), SAMPLE, Bn)
        tok = tokens.clone()
        for b in range(n):
            if masked[b].any():
                tok[b] = torch.tensor([_ref_draw(lp_all[b, c].exp(), float(u[b, c])) for c in range(Bn)])
        logp = lp_all.gather(-1, tok[..., None])[..., 0]
    conf = F.softmax(logits, -1).gather(-1, tok[..., None])[..., 0]
    S = params.steps_per_block
    quota = Bn // S + (1 if s < Bn % S else 0)
    pick = torch.zeros(n, Bn, dtype=torch.bool)
    for b in range(n):
        k = min(quota, int(masked[b].sum()))
        if k == 0:
            continue
        c = torch.where(masked[b], conf[b], torch.tensor(-math.inf))
        high = (c > params.threshold) & masked[b]
        if params.algorithm == "low_confidence_dynamic" and int(high.sum()) >= k:
            pick[b] = high
        else:
            pick[b, c.topk(k).indices] = True
    return torch.where(pick, tok, tokens), pick, logp, conf


STEP_PARAMS = [
    SamplingParams(block_size=8, steps_per_block=4, algorithm="low_confidence_static"),
    SamplingParams(block_size=8, steps_per_block=3, algorithm="low_confidence_dynamic", threshold=0.3),
    SamplingParams(
        block_size=8, steps_per_block=4, algorithm="low_confidence_static", temperature=0.9, top_k=6, top_p=0.85
    ),
    SamplingParams(
        block_size=8, steps_per_block=2, algorithm="low_confidence_dynamic", threshold=0.25, temperature=1.3, top_p=0.9
    ),
]


@pytest.mark.parametrize("params", STEP_PARAMS, ids=["static", "dynamic", "static-sampled", "dynamic-sampled"])
def test_dllm_step_matches_reference(params):
    torch.manual_seed(0)
    W, Pz, U = torch.randn(V, V) * 2.5, torch.randn(8, V) * 2.0, torch.randn(V, V) * 0.5
    tokens = torch.full((3, 8), MASK)
    tokens[0, :3] = torch.tensor([1, 2, 3])  # a prompt remainder at the block start
    tokens[2, :1] = torch.tensor([4])
    ref_tokens = tokens.clone()
    keys, counters = [7, 8, 9], [0, 4, 1]  # any stream keys, any step counts so far
    trace = BlockTrace(3)
    for s in range(params.steps_per_block):
        masked = tokens == MASK
        if not masked.any():
            break
        # a function of the block's current tokens: token, position and block-context terms
        logits = W[tokens] + Pz + (F.one_hot(tokens, V).float().sum(1) @ U)[:, None]
        res = dllm_step(logits, BlockState(tokens, masked), s, params, Streams.of(keys, counters), mask_token_id=MASK)
        ref_new, ref_pick, ref_logp, ref_conf = _ref_step(
            logits, ref_tokens, ref_tokens == MASK, s, params, keys, counters
        )
        assert torch.equal(res.committed, ref_pick) and torch.equal(res.tokens, ref_new)
        assert torch.allclose(res.logprobs[res.committed], ref_logp[ref_pick], atol=1e-6)
        act = masked.any(1)
        assert torch.equal(res.active, act) and torch.allclose(res.confidence[act], ref_conf[act], atol=1e-6)
        assert (res.tokens != MASK).sum() > (tokens != MASK).sum()  # every step commits something
        trace.add(res, s)
        counters = [c + int(a) for c, a in zip(counters, act)]
        tokens, ref_tokens = res.tokens, ref_new
    assert not (tokens == MASK).any()  # S steps finish a block
    for b in range(3):  # every decoded position recorded once, at its step
        decoded = [c for c in range(8) if c not in trace.records[b]]
        assert len(decoded) == (3, 0, 1)[b]
        assert all(f == s for f, s, _ in trace.records[b].values())
        assert all(lp <= 0 for _, _, lp in trace.records[b].values())


def test_dllm_step_never_predicts_mask_and_finishes_past_schedule():
    logits = torch.zeros(1, 4, V)
    logits[..., MASK] = 100.0  # the model loves the mask token
    tokens = torch.full((1, 4), MASK)
    res = dllm_step(
        logits,
        BlockState(tokens, tokens == MASK),
        9,
        SamplingParams(block_size=4, steps_per_block=2),
        Streams.of([0]),
        mask_token_id=MASK,
    )
    assert res.committed.all() and not (res.tokens == MASK).any()  # step 9 > S: commits every masked position
    with pytest.raises(ValueError, match="block has 3 positions"):
        dllm_step(
            torch.zeros(1, 3, V),
            BlockState(torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 3, dtype=torch.bool)),
            0,
            SamplingParams(block_size=4, steps_per_block=2),
            Streams.of([0]),
        )
    with pytest.raises(ValueError, match="one per row"):
        dllm_step(
            torch.zeros(2, 4, V),
            BlockState(torch.full((2, 4), MASK), torch.ones(2, 4, dtype=torch.bool)),
            0,
            SamplingParams(block_size=4, steps_per_block=2),
            Streams.of([0]),
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_dllm_step_leaves_the_callers_logits_untouched(dtype, temperature):
    """The mask token is forbidden in the step's own float32 copy (bf16 logits: filled in place in the upcast one),
    never in the caller's logits (the SGLang plugin hands sglang's own)."""
    logits = torch.randn(2, 4, V, generator=torch.Generator().manual_seed(0)).to(dtype)
    logits[..., MASK] = 100.0
    before = logits.clone()
    tokens = torch.full((2, 4), MASK)
    params = SamplingParams(block_size=4, steps_per_block=4, temperature=temperature)
    res = dllm_step(logits, BlockState(tokens, tokens == MASK), 0, params, Streams.of([0, 1]), mask_token_id=MASK)
    assert torch.equal(logits, before)
    assert not (res.proposals == MASK).any() and res.committed.sum() == 2


# ---------------------------------------------------------------------------------------------- (b) the core loop
def drive_request(
    core: sp.BlockDenoiser, model: ToyBlockLM, prompt: list[int], params: SamplingParams, index: int = 0
) -> dict[str, Any]:
    """One request (the ``index``-th prompt of a generate() call) through the plugin core the way sglang serves
    it: complete prompt blocks are prefilled, the first decode block starts with the prompt's remainder, each block
    is denoised by ``denoise_block`` (forward, step, ..., final forward), the trace goes out per emitted token; stop
    after the block holding EOS. Returns what sglang's generate() returns for the request."""
    pre = len(prompt) // B * B
    grid, out, trace, forwards = list(prompt[:pre]), [], [], 0
    custom = {
        sp.CUSTOM_PARAMS_KEY: {
            "algorithm": params.algorithm,
            "steps_per_block": params.steps_per_block,
            "threshold": params.threshold,
            "seed": prompt_seed(params.seed, index),
        }
    }
    rparams = core.params_for(
        params.temperature if params.temperature > 0 else 0.0,
        params.top_p,
        params.top_k if params.top_k > 0 else -1,
        custom,
    )
    rng = sp.RequestStream(rparams.seed)  # lives on the Req for the whole generation
    first = True
    while len(out) < params.max_new_tokens:
        head = list(prompt[pre:]) if first else []
        block = torch.tensor([head + [MASK] * (B - len(head))])
        state = core.new_state(rparams, rng)
        block = core.denoise_block(lambda t: block_logits(model, grid, t), block, [state])
        entries, forwards = core.trace_entries(state, forwards)
        emitted = block[0, len(head) :].tolist()
        assert len(entries) == len(emitted)
        out += emitted
        trace += entries
        grid += block[0].tolist()
        first = False
        if params.stop_at_eos and EOS in emitted:
            break
    finish: dict[str, Any] = {"type": "length"}
    if params.stop_at_eos and EOS in out[: params.max_new_tokens]:
        out = out[: out.index(EOS) + 1]
        finish = {"type": "stop", "matched": EOS}
    out = out[: params.max_new_tokens]
    return {"output_ids": out, "meta_info": {"finish_reason": finish, sp.TRACE_KEY: trace[: len(out)]}}


CORE_PARAMS = [
    SamplingParams(max_new_tokens=10, block_size=B, steps_per_block=4, stop_at_eos=False),
    SamplingParams(
        max_new_tokens=10,
        block_size=B,
        steps_per_block=2,
        algorithm="low_confidence_dynamic",
        threshold=0.6,
        stop_at_eos=False,
    ),
    SamplingParams(
        max_new_tokens=9,
        block_size=B,
        steps_per_block=4,
        temperature=0.8,
        top_k=8,
        top_p=0.95,
        seed=3,
        stop_at_eos=False,
    ),
    SamplingParams(
        max_new_tokens=12,
        block_size=B,
        steps_per_block=2,
        algorithm="random",
        temperature=1.0,
        seed=11,
        stop_at_eos=False,
    ),
    SamplingParams(max_new_tokens=16, block_size=B, steps_per_block=4, temperature=1.2, seed=1),
]


@pytest.mark.parametrize("params", CORE_PARAMS, ids=["static", "dynamic", "sampled", "random", "sampled-eos"])
def test_plugin_core_reproduces_native_engine(params):
    model = ToyBlockLM()
    native = NativeEngine(model, toy_arch(), eos_token_id=EOS, device="cpu", settings=NativeSettings(use_cache=False))
    core = sp.BlockDenoiser(B, MASK, {"block_size": B, "steps_per_block": 4})
    greedy = params.temperature == 0
    # one batched native call: prompt i draws from its own stream seeded prompt_seed(seed, i) in both engines
    natives = native.generate(PROMPTS, params)
    finishes = set()
    for i, (prompt, nat) in enumerate(zip(PROMPTS, natives)):
        out = drive_request(core, model, prompt, params, index=i)
        traj = se.trajectory_from_output(prompt, out, params, EOS, policy_version=4)  # validates
        assert traj.response_ids == nat.response_ids
        assert traj.commit_step == nat.commit_step and traj.block_step == nat.block_step
        assert traj.logprobs == pytest.approx(nat.logprobs, abs=1e-6)
        assert traj.finish_reason == nat.finish_reason and traj.policy_version == 4
        assert traj.num_forwards == nat.num_forwards
        finishes.add(traj.finish_reason)
        if not greedy:
            assert any(lp < 0 for lp in traj.logprobs)
        assert len(set(traj.commit_step)) > 1
    if params.stop_at_eos:
        assert "eos" in finishes  # the EOS path was exercised


def test_request_params_translate_sglang_conventions():
    core = sp.BlockDenoiser(B, MASK, {"steps_per_block": 2, "algorithm": "low_confidence_dynamic", "threshold": 0.7})
    greedy = core.params_for(temperature=1.0, top_p=1.0, top_k=1, rid="abc")  # sglang's form of temperature 0
    assert greedy.temperature == 0 and greedy.top_k == 0 and greedy.steps_per_block == 2
    assert greedy.algorithm == "low_confidence_dynamic" and greedy.threshold == 0.7
    assert greedy.seed == core.params_for(top_k=1, rid="abc").seed != core.params_for(top_k=1, rid="abd").seed
    sampled = core.params_for(
        temperature=0.7,
        top_p=0.9,
        top_k=1 << 30,
        sampling_seed=5,
        custom_params={"megadare": {"algorithm": "random", "steps_per_block": 4}},
    )
    assert (sampled.temperature, sampled.top_k, sampled.top_p, sampled.seed) == (0.7, 0, 0.9, 5)
    assert sampled.algorithm == "random" and sampled.steps_per_block == 4
    assert core.params_for(temperature=0.7, sampling_seed=5, custom_params={"megadare": {"seed": 9}}).seed == 9
    with pytest.raises(ValueError, match="unknown keys"):
        core.params_for(custom_params={"megadare": {"steps": 2}})
    with pytest.raises(ValueError, match="steps_per_block=8 > block_size=4"):
        core.params_for(custom_params={"megadare": {"steps_per_block": 8}})
    with pytest.raises(ValueError, match="unknown keys"):
        sp.BlockDenoiser(B, MASK, {"temperature": 1.0})


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_propose_in_chunks_equals_one_pass_and_never_predicts_the_mask(monkeypatch, temperature):
    """dllm_step.propose (MDPO's later-block predictions) samples a few positions at a time: the same proposals
    and probabilities as one pass over all of them, from the rows' streams after the block's positions."""
    logits = torch.randn(3, 7, 40, generator=torch.Generator().manual_seed(0)) * 3
    logits[..., 39] = 50.0  # the mask token would win every position
    params = SamplingParams(max_new_tokens=8, block_size=4, temperature=temperature, record_steps=True)
    streams = ds.Streams.of([11, 12, 13], [0, 2, 5])
    whole = ds.propose(logits, params, streams, offset=4, mask_token_id=39)
    monkeypatch.setattr(ds, "PROPOSE_CHUNK", 2)
    parts = ds.propose(logits, params, streams, offset=4, mask_token_id=39)
    assert torch.equal(whole[0], parts[0]) and torch.equal(whole[1], parts[1]) and not (whole[0] == 39).any()
    if temperature > 0:  # position j draws the stream's uniform at offset + j
        u = streams.uniforms(ds.SAMPLE, 11)[:, 4:]
        flat = (logits / temperature).index_fill(-1, torch.tensor([39]), float("-inf"))
        cdf = torch.softmax(flat.double(), -1).cumsum(-1)
        assert torch.equal(whole[0], torch.searchsorted(cdf, u[..., None].double(), right=True).squeeze(-1))
