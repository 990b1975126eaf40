"""SFT modes for diffusion LMs: each turns one tokenized example into training rows (data/rows.py).

Every row carries per-token loss weights so that the trainer minimises sum(w * CE) / D over the global batch.
Notation: prompt c (never masked), response y of length L, mask token M, t the masking probability.

* ``random`` -- random-masking SFT (LLaDA arXiv:2502.09992 Alg. 1; Dream): t ~ U(low, high), every response
  token masked i.i.d. with prob. t, one bidirectional forward over c ++ y_t. Loss (LLaDA's official form)

      L = 1/|batch| * sum_samples (1/L) * sum_{k masked} w(t) * -log p(y_k | c, y_t),   w(t) = 1/t

  (``normalize='masked_tokens'`` divides by the number of masked tokens of the global batch instead;
  ``'masked_tokens_per_sample'`` by each sample's own: DARE's trainers divide each micro-batch by its masked tokens
  and average the micro-batches, which is the latter at ``micro_batch_size_per_gpu=1``).
* ``block`` -- block-diffusion SFT (SDAR / BD3-LM arXiv:2503.09573; LLaDA2, TraDo): blocks of ``block_size``
  on the global prompt+response grid; t per block (or per sample); the row is x_t ++ x_0 with the
  block-diffusion mask, so every block's term  sum_b E_t [ w(t_b) sum_{k in b masked} CE_k ]  comes from one
  forward; at least one response token is masked per sample by SDAR's rule (modeling_sdar.py
  ``forward_add_noise_packed``): t and the mask are drawn again, up to 10 times, then one token is forced
  (``redraw_empty``; off, an empty draw stays and scores nothing, as DARE's LLaDA2 dataset draws).
* ``semi_ar`` -- semi-autoregressive SFT with sliced data for full-attention models (dLLM-RL ``semi-ar``):
  one response block b drawn uniformly per sample, the row is c ++ y_{<b} (clean) ++ y_b (masked with prob.
  t), later blocks sliced off; weighted by n_blocks so the expectation over b is the sum over blocks. Not dLLM-RL's
  objective as its train/sft_llada.py codes it: a row per block, the later blocks kept in the input as masks, each
  token masked with its own p ~ U(lower_p, upper_p), no 1/t, each row divided by its masked tokens.
* ``trace`` -- trace SFT (TraDo/TraceRL arXiv:2509.06949, dLLM-RL ``trace``): a recorded decoding trace gives
  the step s_k at which each response token was committed; steps are grouped ``shrink`` at a time; for each
  group g one row holds the state before g (tokens committed earlier clean, the rest masked) and scores the
  tokens committed in g:  L = (1/L) sum_g sum_{k in g} -log p(y_k | state_g). Block-causal families slice the
  row after the active block and use the block-causal inference mask.

Dream (``arch.logits_shift == 1``) predicts token k from position k-1: targets and weights move one left.
All randomness comes from the generator passed in (seeded per step and example by the caller).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megadare.data.sft_data import SFTExample
from megadare.diffusion.masking import block_index, iid_mask, mask_tokens
from megadare.diffusion.schedule import NoiseSchedule
from megadare.models.family import MaskKind, ModelArch
from megadare.data.rows import Row

SFT_MODES = ("random", "block", "semi_ar", "trace")
NORMALIZE = ("answer_length", "masked_tokens", "masked_tokens_per_sample")
SDAR_MASK_TRIES = 10  # forward_add_noise_packed(max_tries=10) in SDAR's modeling_sdar.py


@dataclass(frozen=True)
class SFTRecipe:
    mode: str
    block_size: int = 4
    schedule: NoiseSchedule = NoiseSchedule()
    normalize: str = "answer_length"
    t_per: str = "block"  # block mode: one t per block or per sample
    trace_shrink: int = 1
    redraw_empty: bool = True  # block mode: SDAR's rule, draw again while nothing is masked (False: keep it)

    def __post_init__(self) -> None:
        if self.mode not in SFT_MODES:
            raise ValueError(f"sft.mode={self.mode!r} unknown; choose one of {SFT_MODES}")
        if self.normalize not in NORMALIZE:
            raise ValueError(f"sft.normalize={self.normalize!r} unknown; choose one of {NORMALIZE}")
        if self.t_per not in ("block", "sample"):
            raise ValueError(f"sft.t_per={self.t_per!r} must be 'block' or 'sample'")
        if self.trace_shrink < 1:
            raise ValueError(f"sft.trace_shrink={self.trace_shrink} must be >= 1")


def mask_kind(recipe: SFTRecipe, arch: ModelArch) -> MaskKind:
    """The attention mask the rows of this recipe are trained with (checks the mode fits the family)."""
    block_family = arch.is_block_diffusion
    if recipe.mode == "block":
        if not block_family:
            raise ValueError(
                f"sft.mode=block needs a block-diffusion family; {arch.family} uses full attention "
                "(use sft.mode=random or semi_ar)"
            )
        return MaskKind.BLOCK_DIFFUSION
    if recipe.mode in ("random", "semi_ar"):
        if block_family:
            raise ValueError(
                f"sft.mode={recipe.mode} trains full attention; {arch.family} is a block-diffusion "
                "family (use sft.mode=block or trace)"
            )
        return MaskKind.BIDIRECTIONAL
    return arch.attention


def _shift(row: Row) -> Row:
    """Dream's convention: position k-1 predicts token k (targets and weights move one position left)."""
    labels = torch.cat([row.labels[1:], row.labels[:1]])
    weight = torch.cat([row.weight[1:], torch.zeros(1)])
    return Row(
        tokens=row.tokens,
        labels=labels,
        weight=weight,
        position_ids=row.position_ids,
        stream_ids=row.stream_ids,
        denom=row.denom,
    )


