"""Configs that cannot learn, or whose value is out of its range, are refused before any process starts, in one
line naming the key, the value and the fix; the legitimate neighbours of each still load."""

from __future__ import annotations

import re

import pytest

from megadare.config import load_config
from megadare.errors import ConfigError
from megadare.trainer.spec import resolve

SFT = "examples/configs/sft_sdar_tiny.yaml"
RL = "megadare/configs/demo_rl.yaml"

# (config file, job, overrides, words of the one-line message)
REFUSED = [
    # NaN / inf read as numbers
    (SFT, "sft", ["optim.lr=nan"], "optim.lr=nan must be a finite number"),
    (SFT, "sft", ["train.lr=inf"], "train.lr=inf must be a finite number"),
    (RL, "rl", ["rollout.temperature=nan"], "rollout.temperature=nan must be a finite number"),
    # negative intervals run every step; ranges of the optimiser and the rest
    (SFT, "sft", ["checkpoint.save_interval=-1"], "checkpoint.save_interval=-1 must be within [0, inf)"),
    (RL, "rl", ["rl.eval_interval=-1"], "rl.eval_interval=-1 must be within [0, inf)"),
    (SFT, "sft", ["checkpoint.keep_last=-1"], "checkpoint.keep_last=-1 must be within [0, inf)"),
    (SFT, "sft", ["optim.clip_grad=-1"], "optim.clip_grad=-1.0 must be within [0, inf)"),
    (SFT, "sft", ["optim.weight_decay=-0.1"], "optim.weight_decay=-0.1 must be within [0, inf)"),
    (SFT, "sft", ["optim.adam_beta1=1.5"], "optim.adam_beta1=1.5 must be within [0, 1)"),
    (SFT, "sft", ["optim.adam_beta2=1.0"], "optim.adam_beta2=1.0 must be within [0, 1)"),
    (SFT, "sft", ["train.moe_aux_loss_coeff=-1"], "train.moe_aux_loss_coeff=-1.0 must be within [0, inf)"),
    (SFT, "sft", ["data.synthetic_correct=2"], "data.synthetic_correct=2.0 must be within [0, 1]"),
    (SFT, "dpo", ["dpo.beta=0"], "dpo.beta=0.0 must be within (0, inf)"),
    (RL, "rl", ["replay.fraction=-1"], "replay.fraction=-1.0 must be within [0, inf)"),
    (RL, "rl", ["offpolicy.rollout_is_threshold=0"], "offpolicy.rollout_is_threshold=0.0 must be within (0, inf)"),
    # megatron's sequence parallelism asserts mid-step on a length TP does not divide
    (
        SFT,
        "sft",
        ["parallel.tp=2", "parallel.sp=true", "train.seq_length=127"],
        "train.seq_length=127 must be divisible by parallel.cp=1 x parallel.tp=2 (sequence parallel",
    ),
    # LoRA adapters that train nothing
    (SFT, "sft", ["lora.rank=4", "lora.alpha=0"], "lora.alpha=0.0 with lora.rank=4: the adapters scale by alpha"),
    (SFT, "sft", ["lora.rank=4", "lora.targets=[]"], "lora.targets=[] is empty"),
    (SFT, "sft", ["lora.rank=4", "lora.targets=[linear_qkvv,linear_proj]"], "names no linear ['linear_qkvv']"),
    # RL settings under which every advantage is 0 or no group trains
    (RL, "rl", ["rollout.temperature=0"], "rollout.temperature=0 with rl.n_samples=8: greedy decoding"),
    (RL, "rl", ["rl.mini_batches=64"], "rl.mini_batches=64 > rl.prompts_per_step=16: a mini-batch holds whole"),
    (RL, "rl", ["advantage.accuracy_band=[0.9,0.1]"], "advantage.accuracy_band=[0.9, 0.1]: low > high"),
    (RL, "rl", ["rl.accuracy_band=[0.2]"], "rl.accuracy_band=[0.2] must be [low, high]"),
    (
        RL,
        "rl",
        ["offpolicy.loss_mode=decoupled", "offpolicy.rollout_is=token", "offpolicy.rollout_is_threshold_low=3"],
        "offpolicy.rollout_is_threshold_low=3.0 > offpolicy.rollout_is_threshold=2.0",
    ),
    (
        RL,
        "rl",
        ["replay.enable=true", "offpolicy.loss_mode=decoupled", "replay.fraction=0"],
        "replay.enable=true with replay.fraction=0 replays nothing",
    ),
    # the decoder's message names the key that is wrong
    (RL, "rl", ["rollout.top_p=0"], "rollout.top_p: top_p=0.0 must lie in (0, 1]"),
    (RL, "rl", ["rollout.eval_temperature=-1"], "rollout.eval_temperature: temperature=-1.0 must be >= 0"),
    # algorithm hyper-parameters, set on the command line
    (RL, "rl", ["algo.params.eps_low=-0.1"], "algo.params.eps_low=-0.1 must be within [0, 1)"),
    (RL, "rl", ["algo.params.eps_high=-0.5"], "algo.params.eps_high=-0.5 must be within [0, inf)"),
    (RL, "rl", ["algo.params.kl_coef=-0.1"], "algo.params.kl_coef=-0.1 must be within [0, inf)"),
    (RL, "rl", ["algo.params.kl_coef=nan"], "algo.params.kl_coef='nan': tracerl's kl_coef is a finite number"),
    (RL, "rl", ["algo.params.log_ratio_clamp=0"], "algo.params.log_ratio_clamp=0 must be within (0, inf)"),
    (RL, "rl", ["algo.params.value_model=maybe"], "algo.params.value_model='maybe': tracerl's value_model is true or"),
    (RL, "rl", ["algo.params.kl_coeff=0.1"], "no parameter 'kl_coeff'; did you mean algo.params.kl_coef?"),
    (
        RL,
        "rl",
        ["algo.name=bgpo", "algo.params.kl_coef=0.05"],
        "algo.params.kl_coef=0.05 with algo.params.kl_anchor=none (bgpo's default) penalises nothing",
    ),
    (RL, "rl", ["algo.name=espo", "algo.params.n_mc=0"], "algo.params.n_mc=0 must be within [1, inf)"),
    (RL, "rl", ["algo.name=bgpo", "algo.params.n_mc=2.5"], "algo.params.n_mc=2.5: bgpo's n_mc is an integer"),
    (
        RL,
        "rl",
        ["algo.name=random_mask_rl", "algo.params.p_low=0.9", "algo.params.p_high=0.1"],
        "algo.params.p_low=0.9 > algo.params.p_high=0.1: the range is inverted",
    ),
    (RL, "rl", ["algo.name=random_mask_rl", "algo.params.p_low=0"], "algo.params.p_low=0 must be within (0, 1]"),
    # a clip, a threshold or an epsilon whose value means nothing
    (RL, "rl", ["algo.params.eps_low=1.5"], "algo.params.eps_low=1.5 must be within [0, 1)"),
    (RL, "rl", ["rollout.threshold=2"], "rollout.threshold: threshold=2.0 must be < 1"),
    (RL, "rl", ["rollout.threshold=1", "rollout.algorithm=low_confidence_dynamic"], "threshold=1.0 must be < 1"),
    (
        RL,
        "rl",
        ["rollout.algorithm=low_confidence_dynamic", "rollout.confidence=entropy", "rollout.threshold=0.5"],
        "threshold=0.5 with confidence=entropy: that confidence is a negative entropy (<= 0)",
    ),
    (SFT, "sft", ["optim.adam_eps=0"], "optim.adam_eps=0.0 must be within (0, inf)"),
    # a KL estimator the loss does not know: refused at load, not at the first loss after the rollouts
    (RL, "rl", ["algo.params.kl_estimator=k4"], "algo.params.kl_estimator='k4' unknown; choose one of"),
    # a key the configured mode ignores
    (RL, "rl", ["offpolicy.max_staleness=4"], "offpolicy.max_staleness=4 bounds how many versions"),
    (RL, "rl", ["rl.max_staleness=4"], "rl.max_staleness=4 bounds how many versions queued rollouts lag; rl.mode=sync"),
    (SFT, "sft", ["sft.trace_shrink=4"], "sft.trace_shrink=4 groups the decoding steps of a trace (sft.mode=trace); "),
    (SFT, "sft", ["sft.mode=trace", "sft.pad_response=eos"], "sft.pad_response=eos pads responses, but sft.mode=trace"),
    (RL, "rl", ["data.eval_path=held.jsonl"], "data.eval_path='held.jsonl' and data.synthetic='reverse' are both set"),
    # a band no group of rl.n_samples 0-or-1 rewards can fall into
    (
        RL,
        "rl",
        ["rl.n_samples=4", "advantage.accuracy_band=[0.3,0.45]"],
        "advantage.accuracy_band=[0.3, 0.45] with rl.n_samples=4 and rewards.name=exact_match (0 or 1 per "
        "response): a group's accuracy is one of 0, 0.25, 0.5, 0.75, 1, none within the band",
    ),
]


