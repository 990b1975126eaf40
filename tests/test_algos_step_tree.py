"""MDPO step-wise scores, per-step group normalisation, top-K steps (batch / sample), intermediate answers over
semi-AR blocks and the engine's response-aligned step predictions; d-TreeRPO local advantages."""

from __future__ import annotations

import pytest
import torch

from megadare.algos.base import RLSample
from megadare.algos.d_treerpo import DTreeRPO
from megadare.algos.mdpo import MDPO, intermediate_answer, step_scores, top_steps
from megadare.trainer.offpolicy.correction import reindex


def test_step_scores_formula():
    # s_t = (r_t - r_{t-1}) + 1 + mean_{t'>t} r_t'; the last step adds r_T
    assert step_scores([0.0, 1.0, 1.0]) == pytest.approx([0 + 1 + 1.0, 1 + 1 + 1.0, 0 + 1 + 1.0])
    assert step_scores([1.0, 0.0]) == pytest.approx([1 + 1 + 0.0, -1 + 1 + 0.0])


def _sample(i, group, preds, response):
    return RLSample(
        prompt_ids=[1, 2],
        response_ids=response,
        reward=0.0,
        advantage=0.0,
        index=i,
        group=group,
        commit_step=[0, 1, 2],
        block_step=[0, 1, 2],
        extra={"step_predictions": preds, "step_confidences": [[0.5] * 3] * 3},
    )


def test_prepare_normalises_per_step_and_keeps_top_k():
    algo = MDPO({"top_k_steps": 2})
    # reward = 1 when the intermediate answer is [7, 7, 7]; committed tokens override predictions
    good = _sample(0, 0, [[7, 7, 7], [7, 7, 7], [7, 7, 7]], [7, 7, 7])
    bad = _sample(1, 0, [[7, 0, 0], [0, 0, 0], [0, 0, 0]], [7, 0, 0])
    algo.prepare([good, bad], lambda rs, idx: [float(r == [7, 7, 7]) for r in rs], group_size=2)
    assert good.extra["step_rewards"] == [1.0, 1.0, 1.0] and bad.extra["step_rewards"] == [0.0, 0.0, 0.0]
    for t in range(3):  # two members per step: +-1/sqrt(2) after unbiased-std normalisation
        a, b = good.extra["step_adv"][t], bad.extra["step_adv"][t]
        assert a == pytest.approx(-b) and abs(a) == pytest.approx(1 / 2**0.5, rel=1e-4)
    assert len(good.extra["steps"]) == 2
    # the views replay x_t with the intermediate predictions as targets, scored only where x_t is masked
    from megadare.models import get_family

    arch = get_family("llada").arch(get_family("llada").tiny_config())
    views = algo.views(good, arch, 8, torch.Generator())
    for v in views:
        masked = v.tokens == arch.mask_token_id
        assert torch.equal(v.coef > 0, masked)
        assert v.labels[masked].tolist() == [7] * int(masked.sum())


def test_one_response_per_prompt_keeps_its_step_scores_as_dare():
    """rl.n_samples=1: DARE's ``compute_step_wise_advantage`` (mdpo_algos.py:134-158 @83ae8a3) gives a uid of one
    mean 0 and std 1, so each step keeps s_t / (1 + 1e-6) (megadare gave 0: MDPO never learned); a group of two
    left with one response (the other empty, dropped) still gets 0. The config accepts n_samples=1 for MDPO with
    grpo (its advantages are its own) and refuses rloo, which the rollout computes and refuses every step."""
    from megadare.config import load_config
    from megadare.errors import ConfigError
    from megadare.trainer.checks import validate

    algo = MDPO({"top_k_steps": 2})
    good = _sample(0, 0, [[7, 7, 7], [7, 7, 7], [7, 7, 7]], [7, 7, 7])
    bad = _sample(1, 1, [[7, 0, 0], [0, 0, 0], [0, 0, 0]], [7, 0, 0])
    reward = lambda rs, idx: [float(r == [7, 7, 7]) for r in rs]  # noqa: E731
    algo.prepare([good, bad], reward, group_size=1)
    for s in (good, bad):
        want = [x / (1 + 1e-6) for x in step_scores(s.extra["step_rewards"])]
        assert [s.extra["step_adv"][t] for t in range(3)] == pytest.approx(want, rel=1e-12)
    assert good.extra["step_adv"][0] == pytest.approx(3 / (1 + 1e-6))
    algo.prepare([good], reward, group_size=2)
    assert list(good.extra["step_adv"].values()) == [0.0, 0.0, 0.0]
    validate(load_config(None, ["algo.name=mdpo", "rl.n_samples=1", "advantage.estimator=grpo"]), None)
    with pytest.raises(ConfigError, match="rl.n_samples=1 with advantage.estimator=rloo"):
        validate(load_config(None, ["algo.name=mdpo", "rl.n_samples=1", "advantage.estimator=rloo"]), None)


