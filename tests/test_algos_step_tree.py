"""MDPO step-wise scores, per-step group normalisation, top-K steps (batch / sample), intermediate answers over
semi-AR blocks and the engine's response-aligned step predictions; d-TreeRPO local advantages."""
from __future__ import annotations

import pytest
import torch

from megadare.algos.base import RLSample
from megadare.algos.mdpo import MDPO, intermediate_answer, step_scores, top_steps


def test_step_scores_formula():
    # s_t = (r_t - r_{t-1}) + 1 + mean_{t'>t} r_t'; the last step adds r_T
    assert step_scores([0.0, 1.0, 1.0]) == pytest.approx([0 + 1 + 1.0, 1 + 1 + 1.0, 0 + 1 + 1.0])
    assert step_scores([1.0, 0.0]) == pytest.approx([1 + 1 + 0.0, -1 + 1 + 0.0])


def _sample(i, group, preds, response):
    return RLSample(prompt_ids=[1, 2], response_ids=response, reward=0.0, advantage=0.0, index=i, group=group,
                    commit_step=[0, 1, 2], block_step=[0, 1, 2],
                    extra={"step_predictions": preds, "step_confidences": [[0.5] * 3] * 3})


def test_prepare_normalises_per_step_and_keeps_top_k():
    algo = MDPO({"top_k_steps": 2})
    # reward = 1 when the intermediate answer is [7, 7, 7]; committed tokens override predictions
    good = _sample(0, 0, [[7, 7, 7], [7, 7, 7], [7, 7, 7]], [7, 7, 7])
    bad = _sample(1, 0, [[7, 0, 0], [0, 0, 0], [0, 0, 0]], [7, 0, 0])
    algo.prepare([good, bad], lambda rs, idx: [float(r == [7, 7, 7]) for r in rs], group_size=2)
    assert good.extra["step_rewards"] == [1.0, 1.0, 1.0] and bad.extra["step_rewards"] == [0.0, 0.0, 0.0]
    for t in range(3):  # two members per step: +-1/sqrt(2) after unbiased-std normalisation
        a, b = good.extra["step_adv"][t], bad.extra["step_adv"][t]
        assert a == pytest.approx(-b) and abs(a) == pytest.approx(1 / 2 ** 0.5, rel=1e-4)
    assert len(good.extra["steps"]) == 2
    # the views replay x_t with the intermediate predictions as targets, scored only where x_t is masked
    from megadare.models import get_family

    arch = get_family("llada").arch(get_family("llada").tiny_config())
    views = algo.views(good, arch, 8, torch.Generator())
    for v in views:
        masked = v.tokens == arch.mask_token_id
        assert torch.equal(v.coef > 0, masked)
        assert v.labels[masked].tolist() == [7] * int(masked.sum())


def test_intermediate_answer_over_blocks():
    # tokens committed before t stay; step t's proposals fill the rest; the answer stops where t predicted nothing
    resp, commit = [1, 2, 3, 4, 5, 6], [0, 1, 2, 2, 3, 4]
    assert intermediate_answer(resp, commit, [9, 9, 8, 8, -1, -1], 2) == [1, 2, 8, 8]
    assert intermediate_answer(resp, commit, [-1, -1, -1, -1, 7, 7], 3) == [1, 2, 3, 4, 7, 7]
    assert intermediate_answer(resp, commit, [-1] * 6, 0) == []


def test_top_k_steps_across_the_batch_or_per_sample():
    a = RLSample([1], [2], 0.0, 0.0, index=0, extra={"step_adv": {0: 0.1, 1: 2.0, 2: 0.2}})
    b = RLSample([1], [2], 0.0, 0.0, index=1, extra={"step_adv": {0: 1.5, 1: 0.1, 2: 0.0, 3: 0.3}})
    top_steps([a, b], 2, "batch")        # importance |A| summed over samples: 0 -> 1.6, 1 -> 2.1, 2 -> 0.2, 3 -> 0.3
    assert a.extra["steps"] == [0, 1] and b.extra["steps"] == [0, 1]
    top_steps([a, b], 2, "sample")
    assert a.extra["steps"] == [1, 2] and b.extra["steps"] == [0, 3]
    with pytest.raises(ValueError, match="top_k_scope"):
        MDPO({"top_k_scope": "global"})


@pytest.mark.parametrize("family", ["sdar", "llada"])
def test_step_predictions_sit_on_response_positions(family):
    """At the step that committed a token, that step's proposal at the token's response position is the token --
    also when the prompt's remainder shares the first block (SDAR, prompt length 7 with block 4) and the response
    spans several blocks; positions of other blocks are -1."""
    from megadare.models import build_hf_model, get_family
    from megadare.rollout.engine import SamplingParams
    from megadare.rollout.native import NativeEngine

    torch.manual_seed(0)
    fam = get_family(family)
    cfg = fam.tiny_config(**({"block_size": 4} if family == "sdar" else {}))
    eng = NativeEngine(build_hf_model(cfg), fam.arch(cfg), eos_token_id=253, device="cpu")
    params = SamplingParams(max_new_tokens=9, block_size=4, steps_per_block=2, temperature=1.0, seed=1,
                            stop_at_eos=False, record_steps=True)
    for t in eng.generate([[5, 6, 7, 8, 9, 10, 11], [5, 6]], params):
        assert len(t.step_predictions) == t.num_forwards
        for j, (tok, step) in enumerate(zip(t.response_ids, t.commit_step)):
            assert t.step_predictions[step][j] == tok and t.step_confidences[step][j] > 0
        for step, pred in enumerate(t.step_predictions):   # one block per step: at most 4 positions predicted
            got = [j for j, p in enumerate(pred) if p >= 0]
            assert 0 < len(got) <= 4 and got == list(range(got[0], got[-1] + 1))


def test_d_treerpo_local_advantages():
    from megadare.algos.d_treerpo import local_advantages

    # branch 2, depth 2: leaves [1, 0 | 1, 1] -> node values [0.5, 1.0]
    adv = local_advantages([1.0, 0.0, 1.0, 1.0], branch=2, depth=2)
    assert adv[0] == pytest.approx([-0.25, 0.25])          # nodes vs the mean of siblings (0.75)
    assert adv[1] == pytest.approx([0.5, -0.5, 0.0, 0.0])  # leaves vs their siblings
