"""examples/configs/dare/*.yaml reproduce DARE's published recipes (yjyddq/DARE @83ae8a3, task=math; VRPO:
task=ultrafeedback).

``DARE`` (RL, ``megadare rl``) and ``DARE_DPO`` (offline VRPO, ``megadare dpo``) below are transcribed by hand from
the scripts, in DARE's own terms (the shell variables and verl overrides of each ``recipe/**/run_*.sh``; defaults
of verl where the script sets nothing: clip_ratio 0.2, clip_ratio_c 3.0, ppo_epochs 1, grad_clip 1.0, AdamW betas
(0.9, 0.999), warmup_style constant with lr_warmup_steps_ratio 0). The test translates them into megadare's keys
and checks every preset against them, that each preset names its script, and that each loads with ``--dry-run``.
"""

from __future__ import annotations

import glob
import math
import os

import pytest

from megadare.config import load_config

ROOT = os.path.join(os.path.dirname(__file__), "..", "examples", "configs", "dare")
MATH_PROMPTS = 7474 + 7473  # math_1 + gsm8k_1 training parquets (drop_last batches per epoch)
# DARE objectives that apply dual clip (compute_policy_loss / compute_policy_loss_bgpo with clip_ratio_c)
DUAL_CLIP = {"d1", "coupled_grpo", "cj_grpo", "bgpo", "justgrpo"}
# models whose DARE rollouts decode the whole canvas of R positions: the hf rollouts of LLaDA / Dream return a
# response attention mask of all ones (rollout_utils.py; mdpo_*_rollout.py and dtreerpo_llada_rollout.py decode all
# R positions too) -> rl.canvas=full, stated in the preset
FULL_CANVAS = {"llada", "dream"}
KL_TYPE = {"k2": "k2", "low_var_kl": "k3"}  # verl kl_loss_type -> algo.params.kl_estimator
# rollouts DARE runs with use_cache=True, dual_cache=False (the recipes; espo's default): Fast-dLLM's prefix cache
# (generate.py generate_with_prefix_cache, generation_utils_block.py _sample). MDPO, d-TreeRPO and JustGRPO
# (use_cache False by default) decode without a cache.
PREFIX_CACHE = {f"{a}_{m}" for m in ("llada", "dream") for a in ("d1", "coupled_grpo", "bgpo", "cj_grpo", "spg")} | {
    "espo_llada"
}
# DARE's MDPO rollouts (mdpo_llada_rollout.py, mdpo_dream_rollout.py): LLaDA ranks by p(x0) under the tempered
# distribution (conf_alg llada); Dream decodes one block over the response (block_length unused) in
# num_diffusion_steps steps, entropy ranking, n_masked - int(n_masked * s/t) tokens per step
MDPO_DECODER = {
    "mdpo_llada": lambda d: {"rollout.confidence": "maskgit_plus", "rollout.schedule": "even"},
    "mdpo_dream": lambda d: {
        "rollout.block_size": d["max_response_length"],
        "rollout.steps_per_block": d["num_diffusion_steps"],
        "rollout.confidence": "entropy",
        "rollout.schedule": "linspace_remaining",
    },
}
# DARE's Dream recipes (use_cache=True, dllm_fsdp_workers.py:672-676 -> fast_dream_rollout.py /
# fast_cj_dream_rollout.py) decode with generation_utils_block.py _sample: diffusion_generate(alg="entropy",
# alg_temp=0.0, top_p=0.95 if temperature > 0 else 1.0) (rollout_utils.py:792-805, 1068-1082), eps 1e-3 (its
# DreamGenerationConfig default); step 0 of a block commits the block's first position alone (:592-593), the
# other steps the linspace counts (:686-694). d-TreeRPO (dtreerpo_llada_rollout.py) and MDPO have their own
# samplers.
DREAM_BLOCK_SAMPLER = {"d1", "coupled_grpo", "bgpo", "cj_grpo", "spg"}

