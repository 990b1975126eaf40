"""Keys users bring from the projects they come from (verl / DARE, dLLM-RL, Megatron-LM, torchrun), each with the
megadare setting that means the same. The loader and the command line only *suggest* it: a foreign key is an error
whose one line says what to write instead. None is translated silently: many look alike but count another unit
(verl's ``trainer.total_epochs`` against megadare's ``rl.steps``; DARE's ``num_diffusion_steps`` per response against
``rollout.steps_per_block``), and a half-translated command would run a recipe that is not the one pasted.

Each entry: the foreign key as its project spells it -> the fix, a template of megadare overrides where ``{v}`` is
the value the user gave (``<...>`` marks a value to compute), or for a value whose spelling changes, a
{foreign value: fix} table (lower-cased; ``*`` for any other value). Verified against the sources named per block
and against megadare's own keys (tests/test_cli_habits.py loads every fix without ``<...>``).
"""

from __future__ import annotations

from typing import Any, Optional, Union

Fix = Union[str, dict[str, str]]

# verl's PPO trainer as DARE ships it (yjyddq/DARE @83ae8a3: verl/trainer/config/ppo_trainer.yaml,
# ppo_megatron_trainer.yaml, recipe/*/run_*.sh; the DARE-only keys are the ``+`` ones of the recipes). Meanings as
# tests/test_dare_presets.py transcribes the recipes into megadare keys.
_ACTOR = "actor_rollout_ref.actor"
_MEGATRON = f"{_ACTOR}.megatron"
_ROLLOUT = "actor_rollout_ref.rollout"
VERL: dict[str, Fix] = {
    "data.train_files": "data.path={v}",
    "data.val_files": "data.eval_path={v}",
    "data.train_batch_size": "rl.prompts_per_step={v}",
    "data.max_prompt_length": "data.max_length=<{v} + rollout.max_new_tokens> (prompt + response tokens)",
    "data.max_response_length": "rollout.max_new_tokens={v}",
    "actor_rollout_ref.model.path": "model.hf_path={v}",
    "actor_rollout_ref.model.lora_rank": "lora.rank={v}",
    "actor_rollout_ref.model.lora_alpha": "lora.alpha={v}",
    "actor_rollout_ref.model.enable_gradient_checkpointing": {
        "true": "train.recompute=full",
        "false": "train.recompute=none",
    },
    f"{_ACTOR}.optim.lr": "optim.lr={v}",
    f"{_ACTOR}.optim.weight_decay": "optim.weight_decay={v}",
    f"{_ACTOR}.optim.lr_warmup_steps": (
        "optim.warmup_steps=<{v} x rl.ppo_epochs x rl.mini_batches> (verl counts RL steps, megadare optimizer updates)"
    ),
    f"{_ACTOR}.optim.lr_warmup_steps_ratio": (
        "optim.warmup_steps=<{v} x rl.steps x rl.ppo_epochs x rl.mini_batches> (optimizer updates)"
    ),
    f"{_ACTOR}.optim.warmup_style": "optim.lr_decay_style={v}",
    f"{_ACTOR}.optim.min_lr_ratio": "optim.min_lr=<{v} x optim.lr> (an absolute learning rate)",
    f"{_ACTOR}.grad_clip": "optim.clip_grad={v}",
    f"{_ACTOR}.clip_ratio": "algo.params.eps_low={v}",
    f"{_ACTOR}.clip_ratio_low": "algo.params.eps_low={v}",
    f"{_ACTOR}.clip_ratio_high": "algo.params.eps_high={v}",
    f"{_ACTOR}.clip_ratio_c": "algo.params.dual_clip={v}",
    f"{_ACTOR}.use_kl_loss": {"false": "algo.params.kl_coef=0", "true": "algo.params.kl_coef=<kl_loss_coef>"},
    f"{_ACTOR}.kl_loss_coef": "algo.params.kl_coef={v} (verl applies it only with use_kl_loss=True)",
    f"{_ACTOR}.kl_loss_type": {
        "low_var_kl": "algo.params.kl_estimator=k3",
        "k2": "algo.params.kl_estimator=k2",
        "*": "algo.params.kl_estimator=<one of k1, k2, k3, k3_exp10, k3_plain>",
    },
    f"{_ACTOR}.ppo_epochs": "rl.ppo_epochs={v}",
    f"{_ACTOR}.ppo_mini_batch_size": "rl.mini_batches=<rl.prompts_per_step / {v}> (optimizer steps per epoch)",
    f"{_ACTOR}.mc_num": "algo.params.n_mc={v}",
    f"{_MEGATRON}.tensor_model_parallel_size": "parallel.tp={v}",
    f"{_MEGATRON}.pipeline_model_parallel_size": "parallel.pp={v}",
    f"{_MEGATRON}.virtual_pipeline_model_parallel_size": "parallel.vpp={v}",
    f"{_MEGATRON}.expert_model_parallel_size": "parallel.ep={v}",
    f"{_MEGATRON}.expert_tensor_parallel_size": "parallel.etp={v}",
    f"{_MEGATRON}.context_parallel_size": "parallel.cp={v}",
    f"{_MEGATRON}.sequence_parallel": "parallel.sp={v}",
    f"{_ROLLOUT}.n": "rl.n_samples={v}",
    f"{_ROLLOUT}.temperature": "rollout.temperature={v}",
    f"{_ROLLOUT}.top_k": {"-1": "rollout.top_k=0 (0 is off)", "*": "rollout.top_k={v}"},
    f"{_ROLLOUT}.top_p": "rollout.top_p={v}",
    f"{_ROLLOUT}.val_kwargs.temperature": "rollout.eval_temperature={v}",
    f"{_ROLLOUT}.tensor_model_parallel_size": "rollout.engine_tp={v} (with rollout.engine=sglang)",
    f"{_ROLLOUT}.block_length": "rollout.block_size={v}",
    f"{_ROLLOUT}.num_diffusion_steps": (
        "rollout.steps_per_block=<{v} / (rollout.max_new_tokens / rollout.block_size)> (steps per block)"
    ),
    f"{_ROLLOUT}.val_kwargs.num_diffusion_steps": (
        "rollout.eval_steps_per_block=<{v} / (rollout.max_new_tokens / rollout.block_size)> (steps per block)"
    ),
    f"{_ROLLOUT}.use_cache": {
        "true": "rollout.full_attention_cache=prefix (LLaDA / Dream; dual_cache=True: dual)",
        "false": "rollout.full_attention_cache=none",
    },
    f"{_ROLLOUT}.dual_cache": {
        "true": "rollout.full_attention_cache=dual",
        "false": "rollout.full_attention_cache=prefix (with use_cache=True; none without)",
    },
    "algorithm.adv_estimator": {
        "grpo": "advantage.estimator=grpo",
        "rloo": "advantage.estimator=rloo",
        "*": "advantage.estimator=<one of grpo, rloo, reinforce_pp>",
    },
    "algorithm.norm_adv_by_std_in_grpo": {"true": "advantage.std=unbiased", "false": "advantage.std=none"},
    "trainer.total_epochs": "rl.steps=<{v} x training prompts // rl.prompts_per_step> (RL steps, not epochs)",
    "trainer.total_training_steps": "rl.steps={v}",
    "trainer.test_freq": "rl.eval_interval={v}",
    "trainer.save_freq": "checkpoint.save_interval={v}",
    "trainer.default_local_dir": "checkpoint.save={v}",
    "trainer.n_gpus_per_node": "--nproc {v} (under torchrun or Slurm: their process count)",
    # DARE's SFT trainers (verl/trainer/{sdar,llada,llada2,dream}_fsdp_sft_trainer.py, config/sft_trainer.yaml,
    # recipe/*/run_sft_*.sh; compared live by tests/test_dare_live_sft.py): each micro-batch is divided by its own
    # token count and the micro-batches averaged; megadare divides the global batch once (sft.normalize).
    "data.micro_batch_size_per_gpu": {
        "1": (
            "sft.normalize=masked_tokens_per_sample (LLaDA, LLaDA2, Dream; SDAR: sft.normalize=answer_length): "
            "DARE's loss at one sample a micro-batch"
        ),
        "*": (
            "sft.normalize=masked_tokens (LLaDA, LLaDA2, Dream; SDAR: answer_length): DARE averages micro-batches of "
            "{v}, each over its own tokens; megadare takes one mean over the global batch"
        ),
    },
    "data.balance_dp_token": {
        "true": "sft.normalize=masked_tokens (the masked tokens of the global batch)",
        "false": "sft.normalize=masked_tokens_per_sample (each sample's masked tokens, as DARE at one a micro-batch)",
    },
    # DARE's SFT recipes name the model so (the RL ones actor_rollout_ref.model.path); its SFT datasets pad every
    # answer to data.max_length and train on the pads, megadare only when told (sft.pad_response)
    "model.partial_pretrain": (
        "model.hf_path={v} (DARE's SFT datasets pad every answer to data.max_length and train on the pads: "
        "sft.pad_response=eos for LLaDA, pad for SDAR and Dream; LLaDA2's pads are not trained)"
    ),
    "data.noise_range_low": "sft.noise_low={v} sft.weighting=none (DARE's LLaDA2 SFT: t ~ U(low, high), no 1/t)",
    "data.noise_range_high": "sft.noise_high={v} sft.weighting=none (DARE's LLaDA2 SFT: t ~ U(low, high), no 1/t)",
}

