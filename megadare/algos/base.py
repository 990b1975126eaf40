"""The pieces every RL algorithm is made of: samples, views (corruptions), rows, and the slot objective.

An algorithm = corruption sampler x likelihood estimator x objective x rollout contract (DESIGN.md section 6).

* A ``RLSample`` is one rollout response with its reward/advantage and, when the engine recorded it, its
  decoding trace (the step at which every token was committed).
* A ``View`` is one corrupted copy of prompt ++ response: the model input x_t, which positions are scored and
  with which coefficient, and into which *slot* each scored position's log-prob goes. A slot is one quantity
  the objective puts in a ratio: a token (d1, Coupled-GRPO, TraceRL), or a whole sequence (BGPO, VRPO). The
  estimate of a slot is linear in the per-view log-probs,

      l_s = sum_{views v} sum_{positions k of v in slot s} c_{v,k} log p_theta(y_k | x_t^{(v)}),

  which covers one-step (d1), coupled/antithetic (Coupled-GRPO), Monte-Carlo ELBO (VRPO/BGPO/SPG) and trace
  replay (TraceRL, CJ-GRPO) estimators.
* ``views_to_row`` lays views out as one training row (several segments that never attend to each other, so a
  slot's views always share a micro-batch): ``c ++ x_t`` for full-attention families, ``x_t ++ x_0`` with the
  block-diffusion mask for block families (one forward scores every block against its clean predecessors), and
  Dream's shifted logits.
* ``SlotObjective`` turns a micro-batch's per-position log-probs into slot estimates (current, old, reference)
  and hands them to the algorithm's per-slot loss; slots are weighted by their ``head`` weight and the trainer
  divides by the global denominator (token-mean or sequence-mean aggregation).

Corruptions are drawn from a generator seeded by (seed, step, sample, iteration) and stored in the rows, so
old, reference and current log-probs all see the same masks (never a global reseed).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed.nn.functional as dist_nn

from megadare.models.family import ModelArch
from megadare.data.rows import MicroBatch, Row
from megadare.diffusion.views import View, list_tensor
from megadare.rollout.engine import fields_from_extra

SLOT_CONST = "per_slot_"  # row extras constant over a slot, handed to the slot loss in Slots.extra
LOSS_AGG = (
    "token_mean",
    "seq_mean_token_mean",
    "seq_mean_token_sum",
    "seq_mean_length",
    "fragment_mean",
    "fragment_width",
)
STEP_WIDTH = "step_width"  # RLSample.extra: the longest response of the sample's RL step (fragment_width)
ANSWER_LENGTH = "answer_length"  # RLSample.extra: response tokens up to the first EOS (inclusive); the rest of a
# full canvas is what the sampler decoded after the answer (stamped by the trainer's rollout)


@dataclass
class RLSample:
    prompt_ids: list[int]
    response_ids: list[int]
    reward: float
    advantage: float | list[float]  # per response, or per response token (value-model baselines)
    index: int = 0  # position in the global batch (seeds its corruptions)
    group: int = 0  # prompt group
    commit_step: Optional[list[int]] = None  # global denoising step of each response token (trace estimators)
    block_step: Optional[list[int]] = None  # step inside the token's block
    superseded: Optional[list] = None  # token editing: overwritten commits (rollout.engine.Superseded)
    truncated: bool = False
    policy_version: Optional[int] = None  # the behaviour policy's version (None: not recorded)
    token_versions: Optional[list[int]] = None  # partial rollouts: the policy version of every response token
    engine_logprobs: Optional[list[float]] = None  # the engine's sampler log-prob of every trace-replay slot
    extra: dict[str, Any] = field(default_factory=dict)  # one algorithm's own (MDPO's steps, d-TreeRPO's parent ...)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(fields_from_extra(state, ("policy_version", "token_versions", "engine_logprobs")))

    def token_advantages(self) -> torch.Tensor:
        L = len(self.response_ids)
        if isinstance(self.advantage, (list, tuple, torch.Tensor)):
            a = torch.as_tensor(self.advantage, dtype=torch.float32)
            if a.shape != (L,):
                raise ValueError(f"sample {self.index}: {a.numel()} token advantages for {L} response tokens")
            return a
        return torch.full((L,), float(self.advantage))


LONG_COLS = ("tokens", "labels", "pos", "stream", "slot", "tok", "sample")  # a half-view's long columns, stacked


class SampleColumns:
    """What every view of one sample shares, built once per sample (not once per row): the advantage of each
    position and ``LONG_COLS`` of a noisy half before a view's own (tokens and labels x_0, positions, stream 0, no
    slot, the response token, the sample) and of a clean x_0 half (stream 1, no slot, no response token)."""

    def __init__(self, sample: RLSample):
        ids = list(sample.prompt_ids) + list(sample.response_ids)
        P, N, i = len(sample.prompt_ids), len(ids), sample.index
        pos, none = list(range(N)), [-1] * N
        tok = [-1] * P + list(range(len(sample.response_ids)))
        grid = ids + ids + pos + [0] * N + none + tok + [i] * N + ids + ids + pos + [1] * N + none + none + [i] * N
        self.P, self.grid = P, list_tensor(grid, torch.long).view(14, N)
        self.adv = torch.cat([torch.zeros(P), sample.token_advantages()])
        self.zeros = torch.zeros(3, N)  # weight, head, adv of a clean half
        self.cut: dict[int, tuple] = {}

    def halves(self, n: int) -> tuple:
        """The first ``n`` positions: the noisy half's ``LONG_COLS`` one by one, the clean half's [7, n] long and
        [3, n] float columns, the advantages (once per view length, not once per view)."""
        if n not in self.cut:
            g = self.grid[:, :n]
            self.cut[n] = (g[:7].unbind(0), g[7:], self.zeros[:, :n], self.adv[:n])
        return self.cut[n]


def views_to_row(
    sample: RLSample,
    views: list[View],
    arch: ModelArch,
    slot_weight: dict[int, float],
    denom: float,
    cols: Optional[SampleColumns] = None,
) -> Row:
    """One row holding every view of a sample (one segment each; block-diffusion families: x_t ++ x_0).

    ``slot_weight[s]``: the aggregation weight of slot s (1 for token-mean, 1/L for sequence-mean ...), put on
    the slot's first position as ``head``; ``denom``: the sample's share of the global denominator. The
    advantage of each response token is the sample's (``RLSample.token_advantages``) unless a view carries its own.
    ``cols``: the sample's ``SampleColumns`` (built here when None; a caller building several rows of one sample
    passes one). A row is built per sample per step: each half-view is two stacked tensors (its long and its float
    columns) joined by one ``torch.cat`` each; the row's columns are rows of those two tensors.
    """
    block_diffusion = arch.is_block_diffusion
    c = cols if cols is not None else SampleColumns(sample)
    longs: list[torch.Tensor] = []
    floats: list[torch.Tensor] = []
    sizes: list[int] = []
    seen: set[int] = set()
    for v in views:
        n = v.tokens.shape[0]
        t, clean, zeros, adv_n = c.halves(n)
        labels, tok = (t[1] if v.labels is None else v.labels), t[5]
        coef, slot = v.coef.float(), v.slot
        adv = adv_n if v.adv is None else v.adv.float()
        if arch.logits_shift:  # Dream: position k-1 predicts token k
            labels, coef, slot, adv, tok = _shifted(c.P, labels, coef, slot, adv, tok)
        head = _slot_heads(slot, slot_weight, seen)
        longs.append(torch.stack([v.tokens, labels, t[2], t[3], slot, tok, t[6]]))
        floats.append(torch.stack([coef, head, adv]))
        if block_diffusion:  # x_t ++ x_0: the clean half is context only
            longs += [clean]
            floats += [zeros]
        sizes.append((2 if block_diffusion else 1) * n)
    tokens, labels, pos, stream, slot, tok, index = (torch.cat(longs, 1) if len(longs) > 1 else longs[0]).unbind(0)
    weight, head, adv = (torch.cat(floats, 1) if len(floats) > 1 else floats[0]).unbind(0)
    seg = segment_ids(sizes) if len(views) > 1 else None
    return Row(
        tokens=tokens,
        labels=labels,
        weight=weight,
        position_ids=pos,
        stream_ids=stream if block_diffusion else None,
        denom=denom,
        segment_ids=seg,
        slot=slot,
        head=head,
        adv=adv,
        tok=tok,
        sample=index,
    )


def segment_ids(sizes: list[int]) -> torch.Tensor:
    """[sum(sizes)] long: segment i repeated sizes[i] times. One ``torch.full`` per segment joined by a cat, not
    ``torch.repeat_interleave`` with a repeats tensor: torch runs that one as a parallel loop of grain 1 whatever
    its size, and on a loaded machine each call waited 7-25 ms for torch's intra-op threads (15 us alone)."""
    return torch.cat([torch.full((n,), i, dtype=torch.long) for i, n in enumerate(sizes)])