@pytest.mark.parametrize("path,job,overrides,message", REFUSED)
def test_refused_in_one_line(path, job, overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)) as e:
        resolve(load_config(path, overrides), job=job)
    assert "\n" not in str(e.value)


# the legitimate neighbours of the refusals above
ACCEPTED = [
    (RL, "rl", ["rollout.temperature=0", "rollout.algorithm=random"]),  # random remasking still varies
    (RL, "rl", ["rollout.temperature=0", "rl.n_samples=1", "advantage.estimator=reinforce_pp"]),
    (RL, "rl", ["rollout.temperature=0", "algo.params.value_model=true"]),  # a value model's advantages
    (RL, "rl", ["advantage.accuracy_band=[0.2,0.8]", "checkpoint.keep_last=0", "rl.eval_interval=0"]),
    (RL, "rl", ["rl.mini_batches=16"]),
    (RL, "rl", ["algo.params.eps_low=0.2", "algo.params.eps_high=0.28", "algo.params.kl_coef=0"]),
    (RL, "rl", ["algo.name=bgpo", "algo.params.kl_coef=0.05", "algo.params.kl_anchor=ref"]),
    (SFT, "sft", ["lora.rank=4", "lora.alpha=8", "lora.targets=[linear_qkv]", "optim.clip_grad=0"]),
    (SFT, "sft", ["parallel.tp=2", "train.seq_length=127"]),  # without sp the sequence is not split
    (RL, "rl", ["algo.params.eps_low=0.99", "rollout.threshold=0.99", "offpolicy.max_staleness=0"]),
    (RL, "rl", ["offpolicy.mode=fully_async", "offpolicy.max_staleness=4", "offpolicy.loss_mode=decoupled"]),
    (RL, "rl", ["offpolicy.mode=one_step_off", "offpolicy.max_staleness=2"]),  # an old run's config.yaml
    (SFT, "sft", ["sft.mode=trace", "sft.trace_shrink=4"]),
    (SFT, "sft", ["sft.pad_response=pad", "sft.t_per=sample"]),  # DARE's SDAR SFT
    (SFT, "sft", ["optim.adam_eps=1e-12"]),
    (RL, "rl", ["rollout.algorithm=low_confidence_dynamic", "rollout.confidence=entropy", "rollout.threshold=-0.5"]),
    (RL, "rl", ["rl.n_samples=4", "advantage.accuracy_band=[0.3,0.5]"]),  # 0.5 is reachable
    (RL, "rl", ["rl.n_samples=4", "advantage.accuracy_band=[0.3,0.45]", "rewards.name=code"]),  # fractions of tests
]


@pytest.mark.parametrize("path,job,overrides", ACCEPTED)
def test_legitimate_neighbours_load(path, job, overrides):
    resolve(load_config(path, overrides), job=job)


def test_mapping_entries_set_on_the_command_line():
    """algo.params.n_mc=16 is what the foreign-key table tells a verl user to write: it must be accepted, as must
    an entry of every other free-form mapping."""
    cfg = load_config(
        RL,
        [
            "algo.name=espo",
            "algo.params.n_mc=16",
            "algo.params.kl_coef=0.01",
            "eval.paths.gsm8k=data/gsm8k.jsonl",
            "rollout.engine_resources.num_gpus=1",
        ],
    )
    assert cfg.algo.params == {"n_mc": 16, "kl_coef": 0.01}
    assert cfg.eval.paths == {"gsm8k": "data/gsm8k.jsonl"}
    assert cfg.rollout.engine_resources == {"num_cpus": 1, "num_gpus": 1}
    assert resolve(cfg, job="rl").algo.p["n_mc"] == 16


def test_typo_suggests_a_key_not_a_section():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["optim.lR=1e-3"])
    assert str(e.value).endswith("did you mean optim.lr=1e-3?")
