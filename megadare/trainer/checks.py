"""Cross-checks of a whole config against the model and the world size (``validate``) and the rollout decoder
(``check_decoder``): what no single field can know. Here in the trainer layer, not in megadare/config/, because
they need the model, the algorithms and the engines (torch, megatron): the config layer stays torch-free, so a
bad key or value is refused (config.load_config) before any of them loads."""

from __future__ import annotations

from typing import Optional


from megadare.algos import build_algorithm
from megadare.errors import ConfigError
from megadare.config import Config, check_choices, resolve_sft_mode
from megadare.models import step_fusions
from megadare.models.family import ModelArch
from megadare.models.lora import DEFAULT_TARGETS
from megadare.parallel.layout import Layout
from megadare.rollout.engine import (
    SamplingParams,
)
from megadare.rollout.setup import resolve_canvas, rollout_block


def validate(cfg: Config, arch: Optional[ModelArch], world_size: Optional[int] = None, *, algo=None) -> None:
    """Cross-checks of a whole config against the model (when known) and the world size; ``algo``: the
    configured algorithm when the caller has built it (``trainer/spec.resolve``)."""
    check_choices(cfg)
    check_data_source(cfg)
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
    Layout.of(p, world_size or p.world_size)  # checks the sizes against the world
    t, sft = cfg.train, cfg.sft
    if not 0.0 < sft.noise_low <= sft.noise_high <= 1.0:
        raise ConfigError(
            f"sft.noise_low={sft.noise_low}, sft.noise_high={sft.noise_high}: need 0 < noise_low <= noise_high <= 1"
        )
    o, named = cfg.optim, cfg.as_written
    if o.lr <= 0 or o.min_lr < 0 or o.min_lr > o.lr:
        raise ConfigError(
            f"{named('optim.lr')}={o.lr}, {named('optim.min_lr')}={o.min_lr}: need 0 <= min_lr <= lr and lr > 0"
        )
    if o.warmup_steps < 0 or o.warmup_steps > t.steps:
        raise ConfigError(f"{named('optim.warmup_steps')}={o.warmup_steps} must be within [0, train.steps={t.steps}]")
    check_lora(cfg)
    check_rl_filters(cfg)
    check_mode_keys(cfg, arch)
    if not 0 < cfg.rollout.timeout_s < p.collective_timeout_s:
        raise ConfigError(
            f"rollout.timeout_s={cfg.rollout.timeout_s}, parallel.collective_timeout_s={p.collective_timeout_s}: "
            "need 0 < rollout.timeout_s < parallel.collective_timeout_s (the other trainer ranks wait for rank 0's "
            "rollout in a collective); e.g. 1800 and 3600"
        )
    if cfg.rollout.max_batch < 0:
        raise ConfigError(
            f"rollout.max_batch={cfg.rollout.max_batch} must be >= 0 (0 = every prompt of a request at once)"
        )
    row = cfg.data.max_length * (2 if resolve_sft_mode(cfg, arch) == "block" else 1)
    if row > t.seq_length:
        raise ConfigError(
            f"data.max_length={cfg.data.max_length} gives rows of up to {row} tokens (block-diffusion "
            f"rows hold x_t ++ x_0), more than train.seq_length={t.seq_length}; raise "
            "train.seq_length or lower data.max_length"
        )
    if cfg.rollout.fp8_weights and cfg.rollout.engine != "sglang":
        raise ConfigError(
            "rollout.fp8_weights=true sends block-fp8 weights, which only SGLang engines serving an "
            "fp8-block checkpoint load; set rollout.engine=sglang or rollout.fp8_weights=false"
        )
    if t.seq_length % p.cp or (p.sp and t.seq_length // p.cp % p.tp):
        need = (
            f"parallel.cp={p.cp} x parallel.tp={p.tp} (sequence parallel splits it over TP)"
            if p.sp
            else f"parallel.cp={p.cp}"
        )
        raise ConfigError(f"train.seq_length={t.seq_length} must be divisible by {need}")
    if resolve_canvas(cfg, arch) == "full" and cfg.offpolicy.partial_rollout:
        key = named("offpolicy.partial_rollout")
        raise ConfigError(
            f"{key}={cfg.offpolicy.partial_rollout} continues a response as a new prompt, which "
            f"cannot decode one fixed canvas (rl.canvas=full); set rl.canvas=eos or {key}=0"
        )
    check_decoder(cfg, arch)
    missing = step_fusions.unavailable(t.gradient_accumulation_fusion, t.fused_elementwise, cfg.model.dtype)
    if missing:
        raise ConfigError(missing)

    (algo or build_algorithm(cfg.algo.name, dict(cfg.algo.params))).check_config(cfg, arch)


def check_lora(cfg: Config) -> None:
    """LoRA adapters that can train: a rank >= 0, and with a rank a scale alpha / rank > 0 (else the adapters'
    output and gradients are 0) on linears the model has (a misspelt name wraps nothing and trains nothing)."""
    lo, named = cfg.lora, cfg.as_written
    if lo.rank < 0:
        raise ConfigError(f"{named('lora.rank')}={lo.rank} must be >= 0 (0 = full fine-tuning)")
    if not lo.rank:
        return
    if not lo.alpha > 0:
        raise ConfigError(
            f"{named('lora.alpha')}={lo.alpha} with {named('lora.rank')}={lo.rank}: the adapters scale by "
            "alpha / rank, so they and their gradients are 0 and nothing learns; set lora.alpha > 0 (e.g. 16)"
        )
    unknown = [t for t in lo.targets if t not in DEFAULT_TARGETS]
    if unknown or not lo.targets:
        what = f"names no linear {unknown}" if unknown else "is empty (no adapter would train)"
        raise ConfigError(f"{named('lora.targets')}={list(lo.targets)} {what}; choose from {list(DEFAULT_TARGETS)}")


def check_rl_filters(cfg: Config) -> None:
    """The group filter, mini-batches, the importance-weight bounds and replay: settings under which no sample (or
    fewer optimizer steps than the schedule counts) would train."""
    band, named = cfg.advantage.accuracy_band, cfg.as_written
    if band is not None:
        key = named("advantage.accuracy_band")
        if len(band) != 2 or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in band):
            raise ConfigError(f"{key}={list(band)} must be [low, high], two numbers (dLLM-RL: [0.2, 0.8])")
        if band[0] > band[1]:
            raise ConfigError(f"{key}={list(band)}: low > high keeps no group; write [{band[1]}, {band[0]}]")
        check_band_reachable(cfg, list(band))
    rl = cfg.rl
    if rl.mini_batches > rl.prompts_per_step:
        raise ConfigError(
            f"rl.mini_batches={rl.mini_batches} > rl.prompts_per_step={rl.prompts_per_step}: a mini-batch holds whole "
            f"prompt groups, so at most {rl.prompts_per_step} optimizer steps run per epoch while the learning-rate "
            f"schedule counts {rl.mini_batches}; set rl.mini_batches <= {rl.prompts_per_step}"
        )
    o = cfg.offpolicy
    if o.rollout_is_threshold_low is not None and o.rollout_is_threshold_low > o.rollout_is_threshold:
        raise ConfigError(
            f"{named('offpolicy.rollout_is_threshold_low')}={o.rollout_is_threshold_low} > "
            f"{named('offpolicy.rollout_is_threshold')}={o.rollout_is_threshold}: the bounds are inverted; swap them"
        )
    if cfg.replay.enable and cfg.replay.fraction == 0:
        raise ConfigError(
            "replay.enable=true with replay.fraction=0 replays nothing; set replay.fraction > 0 or replay.enable=false"
        )


