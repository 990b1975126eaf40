"""The publishers' decoders in megadare's samplers, against the publishers' own logic (tests/publisher_decoders.py):

(a) the pure pieces, exhaustively on random logits with the same random numbers on both sides (the
    publishers' draw replaced by megadare's stream, ``publisher_decoders.DRAW``): Dream's ``sample_tokens``
    (proposal and maskgit_plus / topk_margin / entropy confidence, every filter and temperature), LLaDA2.1's
    ``_sample_with_temperature_topk_topp`` (proposal and x0_p), Dream's linspace counts, ``alg_temp`` draws;
(b) whole decodes on tiny random models, token for token and step for step: Dream's ``_sample`` (one block,
    linspace schedule) and DARE's Dream block sampler (``linspace_first``, entropy; top-p 0.95 as the DARE Dream
    presets) in the built-in engine, greedy and sampled; LLaDA2.1's ``generate()`` with token editing in the
    built-in engine (KV cached), greedy and sampled, including the commits its edits overwrote;
(c) the config keys, refused up front with their names.
(Traces with edits, their replay, the SGLang plugin: tests/test_edit_trace.py.)
"""

from __future__ import annotations

import pytest
import torch

import publisher_decoders
from megadare.config import load_config
from megadare.trainer.checks import validate
from megadare.errors import ConfigError
from megadare.models import build_hf_model, get_family
from megadare.rollout.dllm_step import ranking_confidence
from megadare.rollout.engine import SamplingParams
from megadare.rollout.native import NativeEngine
from megadare.rollout.sampling import (
    REMASK,
    SAMPLE,
    CommitRule,
    SamplingRule,
    dream_confidence,
    linspace_counts,
    sample_tokens,
    select_commits,
    stream_uniforms,
)

from publisher_decoders import (
    DREAM_ALG,
    dare_dream_block_generate,
    dream_generate,
    dream_sample_tokens,
    llada21_generate,
    llada21_sample,
    stream_draw,
)

EOS, MASK = 253, 255
PROMPTS = [[5, 17, 99, 3, 42, 7], [11, 2, 9]]
# a dense and an MoE layer of 4 experts (top-2 in 2 groups): the MoE forward is what a decode step costs here
LLADA2_SMALL = dict(block_size=4, num_hidden_layers=2, num_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1)


def _engine(family: str, **over) -> NativeEngine:
    torch.manual_seed(0)
    fam = get_family(family)
    cfg = fam.tiny_config(**over)
    model = build_hf_model(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)  # peaked predictions: confidences differ clearly
    return NativeEngine(model, fam.arch(cfg), eos_token_id=EOS, device="cpu")


# ---------------------------------------------------------------------------------------------- (a) pure pieces
FILTERS = [(0, 1.0), (5, 1.0), (0, 0.9)]  # (top_k, top_p): Dream filters top-p before top-k, so never both


@pytest.fixture
def draws_from(monkeypatch):
    """The publishers' draws from megadare's stream with key ``k`` (publisher_decoders.DRAW)."""
    return lambda key: monkeypatch.setattr(publisher_decoders, "DRAW", stream_draw(key))


def _uniforms(key: int, step: int, width: int) -> torch.Tensor:
    return stream_uniforms(torch.tensor([key]), torch.tensor([step]), SAMPLE, width)[0]


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.3])
def test_dream_sample_tokens_and_confidence_rules(temperature, draws_from):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(40, 50, generator=gen) * 3
    draws_from(11)
    for top_k, top_p in FILTERS:
        for rule, kw in DREAM_ALG.items():
            ref_conf, ref_x0 = dream_sample_tokens(logits, temperature, top_p=top_p, top_k=top_k or None, step=3, **kw)
            x0, logp, _ = sample_tokens(logits, temperature, top_k, top_p, _uniforms(11, 3, 40))
            assert torch.equal(x0, ref_x0), (rule, top_k, top_p)
            conf = dream_confidence(logits, x0, rule, SamplingRule(temperature, top_k, top_p))
            assert torch.allclose(conf, ref_conf, atol=1e-6), (rule, top_k, top_p)
            if temperature > 0:  # the recorded log-prob is the proposal's under Dream's sampling distribution
                p = dream_confidence(logits, x0, "maskgit_plus", SamplingRule(temperature, top_k, top_p))
                assert torch.allclose(logp.exp(), p, atol=1e-6)


@pytest.mark.parametrize("temperature", [0.0, 0.8, 1.0])
def test_llada21_proposal_and_confidence(temperature, draws_from):
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(1, 32, 60, generator=gen) * 3
    draws_from(5)
    for top_k, top_p in FILTERS + [(7, 0.8)]:
        ref_x0, ref_p = llada21_sample(logits, temperature, top_k, top_p, step=2)
        params = SamplingParams(
            block_size=32, steps_per_block=1, algorithm="editing", temperature=temperature, top_k=top_k, top_p=top_p
        )
        x0, _, model_prob = sample_tokens(logits, temperature, top_k, top_p, _uniforms(5, 2, 32)[None])
        assert torch.equal(x0, ref_x0)
        assert torch.allclose(ranking_confidence(logits, x0, model_prob, params), ref_p, atol=1e-6)