_LLADA = dict(
    lr=5e-7,
    batch_size=16,
    n_rollout=8,
    train_temperature=0.6,
    block_length=32,
    max_response_length=512,
    num_diffusion_steps=256,
    val_temperature=0.0,
    mc_num=1,
    test_freq=20,
)
_DREAM = dict(_LLADA, train_temperature=0.2, val_temperature=0.2)
_TREE = dict(
    lr=3e-5,
    batch_size=16,
    train_temperature=0.9,
    block_length=32,
    max_response_length=256,
    num_diffusion_steps=128,
    val_temperature=0.0,
    clip_ratio=0.4,
    use_kl_loss=True,
    kl_loss_coef=0.01,
    ppo_epochs=12,
    total_epoch=10,
    lora_rank=128,
    lora_alpha=64,
    grad_clip=0.2,
    weight_decay=0.1,
    betas=(0.9, 0.99),
    tree_branch_factor=4,
    tree_contraction_factor=2,
    num_tree_samples=4,
    enable_self_distillation=True,
    test_freq=20,
)
_SDAR = dict(
    lr=5e-7,
    n_rollout=8,
    train_temperature=1.0,
    block_length=4,
    max_response_length=2048,
    steps_per_block=4,
    top_k=50,
    test_freq=10,
)
_BGPO_SDAR = dict(_SDAR, batch_size=14, mc_num=16, threshold=0.9)  # engine=lmdeploy
_EBPO_SDAR = dict(_SDAR, batch_size=16, mc_num=16, top_p=1.0, val_temperature=0.0, threshold=0.95)  # sglang
_LLADA2 = dict(
    lr=5e-7,
    batch_size=16,
    n_rollout=8,
    train_temperature=0.6,
    block_length=32,
    max_response_length=2048,
    num_diffusion_steps=1024,
    val_temperature=0.0,
    test_freq=10,
)


def _full_attention(model: str, script_model: str, base: dict, **per_algo: dict) -> dict:
    """The seven LLaDA / Dream recipes of one model (their scripts share every setting but the model's)."""
    short = dict(max_response_length=256, num_diffusion_steps=128)
    algos = {
        "d1": {},
        "coupled_grpo": {},
        "bgpo": dict(mc_num=16),
        "cj_grpo": short,
        "spg": dict(logp_estimation="mix"),
        "mdpo": dict(sample_train_steps=16),
    }
    out = {
        f"{a}_{model}": (f"recipe/{model}/run_{a}_{script_model}.sh", dict(base, **extra, **per_algo.get(a, {})))
        for a, extra in algos.items()
    }
    out[f"d_treerpo_{model}"] = (f"recipe/{model}/run_dtreerpo_{script_model}.sh", _TREE)
    return out


