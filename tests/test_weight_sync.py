"""Weight sync from a sharded Megatron trainer (TP2, PP2, EP2 on gloo) into built-in engines: after a training
step changed the weights, every engine's logits equal the trainer's."""
from __future__ import annotations

import os

import pytest
import torch

from dist import run_distributed, stepped_trainer
from tiny import write_tiny_hf
from megadare.rollout.weight_sync import plan_buckets

SEQ = 12


def _hf(tmp, name: str, seed: int) -> str:
    return write_tiny_hf(tmp, name, seed, num_hidden_layers=4, **({"block_size": 4} if name != "llada" else {}))


def _worker(rank, world, layout, trainer_hf, engine_hf, ids, bucket_bytes):
    from megadare.convert import mapping_for
    from megadare.models.attention import family_mask
    from megadare.models import load_hf_model
    from megadare.parallel import destroy_distributed, init_distributed
    from megadare.rollout.native import NativeEngine
    from megadare.rollout.weight_sync import sync_weights
    from megadare.trainer.forward import forward_logits

    init_distributed(**layout)
    try:
        chunks, model, arch, cfg = stepped_trainer(layout, trainer_hf, n_rows=4,
                                                   lr=float(os.environ.get("LR", "1e-2")))
        _, _, table = mapping_for(cfg)
        engines = []
        if rank == 0:
            engines = [NativeEngine(load_hf_model(engine_hf), arch, eos_token_id=253, device="cpu") for _ in range(2)]
            before = engines[0].model(ids, attention_mask=family_mask(arch).dense(SEQ, SEQ))
        stats = sync_weights(model, table, engines, version=3, bucket_bytes=bucket_bytes)
        out = {"trainer": forward_logits(chunks, ids, arch.vocab_size, family_mask(arch)), "stats": stats}
        if rank == 0:
            with torch.no_grad():
                out["engines"] = [e.model(ids, attention_mask=family_mask(arch).dense(SEQ, SEQ)) for e in engines]
            out["before"] = before.detach()
            out["versions"] = [e.health()["version"] for e in engines]
        return out
    finally:
        destroy_distributed()


CASES = [("sdar", {"tp": 2, "sp": True}), ("sdar", {"pp": 2}), ("sdar_moe", {"ep": 2}), ("llada2", {"tp": 2, "sp": True})]


@pytest.mark.parametrize("family,layout", CASES, ids=["sdar-tp2sp", "sdar-pp2", "sdar_moe-ep2", "llada2-tp2sp"])
def test_engines_match_the_trained_megatron_model(family, layout, tmp_path):
    trainer_hf, engine_hf = _hf(tmp_path, family, 0), _hf(tmp_path, family, 1)
    ids = torch.randint(0, 250, (2, SEQ), generator=torch.Generator().manual_seed(5))
    outs = run_distributed(_worker, 2, layout, trainer_hf, engine_hf, ids, 64 << 10, timeout_s=300)
    trainer = [o["trainer"] for o in outs if o["trainer"] is not None][0]
    r0 = outs[0]
    assert r0["versions"] == [3, 3]
    assert r0["stats"]["sync_buckets"] > 2 and r0["stats"]["sync_bytes"] > 0   # bucketed
    assert (r0["before"] - trainer).abs().max() > 1e-2                             # the engines really changed
    for logits in r0["engines"]:
        assert (logits - trainer).abs().max() < 1e-4


def test_buckets_are_bounded_and_experts_come_last():
    from megadare.models.mapping import ParamMap

    table = [ParamMap(f"decoder.layers.{i}.mlp.experts.linear_fc1.weight{i}", (f"e{i}",)) for i in range(3)]
    table += [ParamMap(f"decoder.layers.{i}.self_attention.linear_proj.weight", (f"a{i}",)) for i in range(3)]
    shapes = {r.mcore: ((256, 256), torch.float32) for r in table}   # 256 KiB each
    buckets = plan_buckets(table, shapes, bucket_bytes=600 << 10)
    assert [len(b) for b in buckets] == [2, 2, 2]
    flat = [r.mcore for b in buckets for r in b]
    assert all(".experts." not in k for k in flat[:3]) and all(".experts." in k for k in flat[3:])


class _Recorder:
    def __init__(self):
        self.named: dict[str, torch.Tensor] = {}

    def update_weights(self, named, version):
        self.named.update({n: t.clone() for n, t in named})


def _fp8_worker(rank, world, layout, trainer_hf):
    """Syncs plainly and in fp8 into two recorders; returns what arrived (fp8 tensors as their uint8 bytes and the
    dequantized float32 values: fp8 storages do not cross process boundaries)."""
    from megadare.convert import mapping_for
    from megadare.convert.fp8 import dequantize_fp8
    from megadare.parallel import destroy_distributed, init_distributed
    from megadare.rollout.weight_sync import sync_weights

    init_distributed(**layout)
    try:
        _, model, _, cfg = stepped_trainer(layout, trainer_hf, n_rows=4, lr=1e-2)
        _, _, table = mapping_for(cfg)
        plain, fp8 = _Recorder(), _Recorder()
        sync_weights(model, table, [plain] if rank == 0 else [], version=1, bucket_bytes=64 << 10)
        sync_weights(model, table, [fp8] if rank == 0 else [], version=1, bucket_bytes=64 << 10, fp8_block=(128, 128))
        deq = {n[: -len("_scale_inv")]: dequantize_fp8(fp8.named[n[: -len("_scale_inv")]], t, block=(128, 128))
               for n, t in fp8.named.items() if n.endswith("weight_scale_inv")}
        dtypes = {n: str(t.dtype) for n, t in fp8.named.items()}
        fp8_named = {n: (t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t) for n, t in fp8.named.items()}
        return {"plain": plain.named, "fp8": fp8_named, "dtypes": dtypes, "deq": deq}
    finally:
        destroy_distributed()


def test_fp8_rollout_weights_through_sync():
    """sync_weights(fp8_block=(128, 128)) from a TP2 trainer: every linear weight arrives as float8_e4m3fn with a
    weight_scale_inv per 128x128 block, its dequantization is the plain sync's tensor within fp8 precision (e4m3:
    3 mantissa bits, relative error <= 1/16), and every other tensor arrives unchanged."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = run_distributed(_fp8_worker, 2, {"tp": 2, "sp": True}, _hf(tmp, "sdar", 0), timeout_s=300)[0]
    plain, fp8, deq = out["plain"], out["fp8"], out["deq"]
    scales = [n for n in fp8 if n.endswith("weight_scale_inv")]
    assert len(scales) >= 4 * 7 and set(fp8) == set(plain) | set(scales)   # 4 layers x (q, k, v, o, gate, up, down)
    for w, d in deq.items():
        assert out["dtypes"][w] == "torch.float8_e4m3fn"
        ref = plain[w].float()
        assert ((d - ref).abs() <= torch.maximum(ref.abs() / 16, torch.full_like(ref, 1e-3))).all(), w
    for n in set(plain) - set(deq):
        assert torch.equal(fp8[n], plain[n]), n
