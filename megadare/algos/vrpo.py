"""VRPO: variance-reduced preference optimisation (LLaDA 1.5, Zhu et al., arXiv:2505.19223; DARE
``workers/actor/llada_dp_actor_vrpo.py``, ``compute_dpo_loss``, ``_forward_process_vrpo``).

Objective: DPO with ELBO surrogates B for the intractable log-likelihoods,

    L = -log sigmoid( beta [ (B_theta(y_w) - B_ref(y_w)) - (B_theta(y_l) - B_ref(y_l)) ] ),

    B(y) = (1/n) sum_j (L/m_j) sum_{k masked in j} log p(y_k | x_j)     (count-stratified ELBO, n MC samples)

Variance reduction as published: n Monte-Carlo samples all spent on timesteps (one mask per count m_j,
stratified over [1, L]: pooled over the n draws each count is exactly equally likely, diffusion/corruption.py
``stratified``; DARE's ``_forward_process_vrpo`` rounds its counts half to even, so unless n / gcd(n, L) is odd
-- n = 4: 4 divides L -- some counts are more likely than others, at L = 6 half of them 1.5x and half 0.5x
uniform, which biases its L/m-weighted ELBO; megadare keeps the uniform counts), and antithetic sampling --
the policy and the reference score the *same* stored masks (here: the reference log-probs are computed on the
very rows the policy trains on).

The paper trains on offline preference pairs: ``megadare dpo`` (trainer/dpo_loop.py) runs exactly this estimator
and loss on a preference dataset. In the online RL loop (``algo.name=vrpo``) each prompt group gives one pair,
chosen = the highest-reward response, rejected = the lowest (groups with equal rewards give none).
``margin_norm=canvas`` divides the margin by the response canvas R = ``canvas_length`` as DARE does
(``llada_dp_actor_vrpo.py``: B / R; its effective beta is beta / R). Defaults (DARE recipe): beta 0.2, n = 4
(paper main runs 8), lr 5e-7, no margin normalisation (the paper's form).

Canvas: offline pairs are the responses as written (ending with EOS); online (``algo.name=vrpo``) the
rollout's ``rl.canvas``. DARE's VRPO scores the response up to EOS and divides the margin by the canvas R.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from megadare.algos.algorithm import Algorithm
from megadare.algos.base import RLSample, Slots, views_to_row
from megadare.diffusion.corruption import CleanSequence, stratified
from megadare.data.rows import Row
from megadare.errors import ConfigError


def concat_rows(rows: list[Row]) -> Row:
    """One row holding several rows as separate segments (so they share a micro-batch); slots renumbered."""
    seg, slots, first_seg, first_slot = [], [], 0, 0
    for r in rows:
        seg.append(first_seg + (r.segment_ids if r.segment_ids is not None else torch.zeros(len(r), dtype=torch.long)))
        first_seg += r.num_segments
        sl = r.slot
        slots.append(torch.where(sl >= 0, sl + first_slot, sl))
        first_slot += int(sl.max()) + 1 if (sl >= 0).any() else 0
    cat = lambda name: None if getattr(rows[0], name) is None else torch.cat([getattr(r, name) for r in rows])  # noqa: E731
    extras = {k: torch.cat([r.extras[k] for r in rows]) for k in rows[0].extras}
    return Row(
        tokens=cat("tokens"),
        labels=cat("labels"),
        weight=cat("weight"),
        position_ids=cat("position_ids"),
        stream_ids=cat("stream_ids"),
        denom=sum(r.denom for r in rows),
        segment_ids=torch.cat(seg),
        head=cat("head"),
        adv=cat("adv"),
        tok=cat("tok"),
        sample=cat("sample"),
        slot=torch.cat(slots),
        extras=extras,
    )


class VRPO(Algorithm):
    name = "vrpo"
    clipped_ratio = False
    defaults = {"beta": 0.2, "n_mc": 4, "kl_anchor": "ref", "margin_norm": "none", "canvas_length": None}

    def __init__(self, overrides=None):
        super().__init__(overrides)
        norm, R = self.p["margin_norm"], self.p["canvas_length"]
        if norm not in ("none", "canvas"):
            raise ConfigError(f"algo.params.margin_norm={norm!r}: choose none or canvas")
        if norm == "canvas" and not (isinstance(R, int) and R > 0):
            raise ConfigError(
                f"algo.params.margin_norm=canvas divides the margin by the response canvas: set "
                f"algo.params.canvas_length to it (a positive integer, got {R!r})"
            )

    @property
    def needs_ref(self) -> bool:
        return True

    def views(self, s, arch, block_size, g):
        """n count-stratified masks of the response, one sequence slot: B(y) = mean_j (L/m_j) sum log p."""
        seq = CleanSequence.of(s.prompt_ids, s.response_ids, arch.mask_token_id)
        return stratified(seq, g, self.p["n_mc"], slots="sequence")

    def _row(self, s: RLSample, arch, g, sign: float, head: float) -> Row:
        """The sample's row; its advantage slot carries the pair role (+1 chosen, -1 rejected)."""
        return views_to_row(
            dataclasses.replace(s, advantage=sign),
            self.views(s, arch, 0, g),
            arch,
            {0: head},
            head,
        )

    def check_config(self, cfg, arch) -> None:
        super().check_config(cfg, arch)
        if cfg.rl.n_samples < 2:
            raise ConfigError(
                f"rl.n_samples={cfg.rl.n_samples}: online VRPO pairs the best and the worst response "
                "of a prompt's group and needs rl.n_samples >= 2"
            )

    def batch_rows(self, samples, arch, block_size, generator_for):
        rows = []
        by_group: dict[int, list[RLSample]] = {}
        for s in samples:
            by_group.setdefault(s.group, []).append(s)
        for group in by_group.values():
            ranked = sorted(group, key=lambda s: (s.reward, -s.index))
            lo, hi = ranked[0], ranked[-1]
            if hi.reward <= lo.reward or not lo.response_ids or not hi.response_ids:
                continue
            rows.append(self.pair_row(hi, lo, arch, generator_for(hi.index), generator_for(lo.index)))
        return rows

    def pair_row(self, chosen: RLSample, rejected: RLSample, arch, g_chosen, g_rejected) -> Row:
        """One row holding a preference pair (chosen first), each response with its own stored masks."""
        return concat_rows(
            [self._row(chosen, arch, g_chosen, +1.0, 1.0), self._row(rejected, arch, g_rejected, -1.0, 0.0)]
        )

    def slot_loss(self, s: Slots):
        if s.ref is None:
            raise RuntimeError("VRPO needs reference log-probs")
        n = s.logp.numel()
        if n % 2:
            raise RuntimeError("VRPO: a micro-batch holds an incomplete preference pair")
        d = (s.logp - s.ref).view(-1, 2)  # (chosen, rejected) per pair, chosen first
        sign = s.adv.view(-1, 2)
        if not bool(((sign[:, 0] > 0) & (sign[:, 1] < 0)).all()):
            raise RuntimeError("VRPO: pair slots out of order")
        margin = self.p["beta"] * (d[:, 0] - d[:, 1])
        if self.p["margin_norm"] == "canvas":
            margin = margin / self.p["canvas_length"]
        loss = torch.stack([-F.logsigmoid(margin), torch.zeros_like(margin)], 1).view(-1)
        acc = torch.stack([(margin > 0).float(), torch.zeros_like(margin)], 1).view(-1)
        return loss, {"pair_accuracy": acc, "margin": torch.stack([margin, torch.zeros_like(margin)], 1).view(-1)}
