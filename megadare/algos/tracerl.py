"""TraceRL (Wang, Yang, Li, Tian, Shen, Wang, arXiv:2509.06949; code: Gen-Verse/dLLM-RL ``train/rl_trado.py``,
``rl_llada.py``).

Estimator: replay the recorded decoding trajectory (diffusion/trace_replay.py). Tokens are grouped by the step at
which the sampler committed them; ``shrink`` s merges every s consecutive distinct steps (per block for block
families) into one fragment; each fragment scores its tokens from the state before them:

    L = (1/N) sum_f w_f sum_{k in f} [-min(rho_k A_k, clip(rho_k, 1 +- eps) A_k) + beta KL3_k(pi_theta || pi_old)],
    rho_k = exp(log p_theta(y_k | x_f) - log p_old(y_k | x_f)),

N the number of fragments, w_f = 1/|f| on LLaDA/Dream (``loss_agg=fragment_mean``) and 1/L1, the step's longest
response, on block families (``fragment_width``); DllmRlLoss says where this follows dLLM-RL and where not and
why. The log-ratio is clamped to +-10 and KL3 computed as dLLM-RL's block path does (``kl_estimator=k3_exp10``:
exponent clamped to +-10, estimate unbounded; ``train/rl_trado.py:731-754``).
Advantages (the paper's; set by the config, as examples/configs/rl_sdar30b.yaml does: ``algo.name=tracerl`` alone
keeps the config's defaults, ``advantage.std=unbiased``, no band, truncated responses scored as written): per-prompt
z-score of 0/1 rewards with the population std (``advantage.std=population``), responses truncated at max length
counted wrong (``rewards.truncated_as_wrong``), prompts with accuracy outside [0.2, 0.8] dropped
(``advantage.accuracy_band``). dLLM-RL's defaults (its ``configs/rl_trado.yaml``): eps 0.2, beta 0.01, shrink 1 for
block families (8 for LLaDA/Dream) -- this algorithm's defaults too --, lr 1e-6, temperature 1.0,
``low_confidence_dynamic`` 0.9 (megadare's ``optim.lr`` / ``rollout.*``: set them in the config).
With ``value_model=true`` a second Megatron model (same backbone, zero-initialised scalar head, own optimizer,
``value_lr`` 5e-6) gives token-wise values and the advantages become TraceRL's step-level GAE
(algos/value_model.py; gamma = lambda = 1 by default, value clip 0.2); otherwise they are group-relative.

Fragments (checked against dLLM-RL's own construction on the same traces, tests/test_tracerl_fragments.py): block
families group per block of the sample's grid from position 0, the sampler's blocks (jetengine and megadare's
engine put the prompt's remainder in the first block); dLLM-RL's trainer cuts its blocks from the response start
(``rl_trado.py:516-522``), which is not its sampler's state when the prompt length is not a multiple of the block:
not copied. The value model's step-level GAE runs over the shrunk trace (``TraceRL.value_steps``).

Canvas (``rl.canvas``): TraDo/SDAR (the paper's main models) replay the response up to its EOS (``eos``, the
block families' default); on LLaDA/Dream the full canvas (default there) replays every decoded position, the
post-EOS ones included, so each replayed state is the sampler's; as dLLM-RL's ``post_num: 0``, the positions after
the answer's EOS are no targets (``post_num``: how many of them are; null: all, DARE's way).
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import replace

from megadare.algos.algorithm import Algorithm, ValueModelSettings
from megadare.algos.base import ANSWER_LENGTH, STEP_WIDTH, RLSample
from megadare.diffusion.trace_replay import replay_views, shrunk_steps
from megadare.diffusion.views import View
from megadare.errors import ConfigError


# dLLM-RL's loss (PPO clip, log-ratio clamp, KL3 to the old policy, the family's aggregation: DllmRlLoss):
# random-masking and coupled RL (algos/random_mask_rl.py) train with the same forward_process (rl_trado.py:711)
TRACERL_LOSS = {
    "eps_low": 0.2,
    "log_ratio_clamp": 10.0,
    "kl_coef": 0.01,
    "kl_anchor": "old",
    "kl_estimator": "k3_exp10",
    "loss_agg": None,  # the family's (DllmRlLoss.loss_agg)
    "post_num": 0,  # targets kept after the answer's EOS on a full canvas (dLLM-RL's post_num; null: all)
}


class DllmRlLoss(Algorithm):
    """dLLM-RL's loss, shared by TraceRL and random-masking / coupled RL (each model file of dLLM-RL trains its
    three modes with one ``forward_process``).

    Aggregation (``loss_agg``; null: the family's, as dLLM-RL trains it), always a mean over fragments (a fragment
    is one replayed step group, or one random mask, of one response: dLLM-RL's training row). LLaDA / Dream:
    ``fragment_mean``, each fragment's surrogate sum / its number of targets (``train/rl_llada.py:589-592``,
    ``train/rl_dream.py:618-622``), so a short fragment weighs as much as a long one. Block families (TraDo /
    SDAR): ``fragment_width``, each fragment's sum / the longest response of the RL step (L1, the width dLLM-RL
    pads the step's responses to, ``train/rl_trado.py:742-744``), so every token of the step weighs the same
    whatever its response's length. The step's longest response is stamped on the samples by ``prepare`` (the
    step's samples) and ``batch_rows`` (at least the mini-batch's); rows of a lone sample use its own length.

    Kept on purpose where rl_llada.py / rl_dream.py differ: (1) the KL term takes the policy term's normaliser.
    They sum the KL over a fragment's targets without dividing by their number (``rl_llada.py:601-602``,
    ``rl_dream.py:630-631``), so its weight against the policy term grows with the fragment (x ~8 at shrink 8 with
    one token per step, x ~L/2 under random masking of an L-token response), whereas dLLM-RL's block path
    (``rl_trado.py:754``) and its LLaDA-V policy trainer (``train/train_lladav_policy.py:408-409``) divide both
    terms alike. (2) The log-ratio clamp +-10 and the KL3 exponent clamp (``rl_trado.py:732, 752``,
    ``train_lladav_policy.py:395, 406``) on every family, where rl_llada.py / rl_dream.py clamp nothing: the
    same loss while |log rho| <= 10."""

    def loss_agg(self, arch) -> str:
        return self.p["loss_agg"] or ("fragment_width" if arch.is_block_diffusion else "fragment_mean")

    @abstractmethod
    def fragments(self, s: RLSample, arch, block_size: int, g) -> list[View]:
        """The mode's training rows of one sample before the post-answer rule (:meth:`views`): TraceRL's replayed
        step groups, random masking's masks."""

    def views(self, s, arch, block_size, g):
        """The mode's fragments; on a full canvas (``rl.canvas=full``) the positions after the answer beyond its
        first ``post_num`` are no targets, and fragments left without one are dropped, as dLLM-RL's
        ``post_num`` (``rl_llada.py:265-276, 401-406``, ``rl_trado.py:552-555, 566-571``). Differences: dLLM-RL
        counts pad tokens (with post_num 0 it drops an EOS that is the pad token too), here the positions after
        the first EOS (the EOS stays a target); its random masking also masks the dropped positions in every
        input (``rl_llada.py:331``), here too on full-attention families (``masks_tail``)."""
        views = self.fragments(s, arch, block_size, g)
        answer, post = s.extra.get(ANSWER_LENGTH), self.p["post_num"]
        if answer is None or post is None or answer + post >= len(s.response_ids):
            return views
        tail = len(s.prompt_ids) + answer + post
        mask = arch.mask_token_id if self.masks_tail(arch) else None
        return [v for v in (_without_targets_from(v, tail, mask) for v in views) if bool((v.coef != 0).any())]

    def masks_tail(self, arch) -> bool:
        return False

    def check_config(self, cfg, arch) -> None:
        super().check_config(cfg, arch)
        post = self.p["post_num"]
        if post is not None and (isinstance(post, bool) or not isinstance(post, int) or post < 0):
            raise ConfigError(
                f"algo.params.post_num={post!r}: the number of targets kept after the answer's EOS must be an "
                "integer >= 0 (dLLM-RL: 0), or null to score the whole canvas"
            )

    def prepare(self, samples, score, group_size) -> None:
        stamp_step_width(samples)

    def batch_rows(self, samples, arch, block_size, generator_for):
        stamp_step_width(samples)
        return super().batch_rows(samples, arch, block_size, generator_for)