def test_intermediate_answer_over_blocks():
    # tokens committed before t stay; step t's proposals fill the rest; the answer stops where t predicted nothing
    resp, commit = [1, 2, 3, 4, 5, 6], [0, 1, 2, 2, 3, 4]
    assert intermediate_answer(resp, commit, [9, 9, 8, 8, -1, -1], 2) == [1, 2, 8, 8]
    assert intermediate_answer(resp, commit, [-1, -1, -1, -1, 7, 7], 3) == [1, 2, 3, 4, 7, 7]
    assert intermediate_answer(resp, commit, [-1] * 6, 0) == []


def test_top_k_steps_across_the_batch_or_per_sample():
    a = RLSample([1], [2], 0.0, 0.0, index=0, extra={"step_adv": {0: 0.1, 1: 2.0, 2: 0.2}})
    b = RLSample([1], [2], 0.0, 0.0, index=1, extra={"step_adv": {0: 1.5, 1: 0.1, 2: 0.0, 3: 0.3}})
    top_steps([a, b], 2, "batch")  # importance |A| summed over samples: 0 -> 1.6, 1 -> 2.1, 2 -> 0.2, 3 -> 0.3
    assert a.extra["steps"] == [0, 1] and b.extra["steps"] == [0, 1]
    top_steps([a, b], 2, "sample")
    assert a.extra["steps"] == [1, 2] and b.extra["steps"] == [0, 3]
    with pytest.raises(ValueError, match="top_k_scope"):
        MDPO({"top_k_scope": "global"})


@pytest.mark.parametrize("family", ["sdar", "llada"])
def test_step_predictions_sit_on_response_positions(family):
    """At the step that committed a token, that step's proposal at the token's response position is the token --
    also when the prompt's remainder shares the first block (SDAR, prompt length 7 with block 4) and the response
    spans several blocks; earlier blocks are -1, and so are later ones of a block-causal model (a full-attention
    step predicts every later position too, as DARE's MDPO rollout)."""
    from megadare.models import build_hf_model, get_family
    from megadare.rollout.engine import SamplingParams
    from megadare.rollout.native import NativeEngine

    torch.manual_seed(0)
    fam = get_family(family)
    cfg = fam.tiny_config(**({"block_size": 4} if family == "sdar" else {}))
    eng = NativeEngine(build_hf_model(cfg), fam.arch(cfg), eos_token_id=253, device="cpu")
    params = SamplingParams(
        max_new_tokens=9, block_size=4, steps_per_block=2, temperature=1.0, seed=1, stop_at_eos=False, record_steps=True
    )
    for t in eng.generate([[5, 6, 7, 8, 9, 10, 11], [5, 6]], params):
        assert len(t.step_predictions) == t.num_forwards
        for j, (tok, step) in enumerate(zip(t.response_ids, t.commit_step)):
            assert t.step_predictions[step][j] == tok and t.step_confidences[step][j] > 0
        for step, pred in enumerate(t.step_predictions):  # from the step's block on, contiguous
            got = [j for j, p in enumerate(pred) if p >= 0]
            assert got and got == list(range(got[0], got[-1] + 1))
            if family == "sdar":  # its own block only: at most 4 positions
                assert len(got) <= 4
            else:  # the block and everything after it
                assert got[-1] == len(pred) - 1 and got[0] % 4 == 0


def test_d_treerpo_local_advantages_exclude_the_node():
    from megadare.algos.d_treerpo import local_advantages

    # branch 2, depth 2: leaves [1, 0 | 1, 1] -> node values [0.5, 1.0]; baseline = the other siblings (DARE)
    adv = local_advantages([1.0, 0.0, 1.0, 1.0], branch=2, depth=2)
    assert adv[0] == pytest.approx([-0.5, 0.5])
    assert adv[1] == pytest.approx([1.0, -1.0, 0.0, 0.0])
    # root fan-out 3, branch 2: 6 leaves; the root's children are compared with the 2 others
    adv = local_advantages([1, 1, 1, 0, 0, 0], branch=2, depth=2, fanout=3)
    assert adv[0] == pytest.approx([1.0 - 0.25, 0.5 - 0.5, 0.0 - 0.75])
    assert adv[1] == pytest.approx([0.0, 0.0, 1.0, -1.0, 0.0, 0.0])