def _shifted(P: int, labels, coef, slot, adv, tok) -> tuple[torch.Tensor, ...]:
    """Dream's shifted logits: each column one position left, the last position scoring nothing."""
    if P == 0:
        raise ValueError("a shifted-logit family (Dream) needs a non-empty prompt")
    zero, none = torch.zeros(1), torch.full((1,), -1, dtype=torch.long)
    labels = torch.cat([labels[1:], labels[:1]])
    coef, slot = torch.cat([coef[1:], zero]), torch.cat([slot[1:], none])
    return labels, coef, slot, torch.cat([adv[1:], zero]), torch.cat([tok[1:], none])


def _slot_heads(slot: torch.Tensor, slot_weight: dict[int, float], seen: set[int]) -> torch.Tensor:
    """The ``head`` column of one view: the weight of each slot at its first scored position in the row (``seen``:
    the slots earlier views of the row already headed; updated)."""
    head = [0.0] * len(slot)
    for i, s in enumerate(slot.tolist()):
        if s >= 0 and s not in seen:
            seen.add(s)
            head[i] = slot_weight.get(s, 0.0)
    return list_tensor(head, torch.float32)


def aggregation(
    loss_agg: str, fragments: list[set[int]], length: int = 0, width: Optional[int] = None
) -> tuple[dict[int, float], float]:
    """(head weight of every slot, the sample's denominator share) for a sample whose views (its fragments) score
    the slot sets ``fragments``; ``length``: its response length; ``width``: the longest response of its RL step
    (``RLSample.extra[STEP_WIDTH]``; None: the sample is a batch of its own, ``length``).

    token_mean: every slot of the global batch counts once, divided by the number of slots (DAPO / verl
    ``token-mean``); seq_mean_token_mean: mean over a sample's slots, then over samples (GRPO's original);
    seq_mean_token_sum: sum over a sample's slots, mean over samples (Dr. GRPO-style, constant normaliser);
    seq_mean_length: sum over a sample's slots / its response length, mean over samples; fragment_mean: each
    fragment's sum over its slots / its number of slots, mean over the global batch's fragments (dLLM-RL's
    LLaDA / Dream: a fragment's surrogate sum / num_mask, mean over fragments, ``train/rl_llada.py:589-592``,
    ``train/rl_dream.py:618-622``); fragment_width: each fragment's sum over its slots / the step's longest
    response, mean over the global batch's fragments (dLLM-RL's block families: a fragment's sum / L1, the padded
    response width of the step, mean over fragments, ``train/rl_trado.py:742-744, 754-755``). In the fragment
    modes a slot must lie in one fragment, and fragments without a slot count for nothing."""
    slots = set().union(*fragments) if fragments else set()
    if loss_agg in ("fragment_mean", "fragment_width"):
        if sum(len(f) for f in fragments) != len(slots):
            raise ValueError(
                f"loss_agg={loss_agg}: a slot is scored in several views (its estimate spans fragments); "
                "use a per-sample aggregation (seq_mean_length, seq_mean_token_mean, ...)"
            )
        scored = [f for f in fragments if f]
        if loss_agg == "fragment_mean":
            return {k: 1.0 / len(f) for f in scored for k in f}, float(len(scored))
        return {k: 1.0 / max(width or length, 1) for f in scored for k in f}, float(len(scored))
    if loss_agg == "token_mean":
        w, denom = 1.0, float(len(slots))
    elif loss_agg == "seq_mean_token_mean":
        w, denom = 1.0 / max(len(slots), 1), 1.0
    elif loss_agg == "seq_mean_token_sum":
        w, denom = 1.0, 1.0
    elif loss_agg == "seq_mean_length":
        w, denom = 1.0 / max(length, 1), 1.0
    else:
        raise ValueError(f"algo.params.loss_agg={loss_agg!r} unknown; choose one of {LOSS_AGG}")
    return {k: w for k in slots}, denom


