"""RL with LoRA (rl.lora_rank): only the adapters train; the KL reference is the policy with its adapters off (no
second model) and equals a separately built copy of the initial model; the rollout engines receive the merged
weights W + s B A, equal to what ``merge_lora`` writes, and the trainer's own weights are left untouched."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megadare.parallel.launch import spawn
from tiny import write_tiny_hf

pytestmark = pytest.mark.timeout(600)


def _samples():
    from megadare.algos.base import RLSample

    g = torch.Generator().manual_seed(1)
    return [
        RLSample(
            prompt_ids=torch.randint(5, 200, (4,), generator=g).tolist(),
            response_ids=torch.randint(5, 200, (6,), generator=g).tolist(),
            reward=float(i % 2),
            advantage=[1.0, -1.0, 0.5, -0.5][i],
            index=i,
            group=i // 2,
        )
        for i in range(4)
    ]


def _worker(rank, world, hf_dir):
    from megadare.algos import build_algorithm
    from megadare.algos.sft import example_generator
    from megadare.config import config_from_dict
    from megadare.convert.hf_megatron import mapping_for
    from megadare.models.lora import adapters_disabled, lora_parameters, merge_lora, merged_weights
    from megadare.parallel import destroy_distributed, init_distributed
    from megadare.rollout.weight_sync.sync import SyncSettings, WeightSync
    from megadare.trainer.model_setup import build_training_chunks, resolve_model_source
    from megadare.trainer.rl import on_rank0
    from megadare.trainer.rl_setup import rl_policy
    from megadare.trainer.rl_update import StepUpdate, TrainShape, _prepare, update
    from megadare.trainer.step import RowFormat, store_outputs

    init_distributed()
    try:
        cfg = config_from_dict(
            {
                "model": {"hf_path": hf_dir},
                "train": {"seq_length": 64, "micro_batch_size": 2, "lr": 2e-2, "lr_decay_style": "constant"},
                "rl": {"lora_rank": 4, "lora_alpha": 8.0, "steps": 3},
                "algo": {"name": "d1", "params": {"kl_coef": 0.04}},
            }
        )
        src = resolve_model_source(cfg)
        arch, kind = src.arch, "block_diffusion"
        algo = build_algorithm("d1", {"kl_coef": 0.04})
        pol = rl_policy(cfg, src, algo)
        out = {
            "ref_chunks": pol.ref_chunks is None,
            "adapters_off": pol.ref_adapters_off,
            "trainable": sorted(n for n, p in pol.model[0].named_parameters() if p.requires_grad),
        }
        before = {n: p.detach().clone() for n, p in pol.model[0].named_parameters()}
        for step in range(3):
            shape = TrainShape(arch, arch.block_size, kind, 0, 1, pol.model, example_generator)
            m = update(StepUpdate(cfg, algo, step, shape), _samples(), pol, algo.objective(on_policy=False))
        out["kl"] = m["kl"]
        moved = {n: float((p.detach() - before[n]).abs().max()) for n, p in pol.model[0].named_parameters()}
        out["moved_adapters"] = min(v for n, v in moved.items() if "lora_" in n)
        out["moved_base"] = max(v for n, v in moved.items() if "lora_" not in n)
        out["lora_names"] = len(lora_parameters(pol.model))
        # the reference pass (adapters off) == an independently built model with the initial weights
        mine, _, _ = _prepare(
            StepUpdate(cfg, algo, 0, TrainShape(arch, arch.block_size, kind, 0, 1, pol.model, example_generator)),
            _samples(),
            need_old=True,
        )
        with adapters_disabled(pol.model):
            store_outputs(pol.model, mine, "ref", RowFormat(kind, arch.block_size, arch.vocab_size))
        plain = build_training_chunks(cfg, src)
        store_outputs(plain, mine, "plain", RowFormat(kind, arch.block_size, arch.vocab_size))
        out["ref_vs_plain"] = max(float((mb.ref - mb.extras["plain"]).abs().max()) for mb in mine)
        out["policy_vs_plain"] = max(float((mb.old - mb.extras["plain"]).abs().max()) for mb in mine)
        # the weight sync sees the merged weights; the trainer's base weights come back unchanged
        table = mapping_for(src.hf_config)[2]

        def received() -> dict:  # what an engine receives from the weight sync
            engine = _Capture()
            WeightSync(pol.model, table, [engine], SyncSettings(transport="object_store")).push(1)
            return engine.got

        with merged_weights(pol.model):
            synced = received()
        out["restored"] = max(
            float((p.detach() - before[n]).abs().max()) for n, p in pol.model[0].named_parameters() if "lora_" not in n
        )
        # a repeat push to restarted engines (the manager's on_stale, inside the trainer's on_rank0) is merged too
        engine = _Capture()
        run = SimpleNamespace(
            policy=pol,
            step=1,
            manager=SimpleNamespace(on_stale=None),
            weight_sync=WeightSync(pol.model, table, [engine], SyncSettings(transport="object_store")),
        )
        on_rank0(run, lambda: run.manager.on_stale())
        merge_lora(pol.model)
        merged = received()
        out["sync_vs_merge"] = max(float((synced[n] - merged[n]).abs().max()) for n in merged)
        out["repush_vs_merge"] = max(float((engine.got[n] - merged[n]).abs().max()) for n in merged)
        out["same_names"] = sorted(synced) == sorted(merged)
        return out
    finally:
        destroy_distributed()


class _Capture:
    """An in-process engine that keeps the named tensors the weight sync gives it."""

    def __init__(self):
        self.got = {}

    def update_weights(self, named, version):
        self.got.update({n: t.clone() for n, t in named})


def test_rl_with_lora_reference_is_the_base_and_engines_get_merged_weights(tmp_path):
    hf = write_tiny_hf(tmp_path, "sdar", seed=4, block_size=4)
    res = spawn(_worker, 1, hf, timeout_s=600)[0]
    assert res["ref_chunks"] and res["adapters_off"]
    assert res["trainable"] and all("lora_" in n for n in res["trainable"])
    assert res["lora_names"] == len(res["trainable"])
    assert res["moved_adapters"] > 0 and res["moved_base"] == 0.0
    assert res["kl"] > 0  # the policy has left the reference
    assert res["ref_vs_plain"] < 1e-5 and res["policy_vs_plain"] > 1e-3
    assert res["restored"] == 0.0
    assert res["same_names"] and res["sync_vs_merge"] == 0.0
    assert res["repush_vs_merge"] == 0.0