def test_linspace_counts_are_dreams():
    for eps in (1e-3, 0.1, 0.5):
        for steps in range(1, 13):
            ts = torch.linspace(1, eps, steps + 1)
            for n in range(0, 33):
                for i in range(steps):
                    num = torch.tensor([[True] * n + [False] * 3]).sum() / 1  # Dream: mask_index.sum() / batch
                    ref = int(num * (1 - ts[i + 1] / ts[i])) if i < steps - 1 else int(num)
                    got = int(linspace_counts(torch.tensor([n]), torch.tensor([i]), steps, eps)[0])
                    assert got == ref, (eps, steps, n, i)


def test_alg_temp_draws_positions_with_dreams_probabilities():
    """k = 1: position frequencies follow Dream's softmax(confidence / alg_temp) over the masked positions;
    k > 1 draws without replacement; alg_temp 0 is the plain top-k."""
    conf = torch.tensor([[-0.5, -2.0, -1.0, -0.1, -3.0, -0.7]])
    masked = torch.tensor([[True, True, False, True, True, True]])
    full = torch.where(masked, conf / 0.5, torch.tensor(float("-inf")))
    expect = torch.softmax(full, -1)[0]
    draws = 4000  # one row per draw: the stream of key 0 at counters 0..3999
    u = stream_uniforms(torch.zeros(draws, dtype=torch.long), torch.arange(draws), REMASK, 6)
    picks = select_commits(
        conf.expand(draws, 6),
        masked.expand(draws, 6),
        torch.ones(draws, dtype=torch.long),
        CommitRule("low_confidence_static", alg_temp=0.5),
        uniforms=u,
    )
    counts = picks.float().sum(0)
    assert torch.allclose(counts / draws, expect, atol=0.03) and counts[2] == 0 and (picks.sum(1) == 1).all()
    three = select_commits(
        conf, masked, torch.tensor([3]), CommitRule("low_confidence_static", alg_temp=0.5), uniforms=u[:1]
    )
    assert int(three.sum()) == 3 and not three[0, 2]
    top = select_commits(conf, masked, torch.tensor([2]), CommitRule("low_confidence_static"))
    assert top[0].nonzero().flatten().tolist() == [0, 3]


# ---------------------------------------------------------------------------------------------- (b) whole decodes
def _final_steps(trace: dict[int, list[tuple[int, int]]], n: int) -> list[int]:
    return [trace[k][-1][0] for k in range(n)]


DREAM_RUNS = [  # (sampling params, reference): Dream's own (the response is one block) and DARE's block sampler
    (
        SamplingParams(
            max_new_tokens=8,
            block_size=8,
            steps_per_block=4,
            schedule="linspace",
            confidence="entropy",
            stop_at_eos=False,
        ),
        "dream",
    ),
    (
        SamplingParams(
            max_new_tokens=8,
            block_size=8,
            steps_per_block=5,
            schedule="linspace",
            confidence="topk_margin",
            stop_at_eos=False,
        ),
        "dream",
    ),
    (
        SamplingParams(
            max_new_tokens=8,
            block_size=8,
            steps_per_block=4,
            schedule="linspace",
            eps=0.2,
            confidence="maskgit_plus",
            temperature=0.8,
            top_p=0.95,
            seed=4,
            stop_at_eos=False,
        ),
        "dream",
    ),
    (
        SamplingParams(
            max_new_tokens=8,
            block_size=4,
            steps_per_block=3,
            schedule="linspace_first",
            confidence="entropy",
            stop_at_eos=False,
        ),
        "dare_block",
    ),
    (
        SamplingParams(
            max_new_tokens=8,
            block_size=4,
            steps_per_block=3,
            schedule="linspace_first",
            confidence="entropy",
            temperature=1.0,
            seed=2,
            stop_at_eos=False,
        ),
        "dare_block",
    ),
    (  # the Dream DARE presets' decoder: rollout_utils.py passes top_p=0.95 when temperature > 0
        SamplingParams(
            max_new_tokens=16,
            block_size=8,
            steps_per_block=4,
            schedule="linspace_first",
            confidence="entropy",
            temperature=1.0,
            top_p=0.95,
            seed=5,
            stop_at_eos=False,
        ),
        "dare_block",
    ),
]


@pytest.mark.parametrize(
    "params,ref",
    DREAM_RUNS,
    ids=["entropy", "margin", "maskgit-sampled", "dare-block", "dare-block-sampled", "dare-block-top-p"],
)
def test_dream_decoders_match_the_publishers(params, ref, draws_from):
    eng = _engine("dream")
    G, rule = params.max_new_tokens, params.confidence
    draws_from(params.seed)  # each prompt alone: prompt 0's stream, key = the seed
    for p in PROMPTS:
        if ref == "dream":
            tokens, trace = dream_generate(
                eng.model,
                p,
                G,
                params.steps_per_block,
                rule,
                MASK,
                params.eps,
                params.temperature,
                params.top_p,
                params.top_k or None,
            )
        else:
            tokens, trace = dare_dream_block_generate(
                eng.model,
                p,
                G,
                params.block_size,
                params.steps_per_block * G // params.block_size,
                MASK,
                params.eps,
                params.temperature,
                params.top_p,
                params.top_k or None,
            )
        t = eng.generate([p], params)[0]
        assert t.response_ids == tokens
        assert t.commit_step == _final_steps(trace, G)
        assert len(set(t.commit_step)) > 2
        if params.temperature > 0:
            assert all(lp < 0 for lp in t.logprobs)