@dataclass
class Slots:
    """Per-slot tensors of one micro-batch, handed to an algorithm's slot loss."""

    logp: torch.Tensor  # current estimate l_s (differentiable)
    old: torch.Tensor  # same estimate under the old policy (no grad)
    ref: Optional[torch.Tensor]  # under the reference policy (None when the algorithm has no ref KL)
    adv: torch.Tensor
    weight: torch.Tensor  # aggregation (head) weight
    extra: dict[str, torch.Tensor] = field(default_factory=dict)
    behave: Optional[torch.Tensor] = None  # under the behaviour policy (rollout correction, trainer/offpolicy/)
    is_weight: Optional[torch.Tensor] = None  # behaviour -> proximal IS weight (0 = rejected), constant per slot


SlotLoss = Callable[[Slots], tuple[torch.Tensor, dict[str, torch.Tensor]]]


class SlotIndex:
    """Which slot each scored position of a micro-batch adds into: slots are (input row, slot id), so the pieces
    of a row split over the micro-batch's sequences count as one. Under context parallelism the micro-batch is
    this rank's slice of the sequence (``mb.context``, set by trainer/step.py ``cp_slice``): the slots are those
    of the whole sequence, in the same order on every CP rank, and each per-slot sum is completed over the CP
    group by a differentiable all-reduce (max: a plain one), so a slot whose positions span CP ranks gets its
    full estimate everywhere."""

    def __init__(self, mb: MicroBatch):
        ctx = mb.context
        self.sel = mb.slot >= 0
        whole_slot, whole_row = (mb.slot, mb.row_ids) if ctx is None else (ctx["slot"], ctx["row_ids"])
        width = int(whole_slot.max()) + 2
        whole = whole_slot >= 0
        uniq = torch.unique(whole_row[whole] * width + whole_slot[whole])
        self.inv = torch.searchsorted(uniq, mb.row_ids[self.sel] * width + mb.slot[self.sel])
        self.n = uniq.numel()
        self.group = None if ctx is None else ctx["group"]

    def sum(self, v: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(self.n, dtype=v.dtype, device=v.device).index_add(0, self.inv, v)
        if self.group is not None:
            out = dist_nn.all_reduce(out, group=self.group)
        return out

    def amax(self, v: torch.Tensor) -> torch.Tensor:
        out = torch.full((self.n,), float("-inf"), dtype=v.dtype, device=v.device).scatter_reduce(
            0, self.inv, v.detach(), reduce="amax"
        )
        if self.group is not None:
            torch.distributed.all_reduce(out, op=torch.distributed.ReduceOp.MAX, group=self.group)
        return out

    def lse(self, logp: torch.Tensor, coef: torch.Tensor, beta: float) -> torch.Tensor:
        """(1/beta) log sum_{positions of s} coef * p^beta per slot (SPG's Renyi upper bound; coef > 0)."""
        z = beta * logp + torch.log(coef.clamp_min(1e-30))
        m = self.amax(z)
        return (m + torch.log(self.sum(torch.exp(z - m[self.inv])))) / beta


def gather_slots(mb: MicroBatch, logp: torch.Tensor, on_policy: bool, lse_beta: Optional[float] = None) -> Slots:
    """Per-slot estimates from per-position log-probs (sum of coef * log p over each slot's positions); with
    ``lse_beta`` also the log-sum-exp combination in ``extra['lse']`` (and ``extra['lse_old']``); a row extra
    ``per_slot_<name>`` (constant over a slot, e.g. ESPO's canvas length) becomes ``extra['<name>']``."""
    idx = SlotIndex(mb)
    sel = idx.sel
    w = mb.weight[sel].float()
    lp = idx.sum(w * logp[sel])
    old = lp.detach() if on_policy or mb.old is None else idx.sum(w * mb.old[sel].float())
    ref = idx.sum(w * mb.ref[sel].float()) if mb.ref is not None else None
    head = idx.sum(mb.head[sel].float())
    # the advantage is constant over a slot: read it at any position (the max of a constant is the constant)
    adv = idx.amax(mb.adv[sel].float())
    behave = idx.sum(w * mb.behave[sel].float()) if mb.behave is not None else None
    is_w = idx.amax(mb.is_weight[sel].float()) if mb.is_weight is not None else None
    extra = {k[len(SLOT_CONST) :]: idx.amax(v[sel].float()) for k, v in mb.extras.items() if k.startswith(SLOT_CONST)}
    if lse_beta is not None:
        extra["lse"] = idx.lse(logp[sel], w, lse_beta)
        extra["lse_old"] = (
            extra["lse"].detach() if on_policy or mb.old is None else idx.lse(mb.old[sel].float(), w, lse_beta)
        )
    return Slots(logp=lp, old=old, ref=ref, adv=adv, weight=head, extra=extra, behave=behave, is_weight=is_w)


class SlotObjective:
    """trainer.step objective: per-position log-probs -> slots -> sum_s head_s * loss_s.

    ``loss_mode`` (off-policy rollouts, trainer/offpolicy/importance.py): ``ppo`` the algorithm's slot loss as is;
    ``decoupled`` its loss times the behaviour -> proximal IS weight of the slot (``mb.is_weight``, computed
    before the update; 0 = rejected), i.e. Hilton et al.'s decoupled PPO when the slot loss is the PPO clip;
    ``bypass`` the ratio is taken against the behaviour estimate (``old := behave``, no proximal pass) and
    rejected slots (``is_w == 0``) are left out."""

    def __init__(
        self, slot_loss: SlotLoss, on_policy: bool = False, lse_beta: Optional[float] = None, loss_mode: str = "ppo"
    ):
        self.slot_loss = slot_loss
        self.on_policy = on_policy
        self.lse_beta = lse_beta
        self.loss_mode = loss_mode
        self.reject: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = None  # bypass: keep(cur, mu)

    def __call__(self, mb: MicroBatch, logp: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        s = gather_slots(mb, logp, self.on_policy and self.loss_mode == "ppo", self.lse_beta)
        if self.loss_mode == "bypass" and s.behave is not None:
            s.old = s.behave
            if self.reject is not None:
                s.is_weight = self.reject(s.logp, s.behave).to(s.logp.dtype)
        loss, parts = self.slot_loss(s)
        if self.loss_mode != "ppo" and s.is_weight is not None:
            w = s.is_weight if self.loss_mode == "decoupled" else (s.is_weight > 0).to(loss.dtype)
            loss = w * loss
            parts = dict(parts, is_weight=w)
        # context parallelism: every CP rank holds the whole slots, the trainer sums the ranks' shares
        share = 1.0 / mb.context["size"] if mb.context is not None else 1.0
        total = (s.weight * loss).sum() * share + (logp * 0).sum()  # (an all-padding micro-batch still has a graph)
        report = {"pg_loss": total.detach()}
        for k, v in parts.items():
            report[k] = (s.weight * v.detach()).sum() * share
        return total, report