# dLLM-RL (Gen-Verse/dLLM-RL @10b4fd1: configs/rl_*.yaml, rl.py, sample/*_rl_rollout.py, train/rl_*.py). Its
# command line is ``python rl.py config=configs/rl_sdar.yaml`` (OmegaConf's dotlist).
DLLM_RL: dict[str, Fix] = {
    "config": "--config {v}",
    "experiment.total_step": "rl.steps={v}",
    "experiment.save_every": "checkpoint.save_interval={v}",
    "experiment.eval_every": "rl.eval_interval={v}",
    "model.pretrained_model": "model.hf_path={v}",
    "model.model_base": "nothing: megadare reads the family from model.hf_path's config.json",
    "dataset.train_dataset": "data.path=<a .jsonl / .json / .parquet file> (a file, not a dataset name)",
    "rollout.num_task_per_step": "rl.prompts_per_step={v}",
    "rollout.num_response_per_task": "rl.n_samples={v}",
    "rollout.max_token": "rollout.max_new_tokens={v}",
    "rollout.denoising_steps_per_block": "rollout.steps_per_block={v}",
    "rollout.remasking_strategy": "rollout.algorithm={v}",
    "rollout.dynamic_threshold": "rollout.threshold={v}",
    # rl.py's methods, and train/sft_*.py's (configs/sft_*.yaml): the same keys mean the SFT objective there
    "training.method": {
        "tracerl": "algo.name=tracerl",
        "random_masking": (
            "algo.name=random_mask_rl (rl.py; its SFT, train/sft_llada.py / sft_dream.py, is sft.mode=random "
            "sft.weighting=none sft.normalize=masked_tokens_per_sample with t ~ U(lower_p, upper_p))"
        ),
        "coupled": "algo.name=random_mask_rl algo.params.couple=true",
        "semi-ar": (
            "sft.mode=block sft.weighting=none (SDAR / TraDo; dLLM-RL masks each answer token with its own "
            "p ~ U(lower_p, upper_p) and divides by the answer length padded to the data set's longest; LLaDA / "
            "Dream: no megadare mode is its semi-ar, which keeps the later blocks masked in the input where "
            "sft.mode=semi_ar slices them off)"
        ),
        "trace": "sft.mode=trace (training.shrink: sft.trace_shrink)",
        "*": "algo.name=<one of tracerl, random_mask_rl> (SFT: sft.mode=<one of random, block, semi_ar, trace>)",
    },
    "training.eps": "algo.params.eps_low={v}",
    "training.beta": "algo.params.kl_coef={v}",
    "training.shrink": "algo.params.shrink={v} (its SFT's trace mode: sft.trace_shrink={v})",
    "training.post_num": "algo.params.post_num={v}",
    "training.mask_times_per_sample": "algo.params.n_views={v} (algo.name=random_mask_rl)",
    "training.use_kl_estimator_k3": {
        "true": "algo.params.kl_estimator=k3_exp10",
        "false": "algo.params.kl_estimator=k1",
    },
    "training.gam": "algo.params.gamma={v} (algo.params.value_model=true)",
    "training.lam": "algo.params.lam={v} (algo.params.value_model=true)",
    "model.value_base_model": "algo.params.value_model=true (built from the policy: its backbone, a zero head)",
    "optimizer.params.policy_learning_rate": "optim.lr={v}",
    "optimizer.params.value_learning_rate": "algo.params.value_lr={v} (algo.params.value_model=true)",
    "rollout.max_gen_length": "rollout.max_new_tokens={v}",
    "rollout.steps": "rollout.steps_per_block=<{v} x rollout.block_size / rollout.max_new_tokens> (per block)",
    "training.lower_p": (
        "algo.params.p_low={v} (algo.name=random_mask_rl; in its SFT, the masking probability's low end: "
        "sft.noise_low={v} sft.weighting=none)"
    ),
    "training.upper_p": (
        "algo.params.p_high={v} (algo.name=random_mask_rl; in its SFT, the masking probability's high end: "
        "sft.noise_high={v} sft.weighting=none)"
    ),
    "training.max_grad_norm": "optim.clip_grad={v}",
    "training.seed": "seed={v}",
    "training.mixed_precision": {"bf16": "model.dtype=bf16", "fp16": "model.dtype=fp16", "no": "model.dtype=fp32"},
    "training.gradient_checkpointing_enable": {"true": "train.recompute=full", "false": "train.recompute=none"},
    "optimizer.params.learning_rate": "optim.lr={v}",
    "optimizer.params.weight_decay": "optim.weight_decay={v}",
    "optimizer.params.beta1": "optim.adam_beta1={v}",
    "optimizer.params.beta2": "optim.adam_beta2={v}",
    "optimizer.params.epsilon": "optim.adam_eps={v}",
    "lr_scheduler.params.warmup_steps": "optim.warmup_steps={v}",
}

