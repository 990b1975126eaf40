"""Corruption samplers of the first estimator kind: views of prompt ++ response drawn from a generator.

Notation: prompt c (length P), response y (length L), x_t the corrupted sequence, M the mask token. Each
function returns ``View``s (views.py) whose scored positions add c_{v,k} * log p(y_k | x_t^{(v)}) into a
slot. ``token`` slots: one per response token (shared by all views: the estimate sums over views); ``view``
slots: one per (view, token); ``sequence`` slots: one per view (the whole response), or one per sample.

* ``one_step``   d1 (arXiv:2504.12216): y fully masked, each prompt token masked w.p. p_prompt; c = 1.
                 log pi(y_k | c) ~= log p(y_k | c', M..M) (mean-field one-step estimate).
* ``coupled``    Coupled-GRPO (DiffuCoder, arXiv:2506.20639, ``coupled_grpo.py::forward_process``):
                 t ~ U(t_low, t_high), one uniform draw u per token; views a = all masked, b = {u < t},
                 c = {u >= t} (complementary: every token masked exactly once in b or c);
                 l_k = 1/2 [ log f^a_k + w_k log f^{b|c}_k ],  w_k = 1/t if masked in b else 1/(1 - t).
* ``random_mask`` dLLM-RL random-masking RL (arXiv:2509.06949 appendix; ``train/rl_*.py`` random_masking):
                 block families: per block p_b ~ U(0.1, 0.9), tokens masked i.i.d. w.p. p_b; full attention:
                 t ~ U(0.1, 0.9) i.i.d.; ``coupled`` adds the exact complement. c = 1 on masked tokens, no 1/t.
* ``stratified`` count-stratified discrete ELBO (LLaDA 1.5 / VRPO arXiv:2505.19223, BGPO arXiv:2510.11683;
                 DARE ``_forward_process_vrpo`` / ``_forward_process_bgpo``): one offset u ~ U[0, 1) per sample,
                 m_j = floor(1 + (j + u) L / n) for j < n (draw j in its own stratum), a uniform subset of size
                 m_j masked, c = L / m_j (p_mask = m_j / L); B_j = sum_masked c log p. Pooled over the n draws
                 every count 1..L is exactly equally likely (``stratified_count``), which makes the mean of the
                 B_j an unbiased estimate of the ELBO. DARE's draws differ: k ~ U{1..L},
                 m_j = ((round(k + j L / n) - 1) mod L) + 1 with torch.round (half to even), which is uniform
                 only when n / gcd(n, L) is odd (e.g. n divides L); otherwise the gcd(n, L) draws whose offset
                 j L / n is a half-integer take every other count only, and pooled the counts have
                 probabilities (1 +- gcd(n, L) / n) / L -- VRPO's n = 4 at L = 6: 0.5x and 1.5x uniform; BGPO's
                 n = 16 at L = 12: 0.75x and 1.25x -- so its L/m-weighted mean is biased there
                 (tests/test_algos_dare_formulas.py enumerates both).
* ``blockwise``  block-wise ELBO (SPG arXiv:2510.09541, facebookresearch/SPG): a uniformly chosen response block
                 b (earlier blocks clean, later ones fully masked), m ~ U{1..|b|} of its tokens masked, prompt
                 tokens masked w.p. p_prompt; c = n_blocks * |b| / m on the masked tokens of b.
* ``blockwise_dare``  SPG as DARE codes it (``_forward_process_spg`` + ``llada_dp_actor_spg.py``), drawn in DARE's
                 order: the n_mc blocks b_v from one permutation; everything before b_v -- the prompt AND the
                 earlier response blocks -- masked w.p. p_prompt, m ~ U{1..|b|} of b_v and all later blocks
                 masked; every masked response token is scored (earlier blocks' included), c = 1 / (n_mc t_v),
                 t_v = (masked response tokens of draw v) / L, the empirical masking rate.
* ``antithetic_views``  ESPO (arXiv:2512.03759): per draw k masked tokens (coefficient (L+1)/k) and the exact
                 complement ((L+1)/(L-k)), each / (2 n_mc canvas), all in one sequence slot (a sequence ELBO).
* ``ar_views``   JustGRPO (arXiv:2601.15165): one view per response position t, c ++ y_<t ++ M..M, scoring t
                 into token slot t (the autoregressive likelihood on a diffusion model); c = 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megadare.diffusion.masking import complementary
from megadare.diffusion.views import View


@dataclass(frozen=True)
class CleanSequence:
    """x_0 = prompt c ++ response y of one sample and the mask token M: what every view of the sample corrupts."""

    x0: torch.Tensor  # [P + L] long
    P: int
    L: int
    mask_id: int

    @classmethod
    def of(cls, prompt: list[int], response: list[int], mask_id: int) -> CleanSequence:
        x0 = torch.tensor(list(prompt) + list(response), dtype=torch.long)
        return cls(x0, len(prompt), len(response), mask_id)

    def slots(self, scored: torch.Tensor, kind: str, view: int) -> torch.Tensor:
        """Slot ids for the scored positions of view ``view`` (scored: [P + L] bool), -1 elsewhere."""
        P, L = self.P, self.L
        if kind == "token":
            return torch.where(scored, torch.arange(-P, L), -1)
        if kind == "view":
            return torch.where(scored, torch.arange(view * L - P, view * L + L), -1)
        if kind == "sequence_per_view":
            return torch.where(scored, view, -1)
        if kind == "sequence":
            return torch.where(scored, 0, -1)
        raise ValueError(f"slot kind {kind!r} unknown")

    def view(
        self, masked: torch.Tensor, coef: torch.Tensor, slots: str, vi: int, scored: torch.Tensor | None = None
    ) -> View:
        """x_t = x_0 with ``masked`` replaced by M; ``scored`` (default: the masked response positions; a given one
        has its prompt positions cleared in place) carry ``coef`` into slots of kind ``slots`` for view ``vi``. A
        view is built per sample per step: scalar operands and ``masked_fill``, not tensors of constants."""
        scored = masked.clone() if scored is None else scored
        scored[: self.P] = False
        return View(
            tokens=self.x0.masked_fill(masked, self.mask_id),
            coef=torch.where(scored, coef, 0),
            slot=self.slots(scored, slots, vi),
        )


@dataclass(frozen=True)
class BlockGrid:
    """The response blocks a block-wise sampler picks from: ``global_grid`` counts blocks on the prompt+response
    grid (block families: the blocks the model's x_t ++ x_0 mask uses), else from the response start (LLaDA's
    semi-AR blocks)."""

    size: int
    global_grid: bool = False

    def bounds(self, P: int, L: int) -> tuple[int, int]:
        """(offset, number of response blocks): the offset is the number of response tokens sharing the prompt's
        last block."""
        off = P % self.size if self.global_grid else 0
        return off, -(-(L + off) // self.size)

    def block(self, b: int, P: int, L: int) -> tuple[int, int]:
        """[lo, hi) of response block ``b`` on the prompt+response positions."""
        off = P % self.size if self.global_grid else 0
        return max(P, P - off + b * self.size), min(P + L, P - off + (b + 1) * self.size)


def one_step(seq: CleanSequence, g: torch.Generator, p_prompt: float = 0.15, slots: str = "token") -> list[View]:
    P, L = seq.P, seq.L
    masked = torch.cat([torch.rand(P, generator=g, dtype=torch.float64) < p_prompt, torch.ones(L, dtype=torch.bool)])
    return [seq.view(masked, torch.ones(P + L), slots, 0)]


def coupled(seq: CleanSequence, g: torch.Generator, t_low: float = 0.2, t_high: float = 0.8) -> list[View]:
    P, L = seq.P, seq.L
    t = t_low + (t_high - t_low) * float(torch.rand((), generator=g, dtype=torch.float64))
    resp = torch.cat([torch.zeros(P, dtype=torch.bool), torch.ones(L, dtype=torch.bool)])
    b = resp.clone()
    b[P:] = torch.rand(L, generator=g, dtype=torch.float64) < t
    c = complementary(b, resp)
    return [
        seq.view(resp, torch.full((P + L,), 0.5), "token", 0),
        seq.view(b, torch.full((P + L,), 0.5 / t), "token", 1),
        seq.view(c, torch.full((P + L,), 0.5 / (1.0 - t)), "token", 2),
    ]


def random_mask(
    seq: CleanSequence,
    g: torch.Generator,
    block_size: int = 0,
    p_range: tuple[float, float] = (0.1, 0.9),
    n_views: int = 1,
    couple: bool = False,
) -> list[View]:
    """``block_size`` > 0 (block families): every response token draws its own masking probability ~ U(``p_range``)
    (dLLM-RL ``train/rl_trado.py:457``, ``torch.rand(n) <= torch.empty(n).uniform_(lower, upper)`` per block), so
    tokens are masked independently with probability (p_low + p_high) / 2, whatever the block grid; else one
    t ~ U(``p_range``) per view shared by the whole response (``train/rl_llada.py:322``)."""
    P, L = seq.P, seq.L
    p_low, p_high = p_range
    resp = torch.arange(P + L) >= P
    views = []
    for j in range(n_views):
        if block_size > 0:
            p_pos = p_low + (p_high - p_low) * torch.rand(P + L, generator=g, dtype=torch.float64)
        else:
            p_pos = torch.full(
                (P + L,), p_low + (p_high - p_low) * float(torch.rand((), generator=g)), dtype=torch.float64
            )
        masked = (torch.rand(P + L, generator=g, dtype=torch.float64) < p_pos) & resp
        views.append(seq.view(masked, torch.ones(P + L), "view", len(views)))
        if couple:
            views.append(seq.view(resp & ~masked, torch.ones(P + L), "view", len(views)))
    return views


def stratified_count(j: int, offset: float, L: int, n: int) -> int:
    """The masked count of draw j of n for a response of L tokens with the sample's offset in [0, 1)."""
    return min(L, max(1, int(1 + (j + offset) * L / n)))