EDIT_RUNS = [  # (params, prompt): one prompt each, one whose decode edits (each forward of the MoE model costs)
    (
        SamplingParams(
            max_new_tokens=8,
            block_size=4,
            algorithm="editing",
            threshold=0.6,
            editing_threshold=0.3,
            max_post_steps=3,
            stop_at_eos=False,
        ),
        PROMPTS[1],
    ),
    (
        SamplingParams(
            max_new_tokens=8,
            block_size=4,
            algorithm="editing",
            threshold=0.9,
            editing_threshold=0.3,
            max_post_steps=2,
            temperature=0.9,
            top_k=40,
            seed=1,
            stop_at_eos=False,
        ),
        PROMPTS[0],
    ),
]


@pytest.mark.parametrize("params,p", EDIT_RUNS, ids=["greedy", "sampled"])
def test_llada21_editing_matches_the_publisher(params, p, draws_from):
    """The built-in engine (block KV cache) against LLaDA2.1's generate(): tokens, the step of every commit, and
    the commits edits overwrote; the runs do edit."""
    eng = _engine("llada2", **LLADA2_SMALL)
    draws_from(params.seed)
    tokens, trace = llada21_generate(
        eng.model,
        p,
        params.max_new_tokens,
        params.block_size,
        MASK,
        params.temperature,
        params.top_k,
        params.top_p,
        params.threshold,
        params.editing_threshold,
        params.max_post_steps,
        params.num_to_transfer,
    )
    t = eng.generate([p], params)[0]
    assert t.response_ids == tokens
    assert t.commit_step == _final_steps(trace, len(tokens))
    got = sorted((e.position, e.commit_step, e.token) for e in t.superseded)
    assert got == sorted((k, s, tok) for k, chain in trace.items() for s, tok in chain[:-1] if k < len(tokens))
    assert len(got) > 0


# ---------------------------------------------------------------------------------------------- (c) config
@pytest.mark.parametrize(
    "overrides,message",
    [
        (["rollout.confidence=entropy", "rollout.algorithm=random"], "rollout.confidence"),
        (["rollout.alg_temp=0.5", "rollout.algorithm=low_confidence_dynamic"], "rollout.alg_temp"),
        (["rollout.schedule=linspace_first", "rollout.block_size=4", "rollout.steps_per_block=1"], "rollout.schedule"),
        (["rollout.confidence=entropy", "rollout.top_k=5", "rollout.top_p=0.9"], "rollout.confidence"),
        (["rollout.algorithm=editing", "rollout.schedule=linspace"], "rollout.algorithm"),
        (["rollout.algorithm=editing", "rollout.editing_threshold=1.5"], "rollout.editing_threshold"),
        (["rollout.algorithm=editing", "algo.name=mdpo"], "rollout.algorithm=editing: mdpo"),
        (["rollout.algorithm=editing", "algo.name=tracerl", "algo.params={shrink: 4}"], "algo.params.shrink=1"),
        (["rollout.confidence=bogus"], "rollout.confidence='bogus' is not one of"),
    ],
)
def test_decoder_keys_are_checked_up_front(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        validate(load_config(None, overrides), None)


def test_decoder_keys_reach_the_sampler():
    from megadare.rollout.setup import sampling_params

    cfg = load_config(
        None,
        [
            "rollout.algorithm=editing",
            "rollout.editing_threshold=0.5",
            "rollout.max_post_steps=4",
            "rollout.num_to_transfer=2",
            "rollout.threshold=0.7",
        ],
    )
    validate(cfg, None)
    arch = get_family("llada2").arch(get_family("llada2").tiny_config(block_size=4))
    p = sampling_params(cfg, arch, seed=0)
    assert (p.algorithm, p.editing_threshold, p.max_post_steps, p.num_to_transfer, p.threshold) == (
        "editing",
        0.5,
        4,
        2,
        0.7,
    )
    cfg = load_config(
        None,
        [
            "rollout.confidence=entropy",
            "rollout.schedule=linspace_first",
            "rollout.eps=0.01",
            "rollout.alg_temp=0.2",
            "rollout.block_size=8",
            "rollout.steps_per_block=4",
        ],
    )
    validate(cfg, None)
    p = sampling_params(cfg, get_family("dream").arch(get_family("dream").tiny_config()), seed=0)
    assert (p.confidence, p.schedule, p.eps, p.alg_temp) == ("entropy", "linspace_first", 0.01, 0.2)
