"""MDPO step-wise scores, per-step group normalisation and top-K steps; d-TreeRPO local advantages."""
from __future__ import annotations

import pytest
import torch

from megadare.algos.base import RLSample
from megadare.algos.mdpo import MDPO, step_scores


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


def test_d_treerpo_local_advantages():
    from megadare.algos.d_treerpo import local_advantages

    # branch 2, depth 2: leaves [1, 0 | 1, 1] -> node values [0.5, 1.0]
    adv = local_advantages([1.0, 0.0, 1.0, 1.0], branch=2, depth=2)
    assert adv[0] == pytest.approx([-0.25, 0.25])          # nodes vs the mean of siblings (0.75)
    assert adv[1] == pytest.approx([0.5, -0.5, 0.0, 0.0])  # leaves vs their siblings
