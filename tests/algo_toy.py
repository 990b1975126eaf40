"""The exact toy dLLM shared by the estimator and objective tests: a fixed random float64 MLP over 3 tokens, its
log-probs on views and packed micro-batches, exact enumeration of the quantities the estimators aim at
(``Exact``), synthetic decoding traces, and a Monte-Carlo assertion. See test_algos_estimators.py for what
is enumerated and how it is checked."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from megadare.algos.base import RLSample
from megadare.models import get_family

V, MASK, ABSENT = 3, 3, 4  # real tokens 0..2, the mask id, "not visible" (later blocks of a block model)
NMAX = 6  # the toy's context length (prompt + response <= 6)
Z = 4.5  # MC tolerance in standard errors

FULL_C, FULL_Y = [1, 2], [0, 2, 1, 1]  # full-attention toy sample (blocks of 2 aligned with the response)
BLOCK_C, BLOCK_Y = [2], [0, 1, 0, 2]  # block toy: global grid blocks {c,y0} {y1,y2} {y3} (block_size 2)


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny tensors: one intra-op thread (two spin-waiting threads on a busy 2-core machine run ~50x slower)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ------------------------------------------------------------------ the toy model
class Toy(torch.nn.Module):
    """Fixed random MLP: whole context [N, <=nmax] (ids 0..4) -> logits [N, nmax, V]. ``independent``: the
    prediction at each position ignores the context (a fixed table), so the positions are independent."""

    def __init__(self, seed: int, independent: bool = False, scale: float = 2.5, nmax: int = NMAX):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
        d, h = 4, 16
        self.independent, self.nmax = independent, nmax  # nmax: its context length (longer canvases)
        self.emb = torch.nn.Parameter(r(5, d))
        self.pos = torch.nn.Parameter(r(nmax, d))
        self.w1 = torch.nn.Parameter(r(nmax * d, h) * scale / math.sqrt(nmax * d))
        self.b1 = torch.nn.Parameter(r(h))
        self.w2 = torch.nn.Parameter(r(h, nmax * V) * scale / math.sqrt(h))
        self.bias = torch.nn.Parameter(r(nmax, V))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.as_tensor(x)
        if x.shape[-1] < self.nmax:
            x = torch.cat([x, torch.full(x.shape[:-1] + (self.nmax - x.shape[-1],), ABSENT)], -1)
        if self.independent:
            return self.bias.expand(x.shape[0], self.nmax, V)
        hid = torch.tanh((self.emb[x] + self.pos).flatten(1) @ self.w1 + self.b1)
        return (hid @ self.w2).view(x.shape[0], self.nmax, V) + self.bias

    def logp(self, x: torch.Tensor) -> torch.Tensor:
        return F.log_softmax(self.forward(x), -1)


def toy_archs(block_size: int = 2):
    """(full-attention arch, block-diffusion arch) with the toy's mask id (only the arch facts the algos read)."""
    fam = get_family("llada")
    full = replace(fam.arch(fam.tiny_config()), mask_token_id=MASK, vocab_size=V + 1)
    fam = get_family("sdar")
    blk = replace(fam.arch(fam.tiny_config()), mask_token_id=MASK, vocab_size=V + 1, block_size=block_size)
    return full, blk


def toy_dream_arch():
    """The full-attention arch of the Dream family (``logits_shift`` 1: position k-1 predicts token k) with the
    toy's mask id: the toy's output at a position then scores the next token."""
    fam = get_family("dream")
    return replace(fam.arch(fam.tiny_config()), mask_token_id=MASK, vocab_size=V + 1)


def sample(prompt, response, adv=1.0, index=0, **kw) -> RLSample:
    return RLSample(prompt_ids=list(prompt), response_ids=list(response), reward=0.0, advantage=adv, index=index, **kw)