def _without_targets_from(v: View, start: int, mask_id) -> View:
    """``v`` scoring nothing at positions >= ``start`` (with ``mask_id``: those positions masked in the input)."""
    coef, slot, tokens = v.coef.clone(), v.slot.clone(), v.tokens.clone()
    coef[start:], slot[start:] = 0, -1
    if mask_id is not None:
        tokens[start:] = mask_id
    return replace(v, tokens=tokens, coef=coef, slot=slot)


def stamp_step_width(samples: list[RLSample]) -> None:
    """``extra[STEP_WIDTH]`` of every sample: the longest response among ``samples`` (or the one stamped before,
    when longer: a mini-batch keeps its step's width)."""
    width = max((len(s.response_ids) for s in samples), default=0)
    for s in samples:
        s.extra[STEP_WIDTH] = max(width, s.extra.get(STEP_WIDTH, 0))


class TraceRL(DllmRlLoss):
    name = "tracerl"
    needs_trace = True
    replays_edits = True
    defaults = {
        **TRACERL_LOSS,
        "shrink": None,
        "value_model": False,
        "value_lr": 5e-6,
        "value_clip": 0.2,
        "gamma": 1.0,
        "lam": 1.0,
    }

    def shrink(self, arch) -> int:
        return self.p["shrink"] or (1 if arch.is_block_diffusion else 8)

    @property
    def value_model(self) -> ValueModelSettings | None:
        p = self.p
        if not p["value_model"]:
            return None
        return ValueModelSettings(lr=p["value_lr"], clip=p["value_clip"], gamma=p["gamma"], lam=p["lam"])

    def uses_group_baseline(self) -> bool:
        return self.value_model is None

    def check_config(self, cfg, arch) -> None:
        super().check_config(cfg, arch)
        shrink = self.p["shrink"] or (self.shrink(arch) if arch is not None else None)
        if cfg.rollout.algorithm == "editing" and shrink not in (None, 1):
            raise ConfigError(
                f"rollout.algorithm=editing with tracerl shrink={shrink}: a fragment of several steps "
                "would score two commits of one position from one state; set algo.params.shrink=1"
            )

    def engine_logprobs_match(self, arch) -> bool:
        return self.shrink(arch) == 1  # s > 1 scores later tokens of a fragment from its first state

    def value_steps(self, s: RLSample, arch, block_size: int) -> list[int]:
        """The steps of the value model's step-level GAE: the shrunk trace (one step per replayed fragment of a
        block), as dLLM-RL's value trainer aggregates (``train_trado_value.py:491-497``)."""
        return shrunk_steps(s, block_size, self.shrink(arch), arch.is_block_diffusion)

    def fragments(self, s, arch, block_size, g):
        block = arch.is_block_diffusion
        shrink = self.shrink(arch)
        return [v for v, _ in replay_views(s, arch.mask_token_id, block_size, shrink, block_family=block)]
