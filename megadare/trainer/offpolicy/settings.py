"""The off-policy settings checked against each other before a run starts (``check_correction_config``): plain
config arithmetic, no torch, so ``megadare.trainer.spec`` (which every command resolves its config through, the
planner included) does not load the RL loop's step (megatron) to run it. correction.py beside it applies them."""

from __future__ import annotations

from megadare.config import Config
from megadare.errors import ConfigError


def check_correction_config(cfg: Config, algo, arch, ahead: int) -> None:
    """Combinations of offpolicy.mode / loss_mode / rollout_is / behaviour_logp / replay that cannot work, named
    as the config spelled them (``ahead``: rollouts queued ahead of training, queue.lookahead)."""
    o, r = cfg.offpolicy, cfg.rollout
    mode, staleness, partial, loss_mode, rollout_is, behaviour = (
        cfg.as_written(f"offpolicy.{k}")
        for k in ("mode", "max_staleness", "partial_rollout", "loss_mode", "rollout_is", "behaviour_logp")
    )
    if ahead > o.max_staleness:
        raise ConfigError(
            f"{mode}={o.mode} runs rollouts {ahead} version(s) ahead, more than "
            f"{staleness}={o.max_staleness}; raise {staleness} or use {mode}=sync"
        )
    if o.partial_rollout and not ahead:
        raise ConfigError(
            f"{partial}={o.partial_rollout} continues queued rollouts across weight "
            f"updates; {mode}={o.mode} queues none (use one_step_off or fully_async)"
        )
    if ahead and algo.own_rollout:
        raise ConfigError(
            f"{mode}={o.mode}: {algo.name} builds its rollout in several dependent rounds; use {mode}=sync"
        )
    if o.loss_mode == "ppo" and o.rollout_is is not None:
        raise ConfigError(
            f"{rollout_is}={o.rollout_is!r} needs {loss_mode}=decoupled (IS behaviour -> proximal) "
            f"or bypass (ratio against the behaviour policy); {loss_mode}=ppo ignores the behaviour"
        )
    if o.loss_mode == "bypass" and o.rollout_is is not None and o.rollout_is != "token":
        raise ConfigError(
            f"{loss_mode}=bypass rejects slot by slot against the current policy: {rollout_is} "
            f"must be token or null, not {o.rollout_is!r}"
        )
    if o.behaviour_logp == "engine":
        if not algo.engine_logprobs_match(arch):
            raise ConfigError(
                f"{behaviour}=engine: {algo.name}'s estimator is not the engine's per-step "
                "sampler log-prob (only trace replay with one state per step is: cj_grpo, tracerl "
                f"with shrink 1); use {behaviour}=trainer"
            )
        if r.temperature != 1.0 or r.top_k or r.top_p != 1.0:
            raise ConfigError(
                f"{behaviour}=engine needs rollout.temperature=1, top_k=0, top_p=1 (got "
                f"{r.temperature}, {r.top_k}, {r.top_p}): the trainer scores untempered, untruncated "
                "log-probs"
            )
    if cfg.replay.enable and o.loss_mode == "ppo":
        raise ConfigError(
            f"replay.enable=true trains on samples of older policies: set {loss_mode}=decoupled (or "
            "bypass) so they are importance-corrected"
        )
    if cfg.replay.enable and o.behaviour_logp == "engine":
        raise ConfigError(
            "replay.enable=true scores and weights samples under several versions with the trainer's "
            f"estimator: use {behaviour}=trainer"
        )