def stratified(
    seq: CleanSequence,
    g: torch.Generator,
    n_mc: int = 4,
    slots: str = "sequence_per_view",
    normalize_length: bool = False,
) -> list[View]:
    """``normalize_length`` divides each estimate by L (BGPO's per-length ELBO)."""
    P, L = seq.P, seq.L
    if L == 0:
        return []
    offset = float(torch.rand((), generator=g, dtype=torch.float64))
    views = []
    for j in range(n_mc):
        m = stratified_count(j, offset, L, n_mc)
        pick = torch.randperm(L, generator=g)[:m] + P
        masked = torch.zeros(P + L, dtype=torch.bool)
        masked[pick] = True
        c = (L / m) / (L if normalize_length else 1.0) / (n_mc if slots == "sequence" else 1.0)
        views.append(seq.view(masked, torch.full((P + L,), c), slots, j))
    return views


def blockwise(
    seq: CleanSequence, g: torch.Generator, grid: BlockGrid, n_mc: int = 2, p_prompt: float = 0.15, slots: str = "view"
) -> list[View]:
    """SPG's block-wise ELBO draws (module docstring) over the response blocks of ``grid``."""
    P, L = seq.P, seq.L
    _, n_blocks = grid.bounds(P, L)
    views = []
    for j in range(n_mc):
        b = int(torch.randint(n_blocks, (1,), generator=g))
        lo, hi = grid.block(b, P, L)
        m = int(torch.randint(1, hi - lo + 1, (1,), generator=g))
        in_b = torch.zeros(P + L, dtype=torch.bool)
        in_b[lo + torch.randperm(hi - lo, generator=g)[:m]] = True
        masked = in_b.clone()
        masked[hi:] = True
        masked[:P] = torch.rand(P, generator=g, dtype=torch.float64) < p_prompt
        coef = torch.full((P + L,), n_blocks * (hi - lo) / m / n_mc)
        views.append(seq.view(masked, coef, slots, j, scored=in_b))
    return views


