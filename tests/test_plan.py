"""megadare plan: parameter counts against published totals and built models, planned vs measured model-state and
activation memory of a real (gloo, CPU) Megatron model + distributed optimizer, the does-not-fit advice, the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dist import random_step, run_distributed
from megadare.config import load_config
from megadare.models import build_hf_model, family_of, get_family, read_hf_config
from megadare.plan import count_params, plan, rank_params
from megadare.plan.memory import GIB, Layout, logits_bytes, model_state_bytes, stage_activation_bytes

ROOT = Path(__file__).resolve().parents[1]
HF = ROOT / "examples" / "configs" / "hf"

# Published counts. Totals: the Hugging Face safetensors parameter counts of the checkpoints whose shapes these
# models share (Qwen3-30B-A3B: 30,532,122,624; Ling-mini-2.0: 16,255,643,392; Ling-flash-2.0: 102,889,705,216 --
# LLaDA2.0 continues training Ling 2.0 with the same shapes; HF lists LLaDA2.0-flash as 103B). They include
# LLaDA2's expert_bias buffers (E per MoE layer), which are not parameters. Active: model cards (Qwen3-30B-A3B
# "3.3B activated"; Ling 2.0 / LLaDA2.0: mini "1.4B activated, 789M non-embedding", flash "6.1B activated, 4.8B
# non-embedding").
PUBLISHED = {
    "SDAR-30B-A3B": dict(total=30_532_122_624, active=3.3e9, bias=0),
    "LLaDA2.0-mini": dict(total=16_255_643_392, active=1.4e9, active_non_embedding=789e6, bias=19 * 256),
    "LLaDA2.0-flash": dict(total=102_889_705_216, active=6.1e9, active_non_embedding=4.8e9, bias=31 * 256),
}
ACTIVE_TOL = 0.03  # published active counts are rounded to 2 significant digits
STATE_TOL = 0.01  # planned vs measured model-state bytes (megatron pads every param start to 64 elements)
ACT_TOL = 0.05  # planned vs saved-for-backward bytes (CPU sdpa's output aliases the projection input)
ACT_SEQ = 256


def _arch(name: str):
    cfg = read_hf_config(HF / name)
    return family_of(cfg).arch(cfg)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_counts_match_published_totals(name):
    pub, pc = PUBLISHED[name], count_params(_arch(name))
    assert pc.total + pub["bias"] == pub["total"]  # exact: shapes identical to the published checkpoint
    assert abs(pc.active - pub["active"]) / pub["active"] < ACTIVE_TOL, pc.active
    if "active_non_embedding" in pub:
        ne = pub["active_non_embedding"]
        assert abs(pc.active_non_embedding - ne) / ne < ACTIVE_TOL, pc.active_non_embedding


@pytest.mark.parametrize("family", ["sdar", "sdar_moe", "llada2", "llada", "dream"])
def test_parameter_count_equals_built_model(family):
    cfg = get_family(family).tiny_config()
    arch = family_of(cfg).arch(cfg)
    pc = count_params(arch)
    assert pc.total == sum(p.numel() for p in build_hf_model(cfg).parameters())
    # the Megatron model (padded vocabulary) on one GPU == the HF count + vocabulary padding rows
    from megadare.models.mapping import padded_vocab_size

    pad = (padded_vocab_size(arch.vocab_size) - arch.vocab_size) * arch.hidden_size
    assert rank_params(arch).total == pc.total + pad * (1 if arch.tie_word_embeddings else 2)


TINY = {
    "sdar": dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64),
    "sdar_moe": dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=128, head_dim=32),
}
MEASURE = [("sdar", "bf16", {}), ("sdar_moe", "bf16", {"ep": 2}), ("sdar", "fp32", {})]


def _storage_bytes(tensors, seen: set) -> int:
    total = 0
    for t in tensors:
        s = t.untyped_storage()
        if s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


def _saved_activation_bytes(model, arch, param_ptrs: set) -> int:
    """Bytes of the distinct storages autograd saves for backward in one forward + loss of ACT_SEQ tokens, plus
    the logits the loss reads (alive during it)."""
    from megadare.models.attention import MaskSpec
    from megadare.trainer.logprob import token_logprobs

    seen: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in param_ptrs:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    ids = torch.randint(0, 250, (1, ACT_SEQ), generator=torch.Generator().manual_seed(1))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(ids, torch.arange(ACT_SEQ)[None], MaskSpec(kind="bidirectional", block_size=4))
        token_logprobs(logits, ids, arch.vocab_size)
    return sum(seen.values()) + logits.untyped_storage().nbytes()


def _measure_worker(rank, world, cases):
    """Build each tiny model under its layout with megatron's DDP + distributed optimizer, take one step, and
    count the bytes of distinct storages: parameters, grad buffers, optimizer states and master weights."""
    from megatron.core import parallel_state as ps

    from megadare.models.gpt import build_model_chunks, transformer_config
    from megadare.parallel import Layout, destroy_distributed, init_distributed
    from megadare.trainer.optim import OptimSettings, build_optimizer, wrap_ddp

    out = []
    try:
        for family, dtype, layout in cases:
            init_distributed(Layout(**layout))
            cfg = get_family(family).tiny_config(**TINY[family])
            arch = family_of(cfg).arch(cfg)
            chunks = build_model_chunks(arch, transformer_config(arch, dtype), attention_backend="sdpa")
            model = wrap_ddp(chunks, True)
            opt, sched = build_optimizer(model, OptimSettings(lr=1e-3, total_steps=2, dtype=dtype))
            random_step(model, opt, sched, arch)
            seen: set = set()
            params = [p for c in chunks for p in c.parameters()]
            weights = _storage_bytes(params, seen)
            grads = _storage_bytes([b.grad_data for m in model for b in m.buffers + m.expert_parallel_buffers], seen)
            state = []
            for o in getattr(opt, "chained_optimizers", [opt]):
                state += [v for st in o.optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
                state += [p for group in o.optimizer.param_groups for p in group["params"]]
            out.append(
                {
                    "numel": sum(p.numel() for p in params),
                    "weights": weights,
                    "grads": grads,
                    "optimizer": _storage_bytes(state, seen),
                    "activations": _saved_activation_bytes(
                        chunks[0], arch, {p.untyped_storage().data_ptr() for p in params}
                    ),
                }
            )
            ps.destroy_model_parallel()  # the next case re-initialises megatron's groups in the same processes
    finally:
        destroy_distributed()
    return out


def test_planned_model_state_matches_measured_megatron_bytes():
    measured = run_distributed(_measure_worker, 2, MEASURE, timeout_s=300)
    for i, (family, dtype, layout) in enumerate(MEASURE):
        got = measured[0][i]
        cfg = get_family(family).tiny_config(**TINY[family])
        arch = family_of(cfg).arch(cfg)
        lay = Layout(world=2, tp=1, pp=1, vpp=None, ep=layout.get("ep", 1), etp=1, cp=1, sp=False)
        numel, w, g, o = model_state_bytes(arch, lay, dtype, True)
        assert got["numel"] == numel, (family, dtype)
        for key, planned in (("weights", w), ("grads", g), ("optimizer", o)):
            assert abs(got[key] - planned) / planned < STATE_TOL, (family, dtype, key, got[key], planned)
        # the logits of every position, as measured here (the scored head: benchmarks/train_memory.py)
        run = load_config(
            None,
            [
                f"model.dtype={dtype}",
                "model.attention_backend=sdpa",
                f"train.seq_length={ACT_SEQ}",
                "train.micro_batch_size=1",
                "train.recompute=none",
                "train.logits=full",
            ],
        )
        planned = stage_activation_bytes(arch, lay, run, 1, 0) + logits_bytes(arch, lay, run)
        # routed tokens split unevenly over the EP ranks: compare the sum over both ranks
        got_act = sum(r[i]["activations"] for r in measured)
        assert abs(got_act - 2 * planned) / (2 * planned) < ACT_TOL, (family, dtype, got_act, 2 * planned)


def _cfg(name: str, *overrides: str):
    return load_config(str(ROOT / "examples" / "configs" / name), list(overrides))


@pytest.mark.parametrize("name", ["plan_sdar30b.yaml", "plan_llada2_mini.yaml", "plan_llada2_flash.yaml"])
def test_shipped_plans_fit(name, monkeypatch):
    monkeypatch.chdir(ROOT)
    cfg = _cfg(name)
    report = plan(cfg, _arch(Path(cfg.model.hf_path).name))
    d = json.loads(json.dumps(report.as_dict()))
    assert report.fits and not report.advice and d["peak_gb"] <= cfg.plan.gpu_memory_gb
    stage = report.stages[0]
    # bf16 + distributed optimizer: 2 + 4 bytes per local parameter plus 12 sharded
    assert stage.weights == 2 * stage.params and stage.grads == 4 * stage.params


def test_too_small_gpu_names_the_knob_and_its_effect(monkeypatch):
    monkeypatch.chdir(ROOT)
    arch = _arch("LLaDA2.0-mini")
    # activation-bound SFT: long rows, no recomputation, megatron's materialising attention
    cfg = _cfg(
        "plan_llada2_mini.yaml",
        "train.recompute=none",
        "model.attention_backend=local",
        "train.micro_batch_size=2",
        "plan.gpu_memory_gb=70",
    )
    report = plan(cfg, arch)
    assert not report.fits and report.bottleneck == "trainer"
    changes = {a["change"]: a for a in report.advice}
    full = changes["train.recompute=full"]
    assert full["fits"] and "train.recompute=selective" in changes and "train.micro_batch_size=1" in changes
    # the estimated effect is the plan of the changed config
    redo = plan(
        _cfg(
            "plan_llada2_mini.yaml",
            "model.attention_backend=local",
            "train.micro_batch_size=2",
            "plan.gpu_memory_gb=70",
            "train.recompute=full",
        ),
        arch,
    )
    assert redo.fits and full["peak_gb"] == round(redo.peak / GIB, 2)
    assert full["saves_gb"] == pytest.approx((report.peak - redo.peak) / GIB, abs=0.01)
    assert report.advice[0]["fits"]

    # RL whose rollout phase (trainer state + colocated engine) does not fit
    rl = plan(_cfg("plan_sdar30b.yaml", "plan.gpu_memory_gb=60"), _arch("SDAR-30B-A3B"))
    assert not rl.fits and rl.bottleneck == "rollout"
    assert rl.advice[0]["fits"]
    wider = {a["change"]: a for a in rl.advice}["rollout.engine_tp=8"]  # halves the engine's weight shard
    assert wider["saves_gb"] == pytest.approx(rl.rollout.weights / 2 / GIB, abs=0.01)

    # nothing single fits: a chain of changes is offered first
    tight = plan(_cfg("plan_sdar30b.yaml", "plan.gpu_memory_gb=24", "train.recompute=none"), _arch("SDAR-30B-A3B"))
    assert tight.advice and tight.advice[0]["fits"] and len(tight.advice[0]["change"].split()) > 1


def test_cli_prints_the_table(monkeypatch, capsys):
    from megadare.cli import main

    monkeypatch.chdir(ROOT)
    assert main(["plan", "--config", "examples/configs/plan_sdar30b.yaml"]) == 0
    out = capsys.readouterr().out
    for text in ("total 30.53B, active 3.35B", "optimizer", "activations", "KV cache", "fits"):
        assert text in out, out
    assert main(["plan", "--config", "examples/configs/plan_sdar30b.yaml", "plan.gpu_memory_gb=40"]) == 1
    assert "DOES NOT FIT" in capsys.readouterr().out


# what the planner must not load: it does arithmetic on config.json (README "Planner"); megatron-core and the
# checkpoint I/O (torch.distributed.checkpoint, which pulls torch's compiler) cost seconds a user sizing a
# cluster waits for. Bare torch still loads (the algorithms and models/ import it at the top).
_NOT_FOR_THE_PLAN = ("megatron", "ray", "transformers", "torch.distributed.checkpoint", "megadare.trainer.step")


def test_plan_command_loads_neither_megatron_nor_the_checkpoint_io():
    """``megadare plan`` in a fresh interpreter (this process has megatron loaded): the table, and none of
    _NOT_FOR_THE_PLAN among the modules it imported."""
    code = (
        "import runpy, sys\n"
        "sys.argv = ['megadare', 'plan', '--config', 'examples/configs/plan_sdar30b.yaml']\n"
        "try:\n    runpy.run_module('megadare', run_name='__main__')\n"
        "except SystemExit as e:\n    rc = e.code\n"
        f"print('loaded:', rc, sorted(m for m in {_NOT_FOR_THE_PLAN!r} if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "total 30.53B, active 3.35B" in out.stdout and ": fits" in out.stdout, out.stdout
    assert out.stdout.splitlines()[-1] == "loaded: 0 []", out.stdout.splitlines()[-1]


@pytest.mark.parametrize("path", sorted((ROOT / "examples" / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_plans_and_dry_runs_as_shipped(path, monkeypatch, capsys):
    """Each config carries the cluster it was written for (plan.*; parallel.world_size = its trainer GPUs), so
    `megadare plan` and `megadare <job> --dry-run --config-only` take it without overrides (its paths are
    placeholders), and it fits that cluster."""
    from megadare.cli import main

    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(["plan", "--config", str(path)]) == 0, capsys.readouterr().err
    assert ": fits" in capsys.readouterr().out
    job = load_config(str(path)).plan.job
    assert main([job, "--config", str(path), "--dry-run", "--config-only"]) == 0, capsys.readouterr().err


def test_plan_refuses_a_world_size_the_cluster_does_not_give(monkeypatch, capsys):
    from megadare.cli import main

    monkeypatch.chdir(ROOT)
    assert main(["plan", "--config", "examples/configs/rl_sdar30b.yaml", "plan.nodes=6"]) == 2
    err = capsys.readouterr().err
    assert "parallel.world_size=16 but the plan gives the trainer" in err and "= 32 GPUs" in err
    assert main(["plan", "--config", "examples/configs/rl_sdar30b.yaml", "plan.nodes=6", "parallel.world_size=32"]) == 0


def test_rollout_rows_are_capped_by_the_engines_max_batch_and_mdpo_counts_the_canvas(monkeypatch):
    """The built-in engine decodes at most rollout.max_batch rows at once (the rest queue): its KV cache and logits
    scale with that, not plan.rollout_batch. MDPO on a full-attention model predicts the whole canvas each step."""
    monkeypatch.chdir(ROOT)
    dare = "dare/mdpo_dream.yaml"
    arch = _arch("Dream-v0-Instruct-7B")
    full, capped = plan(_cfg(dare), arch).rollout, plan(_cfg(dare, "rollout.max_batch=16"), arch).rollout
    assert (full.batch, capped.batch) == (64, 16)
    assert capped.kv_cache == pytest.approx(full.kv_cache / 4) and capped.logits == pytest.approx(full.logits / 4)
    assert full.logits == 64 * 512 * arch.vocab_size * 4  # the whole response canvas, fp32
    llada = _arch("LLaDA-8B-Instruct")
    mdpo, d1 = plan(_cfg("dare/mdpo_llada.yaml"), llada).rollout, plan(_cfg("dare/d1_llada.yaml"), llada).rollout
    assert mdpo.logits == 64 * 512 * llada.vocab_size * 4 and d1.logits == 64 * 32 * llada.vocab_size * 4
