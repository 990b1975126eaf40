"""Token sampling and commit selection for dLLM decoding (shared by the built-in engine and the SGLang plugin).

Everything here is a tensor op over a whole batch of rows (no per-row Python, no host synchronisation), so a
denoising step runs where the logits are.

Random numbers: every row (a prompt, a request) has its own stream, a counter-based generator (SplitMix64's
output function, Steele et al. 2014, on a 64-bit counter): the uniform number at (row key, counter, purpose,
position) is a pure function of those four integers, computed for all rows in one op. A row's key is
``engine.prompt_seed(seed, prompt index)`` and its counter is the row's own denoising-step count, so a trajectory
depends on (seed, prompt index) and the weights only: not on the batch, the engine, or the device (the integer
arithmetic is exact everywhere; :func:`stream_uniforms`).

* ``sample_tokens``: x0 ~ softmax(filter(logits / T)) with top-k / top-p filters (argmax when T = 0), drawn by
  inverting the distribution's CDF at the row's uniform number (:func:`categorical`, exact in float64 over
  float32 weights); returns the proposal, its log-probability under that sampling distribution (0 for greedy: a
  point mass) and its confidence p_theta(x0) under the unfiltered model distribution (SDAR's ``generate.py`` and
  LLaDA's low-confidence remasking rank by the model probability of the proposal).
* ``linspace_counts``: Dream's schedule (``generation_utils.py``): ``int(n_masked * (1 - s/t))`` with t, s
  consecutive points of ``linspace(1, eps, S + 1)``, computed in float32 as Dream does; the last step commits
  the rest.
* ``dream_confidence``: Dream's ``sample_tokens`` confidence rules on its sampling distribution
  p = softmax(filter(logits / T)) (T = 0: softmax(filter(logits))): ``maskgit_plus`` p(x0), ``topk_margin``
  p_(1) - p_(2), ``entropy`` sum_v p_v log(p_v + 1e-10) (negative entropy: larger = more certain).
* ``select_commits``: ``low_confidence_static`` commits the top-n confident masked positions (``alg_temp`` > 0:
  n positions drawn without replacement with probabilities softmax(confidence / alg_temp), Dream's ``alg_temp``,
  by Gumbel-top-k); ``random`` commits n random masked positions (LLaDA's random remasking);
  ``low_confidence_dynamic`` (SDAR / TraDo, Fast-dLLM threshold decoding) and ``editing`` (LLaDA2.1, n =
  num_to_transfer) commit every masked position with confidence > threshold when that is at least n, otherwise
  the top-n. n is clamped to the number of masked positions (the reference SDAR code could overwrite prompt
  tokens in a first block that holds the prompt's remainder; here it cannot). Ties in confidence go to the
  earlier position.

The draws differ from ``torch.multinomial`` with a per-row ``torch.Generator`` (what megadare used before): those
streams are Mersenne-Twister state that only a per-row loop can advance. The distributions are the same.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional, Union

import torch
import torch.nn.functional as F


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN = _signed(0x9E3779B97F4A7C15)  # SplitMix64's increment
_MIX1, _MIX2 = _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)
_COUNTER_SHIFT, _PURPOSE_SHIFT = 21, 20  # stream index = counter << 21 | purpose << 20 | position
SAMPLE, REMASK = 0, 1  # purposes: token proposals, random / alg_temp commit selection
_ONE_LEVEL = 16384  # categorical: one cumulative sum up to this vocabulary size


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def mix64(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's output function on int64 (wrapping multiplication: two's complement, as on every device)."""
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    return z ^ _shr(z, 31)