def synthetic_trace(P: int, L: int, block_size: int, seed: int, per_step: int = 1) -> tuple[list[int], list[int]]:
    """A decoding trace (commit_step, block_step): blocks of the global grid left to right, inside a block a
    random order committing ``per_step`` tokens per step (block_size 0: the response is one block)."""
    g = torch.Generator().manual_seed(seed)
    bs = block_size or (P + L)
    blocks: dict[int, list[int]] = {}
    for k in range(L):
        blocks.setdefault((P + k) // bs if block_size else 0, []).append(k)
    commit, bstep, step = [0] * L, [0] * L, 0
    for b in sorted(blocks):
        order = [blocks[b][i] for i in torch.randperm(len(blocks[b]), generator=g).tolist()]
        for j in range(0, len(order), per_step):
            for k in order[j : j + per_step]:
                commit[k], bstep[k] = step, j // per_step
            step += 1
    return commit, bstep


# ------------------------------------------------------------------ toy log-probs of views and micro-batches
def contexts(x0: torch.Tensor, xt: torch.Tensor, block_size: int) -> torch.Tensor:
    """[n, n]: row i = what x_t position i sees. Full attention: x_t. Block diffusion (x_t ++ x_0 layout): the
    clean x_0 of earlier blocks, x_t of its own block, nothing of later blocks."""
    n = x0.shape[0]
    if not block_size:
        return xt.unsqueeze(0).expand(n, n)
    blk = torch.arange(n) // block_size
    qb, kb = blk.unsqueeze(1), blk.unsqueeze(0)
    return torch.where(kb < qb, x0.unsqueeze(0), torch.where(kb == qb, xt.unsqueeze(0), torch.full((n, n), ABSENT)))


def view_logps(toy: Toy, x0: torch.Tensor, tokens: list[torch.Tensor], block_size: int = 0) -> torch.Tensor:
    """[n_views, n]: log p(x0_i | view) at every position of every view (one batched toy forward)."""
    n, nv = x0.shape[0], len(tokens)
    ctx = torch.stack([contexts(x0, t, block_size) for t in tokens]).reshape(-1, n)
    lp = toy.logp(ctx).reshape(nv, n, toy.nmax, V)
    idx = torch.arange(n)
    lp = lp[:, idx, idx]  # position i read in its own context
    return lp.gather(-1, x0.expand(nv, n).unsqueeze(-1)).squeeze(-1)


def draws(fn, n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [fn(g) for _ in range(n)]


def mc_arrays(toy: Toy, x0: torch.Tensor, ds, block_size: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(coef, logp) [N, n_views, n] of N draws of equally many views."""
    nv = len(ds[0])
    with torch.no_grad():
        lp = view_logps(toy, x0, [v.tokens for d in ds for v in d], block_size).view(len(ds), nv, -1)
    coef = torch.stack([v.coef for d in ds for v in d]).double().view(len(ds), nv, -1)
    return coef, lp


def direct_slots(toy: Toy, x0: torch.Tensor, views, block_size: int = 0, beta: float | None = None):
    """{slot: l_s} = sum over views/positions of coef * log p (and {slot: (1/beta) log sum coef p^beta})."""
    lp = view_logps(toy, x0, [v.tokens for v in views], block_size)
    lin: dict[int, torch.Tensor] = {}
    pw: dict[int, torch.Tensor] = {}
    for vi, v in enumerate(views):
        for i in (v.slot >= 0).nonzero().flatten().tolist():
            s, c = int(v.slot[i]), v.coef[i].double()
            lin[s] = lin.get(s, 0.0) + c * lp[vi, i]
            if beta is not None:
                pw[s] = pw.get(s, 0.0) + c * torch.exp(beta * lp[vi, i])
    return lin, {s: torch.log(p) / beta for s, p in pw.items()}


def mb_logps(toy: Toy, mb, block_size: int = 0) -> torch.Tensor:
    """The toy's per-position label log-probs of a packed micro-batch [b, S] (differentiable): every segment is
    one view of one sample; block rows (stream ids) are read with the block-diffusion visibility."""
    B, S = mb.tokens.shape
    rows = mb.row_ids
    ctxs, where, pos_of, lab = [], [], [], []
    for b in range(B):
        i = 0
        while i < S:
            if int(rows[b, i]) < 0:
                i += 1
                continue
            j = i
            same = (rows[b] == rows[b, i]) & (mb.segment_ids[b] == mb.segment_ids[b, i])
            while j < S and bool(same[j]):
                j += 1
            pos, tok = mb.position_ids[b, i:j], mb.tokens[b, i:j]
            stream = mb.stream_ids[b, i:j] if mb.stream_ids is not None else torch.zeros(j - i, dtype=torch.long)
            n = int(pos.max()) + 1
            xt = torch.full((n,), ABSENT, dtype=torch.long)
            x0 = torch.full((n,), ABSENT, dtype=torch.long)
            xt[pos[stream == 0]] = tok[stream == 0]
            x0[pos[stream == 1]] = tok[stream == 1]
            ctx = contexts(x0, xt, block_size if mb.stream_ids is not None else 0)
            for q in range(i, j):
                if int(stream[q - i]) == 1:
                    continue  # the clean stream is context only (never scored)
                p = int(mb.position_ids[b, q])
                ctxs.append(F.pad(ctx[p], (0, toy.nmax - n), value=ABSENT))
                where.append((b, q))
                pos_of.append(p)
                lab.append(int(mb.labels[b, q]))
            i = j
    logits = toy.forward(torch.stack(ctxs))
    if "logit_scale" in mb.extras:  # rows scored under a tempered sampler (JustGRPO), as trainer/logprob.py does
        bi, qi = zip(*where)
        logits = logits * mb.extras["logit_scale"][torch.tensor(bi), torch.tensor(qi)].double().view(-1, 1, 1)
    lp = F.log_softmax(logits, -1)
    vals = lp[torch.arange(len(ctxs)), torch.tensor(pos_of), torch.tensor(lab)]
    out = torch.zeros(B, S, dtype=vals.dtype)
    bi, qi = zip(*where)
    return out.index_put((torch.tensor(bi), torch.tensor(qi)), vals)


# ------------------------------------------------------------------ exact quantities by enumeration
class Exact:
    """Enumerated quantities of one (prompt, response) under a toy. Block structure: ``block_size`` with blocks
    on the global grid (``glob``) or counted from the response start; ``future`` 'mask' (full attention: later
    blocks are masks in the input) or 'absent' (block-causal: later blocks not visible)."""

    def __init__(self, toy: Toy, prompt, response):
        self.toy, self.c, self.y = toy, list(prompt), list(response)
        self.P, self.L = len(prompt), len(response)
        self._cache: dict[tuple, torch.Tensor] = {}

    def lp(self, ctx, k: int) -> float:
        key = tuple(ctx)
        if key not in self._cache:
            with torch.no_grad():
                self._cache[key] = self.toy.logp(torch.tensor([key]))[0]
        return float(self._cache[key][self.P + k, self.y[k]])

    def block_of(self, k, bs, glob):
        return (k + (self.P if glob else 0)) // bs if bs else 0

    def ctx(self, masked, bs=0, b=0, future="mask", glob=True):
        out = []
        for k, t in enumerate(self.y):
            if bs and self.block_of(k, bs, glob) > b:
                out.append(MASK if future == "mask" else ABSENT)
            else:
                out.append(MASK if k in masked else t)
        return self.c + out

    def blocks(self, bs, glob=True):
        out: dict[int, list[int]] = {}
        for k in range(self.L):
            out.setdefault(self.block_of(k, bs, glob), []).append(k)
        return out

    def g(self, toks, m, bs=0, b=0, future="mask", glob=True) -> float:
        """E_{S subset of toks, |S| = m} sum_{k in S} log p(y_k | x_S)  (other tokens of the block clean)."""
        subs = list(itertools.combinations(toks, m))
        return sum(sum(self.lp(self.ctx(set(S), bs, b, future, glob), k) for k in S) for S in subs) / len(subs)

    def _elbo(self, toks, bs, b, future, glob):
        return sum(self.g(toks, m, bs, b, future, glob) / m for m in range(1, len(toks) + 1))

    def _loglik(self, toks, bs, b, future, glob):
        vals = []
        for order in itertools.permutations(toks):
            vals.append(sum(self.lp(self.ctx(set(order[i:]), bs, b, future, glob), k) for i, k in enumerate(order)))
        return float(torch.logsumexp(torch.tensor(vals, dtype=torch.float64), 0)) - math.log(len(vals))

    def elbo(self):
        return self._elbo(list(range(self.L)), 0, 0, "mask", True)

    def loglik(self):
        return self._loglik(list(range(self.L)), 0, 0, "mask", True)

    def block_elbo(self, bs, future, glob=True):
        return sum(self._elbo(t, bs, b, future, glob) for b, t in self.blocks(bs, glob).items())

    def block_loglik(self, bs, future, glob=True):
        return sum(self._loglik(t, bs, b, future, glob) for b, t in self.blocks(bs, glob).items())

    def one_step(self) -> float:
        ctx = self.ctx(set(range(self.L)))
        return sum(self.lp(ctx, k) for k in range(self.L))

    def subsets(self):
        """{frozenset S: [log p(y_k | x_S) for k in S]} over all non-empty S (full attention)."""
        out = {}
        for m in range(1, self.L + 1):
            for S in itertools.combinations(range(self.L), m):
                out[frozenset(S)] = {k: self.lp(self.ctx(set(S)), k) for k in S}
        return out

    def eubo_inner(self, bs, future, beta, glob=True) -> dict[int, float]:
        """{k: E_{b, m, S}[1[k in S] (n_blocks |b| / m) p(y_k | x_S)^beta]} for block-wise masking (a block b
        uniformly, m ~ U{1..|b|}, S a uniform m-subset of b): the expectation inside SPG's per-token EUBO."""
        blocks = self.blocks(bs, glob)
        out = {}
        for b, toks in blocks.items():
            for k in toks:
                acc = 0.0
                for m in range(1, len(toks) + 1):
                    subs = list(itertools.combinations(toks, m))
                    hit = sum(
                        math.exp(beta * self.lp(self.ctx(set(S), bs, b, future, glob), k)) for S in subs if k in S
                    )
                    acc += (1 / len(blocks)) * (1 / len(toks)) * (len(blocks) * len(toks) / m) * hit / len(subs)
                out[k] = acc
        return out

    def eubo_limit(self, bs, future, beta, glob=True):
        """SPG's per-token EUBO at n_mc -> infinity: sum_k (1/beta) log eubo_inner_k."""
        return sum(math.log(v) / beta for v in self.eubo_inner(bs, future, beta, glob).values())


class JointToy(torch.nn.Module):
    """A toy whose conditionals are consistent: a fixed random joint J(y) over the 3^L responses (any prompt),
    and every position predicts p(y_k = v | the visible response tokens other than k) = the marginal of J.
    Its generative likelihood is then log J(y) for every unmasking order (the setting of SPG's EUBO)."""

    nmax = NMAX

    def __init__(self, seed: int, prompt_len: int, resp_len: int = 4, scale: float = 2.0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.P, self.L = prompt_len, resp_len
        self.table = torch.tensor(list(itertools.product(range(V), repeat=resp_len)))  # [V^L, L]
        self.log_joint = F.log_softmax(torch.randn(V**resp_len, generator=g, dtype=torch.float64) * scale, 0)

    def joint_logp(self, y) -> float:
        return float(self.log_joint[(self.table == torch.tensor(y)).all(-1)][0])

    def logp(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.as_tensor(x)
        r = x[:, self.P : self.P + self.L]
        vis = r < V
        agree = (self.table.unsqueeze(0) == r.unsqueeze(1)) | ~vis.unsqueeze(1)  # [N, V^L, L]
        out = torch.full((x.shape[0], NMAX, V), -math.log(V), dtype=torch.float64)
        joint = self.log_joint.exp()
        for k in range(self.L):
            ok = torch.cat([agree[..., :k], agree[..., k + 1 :]], -1).all(-1)  # ignore position k
            w = (ok * joint) @ F.one_hot(self.table[:, k], V).double()  # [N, V]
            out[:, self.P + k] = torch.log(w / w.sum(-1, keepdim=True))
        return out


def uniform_mean(f, lo: float, hi: float, n: int = 40) -> float:
    """E_{t ~ U(lo, hi)} f(t) by Gauss-Legendre (exact for the polynomials below)."""
    x, w = np.polynomial.legendre.leggauss(n)
    t = 0.5 * (hi - lo) * x + 0.5 * (hi + lo)
    return float(sum(wi * f(float(ti)) for wi, ti in zip(w, t)) / 2.0)


def assert_mc(values: torch.Tensor, target: float, what: str) -> tuple[float, float]:
    mean, se = float(values.mean()), float(values.std()) / math.sqrt(values.numel())
    assert abs(mean - target) < Z * se, f"{what}: MC mean {mean:.4f} +- {se:.4f}, expected {target:.4f}"
    return mean, se
