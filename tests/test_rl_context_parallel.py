"""RL updates under context parallelism (parallel.cp=2) equal cp=1: the same rows, old log-probs from a separate
pass (gathered over the CP ranks), slot estimates completed across the ranks (a sequence slot's views, token
slots shared by coupled views, SPG's log-sum-exp), one optimizer step. Compared: loss, gradient norm and every
parameter's gradient (all-reduced over the CP ranks). Sequences are packed so that slots straddle the two CP halves.

Weights after the step are not compared: Adam's first step moves every parameter by about lr * sign(gradient), so
float noise on a near-zero gradient becomes an lr-sized difference (1.3e-4 at lr 1e-2 on an AMD EPYC), which says
nothing about context parallelism. The gradient is what CP must reproduce; the step only has to move the weights."""

from __future__ import annotations

import pytest
import torch

from megadare.parallel.launch import spawn
from tiny import write_tiny_hf

pytestmark = pytest.mark.timeout(600)
ALGOS = {"ebpo": {"n_mc": 3}, "coupled_grpo": {"kl_coef": 0.0}, "spg": {"estimator": "dare", "n_mc": 2}}


def _samples():
    from megadare.algos.base import RLSample

    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(4):
        P, L = 3 + i % 2, 5 + i
        out.append(
            RLSample(
                prompt_ids=torch.randint(5, 200, (P,), generator=g).tolist(),
                response_ids=torch.randint(5, 200, (L,), generator=g).tolist(),
                reward=float(i % 2),
                advantage=[1.0, -0.5, 0.75, -1.25][i],
                index=i,
                group=i // 2,
            )
        )
    return out


def _worker(rank, world, hf_dir, cp):
    from megatron.core import parallel_state as ps

    from megadare.algos import build_algorithm
    from megadare.algos.sft import example_generator
    from megadare.config import config_from_dict
    from megadare.parallel import Layout, destroy_distributed, init_distributed
    from megadare.trainer.model_setup import build_training_chunks, resolve_model_source
    from megadare.trainer.optim import OptimSettings, build_optimizer, wrap_ddp
    from megadare.trainer.policy import Policy
    from megadare.trainer.rl_update import StepUpdate, TrainShape, update

    init_distributed(Layout(cp=cp))
    try:
        cfg = config_from_dict(
            {"model": {"hf_path": hf_dir}, "parallel": {"cp": cp}, "train": {"seq_length": 96, "micro_batch_size": 2}}
        )
        src = resolve_model_source(cfg)
        out = {}
        for name, params in ALGOS.items():
            torch.manual_seed(0)
            # no distributed optimizer: every rank's grad buffer then holds the whole all-reduced gradient
            model = wrap_ddp(build_training_chunks(cfg, src), False)
            opt, sched = build_optimizer(
                model, OptimSettings(lr=1e-2, total_steps=2, clip_grad=0.0, distributed_optimizer=False)
            )
            algo = build_algorithm(name, params)
            before = [p.detach().clone() for p in model[0].parameters()]
            shape = TrainShape(src.arch, src.arch.block_size, "block_diffusion", 0, 1, model, example_generator)
            m = update(
                StepUpdate(cfg, algo, 0, shape), _samples(), Policy(model, opt, sched), algo.objective(on_policy=False)
            )
            after = [p.detach().clone() for p in model[0].parameters()]
            grads = {n: p.main_grad.detach().clone() for n, p in model[0].module.named_parameters()}
            out[name] = {
                "pg_loss": m["pg_loss"],
                "grad_norm": m["grad_norm"],
                "grads": grads,
                "moved": max(float((a - b).abs().max()) for a, b in zip(after, before)),
            }
        out["cp"] = ps.get_context_parallel_world_size()
        return out
    finally:
        destroy_distributed()


def test_rl_update_with_context_parallelism_equals_cp1(tmp_path):
    hf = write_tiny_hf(tmp_path, "sdar", seed=2, block_size=4)
    one = spawn(_worker, 1, hf, 1, timeout_s=600)[0]
    two = spawn(_worker, 2, hf, 2, timeout_s=600)
    assert two[0]["cp"] == 2
    for name in ALGOS:
        for res in two:
            assert res[name]["pg_loss"] == pytest.approx(one[name]["pg_loss"], rel=1e-4, abs=1e-6), name
            assert res[name]["grad_norm"] == pytest.approx(one[name]["grad_norm"], rel=1e-4), name
            g1, g2 = one[name]["grads"], res[name]["grads"]
            assert sorted(g2) == sorted(g1), name
            scale = max(float(g.abs().max()) for g in g1.values())
            assert scale > 1e-3, name
            for key, g in g1.items():  # relative to the largest gradient entry: float noise, not CP, below 1e-4
                diff = float((g2[key] - g).abs().max())
                assert diff <= 1e-4 * scale, (name, key, diff, scale)
        assert one[name]["moved"] > 1e-4, name
