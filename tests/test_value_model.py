"""TraceRL's diffusion value model: step-level GAE against an independent computation, and a real Megatron
value model (backbone + zero-init head, own optimizer) whose baseline lowers advantage variance on a toy."""

from __future__ import annotations

import random

import pytest
import torch

from megadare.algos.value_model import step_advantages, value_loss
from megadare.parallel.launch import spawn
from tiny import write_tiny_hf  # noqa: E402

pytestmark = pytest.mark.timeout(600)


def _gae_by_sums(values, steps, reward, gamma, lam):
    """Independent form: per-step means, then A*_t = sum_{l>=0} (gamma lam)^l delta*_{t+l}, R*_t = discounted sum."""
    order = sorted(set(steps))
    T = len(order)
    vbar = [sum(v for v, s in zip(values, steps) if s == st) / steps.count(st) for st in order] + [0.0]
    r = [0.0] * (T - 1) + [reward]
    delta = [r[t] - vbar[t] + gamma * vbar[t + 1] for t in range(T)]
    Astar = [sum((gamma * lam) ** l * delta[t + l] for l in range(T - t)) for t in range(T)] + [0.0]
    Rstar = [sum(gamma**l * r[t + l] for l in range(T - t)) for t in range(T)] + [0.0]
    adv, ret = [], []
    for v, s in zip(values, steps):
        t = order.index(s)
        adv.append(r[t] - v + gamma * vbar[t + 1] + gamma * lam * Astar[t + 1])
        ret.append(r[t] + gamma * Rstar[t + 1])
    return adv, ret


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.9, 0.8), (0.5, 0.0)])
def test_step_advantages_match_independent_sums(gamma, lam):
    rng = random.Random(0)
    steps = [0, 0, 2, 1, 5, 5, 3, 2]
    values = [rng.uniform(-1, 1) for _ in steps]
    adv, ret = step_advantages(values, steps, 1.0, gamma, lam)
    ref_adv, ref_ret = _gae_by_sums(values, steps, 1.0, gamma, lam)
    assert adv == pytest.approx(ref_adv, abs=1e-12) and ret == pytest.approx(ref_ret, abs=1e-12)
    if gamma == lam == 1.0:  # A_j = R - V_j
        assert adv == pytest.approx([1.0 - v for v in values], abs=1e-12)


def test_value_loss_clipping():
    v_old, ret = torch.tensor([0.0, 0.0]), torch.tensor([1.0, 1.0])
    v = torch.tensor([0.5, 0.1], requires_grad=True)
    loss = value_loss(v, v_old, ret, clip=0.2)
    # first: clipped value 0.2 is further from the return -> the clipped term (constant in v) wins
    assert loss.tolist() == pytest.approx([0.5 * 0.8**2, 0.5 * 0.9**2])
    loss.sum().backward()
    assert v.grad.tolist() == pytest.approx([0.0, -0.9])


def _train_value(rank, world, hf_dir):
    from megadare.algos.base import RLSample
    from megadare.algos.tracerl import TraceRL
    from megadare.algos.value_model import ValueObjective, attach_value_head, values_of
    from megadare.config import config_from_dict
    from megadare.parallel import destroy_distributed, init_distributed
    from megadare.data.rows import global_denominator, pack_rows
    from megadare.trainer.model_setup import build_training_chunks, resolve_model_source
    from megadare.trainer.optim import OptimSettings, build_optimizer, wrap_ddp
    from megadare.trainer.step import store_outputs as _store_outputs
    from megadare.trainer.policy import Policy
    from megadare.trainer.step import Readout, RowFormat, train_step

    init_distributed()
    try:
        cfg = config_from_dict({"model": {"hf_path": hf_dir}})
        src = resolve_model_source(cfg)
        chunks = build_training_chunks(cfg, src)
        attach_value_head(chunks)
        model = wrap_ddp(chunks, True)
        opt, sched = build_optimizer(model, OptimSettings(lr=3e-3, total_steps=1000, lr_decay_style="constant"))
        algo = TraceRL()
        rng = random.Random(1)
        easy, hard = [5, 6, 7, 8], [40, 41, 42, 43]
        p_success = {0: 0.9, 1: 0.1}
        resp = [10, 11, 12, 13]

        def batch(n):
            samples = []
            for i in range(n):
                kind = i % 2
                r = float(rng.random() < p_success[kind])
                samples.append(
                    RLSample(
                        prompt_ids=easy if kind == 0 else hard,
                        response_ids=resp,
                        reward=r,
                        advantage=0.0,
                        index=i,
                        group=kind,
                        commit_step=[0, 1, 2, 3],
                        block_step=[0, 1, 2, 3],
                    )
                )
            return samples

        def rows_of(samples):
            rows = []
            for s in samples:
                for row in algo.rows(s, src.arch, 4, torch.Generator().manual_seed(s.index)):
                    row.extras["v_old"] = torch.zeros(len(row))
                    row.extras["ret"] = torch.full((len(row),), s.reward)
                    rows.append(row)
            return rows

        for _ in range(40):
            mbs = pack_rows(rows_of(batch(16)), 256, 4)
            for mb in mbs:  # v_old from the current model (the clip acts around it)
                mb.extras["v_old"] = torch.zeros_like(mb.weight)
            _store_outputs(
                model, mbs, "v_old", RowFormat("block_diffusion", 4, src.arch.vocab_size), Readout(values_of)
            )
            train_step(
                Policy(model, opt, sched),
                mbs,
                global_denominator(mbs),
                RowFormat("block_diffusion", 4, src.arch.vocab_size),
                objective=ValueObjective(clip=10.0),
                readout=Readout(per_position=values_of),
            )
        test = batch(400)
        mbs = pack_rows(rows_of(test), 256, 4)
        _store_outputs(model, mbs, "v", RowFormat("block_diffusion", 4, src.arch.vocab_size), Readout(values_of))
        v_by_sample: dict[int, list[float]] = {}
        for mb in mbs:
            sel = mb.head != 0
            for s, v in zip(mb.sample[sel].tolist(), mb.extras["v"][sel].tolist()):
                v_by_sample.setdefault(s, []).append(v)
        rewards = torch.tensor([s.reward for s in test])
        baseline = torch.tensor([sum(v_by_sample[s.index]) / len(v_by_sample[s.index]) for s in test])
        kinds = torch.tensor([s.group for s in test])
        return {
            "var_mean_baseline": float((rewards - rewards.mean()).var()),
            "var_value_baseline": float((rewards - baseline).var()),
            "v_easy": float(baseline[kinds == 0].mean()),
            "v_hard": float(baseline[kinds == 1].mean()),
        }
    finally:
        destroy_distributed()


def test_value_model_baseline_reduces_variance(tmp_path):
    hf = write_tiny_hf(tmp_path, "sdar", seed=2, block_size=4)
    res = spawn(_train_value, 1, hf, timeout_s=600)[0]
    print(res)
    # the values learned the per-prompt success rates (0.9 / 0.1) ...
    assert res["v_easy"] > 0.6 and res["v_hard"] < 0.4, res
    # ... so R - V varies much less than R - mean(R) (analytically 0.09 vs 0.25 at the true values)
    assert res["var_value_baseline"] < 0.6 * res["var_mean_baseline"], res
