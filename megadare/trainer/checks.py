"""Cross-checks of a whole config against the model and the world size (``validate``) and the rollout decoder
(``check_decoder``): what no single field can know. Here in the trainer layer, not in megadare/config/, because
they need the model, the algorithms and the engines (torch, megatron): the config layer stays torch-free, so a
bad key or value is refused (config.load_config) before any of them loads."""

from __future__ import annotations

from typing import Optional


from megadare.algos import build_algorithm
from megadare.errors import ConfigError
from megadare.config import Config, check_choices, check_rules, resolve_sft_mode
from megadare.models import step_fusions
from megadare.models.family import ModelArch
from megadare.parallel.layout import Layout
from megadare.rollout.engine import (
    SamplingParams,
)
from megadare.rollout.setup import resolve_canvas, rollout_block


def validate(
    cfg: Config,
    arch: Optional[ModelArch],
    world_size: Optional[int] = None,
    *,
    algo=None,
    rules: bool = True,
    job: Optional[str] = None,
) -> None:
    """Cross-checks of a whole config against the model (when known) and the world size; ``algo``: the
    configured algorithm when the caller has built it (``trainer/spec.resolve``); ``rules``: False when the caller
    ran config/rules.py's ``check_rules`` on this very config (the CLI, before torch loaded); ``job``: the command
    that runs (sft, dpo, rl, eval; the learning-rate schedule counts its updates)."""
    check_choices(cfg)
    if rules:
        check_rules(cfg, job)  # the settings against each other, before the model's and the world's checks
    p = cfg.parallel
    if arch is not None:  # the model's rules first (they name the key to change), then the world's
        Layout.of(p).check_model(arch)
        if arch.is_moe and p.tp > 1 and not p.sp:
            raise ConfigError(
                f"parallel.tp={p.tp} on the MoE model {arch.family} needs parallel.sp=true "
                "(megatron trains MoE layers under TP only with sequence parallelism)"
            )
        if cfg.rollout.full_attention_cache != "none" and arch.is_block_diffusion:
            raise ConfigError(
                f"rollout.full_attention_cache={cfg.rollout.full_attention_cache}: the {arch.family} family decodes "
                "block-causally and caches earlier blocks exactly; the setting is for LLaDA / Dream: remove it"
            )
        if cfg.model.block_size is not None and not arch.is_block_diffusion:
            raise ConfigError(
                f"model.block_size={cfg.model.block_size}: the {arch.family} family uses full "
                "attention and has no denoising blocks; remove model.block_size"
            )
        if cfg.train.grouped_experts is not None and not arch.is_moe:
            raise ConfigError(
                f"train.grouped_experts={str(cfg.train.grouped_experts).lower()}: the {arch.family} model is dense "
                "and has no MoE experts to run; remove train.grouped_experts"
            )
    Layout.of(p, world_size or p.world_size)  # checks the sizes against the world
    t, named = cfg.train, cfg.as_written
    check_mode_keys(cfg, arch)
    row = cfg.data.max_length * (2 if resolve_sft_mode(cfg, arch) == "block" else 1)
    if row > t.seq_length:
        raise ConfigError(
            f"data.max_length={cfg.data.max_length} gives rows of up to {row} tokens (block-diffusion "
            f"rows hold x_t ++ x_0), more than train.seq_length={t.seq_length}; raise "
            "train.seq_length or lower data.max_length"
        )
    if resolve_canvas(cfg, arch) == "full" and cfg.offpolicy.partial_rollout:
        key = named("offpolicy.partial_rollout")
        raise ConfigError(
            f"{key}={cfg.offpolicy.partial_rollout} continues a response as a new prompt, which "
            f"cannot decode one fixed canvas (rl.canvas=full); set rl.canvas=eos or {key}=0"
        )
    check_decoder(cfg, arch)
    elementwise = t.fused_elementwise is True  # None (auto) turns itself off where it cannot run
    missing = step_fusions.unavailable(t.gradient_accumulation_fusion, elementwise, cfg.model.dtype)
    if missing:
        raise ConfigError(missing)

    (algo or build_algorithm(cfg.algo.name, dict(cfg.algo.params))).check_config(cfg, arch)


def check_mode_keys(cfg: Config, arch: Optional[ModelArch]) -> None:
    """A key that only one mode reads, set away from its default under another mode, would be ignored: refused,
    naming the mode that reads it (as ``model.block_size`` on a full-attention family)."""
    o, named = cfg.offpolicy, cfg.as_written
    if o.mode == "sync" and o.max_staleness > 1:  # 1: the default (a bound sync never reaches either)
        raise ConfigError(
            f"{named('offpolicy.max_staleness')}={o.max_staleness} bounds how many versions queued rollouts lag; "
            f"{named('offpolicy.mode')}=sync queues none and ignores it: remove it or set offpolicy.mode=fully_async"
        )
    mode = resolve_sft_mode(cfg, arch)
    if cfg.sft.trace_shrink > 1 and mode != "trace":
        shown = f"{cfg.sft.mode} ({mode})" if cfg.sft.mode == "auto" and mode != "auto" else cfg.sft.mode
        raise ConfigError(
            f"sft.trace_shrink={cfg.sft.trace_shrink} groups the decoding steps of a trace (sft.mode=trace); "
            f"sft.mode={shown} trains on no trace and ignores it: remove it or set sft.mode=trace"
        )
    if cfg.sft.pad_response != "none" and mode == "trace":
        raise ConfigError(
            f"sft.pad_response={cfg.sft.pad_response} pads responses, but sft.mode=trace scores the recorded "
            "decoding steps of each response token and pads have none: remove sft.pad_response"
        )


_SAMPLER_KEYS = (
    "max_new_tokens",
    "algorithm",
    "threshold",
    "top_k",
    "top_p",
    "confidence",
    "schedule",
    "eps",
    "alg_temp",
    "editing_threshold",
    "max_post_steps",
    "num_to_transfer",
)


def check_decoder(cfg: Config, arch: Optional[ModelArch]) -> None:
    """The rollout's decoder as the engines will build it (``SamplingParams`` at the rollout and the evaluation
    temperature). Whether the RL algorithm can replay a token-editing trace is its own ``check_config``."""
    r = cfg.rollout
    block = rollout_block(cfg, arch)
    if r.eval_steps_per_block < 0:
        raise ConfigError(f"rollout.eval_steps_per_block={r.eval_steps_per_block} must be >= 0 (0: steps_per_block)")
    decoders = (
        (r.temperature, r.steps_per_block, "steps_per_block"),
        (r.eval_temperature, r.eval_steps_per_block or r.steps_per_block, "eval_steps_per_block"),
    )
    for temperature, steps, steps_key in decoders:
        try:
            SamplingParams(
                block_size=block,
                steps_per_block=steps or block,
                temperature=temperature,
                **{k: getattr(r, k) for k in _SAMPLER_KEYS},
            )
        except ValueError as e:
            named = sorted(
                (str(e).find(k), k)
                for k in _SAMPLER_KEYS + ("steps_per_block", "block_size", "temperature")
                if k in str(e)
            )
            key = named[0][1] if named else "algorithm"
            evaluation = {"steps_per_block": steps_key, "temperature": "eval_temperature"}  # the eval decoder's own
            key = evaluation.get(key, key) if steps_key == "eval_steps_per_block" else key
            raise ConfigError(f"rollout.{key}: {e}") from None