DARE = {
    **_full_attention("llada", "llada_8b_instruct", _LLADA),
    **_full_attention(
        "dream", "dream_7b_instruct", _DREAM, coupled_grpo=dict(batch_size=8), cj_grpo=dict(test_freq=10)
    ),
    # JustGRPO: AR order, block_length 1 and num_diffusion_steps = max_response_length
    "justgrpo_llada": (
        "recipe/llada/run_justgrpo_llada_8b_instruct.sh",
        dict(_LLADA, block_length=1, num_diffusion_steps=512, test_freq=10),
    ),
    # ESPO (math): n_rollout 16, num_diffusion_steps R / 2, num_iterations 8 mask sets, k2 KL beta 1e-3
    "espo_llada": (
        "recipe/llada/run_espo_llada_8b_instruct.sh",
        dict(
            _LLADA,
            n_rollout=16,
            train_temperature=1.0,
            adv_estimator="rloo",
            mc_num=2,
            num_iterations=8,
            use_kl_loss=True,
            kl_loss_coef=0.001,
            kl_loss_type="k2",
            test_freq=10,
        ),
    ),
    # SDAR: bgpo defaults to engine=lmdeploy (batch 14, low_confidence_dynamic 0.9), ebpo / cj to sglang (batch 16,
    # LowConfidence threshold 0.95 from recipe/sdar/sglang_low_confidence_sdar.yaml)
    "bgpo_sdar_1dot7b": ("recipe/sdar/run_bgpo_sdar_1dot7b_chat.sh", dict(_BGPO_SDAR, top_p=0.95, val_temperature=1.0)),
    "bgpo_sdar_4b": ("recipe/sdar/run_bgpo_sdar_4b_chat.sh", dict(_BGPO_SDAR, top_p=0.95, val_temperature=1.0)),
    "bgpo_sdar_8b": ("recipe/sdar/run_bgpo_sdar_8b_chat.sh", dict(_BGPO_SDAR, top_p=1.0, val_temperature=0.0)),
    "ebpo_sdar_1dot7b": ("recipe/sdar/run_ebpo_sdar_1dot7b_chat.sh", _EBPO_SDAR),
    "ebpo_sdar_4b": ("recipe/sdar/run_ebpo_sdar_4b_chat.sh", _EBPO_SDAR),
    "ebpo_sdar_8b": ("recipe/sdar/run_ebpo_sdar_8b_chat.sh", _EBPO_SDAR),
    "cj_grpo_sdar_8b": (
        "recipe/sdar/run_cj_grpo_sdar_8b_chat.sh",
        dict(_SDAR, batch_size=16, top_p=1.0, val_temperature=0.0, threshold=0.95),
    ),
    "bgpo_llada2_mini": ("recipe/llada2_mini/run_bgpo_llada2_mini.sh", dict(_LLADA2, mc_num=16)),
    "ebpo_llada2_mini": ("recipe/llada2_mini/run_ebpo_llada2_mini.sh", dict(_LLADA2, mc_num=16)),
    "cj_grpo_llada2_mini": (
        "recipe/llada2_mini/run_cj_grpo_llada2_mini.sh",
        dict(_LLADA2, steps_per_block=32, top_k=50, top_p=0.95, threshold=0.95),
    ),
}


# argilla/ultrafeedback-binarized-preferences-cleaned (60917 pairs), train_test_split(test_size=0.05) in
# verl/utils/preprocess/preprocess_dpo.py: the test split takes ceil(5 %)
ULTRAFEEDBACK_TRAIN = 60917 - math.ceil(0.05 * 60917)
_VRPO = dict(
    lr=5e-7,
    weight_decay=0.01,
    batch_size=64,
    n_gpus_per_node=8,
    ppo_micro_batch_size_per_gpu=4,
    max_prompt_length=512,
    max_response_length=512,
    total_epoch=10,
    beta=0.2,
    mc_num=4,
    n_l=4,
)
DARE_DPO = {
    "vrpo_llada": ("recipe/llada/run_vrpo_llada_8b_instruct.sh", _VRPO),
    "vrpo_dream": ("recipe/dream/run_vrpo_dream_7b_instruct.sh", _VRPO),
}


def _algo(name: str) -> str:
    return name.split("_sdar")[0].split("_llada")[0].split("_dream")[0]


def _load(name: str, script: str):
    path = os.path.join(ROOT, f"{name}.yaml")
    with open(path) as f:
        assert script in f.readline()  # the first line names the DARE script
    return load_config(path)


def _check(cfg, want: dict, name: str) -> None:
    for key, value in want.items():
        obj = cfg
        for part in key.split("."):
            obj = getattr(obj, part)
        assert obj == pytest.approx(value) if isinstance(value, float) else obj == value, (name, key, obj, value)


def test_every_preset_is_in_the_table():
    have = sorted(os.path.basename(p)[:-5] for p in glob.glob(os.path.join(ROOT, "*.yaml")))
    assert have == sorted({**DARE, **DARE_DPO})