# built-in rewards that score a response 0 or 1: a group's accuracy is then k / rl.n_samples
BINARY_REWARDS = ("math", "gsm8k", "dare_math", "exact_match", "code_all_or_nothing")


def check_band_reachable(cfg: Config, band: list) -> None:
    """Under a 0-or-1 reward a group of n responses has accuracy k / n: a band holding none of those drops every
    group, every step, and the run never learns."""
    n, name = cfg.rl.n_samples, cfg.rewards.name
    reachable = [k / n for k in range(n + 1)]
    if name not in BINARY_REWARDS or any(band[0] <= a <= band[1] for a in reachable):
        return
    shown = ", ".join(f"{a:g}" for a in reachable)
    raise ConfigError(
        f"{cfg.as_written('advantage.accuracy_band')}={band} with {cfg.as_written('rl.n_samples')}={n} and "
        f"{cfg.as_written('rewards.name')}={name} (0 or 1 per response): a group's accuracy is one of {shown}, none "
        "within the band, so every group is dropped and nothing learns; widen the band or change rl.n_samples"
    )


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


def check_data_source(cfg: Config) -> None:
    """A file and a generated task are not both the training data: the task would replace the file unseen."""
    d = cfg.data
    if d.synthetic and d.path:
        raise ConfigError(
            f"data.path={d.path!r} and data.synthetic={d.synthetic!r} are both set: the generated task would "
            "replace the file; add data.synthetic=null to train on data.path"
        )
    if d.synthetic and d.eval_path:
        raise ConfigError(
            f"data.eval_path={d.eval_path!r} and data.synthetic={d.synthetic!r} are both set: the generated task "
            "holds out its own prompts and the file would go unread; add data.synthetic=null and set data.path "
            "(or remove data.eval_path)"
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
