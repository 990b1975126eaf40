"""The SFT loop end to end on CPU: parallel equivalence, resume, SIGTERM, loss goes down, tensorboard files.

Every run goes through ``run_sft`` (config -> model -> data -> corruption rows -> packing -> megatron schedules ->
distributed optimizer -> checkpoints), in 1 or 2 gloo processes.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from dist import run_distributed
from megadare.config import config_from_dict
from megadare.trainer.sft_loop import sft_worker


def _cfg(tmp, name: str, family: str = "sdar", steps: int = 5, **over) -> object:
    d = {
        "model": {
            "family": family,
            "tiny": True,
            "dtype": "fp32",
            "attention_backend": "sdpa",
            "tiny_config": {"num_hidden_layers": 4},
        },
        "data": {"synthetic": "addition", "synthetic_size": 64, "max_length": 16},
        "train": {
            "steps": steps,
            "global_batch_size": 8,
            "micro_batch_size": 1,
            "seq_length": 64,
            "lr": 1e-3,
            "warmup_steps": 1,
            "adam_eps": 1e-6,
        },
        "checkpoint": {"save_interval": 0},
        "logging": {"run_dir": os.path.join(str(tmp), name), "tensorboard": False},
        "seed": 7,
    }
    for key, v in over.items():
        sec, k = key.split("__")
        d.setdefault(sec, {})[k] = v
    return config_from_dict(d)


def _run(cfg, world: int, max_steps=None) -> dict:
    return run_distributed(sft_worker, world, cfg, max_steps, timeout_s=600)[0]


def _losses(out: dict) -> list[float]:
    return [h["loss"] for h in out["history"]]


def _model_tensors(ckpt_root: str) -> dict[str, torch.Tensor]:
    from megadare.convert.mcore_ckpt import checkpoint_keys, read_tensors, resolve_checkpoint_dir

    d = resolve_checkpoint_dir(ckpt_root)
    keys = [k for k in checkpoint_keys(d) if not k.startswith("optimizer.")]
    return dict(read_tensors(d, keys))


LAYOUTS = {
    "tp2_sp": (2, {"parallel__tp": 2, "parallel__sp": True}),
    "pp2_vpp2": (2, {"parallel__pp": 2, "parallel__vpp": 2}),
    "dp2": (2, {}),
    "cp2": (2, {"parallel__cp": 2}),
    # megatron's own DotProductAttention on dense masks + full activation recomputation
    "local_attention_recompute": (1, {"model__attention_backend": "local", "train__recompute": "full"}),
    # the default backend's MaskSpec mask through megatron's checkpoint (train.recompute=full, the shipped configs)
    "recompute_full": (1, {"train__recompute": "full"}),
}


@pytest.fixture(scope="module")
def dense_reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ref")
    return _losses(_run(_cfg(tmp, "tp1"), 1))


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_parallel_layouts_give_the_same_losses(layout, dense_reference, tmp_path):
    world, over = LAYOUTS[layout]
    losses = _losses(_run(_cfg(tmp_path, layout, **over), world))
    assert len(losses) == len(dense_reference) == 5
    rel = [abs(a - b) / abs(b) for a, b in zip(losses, dense_reference)]
    assert max(rel) < 1e-5, (layout, losses, dense_reference)


def test_moe_expert_and_tensor_parallel_give_the_same_losses(tmp_path):
    """The reference trains megatron's own SequentialMLP; the layouts the experts' grouped GEMMs (the default on a
    CPU: models/experts.py) with the experts split over ranks (EP) and within them (ETP)."""
    for family in ("sdar_moe", "llada2"):
        ref = _losses(_run(_cfg(tmp_path, f"{family}_ep1", family=family, train__grouped_experts=False), 1))
        assert len(set(round(x, 6) for x in ref)) == len(ref)  # the steps really differ
        layouts = {"ep2": {"parallel__ep": 2}}
        if family == "llada2":  # experts split over TP (etp = tp): replicas would drift if grads were not reduced
            layouts["tp2_sp"] = {"parallel__tp": 2, "parallel__sp": True}
        for name, over in layouts.items():
            got = _losses(_run(_cfg(tmp_path, f"{family}_{name}", family=family, **over), 2))
            rel = [abs(a - b) / abs(b) for a, b in zip(got, ref)]
            assert max(rel) < 1e-5, (family, name, got, ref)


def test_resume_continues_identically(tmp_path):
    straight = _cfg(tmp_path, "straight", steps=6)
    _run(straight, 2)
    split = _cfg(tmp_path, "split", steps=6, checkpoint__save_interval=3)
    first = _run(split, 2, max_steps=3)
    assert first["step"] == 3
    second = _run(split, 2)
    assert second["step"] == 6 and len(second["history"]) == 3  # resumed at 3, trained 3 more
    a = _model_tensors(os.path.join(straight.logging.run_dir, "ckpt"))
    b = _model_tensors(os.path.join(split.logging.run_dir, "ckpt"))
    assert a.keys() == b.keys() and len(a) > 10
    for k in a:
        assert torch.equal(a[k], b[k]), k
    init = _model_tensors_from_hf_differs(a, split)
    assert init, "training did not change the weights"


def test_resume_under_another_layout(tmp_path):
    """Checkpoint at DP=2 (distributed optimizer sharded over 2 ranks), resume at TP=2 + SP."""
    straight = _cfg(tmp_path, "straight", steps=4)
    ref = _losses(_run(straight, 1))
    dp2 = _cfg(tmp_path, "moved", steps=4, checkpoint__save_interval=2)
    first = _losses(_run(dp2, 2, max_steps=2))
    tp2 = _cfg(tmp_path, "moved", steps=4, checkpoint__save_interval=2, parallel__tp=2, parallel__sp=True)
    second = _losses(_run(tp2, 2))
    assert len(second) == 2
    assert all(abs(a - b) / b < 1e-5 for a, b in zip(first + second, ref)), (first + second, ref)


def _model_tensors_from_hf_differs(trained: dict, cfg) -> bool:
    from megadare.models import load_hf_model

    hf = load_hf_model(os.path.join(cfg.logging.run_dir, "init_hf"))
    emb = [v for k, v in trained.items() if k.endswith("embedding.word_embeddings.weight")][0]
    ref = hf.state_dict()["model.embed_tokens.weight"]
    return not torch.equal(emb[: ref.shape[0]], ref)


def test_tiny_sft_lowers_the_loss_and_writes_tensorboard(tmp_path):
    cfg = _cfg(
        tmp_path,
        "learn",
        steps=40,
        train__lr=3e-3,
        train__global_batch_size=16,
        sft__noise_low=0.3,
        sft__noise_high=0.8,
        sft__weighting="none",
        logging__tensorboard=True,
    )
    out = _run(cfg, 1)
    losses = _losses(out)
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.6 * first, (first, last)
    events = glob.glob(os.path.join(cfg.logging.run_dir, "tensorboard", "events.out.tfevents.*"))
    assert events
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(os.path.dirname(events[0]))
    acc.Reload()
    scalars = acc.Scalars("train/loss")
    assert [s.step for s in scalars] == list(range(1, 41))
    assert abs(scalars[-1].value - losses[-1]) < 1e-4
    lines = open(os.path.join(cfg.logging.run_dir, "metrics.jsonl")).read().splitlines()
    assert len(lines) == 40 and json.loads(lines[0])["step"] == 1

    # the training checkpoint (with optimizer state) exports to HF and holds the trained weights
    from megadare.convert.hf_megatron import megatron_to_hf
    from megadare.models import load_hf_model

    out_dir = megatron_to_hf(os.path.join(cfg.logging.run_dir, "ckpt"), str(tmp_path / "hf_out"))
    hf = load_hf_model(out_dir).state_dict()
    trained = _model_tensors(os.path.join(cfg.logging.run_dir, "ckpt"))
    assert torch.equal(hf["model.embed_tokens.weight"], trained["embedding.word_embeddings.weight"][:256])


def test_bf16_training_tracks_fp32(tmp_path):
    fp32 = _losses(_run(_cfg(tmp_path, "fp32", steps=3), 1))
    bf16 = _losses(_run(_cfg(tmp_path, "bf16", steps=3, model__dtype="bf16"), 1))
    assert all(abs(a - b) / b < 5e-2 for a, b in zip(bf16, fp32)), (bf16, fp32)
    assert bf16 != fp32


def test_sigterm_leaves_a_loadable_checkpoint(tmp_path):
    run_dir = tmp_path / "term"
    cmd = [
        sys.executable,
        "-m",
        "megadare",
        "sft",
        "--config",
        os.path.join(os.path.dirname(__file__), "..", "examples", "configs", "sft_sdar_tiny.yaml"),
        "train.steps=100000",
        "checkpoint.save_interval=0",
        f"logging.run_dir={run_dir}",
        "model.attention_backend=sdpa",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 3):
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    assert "stopped by signal" in out
    steps_done = len(metrics.read_text().splitlines())
    from megadare.convert.mcore_ckpt import resolve_checkpoint_dir

    ckpt = resolve_checkpoint_dir(str(run_dir / "ckpt"))
    state = json.load(open(os.path.join(ckpt, "train_state.json")))
    assert state["step"] == steps_done
    assert not glob.glob(str(run_dir / "ckpt" / "*.tmp"))
    tensors = _model_tensors(str(run_dir / "ckpt"))
    assert all(torch.isfinite(v).all() for v in tensors.values())


def _write_traces(path: str, n: int = 16, block: int = 4) -> None:
    """Pre-tokenized records with a decoding trace: blocks in order, tokens of a block committed in a random
    order over 2 steps per block (global step numbers), as a block-diffusion sampler records them."""
    g = torch.Generator().manual_seed(0)
    with open(path, "w") as f:
        for _ in range(n):
            P, L = int(torch.randint(3, 6, (1,), generator=g)), 8
            steps = []
            for b in range(L // block):
                order = torch.randperm(block, generator=g)
                steps += [2 * b + int(order[k] >= block // 2) for k in range(block)]
            f.write(
                json.dumps(
                    {
                        "prompt_ids": torch.randint(0, 128, (P,), generator=g).tolist(),
                        "response_ids": torch.randint(0, 128, (L,), generator=g).tolist(),
                        "steps": steps,
                    }
                )
                + "\n"
            )


@pytest.mark.parametrize(
    "family,mode",
    [("sdar", "trace"), ("llada", "trace"), ("llada", "semi_ar"), ("dream", "random"), ("llada2", "block")],
)
def test_every_sft_mode_trains_end_to_end(family, mode, tmp_path):
    over = {"sft__mode": mode, "train__steps": 3, "train__global_batch_size": 4}
    if mode == "trace":
        path = str(tmp_path / "traces.jsonl")
        _write_traces(path)
        over.update(data__path=path, data__synthetic=None)
    cfg = _cfg(tmp_path, f"{family}_{mode}", family=family, **over)
    out = _run(cfg, 1)
    losses = _losses(out)
    assert len(losses) == 3 and all(0 < x < float("inf") for x in losses)
    assert out["data"]["kept"] == (16 if mode == "trace" else 64)


def _lora_logits_worker(rank, world, cfg, ids):
    """Logits of the LoRA model restored from a LoRA SFT checkpoint (not merged)."""
    from megadare.models.lora import apply_lora
    from megadare.parallel import Layout, destroy_distributed, init_distributed
    from megadare.trainer.checkpoint import load_train_checkpoint
    from megadare.trainer.forward import forward_logits
    from megadare.trainer.model_setup import build_training_chunks, resolve_model_source

    init_distributed(Layout(tp=cfg.parallel.tp, sp=cfg.parallel.sp))
    try:
        src = resolve_model_source(cfg)
        chunks = build_training_chunks(cfg, src)
        apply_lora(chunks, cfg.lora.rank, cfg.lora.alpha)
        load_train_checkpoint(os.path.join(cfg.logging.run_dir, "ckpt"), chunks, None, None, load_optimizer=False)
        from megadare.models.attention import block_causal

        return forward_logits(chunks, ids, src.arch.vocab_size, block_causal(src.arch.block_size))
    finally:
        destroy_distributed()


def test_lora_sft_exports_merged_weights(tmp_path):
    cfg = _cfg(
        tmp_path,
        "lora",
        steps=3,
        sft__lora_rank=4,
        sft__lora_alpha=8.0,
        train__lr=1e-2,
        parallel__tp=2,
        parallel__sp=True,
    )
    _run(cfg, 2)
    from megadare.convert.hf_megatron import megatron_to_hf
    from megadare.models import load_hf_model
    from megadare.models.attention import block_causal

    tensors = _model_tensors(os.path.join(cfg.logging.run_dir, "ckpt"))
    assert any(k.endswith("lora_B") and tensors[k].abs().sum() > 0 for k in tensors)  # adapters trained
    out = megatron_to_hf(os.path.join(cfg.logging.run_dir, "ckpt"), str(tmp_path / "merged"), progress=False)
    hf = load_hf_model(out).eval()
    base = load_hf_model(os.path.join(cfg.logging.run_dir, "init_hf")).eval()
    ids = torch.randint(0, 250, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = block_causal(4).dense(12, 12)
    with torch.no_grad():
        merged, untouched = hf(ids, attention_mask=mask), base(ids, attention_mask=mask)
    lora = [x for x in run_distributed(_lora_logits_worker, 2, cfg, ids, timeout_s=300) if x is not None][0]
    assert (merged - lora).abs().max() < 1e-4
    assert (merged - untouched).abs().max() > 1e-3


def _fresh_checkpoint_worker(rank, world, hf_dir, root):
    from dist import random_step, tiny_trainer
    from megadare.parallel import destroy_distributed, init_distributed
    from megadare.trainer.checkpoint import CheckpointState, load_train_checkpoint, save_train_checkpoint
    from megadare.trainer.policy import Policy

    def params(model):
        return {f"{i}.{k}": p.detach().clone() for i, m in enumerate(model) for k, p in m.named_parameters()}

    init_distributed()
    try:
        _, model, opt, sched, arch, _ = tiny_trainer({}, hf_dir)
        save_train_checkpoint(
            root, 0, Policy(model, opt, sched), CheckpointState({})
        )  # before any update (an RL step that kept no group)
        _, resumed, opt2, sched2, _, _ = tiny_trainer({}, hf_dir)
        load_train_checkpoint(root, resumed, opt2, sched2)
        before = params(model)
        random_step(model, opt, sched, arch)
        random_step(resumed, opt2, sched2, arch)
        a, b = params(model), params(resumed)
        return sorted(k for k in a if not torch.equal(a[k], b[k])), sum(not torch.equal(a[k], before[k]) for k in a)
    finally:
        destroy_distributed()


def test_checkpoint_before_the_first_update_resumes_as_a_fresh_optimizer(tmp_path):
    """Saving before the first optimizer step used to fail (megatron: one 'step' per param group); the saved
    fresh Adam loads as a fresh Adam: the next step is the same as without the round trip."""
    from tiny import write_tiny_hf

    hf = write_tiny_hf(tmp_path, "sdar_moe", 0)
    differ, changed = run_distributed(_fresh_checkpoint_worker, 1, hf, str(tmp_path / "ckpt"), timeout_s=300)[0]
    assert differ == [] and changed > 10
