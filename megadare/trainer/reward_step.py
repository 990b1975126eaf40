"""Scoring a batch of rollouts in RL (and held-out evaluation), and stopping when rewards cannot be computed.

    scores, metrics = score_rollouts(cfg, reward_fn, tok, trajectories, prompts, "RL step 3")

Each response is scored with the prompt's open assistant prefill in front, if any (the text the reward checks), by
:func:`megadare.rewards.score_batch`; when more than ``rewards.max_error_fraction`` of the batch raised or ran
past the time limit (60 s a call, ``score_batch``'s default: no config key sets it),
:class:`~megadare.rewards.RewardError` names the reward, the first failing record's ``file:row`` and its exception.
Rank 0 scores; ``parallel.rank0.run_on_rank0`` carries its result, or that error, to every rank, so all ranks stop
before the update instead of waiting on a broadcast that never comes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from megadare.rewards import check_reward_errors, score_batch

if TYPE_CHECKING:
    from megadare.config import Config

__all__ = ["score_rollouts", "score_texts"]


def score_texts(
    cfg: Config, reward_fn, texts: Sequence[str], prompts: Sequence, where: str
) -> tuple[list[float], dict[str, float]]:
    """Rewards of decoded responses of ``prompts`` (PromptRecords, one per text); raises RewardError past
    ``rewards.max_error_fraction``."""
    full = [p.reward_text(t) for p, t in zip(prompts, texts)]
    scores, stats = score_batch(reward_fn, full, [p.record for p in prompts])
    sources, key = [p.where for p in prompts], cfg.as_written("rewards.max_error_fraction")
    check_reward_errors(stats, cfg.rewards.name, sources, cfg.rewards.max_error_fraction, where, key)
    return [float(x) for x in scores], {
        k: float(v) for k, v in stats.to_dict().items() if k in ("errors", "timeouts", "answer_timeouts", "wall_s")
    }


def score_rollouts(
    cfg: Config, reward_fn, tok, trajectories, prompts: Sequence, where: str
) -> tuple[list[float], dict[str, float]]:
    """:func:`score_texts` of the trajectories' decoded answers (a full-canvas response up to its first EOS)."""
    texts = [tok.decode(t.answer_ids(tok.eos_token_id)) for t in trajectories]
    return score_texts(cfg, reward_fn, texts, prompts, where)
