"""Checks of a whole config that need neither the model nor torch: settings that contradict each other. The CLI
runs them (``check_rules``) right after loading, before any command module loads; trainer/checks.py's ``validate``
runs them first for a caller that skipped the CLI (once: the CLI's ``resolve`` tells ``validate`` they ran)."""

from __future__ import annotations

from typing import Optional

from megadare.config.sections import Config
from megadare.errors import ConfigError
from megadare.names import LORA_TARGETS


def check_rules(cfg: Config, job: Optional[str] = None) -> None:
    """Every check of this module: the CLI runs them before torch loads, ``validate`` (trainer/checks.py) for a
    caller that did not (``resolve(..., rules_checked=True)`` says the CLI did). ``job``: the command that runs
    (sft, dpo, rl, ...; None: not known, the checks that depend on it take the loosest bound)."""
    check_data_source(cfg)
    check_schedule(cfg, job)
    check_lora(cfg)
    check_rl_filters(cfg)
    check_rollout_limits(cfg)
    check_engine_split(cfg)


def optimizer_updates(cfg: Config, job: str) -> int:
    """The optimizer updates ``job`` runs, the unit of the learning-rate schedule (``optim.warmup_steps`` and the
    decay): ``train.steps`` for SFT / DPO; for RL one per mini-batch per epoch per RL step. verl counts its
    schedule in RL steps instead (one scheduler step per RL step): the two agree when an RL step makes one update."""
    if job == "rl":
        return cfg.rl.steps * cfg.rl.ppo_epochs * cfg.rl.mini_batches
    return cfg.train.steps


def check_schedule(cfg: Config, job: Optional[str] = None) -> None:
    """The SFT noise band and the learning-rate schedule: a warmup longer than the updates of the job never
    reaches ``optim.lr`` (``job`` None: the longer of the SFT and the RL schedules)."""
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
    rl = cfg.rl
    counted = {
        "sft": f"train.steps={t.steps}",
        "dpo": f"train.steps={t.steps}",
        "rl": f"rl.steps={rl.steps} x rl.ppo_epochs={rl.ppo_epochs} x rl.mini_batches={rl.mini_batches}",
    }
    longest = max([job] if job in counted else ["sft", "rl"], key=lambda j: optimizer_updates(cfg, j))
    updates = optimizer_updates(cfg, longest)
    if o.warmup_steps < 0 or o.warmup_steps > updates:
        raise ConfigError(
            f"{named('optim.warmup_steps')}={o.warmup_steps} counts optimizer updates and must be within "
            f"[0, {updates}] ({counted[longest]}: the updates of this run)"
        )


def check_lora(cfg: Config) -> None:
    """LoRA adapters that can train: a rank >= 0, and with a rank a scale alpha / rank > 0 (else the adapters'
    output and gradients are 0) on linears the model has (a misspelt name wraps nothing and trains nothing; every
    family's linears are megadare.names.LORA_TARGETS)."""
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
    unknown = [t for t in lo.targets if t not in LORA_TARGETS]
    if unknown or not lo.targets:
        what = f"names no linear {unknown}" if unknown else "is empty (no adapter would train)"
        raise ConfigError(f"{named('lora.targets')}={list(lo.targets)} {what}; choose from {list(LORA_TARGETS)}")


def check_rollout_limits(cfg: Config) -> None:
    """The rollout's timeout within the collectives' and a batch cap >= 0."""
    p = cfg.parallel
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


def check_engine_split(cfg: Config) -> None:
    """FP8 weight sync only to SGLang; the sequence split evenly over CP (and TP under sequence parallelism)."""
    t, p = cfg.train, cfg.parallel
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