def _norm(recipe: SFTRecipe, L: int, n_scored: int) -> tuple[float, float]:
    """(weight divisor, denominator share) of one sample under the recipe's normalisation."""
    if recipe.normalize == "answer_length":
        return float(L), 1.0
    if recipe.normalize == "masked_tokens_per_sample":
        return float(max(n_scored, 1)), 1.0
    return 1.0, float(n_scored)


def _random(ex: SFTExample, arch: ModelArch, r: SFTRecipe, g: torch.Generator) -> list[Row]:
    c = torch.tensor(ex.prompt_ids, dtype=torch.long)
    y = torch.tensor(ex.response_ids, dtype=torch.long)
    t = r.schedule.sample(1, g)
    masked = iid_mask(torch.ones(len(y), dtype=torch.bool), t, g)  # LLaDA: no forced token (unbiased ELBO)
    x0 = torch.cat([c, y])
    xt = torch.cat([c, mask_tokens(y, masked, arch.mask_token_id)])
    div, denom = _norm(r, len(y), int(masked.sum()))
    w = torch.cat([torch.zeros(len(c)), masked.float() * r.schedule.weight(t) / div])
    return [Row(tokens=xt, labels=x0, weight=w, position_ids=torch.arange(len(x0)), denom=denom)]


def _block_draw(
    r: SFTRecipe, eligible: torch.Tensor, blocks: torch.Tensor, g: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """(masked, t per position) of a block row by SDAR's rule: draw t and the mask again while nothing is masked,
    up to ``SDAR_MASK_TRIES`` times, then force one eligible token (keeping the last t). Forcing a token at once
    would keep a tiny t and weight that token by 1/t (up to 1/noise_low): a heavy, biased term for short responses."""
    n_blocks = int(blocks[-1]) + 1
    for _ in range(SDAR_MASK_TRIES if r.redraw_empty else 1):
        t_blocks = r.schedule.sample(n_blocks if r.t_per == "block" else 1, g).expand(n_blocks)
        t_tok = t_blocks[blocks]
        masked = iid_mask(eligible, t_tok, g)
        if masked.any() or not eligible.any() or not r.redraw_empty:
            return masked, t_tok
    return iid_mask(eligible, 0.0, g, force_one=True), t_tok


def _block(ex: SFTExample, arch: ModelArch, r: SFTRecipe, g: torch.Generator) -> list[Row]:
    c = torch.tensor(ex.prompt_ids, dtype=torch.long)
    y = torch.tensor(ex.response_ids, dtype=torch.long)
    x0 = torch.cat([c, y])
    n, P = len(x0), len(c)
    pos = torch.arange(n)
    blocks = block_index(pos, r.block_size)
    masked, t_tok = _block_draw(r, pos >= P, blocks, g)
    xt = mask_tokens(x0, masked, arch.mask_token_id)
    div, denom = _norm(r, len(y), int(masked.sum()))
    w = masked.float() * r.schedule.weight(t_tok) / div
    return [
        Row(
            tokens=torch.cat([xt, x0]),
            labels=torch.cat([x0, x0]),
            weight=torch.cat([w, torch.zeros(n)]),
            position_ids=torch.cat([pos, pos]),
            stream_ids=torch.cat([torch.zeros(n, dtype=torch.long), torch.ones(n, dtype=torch.long)]),
            denom=denom,
        )
    ]


def _semi_ar(ex: SFTExample, arch: ModelArch, r: SFTRecipe, g: torch.Generator) -> list[Row]:
    c = torch.tensor(ex.prompt_ids, dtype=torch.long)
    y = torch.tensor(ex.response_ids, dtype=torch.long)
    n_blocks = -(-len(y) // r.block_size)
    b = int(torch.randint(n_blocks, (1,), generator=g))
    end = min(len(y), (b + 1) * r.block_size)
    in_block = torch.zeros(end, dtype=torch.bool)
    in_block[b * r.block_size : end] = True
    t = r.schedule.sample(1, g)
    masked = iid_mask(in_block, t, g, force_one=True)
    x0 = torch.cat([c, y[:end]])
    xt = torch.cat([c, mask_tokens(y[:end], masked, arch.mask_token_id)])
    div, denom = _norm(r, len(y), int(masked.sum()))
    scale = n_blocks if r.normalize == "answer_length" else 1.0
    w = torch.cat([torch.zeros(len(c)), masked.float() * r.schedule.weight(t) * scale / div])
    return [Row(tokens=xt, labels=x0, weight=w, position_ids=torch.arange(len(x0)), denom=denom)]


def trace_groups(steps: list[int], shrink: int) -> list[list[int]]:
    """The distinct committed-at steps in order, grouped ``shrink`` consecutive steps at a time."""
    distinct = sorted(set(steps))
    return [distinct[i : i + shrink] for i in range(0, len(distinct), shrink)]


def _trace(ex: SFTExample, arch: ModelArch, r: SFTRecipe, g: torch.Generator) -> list[Row]:
    if ex.steps is None:
        raise ValueError(
            "sft.mode=trace needs records with a 'steps' field (one committed-at step per response "
            "token), e.g. written by a rollout with trace recording"
        )
    c = torch.tensor(ex.prompt_ids, dtype=torch.long)
    y = torch.tensor(ex.response_ids, dtype=torch.long)
    steps = torch.tensor(ex.steps, dtype=torch.long)
    P, L = len(c), len(y)
    block_family = arch.is_block_diffusion
    rows = []
    groups = trace_groups(ex.steps, r.trace_shrink)
    for gi, group in enumerate(groups):
        first = group[0]
        scored = torch.isin(steps, torch.tensor(group))
        state = mask_tokens(y, steps >= first, arch.mask_token_id)
        end = L
        if block_family:  # later blocks are invisible under the block-causal mask: slice them off
            last_pos = P + int(scored.nonzero().max())
            end = min(L, (last_pos // r.block_size + 1) * r.block_size - P)
        x0 = torch.cat([c, y[:end]])
        xt = torch.cat([c, state[:end]])
        per_sample = r.normalize != "masked_tokens"  # every response token is scored once: its masked tokens are L
        w = torch.cat([torch.zeros(P), scored[:end].float() / (L if per_sample else 1.0)])
        denom = (1.0 if gi == 0 else 0.0) if per_sample else float(scored.sum())
        rows.append(Row(tokens=xt, labels=x0, weight=w, position_ids=torch.arange(len(x0)), denom=denom))
    return rows


_MODES = {"random": _random, "block": _block, "semi_ar": _semi_ar, "trace": _trace}


def example_rows(ex: SFTExample, arch: ModelArch, recipe: SFTRecipe, generator: torch.Generator) -> list[Row]:
    """The training rows of one example under the recipe (Dream-shifted where the family says so)."""
    rows = _MODES[recipe.mode](ex, arch, recipe, generator)
    if arch.logits_shift:
        if not ex.prompt_ids:
            raise ValueError(
                "a shifted-logit family (Dream) needs a non-empty prompt: the first token has no "
                "predecessor to predict it"
            )
        rows = [_shift(row) for row in rows]
    return rows


def example_generator(seed: int, step: int, index: int, epoch: int = 0) -> torch.Generator:
    """The corruption RNG of one example at one step (and RL epoch, when corruptions are redrawn per epoch):
    independent of layout, rank and packing. Epoch 0 is the example's stream at that step."""
    key = (seed * 1_000_003 + step) * 1_000_033 + index
    if epoch:
        key = (key * 1_000_037 + epoch) % (1 << 63)
    return torch.Generator().manual_seed(key)