def test_d_treerpo_fans_out_to_the_group_size_or_refuses_in_the_dry_run():
    from megadare.algos.d_treerpo import DTreeRPO
    from megadare.config import load_config
    from megadare.trainer.checks import validate
    from megadare.errors import ConfigError

    assert DTreeRPO().fanout(8) == 2 and DTreeRPO().fanout(16) == 4 and DTreeRPO({"root_fanout": 4}).fanout(16) == 4
    with pytest.raises(ConfigError, match="rl.n_samples=6"):
        validate(load_config(None, ["algo.name=d_treerpo", "rl.n_samples=6"]), None)
    with pytest.raises(ConfigError, match="root_fanout"):
        validate(load_config(None, ["algo.name=d_treerpo", "rl.n_samples=8", "algo.params={root_fanout: 4}"]), None)


def test_d_treerpo_branch_points_fall_on_blocks():
    from megadare.algos.d_treerpo import level_ends

    # full attention, 8 blocks of 32 over 256 tokens, depth 2: branch after 4 blocks (DARE's [T, T/2, 0])
    assert level_ends(50, 256, 32, 2, global_grid=False) == [128, 256]
    # the demo: SDAR block 4, prompt of 7 (3 in the first decode block), 4 new tokens: blocks [1 | 3]
    assert level_ends(7, 4, 4, 2, global_grid=True) == [1, 4]
    assert level_ends(7, 12, 4, 3, global_grid=True) == [1, 5, 12]


def test_d_treerpo_self_distillation_gradient_equals_dare_kl():
    """The coefficients put on the siblings' token slots reproduce the gradient of DARE's
    lambda_t mean_{(parent, j)} KL(q_j || p(. | parent)_j) (``_compute_self_distillation_loss``), computed here
    directly from q and a table of parent log-probs."""
    from megadare.algos.d_treerpo import DTreeRPO, sd_schedule

    algo = DTreeRPO({"sd_max_steps": 10})
    sibs = [
        RLSample([1], y, 0.0, a, index=i, extra={"parent": (0, 1, 0), "rollout_step": 4})
        for i, (y, a) in enumerate([([5, 6, 7], 1.0), ([5, 8], 0.5), ([9, 6, 7], -0.5), ([5], 2.0)])
    ]
    other = [RLSample([2], [3], 0.0, 1.0, index=9, extra={"parent": (1, 1, 0), "rollout_step": 4})]  # only child
    coef = algo.self_distillation(sibs + other)
    V, J = 12, 3
    logits = torch.randn(J, V, dtype=torch.float64, requires_grad=True)  # the parent state's predictions
    logp = torch.log_softmax(logits, -1)
    lam, tau = sd_schedule(4, algo.p)
    pos = [s for s in sibs if s.advantage > 0]
    w = torch.softmax(torch.tensor([s.advantage for s in pos], dtype=torch.float64) / tau, 0)
    kls = []
    for j in range(J):
        q = torch.zeros(V, dtype=torch.float64)
        for s, wi in zip(pos, w):
            if j < len(s.response_ids):
                q[s.response_ids[j]] += wi
        q = q / q.sum()
        kls.append((q[q > 0] * (q[q > 0].log() - logp[j][q > 0])).sum())
    (want,) = torch.autograd.grad(lam * torch.stack(kls).mean(), logits, retain_graph=True)
    mine = -sum(c * logp[j][sibs[i].response_ids[j]] for (i, j), c in coef.items())
    (got,) = torch.autograd.grad(mine, logits)
    assert lam > 0 and torch.allclose(got, want, atol=1e-12)
    assert all(i != 9 for i, _ in coef) and all(sibs[i].advantage > 0 for i, _ in coef)


def test_d_treerpo_replayed_tree_keeps_its_own_siblings():
    """D-ARL replay brings nodes of an older step's tree into the batch, renumbered into a group of their own
    (correction.reindex) but with their ``extra['parent']`` as built: (group in its step, level, node). A
    replayed tree of prompt group 0 has the names of the fresh tree of group 0; self-distillation pooled the two
    as one sibling family (the positive nodes of both trees in one softmax, distilled towards each other's
    segments though their parent states are different prompts)."""

    def tree(prompt: int, version: int, adv: float) -> list[RLSample]:
        return [
            RLSample(
                [prompt],
                y,
                0.0,
                a,
                index=i,
                group=0,
                policy_version=version,
                extra={"parent": (0, 1, 0), "rollout_step": 4},
            )
            for i, (y, a) in enumerate([([5, 6], adv), ([7, 8], -adv)])
        ]

    fresh = tree(1, version=3, adv=1.0)
    replayed = reindex(tree(2, version=2, adv=0.5), fresh)
    algo = DTreeRPO({"sd_max_steps": 10})
    got = algo.self_distillation(fresh + replayed)
    apart = [RLSample(**{**vars(s), "extra": {**s.extra, "parent": ("another tree",)}}) for s in replayed]
    assert got == algo.self_distillation(fresh + apart)
    assert {i for i, _ in got} == {0, 2}  # each tree's positive node, as its family's only positive