def stream_uniforms(
    keys: torch.Tensor, counters: torch.Tensor, purpose: int, width: int, base: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Uniform numbers in (0, 1), float64 [n, width]: row r's numbers at its counter ``counters[r]`` for one
    ``purpose`` and positions 0..width-1, ``u = (top 52 bits of mix64(mix64(key) + (index + 1) * golden) + 1/2)
    / 2^52``; keys, counters: int64 [n] on the device the numbers are wanted on (``base``: ``mix64(keys)`` if the
    caller keeps it)."""
    if width > 1 << _PURPOSE_SHIFT:
        raise ValueError(f"stream_uniforms: {width} positions per step; at most {1 << _PURPOSE_SHIFT}")
    base = mix64(keys.long()) if base is None else base
    start = base + ((counters.long() << _COUNTER_SHIFT) + ((purpose << _PURPOSE_SHIFT) + 1)) * _GOLDEN
    bits = _shr(mix64(start[:, None] + _position_offsets(width, keys.device)), 12)
    return (bits.double() + 0.5) * (2.0**-52)


@functools.lru_cache(maxsize=16)
def _position_offsets(width: int, device: torch.device) -> torch.Tensor:
    """``arange(width) * golden`` (int64, wrapping) on ``device``, made once per width (never written)."""
    return torch.arange(width, device=device) * _GOLDEN


def _last_positive(w: torch.Tensor) -> torch.Tensor:
    """Index of the last entry > 0 along the last dim."""
    n = w.shape[-1]
    return (n - 1) - (w > 0).flip(-1).to(torch.uint8).argmax(-1)


def _chunk(n: int) -> int:
    c = 256
    while n % c:
        c //= 2
    return c


def categorical(weights: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse-CDF draw: for non-negative weights [R, V] (not all 0) and u [R] in (0, 1), the first index i with
    cumsum(weights)[i] > u * sum(weights), in float64 (vocabularies over 16384: two levels, chunk sums, then one
    chunk); an index with weight 0 is never drawn. Returns (index [R], float64 sum of the weights [R])."""
    R, V = weights.shape
    if V <= _ONE_LEVEL:
        cum = weights.cumsum(-1, dtype=torch.float64)
        total = cum[:, -1]
        x = torch.minimum(u.double() * total, torch.nextafter(total, torch.zeros_like(total)))  # < total
        return torch.searchsorted(cum, x[:, None], right=True).squeeze(1), total
    C = _chunk(V)
    chunks = weights.view(R, V // C, C)
    mass = chunks.sum(-1, dtype=torch.float64)  # [R, K]
    cum = mass.cumsum(-1)
    x = u.double() * cum[:, -1]
    k = torch.searchsorted(cum, x[:, None], right=True).squeeze(1)
    k = torch.minimum(k, _last_positive(mass))
    before = torch.where(k > 0, cum.gather(1, (k - 1).clamp(min=0)[:, None]).squeeze(1), torch.zeros_like(x))
    inner = chunks.gather(1, k[:, None, None].expand(R, 1, C)).squeeze(1).double()  # [R, C]
    j = torch.searchsorted(inner.cumsum(-1), (x - before)[:, None], right=True).squeeze(1)
    j = torch.minimum(j, _last_positive(inner))
    return k * C + j, cum[:, -1]


Setting = Union[float, torch.Tensor]  # a float setting: a Python float, or a [1] tensor (a compiled step's input)


def _is(setting: Setting, value: float) -> bool:
    """Whether ``setting`` is the Python float ``value``. A tensor setting is never one of the values a branch
    tests for: the caller passes those as Python floats (``dllm_step.split_floats``)."""
    return not isinstance(setting, torch.Tensor) and setting == value


def _positive(setting: Setting) -> bool:
    """``setting > 0`` for a Python float; a tensor setting is positive (``dllm_step.split_floats``)."""
    return isinstance(setting, torch.Tensor) or setting > 0


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: Setting = 1.0) -> torch.Tensor:
    """-inf outside the top-k logits and outside the smallest set with cumulative probability >= top_p (a tensor
    ``top_p``: below 1)."""
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if isinstance(top_p, torch.Tensor) or top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cum = torch.cumsum(F.softmax(sorted_logits, dim=-1), dim=-1)
        drop = cum > top_p
        drop[..., 1:] = drop[..., :-1].clone()
        drop[..., 0] = False
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    return logits


def _at(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return x.gather(-1, index[:, None]).squeeze(-1)


def sample_tokens(
    logits: torch.Tensor,
    temperature: Setting,
    top_k: int,
    top_p: Setting,
    uniforms: Optional[torch.Tensor],
    probs: Optional[list] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens, log-prob under the sampling distribution, model confidence) for logits [..., V]; ``uniforms``
    [...] (one per position, from the row's stream; unused when greedy). ``probs``: a list that receives the
    sampling distribution [..., V] when one was built (temperature > 0; Dream's rules rank on it). A tensor
    ``temperature`` / ``top_p`` ([1]) is neither 0 nor 1 / below 1 (:func:`_is`)."""
    shape = logits.shape[:-1]
    flat = logits.float().reshape(-1, logits.shape[-1])
    if _is(temperature, 0):
        tokens = filter_logits(flat, top_k, top_p).argmax(dim=-1)
        conf = (_at(flat, tokens) - torch.logsumexp(flat, dim=-1)).exp()
        return tokens.view(shape), torch.zeros(shape, device=logits.device), conf.view(shape)
    if uniforms is None or uniforms.shape != shape:
        raise ValueError(
            f"sample_tokens: temperature {temperature} needs one uniform number per position {tuple(shape)}"
        )
    z = filter_logits(flat if _is(temperature, 1.0) else flat / temperature, top_k, top_p)
    top = z.amax(dim=-1, keepdim=True)
    weights = (z - top).exp_()
    tokens, total = categorical(weights, uniforms.reshape(-1))
    logp = _at(z, tokens) - top.squeeze(-1) - total.log().float()
    if probs is not None:
        probs.append(weights.div_(total.float()[:, None]).view(*shape, -1))
    unfiltered = top_k == 0 and not isinstance(top_p, torch.Tensor) and top_p >= 1.0
    if _is(temperature, 1.0) and unfiltered:  # the sampling distribution is the model's
        conf = logp.exp()
    else:
        conf = (_at(flat, tokens) - torch.logsumexp(flat, dim=-1)).exp()
    return tokens.view(shape), logp.view(shape), conf.view(shape)


def linspace_counts(n_masked: torch.Tensor, step: torch.Tensor, steps: int, eps: float) -> torch.Tensor:
    """Dream's tokens to commit at ``step`` of ``steps`` with ``n_masked`` still masked (long tensors of one
    shape): int(n_masked * (1 - s/t)), t = linspace(1, eps, steps + 1)[step], s = the next point (float32, as
    ``generation_utils.py``); the last step (and any later one) commits every masked position."""
    ts = torch.linspace(1, eps, steps + 1, device=n_masked.device)
    ratio = 1 - ts[1:] / ts[:-1]
    count = (n_masked.float() * ratio[step.clamp(max=steps - 1)]).long()
    return torch.where(step >= steps - 1, n_masked, count)


def linspace_remaining_counts(n_masked: torch.Tensor, step: torch.Tensor, steps: int, eps: float) -> torch.Tensor:
    """DARE's MDPO rollout for Dream (``mdpo_dream_rollout.py``): n_masked - int(n_masked * s/t) with the points
    of :func:`linspace_counts` (float32); the last step (and any later one) commits every masked position."""
    ts = torch.linspace(1, eps, steps + 1, device=n_masked.device)
    ratio = ts[1:] / ts[:-1]
    count = n_masked - (n_masked.float() * ratio[step.clamp(max=steps - 1)]).long()
    return torch.where(step >= steps - 1, n_masked, count)


class SamplingRule(NamedTuple):
    """The sampling distribution softmax(filter(logits / temperature)) (temperature 0: the logits unscaled), with
    top-k / top-p truncation (``filter_logits``)."""

    temperature: Setting
    top_k: int
    top_p: Setting


def dream_confidence(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    rule: str,
    sampling: SamplingRule,
    probs: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Dream's confidence of the proposals ``tokens`` [...] for logits [..., V] under ``rule`` (maskgit_plus,
    topk_margin, entropy), computed on Dream's sampling distribution ``sampling`` (``probs``: that distribution
    when the caller has it). Follows ``sample_tokens`` of Dream's
    ``generation_utils.py``."""
    if probs is None:
        temperature = sampling.temperature
        logits = logits.float()
        probs = F.softmax(
            filter_logits(logits / temperature if _positive(temperature) else logits, sampling.top_k, sampling.top_p),
            dim=-1,
        )
    if rule == "maskgit_plus":
        return probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    if rule == "topk_margin":
        top2 = torch.topk(probs, 2, dim=-1).values
        return top2[..., 0] - top2[..., 1]
    if rule == "entropy":
        return (probs * torch.log(probs + 1e-10)).sum(-1)
    raise ValueError(f"dream_confidence: rule {rule!r} unknown (maskgit_plus, topk_margin, entropy)")


def top_ranked(score: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """[n, L] bool: the k[r] highest scores of each row (ties: the earlier position first)."""
    order = torch.argsort(score, dim=1, descending=True, stable=True)
    return torch.argsort(order, dim=1) < k[:, None]


class CommitRule(NamedTuple):
    """Which positions a step commits: ``algorithm`` (``SamplingParams.algorithm``), the confidence
    ``threshold`` of low_confidence_dynamic / editing, and ``alg_temp`` (> 0: Gumbel-top-k draws)."""

    algorithm: str
    threshold: Setting = 0.9
    alg_temp: Setting = 0.0


def select_commits(
    confidence: torch.Tensor,
    masked: torch.Tensor,
    n: torch.Tensor,
    rule: CommitRule,
    uniforms: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Which positions to commit under ``rule``. confidence, masked [B, L]; n [B] tokens the schedule asks for;
    uniforms [B, L] in (0, 1) from the rows' streams (``random`` and ``alg_temp`` > 0 only)."""
    algorithm, threshold, alg_temp = rule
    k = torch.minimum(n.to(masked.device), masked.sum(dim=1))
    if algorithm == "random" or _positive(alg_temp):
        if uniforms is None:
            raise ValueError(
                f"select_commits: algorithm={algorithm!r}, alg_temp={alg_temp} draws positions: pass uniforms"
            )
        if algorithm == "random":  # k uniformly random masked positions: the k smallest uniform keys
            score = -uniforms
        else:  # Gumbel-top-k: k draws without replacement ~ softmax(confidence / alg_temp)
            score = confidence.double() / alg_temp - torch.log(-torch.log(uniforms))
    else:
        score = confidence
    pick = top_ranked(score.masked_fill(~masked, float("-inf")), k) & masked
    if algorithm in ("low_confidence_dynamic", "editing"):
        over = masked & (confidence > threshold)
        pick = torch.where((over.sum(dim=1) >= k)[:, None], over, pick)
    return pick & (k > 0)[:, None]