def blockwise_dare(
    seq: CleanSequence, g: torch.Generator, grid: BlockGrid, n_mc: int = 1, p_prompt: float = 0.15
) -> list[View]:
    """DARE's ``_forward_process_spg`` for one sample, drawing from ``g`` in DARE's order (so a generator seeded
    as DARE's ``seed`` gives DARE's masks): the n_mc chosen blocks from one permutation of the response blocks
    (without replacement; past n_blocks draws a fresh permutation continues, where DARE asserts
    n_mc <= n_blocks); per draw m ~ U{1..|b|} and the positions i of b with perm[i] < m masked; then one
    uniform draw per position for all draws: every position before b -- prompt and earlier response blocks --
    masked w.p. ``p_prompt``, b's m and every later position masked. Scored (token slots): every masked
    response token, c = L / (n_mc |masked response tokens of the draw|) (module docstring)."""
    P, L = seq.P, seq.L
    if L == 0:
        return []
    _, n_blocks = grid.bounds(P, L)
    order = torch.cat([torch.randperm(n_blocks, generator=g) for _ in range(-(-n_mc // n_blocks))])
    pos = torch.arange(P + L)
    starts, following = [], []
    for j in range(n_mc):
        lo, hi = grid.block(int(order[j]), P, L)
        m = int(torch.randint(1, hi - lo + 1, (1, 1), generator=g))
        f = pos >= lo
        f[lo:hi] = torch.randperm(hi - lo, generator=g) < m
        starts.append(lo)
        following.append(f)
    u = torch.rand((n_mc, P + L), generator=g)  # DARE's random_matrix (float32)
    views = []
    for j, (lo, f) in enumerate(zip(starts, following)):
        masked = f | ((pos < lo) & (u[j] < p_prompt))
        scored = masked & (pos >= P)
        coef = torch.full((P + L,), L / (int(scored.sum()) * n_mc))
        views.append(seq.view(masked, coef, "token", j, scored=scored))
    return views


def antithetic_views(seq: CleanSequence, counts: list[int], g: torch.Generator, canvas: int) -> list[View]:
    """Per draw: k masked (coefficient (L+1)/k) and the exact complement ((L+1)/(L-k)), each / (2 n_mc canvas),
    all in sequence slot 0; empty views are left out."""
    P, L = seq.P, seq.L
    views = []
    for k in counts:
        masked = torch.zeros(P + L, dtype=torch.bool)
        masked[torch.randperm(L, generator=g)[:k] + P] = True
        comp = (torch.arange(P + L) >= P) & ~masked
        for m, n in ((masked, k), (comp, L - k)):
            if n == 0:
                continue
            c = (L + 1) / n / (2 * len(counts) * canvas)
            views.append(seq.view(m, torch.full((P + L,), c), "sequence", 0))
    return views


def ar_views(seq: CleanSequence) -> list[View]:
    """One view per response position t: c ++ y_<t ++ M..M, scoring position t into token slot t."""
    P, L = seq.P, seq.L
    pos = torch.arange(P + L)
    return [seq.view(pos >= P + t, torch.ones(P + L), "token", 0, scored=pos == P + t) for t in range(L)]