# Megatron-LM's and torchrun's flags (--tensor-model-parallel-size ..., --nproc-per-node), as bare names; flags
# whose name is a megadare leaf (--micro-batch-size, --lr, --seed, --save-interval) need no entry.
FLAGS: dict[str, Fix] = {
    "tensor_model_parallel_size": "parallel.tp={v}",
    "pipeline_model_parallel_size": "parallel.pp={v}",
    "expert_model_parallel_size": "parallel.ep={v}",
    "expert_tensor_parallel_size": "parallel.etp={v}",
    "context_parallel_size": "parallel.cp={v}",
    "sequence_parallel": "parallel.sp=true",
    "train_iters": "train.steps={v}",
    # Megatron-LM fuses these by default (with apex / TE); megadare's where a GPU measured them faster
    "no_gradient_accumulation_fusion": "train.gradient_accumulation_fusion=false (the default)",
    "no_bias_swiglu_fusion": "train.fused_elementwise=false (one key for SwiGLU, the residual add, RMSNorm, RoPE)",
    "no_bias_dropout_fusion": "train.fused_elementwise=false (one key for SwiGLU, the residual add, RMSNorm, RoPE)",
    "moe_grouped_gemm": "train.grouped_experts=true (torch's grouped GEMM over SequentialMLP's weights)",
    "nproc_per_node": "--nproc {v} (or torchrun --nproc_per_node {v} -m megadare ...)",
}

# `megadare eval`'s own options, typed to the other commands
EVAL_OPTIONS: dict[str, Fix] = {"model": "model.hf_path={v}", "tasks": "eval.tasks=[{v}]"}

ORIGINS = {"verl/DARE": VERL, "dLLM-RL": DLLM_RL, "Megatron-LM / torchrun": FLAGS, "megadare eval": EVAL_OPTIONS}


def foreign_fix(key: str, value: Any) -> Optional[tuple[str, str]]:
    """(origin, fix) for a key another project spells ``key`` (None when no project in ORIGINS does)."""
    for origin, table in ORIGINS.items():
        if key in table:
            fix = table[key]
            shown = "<value>" if value is None else str(value)
            if isinstance(fix, dict):
                fix = fix.get(shown.lower()) or fix.get("*") or " or ".join(fix.values())
            return origin, fix.replace("{v}", shown)
    return None