def _eval_steps_per_block(name: str, d: dict) -> int:
    """DARE's LLaDA / Dream recipes validate with val_num_diffusion_steps = max_response_length: one token per
    step (0: as training). d-TreeRPO's rollout ignores it (its own sampler, training settings)."""
    if not name.endswith(("_llada", "_dream")) or name.startswith("d_treerpo"):
        return 0
    R = d["max_response_length"]
    block = R if name == "mdpo_dream" else d["block_length"]
    train = d["num_diffusion_steps"] if name == "mdpo_dream" else d["num_diffusion_steps"] // (R // block)
    per_block = R // (R // block)
    return 0 if per_block == train else per_block


@pytest.mark.parametrize("name", sorted(DARE))
def test_preset_reproduces_the_dare_recipe(name):
    script, d = DARE[name]
    cfg = _load(name, script)
    algo = _algo(name)
    R, block = d["max_response_length"], d["block_length"]
    steps_per_block = d.get("steps_per_block") or d["num_diffusion_steps"] // (R // block)
    tree = algo == "d_treerpo"
    group = (
        d["num_tree_samples"] * d["tree_branch_factor"] ** (d["tree_contraction_factor"] - 1)
        if tree
        else d["n_rollout"]
    )
    want = {
        "algo.name": algo,
        "optim.lr": d["lr"],
        "optim.weight_decay": d.get("weight_decay", 0.01),
        "optim.clip_grad": d.get("grad_clip", 1.0),
        "optim.adam_beta2": d.get("betas", (0.9, 0.999))[1],
        "optim.lr_decay_style": "constant",
        "optim.warmup_steps": 0,
        "rl.prompts_per_step": d["batch_size"],
        "rl.n_samples": group,
        "rl.mini_batches": 1,
        "rl.ppo_epochs": d.get("ppo_epochs", 1) * d.get("num_iterations", 1),  # ESPO: one update per mask set
        "rl.steps": d.get("total_epoch", 1) * (MATH_PROMPTS // d["batch_size"]),
        "rl.eval_interval": d["test_freq"],
        "lora.rank": d.get("lora_rank", 0),
        "advantage.estimator": d.get("adv_estimator", "grpo"),
        "rewards.name": "math",
        "rl.canvas": "full" if name[len(algo) + 1 :] in FULL_CANVAS else None,
        "rollout.temperature": d["train_temperature"],
        "rollout.eval_temperature": d["val_temperature"],
        "rollout.top_k": d.get("top_k", 0),
        "rollout.top_p": d.get("top_p", 1.0),
        "rollout.block_size": R if name == "mdpo_dream" else block,
        "rollout.steps_per_block": d["num_diffusion_steps"] if name == "mdpo_dream" else steps_per_block,
        "rollout.max_new_tokens": R,
        "rollout.full_attention_cache": "prefix" if name in PREFIX_CACHE else "none",
        "rollout.eval_steps_per_block": _eval_steps_per_block(name, d),
        "data.max_length": 512 + R,
    }
    if "threshold" in d:
        want.update({"rollout.algorithm": "low_confidence_dynamic", "rollout.threshold": d["threshold"]})
    if name.endswith("_dream") and algo in DREAM_BLOCK_SAMPLER:
        assert d["train_temperature"] > 0 and d["val_temperature"] > 0  # top_p 0.95 at both temperatures
        want.update(
            {
                "rollout.algorithm": "low_confidence_static",
                "rollout.confidence": "entropy",
                "rollout.schedule": "linspace_first",
                "rollout.top_p": 0.95,
                "rollout.eps": 1e-3,
                "rollout.alg_temp": 0.0,
            }
        )
    if tree:  # dtreerpo_llada_rollout.py:306-321 (LLaDA and Dream): gumbel argmax, p(x0) ranks, even counts
        want.update({"rollout.confidence": "model_prob", "rollout.schedule": "even"})
    if d.get("lora_rank"):
        want["lora.alpha"] = d["lora_alpha"]
    if d.get("num_iterations", 1) > 1:
        want["rl.redraw_corruptions"] = True  # each iteration on its own precomputed mask set
    _check(cfg, want, name)
    p = dict(cfg.algo.params)
    assert p.get("eps_low", 0.2) == d.get("clip_ratio", 0.2)
    assert p.get("dual_clip") == (3.0 if algo in DUAL_CLIP else None), name
    assert p.get("kl_coef", 0.0) == (d["kl_loss_coef"] if d.get("use_kl_loss") else 0.0), name
    if "kl_loss_type" in d:
        assert p["kl_estimator"] == KL_TYPE[d["kl_loss_type"]], name
    if algo in ("bgpo", "ebpo", "spg", "espo"):
        assert p["n_mc"] == d["mc_num"]
    if algo == "spg":
        assert p["estimator"] == "dare" and p["mix"] == 0.5  # logp_estimation=mix, mix_weight 0.5
    if algo == "mdpo":
        assert p["top_k_steps"] == d["sample_train_steps"] and p["top_k_scope"] == "batch"
        _check(cfg, MDPO_DECODER[name](d), name)
    if tree:
        assert (p["branch"], p["depth"], p["root_fanout"]) == (
            d["tree_branch_factor"],
            d["tree_contraction_factor"],
            d["num_tree_samples"],
        )
        # DARE's d-TreeRPO actor computes the plain k3 inline, whatever kl_loss_type (low_var_kl) says
        assert p["self_distillation"] == d["enable_self_distillation"] and p["kl_estimator"] == "k3_plain"


@pytest.mark.parametrize("name", sorted(DARE_DPO))
def test_dpo_preset_reproduces_the_dare_recipe(name):
    script, d = DARE_DPO[name]
    cfg = _load(name, script)
    assert d["n_l"] == d["mc_num"]  # DARE asserts it for vrpo: the whole budget on timesteps
    rows_per_update = d["n_gpus_per_node"] * d["ppo_micro_batch_size_per_gpu"] * 2  # ppo_mini_batch_size
    updates_per_batch = d["batch_size"] * 2 // rows_per_update  # a pair is 2 rows
    _check(
        cfg,
        {
            "optim.lr": d["lr"],
            "optim.weight_decay": d["weight_decay"],
            "optim.clip_grad": 1.0,
            "optim.adam_beta2": 0.999,
            "optim.lr_decay_style": "constant",
            "optim.warmup_steps": 0,
            "train.global_batch_size": rows_per_update // 2,
            "train.steps": d["total_epoch"] * (ULTRAFEEDBACK_TRAIN // d["batch_size"]) * updates_per_batch,
            "data.max_length": d["max_prompt_length"] + d["max_response_length"],
            "dpo.beta": d["beta"],
            "dpo.n_mc": d["mc_num"],
            "dpo.margin_norm": "canvas",
            "dpo.canvas_length": d["max_response_length"],  # ELBO / max_response_length
        },
        name,
    )


def test_every_preset_loads_with_dry_run(capsys):
    """The presets' paths are placeholders (config.json-only models, DARE's data paths), so the config-only
    pre-flight: the config, its layout and its memory plan on the declared cluster."""
    from megadare.cli import main

    for name in sorted({**DARE, **DARE_DPO}):
        command = "dpo" if name in DARE_DPO else "rl"
        assert main([command, "--config", os.path.join(ROOT, f"{name}.yaml"), "--dry-run", "--config-only"]) == 0, (
            name,
            capsys.readouterr().err,
        )
        assert f"run_dir: runs/dare/{name}\n" in capsys.readouterr().out, name  # the resolved config is printed


# trainer.save_freq of each DARE script (verl's checkpoint interval; espo / justgrpo: their --save_freq default 100)
SAVE_FREQ = {
    "recipe/dream/run_bgpo_dream_7b_instruct.sh": 20,
    "recipe/dream/run_cj_grpo_dream_7b_instruct.sh": 100,
    "recipe/dream/run_coupled_grpo_dream_7b_instruct.sh": 20,
    "recipe/dream/run_d1_dream_7b_instruct.sh": 1,
    "recipe/dream/run_dtreerpo_dream_7b_instruct.sh": 20,
    "recipe/dream/run_mdpo_dream_7b_instruct.sh": 20,
    "recipe/dream/run_spg_dream_7b_instruct.sh": 20,
    "recipe/dream/run_vrpo_dream_7b_instruct.sh": 20,
    "recipe/llada/run_bgpo_llada_8b_instruct.sh": 20,
    "recipe/llada/run_cj_grpo_llada_8b_instruct.sh": 20,
    "recipe/llada/run_coupled_grpo_llada_8b_instruct.sh": 20,
    "recipe/llada/run_d1_llada_8b_instruct.sh": 20,
    "recipe/llada/run_dtreerpo_llada_8b_instruct.sh": 20,
    "recipe/llada/run_espo_llada_8b_instruct.sh": 100,
    "recipe/llada/run_justgrpo_llada_8b_instruct.sh": 100,
    "recipe/llada/run_mdpo_llada_8b_instruct.sh": 20,
    "recipe/llada/run_spg_llada_8b_instruct.sh": 20,
    "recipe/llada/run_vrpo_llada_8b_instruct.sh": 20,
    "recipe/llada2_mini/run_bgpo_llada2_mini.sh": 100,
    "recipe/llada2_mini/run_cj_grpo_llada2_mini.sh": 100,
    "recipe/llada2_mini/run_ebpo_llada2_mini.sh": 100,
    "recipe/sdar/run_bgpo_sdar_1dot7b_chat.sh": 100,
    "recipe/sdar/run_bgpo_sdar_4b_chat.sh": 100,
    "recipe/sdar/run_bgpo_sdar_8b_chat.sh": 100,
    "recipe/sdar/run_cj_grpo_sdar_8b_chat.sh": 100,
    "recipe/sdar/run_ebpo_sdar_1dot7b_chat.sh": 100,
    "recipe/sdar/run_ebpo_sdar_4b_chat.sh": 100,
    "recipe/sdar/run_ebpo_sdar_8b_chat.sh": 100,
}
# the files of DARE's task=math (RL) and ultrafeedback (VRPO) runs: train_files / val_files of the scripts
RL_FILES = (
    ["data/preprocessed/rl/train/math_1.parquet", "data/preprocessed/rl/train/gsm8k_1.parquet"],
    ["data/preprocessed/rl/test/math500_1.parquet", "data/preprocessed/rl/test/gsm8k_1.parquet"],
)
DPO_FILE = "data/preprocessed/dpo/train/ultrafeedback.parquet"


@pytest.mark.parametrize("name", sorted({**DARE, **DARE_DPO}))
def test_preset_saves_at_dares_interval_and_fits_its_cluster(name):
    """A crash hours into a preset run loses at most DARE's checkpoint interval; the memory plan of the layout the
    preset sets fits the cluster it declares (plan.*); its data are DARE's own files, read as they are (the
    README's promise), which its comment says."""
    from megadare.models import family_of, read_hf_config
    from megadare.plan import plan

    script = {**DARE, **DARE_DPO}[name][0]
    cfg = _load(name, script)
    assert cfg.checkpoint.save_interval == SAVE_FREQ[script], name
    hf = read_hf_config(os.path.join(ROOT, "..", "..", "..", cfg.model.hf_path))
    report = plan(cfg, family_of(hf).arch(hf), advise=False)
    assert report.fits, (name, report.peak / 2**30, cfg.plan)
    assert (cfg.plan.nodes, cfg.plan.gpus_per_node, cfg.plan.gpu_memory_gb) == (1, 8, 80), name
    assert cfg.plan.job == ("sft" if name in DARE_DPO else "rl"), name
    text = open(os.path.join(ROOT, f"{name}.yaml")).read()
    assert "flattened" not in text and "read as it is" in text.replace("read as they are", "read as it is"), name
    if name in DARE_DPO:
        assert cfg.data.path == DPO_FILE, name
    else:
        assert (list(cfg.data.path), list(cfg.data.eval_path)) == RL_FILES, name
