"""The built-in rollout engine: the family's hf/ model, batched dLLM decoding with a KV cache, full traces.

Block diffusion (SDAR, TraDo, LLaDA2; SDAR's ``generate.py``): the prompt's first floor(P/B)*B tokens are
prefilled block-causally into the KV cache; its remainder sits, unmasked, at the start of the first decode
block. Each block of B tokens starts fully masked (apart from that remainder) and is denoised in at most S
forwards that see the cached earlier blocks and the whole current block; a finished block is run once more to
store its keys/values (exact: under the block-causal mask earlier blocks never see later tokens). Because every
sample's blocks sit on its own global prompt+response grid, aligning the batch at each sample's first decode
block puts all samples' blocks in the same tensor columns: one forward serves the whole batch, and the
per-sample result does not depend on who else is in the batch.

Full attention (LLaDA, Dream; LLaDA's ``generate``): prompt ++ masks, semi-autoregressive blocks over the
response, S steps per block, every step a full bidirectional forward (Dream reads logits shifted by one).
Positions beyond the current block are never committed. ``full_attention_cache`` (Fast-dLLM, arXiv:2505.22618):
'prefix' keeps the keys/values of everything before the current block from the forward at the block's start,
'dual' also those after it, and later steps of the block recompute only the block (an approximation: in a
bidirectional model those keys would change as the block fills in); 'none' (default) is exact.

Each denoising step of a block is ``dllm_step.dllm_step`` (shared with the SGLang plugin) and its records go through
a ``dllm_step.BlockTrace``. Each prompt samples from its own generator, seeded from (seed, prompt index)
(``engine.prompt_seed``), so its trajectory does not depend on the rest of the batch. Every committed token records
its global step (the sample's denoising forward index), its block-local step and its log-prob under the sampling
distribution; ``use_cache=False`` recomputes the whole sequence each step (the reference the cache is tested
against). Token editing (LLaDA2.1, ``algorithm='editing'``) runs a block until ``editing.Refinement`` closes it and
records the commits its edits overwrote (``Trajectory.superseded``).
"""
from __future__ import annotations

import math
from typing import Any, Iterable, Optional

import torch

from megadare.models.attention import bidirectional
from megadare.models.family import ModelArch
from megadare.models.hf.common import KVCache
from megadare.rollout.dllm_step import BlockTrace, dllm_step
from megadare.rollout.editing import Refinement
from megadare.rollout.engine import SamplingParams, Superseded, Trajectory, prompt_seed


class _Recorder:
    """Per-sample trace of committed tokens over the whole generation: step counters advance only when the sample
    had work. Each decoded block's :class:`BlockTrace` is absorbed into it once the block is done."""

    def __init__(self, n: int, record_steps: bool):
        self.steps = [0] * n
        self.commit: list[dict[int, tuple[int, int, float]]] = [dict() for _ in range(n)]
        self.superseded: list[dict[int, list[tuple[int, int, float, int]]]] = [dict() for _ in range(n)]
        self.preds: Optional[list[list[list[int]]]] = [[] for _ in range(n)] if record_steps else None
        self.confs: Optional[list[list[list[float]]]] = [[] for _ in range(n)] if record_steps else None
        self.pred_cols: list[list[int]] = [[] for _ in range(n)]   # first decoded column of each recorded step

    def absorb(self, trace: BlockTrace, col_offset: int) -> None:
        """Add one block's records; its positions start at column ``col_offset`` of the decoded grid."""
        for b in range(len(self.steps)):
            for c, (f, block_step, lp) in trace.records[b].items():
                self.commit[b][c + col_offset] = (self.steps[b] + f, block_step, lp)
            for c, chain in trace.superseded[b].items():
                self.superseded[b][c + col_offset] = [(self.steps[b] + f, s, lp, tok) for f, s, lp, tok in chain]
            if self.preds is not None and self.confs is not None and trace.preds is not None \
                    and trace.confs is not None:
                self.preds[b].extend(trace.preds[b])
                self.confs[b].extend(trace.confs[b])
                self.pred_cols[b].extend([col_offset] * len(trace.preds[b]))
            self.steps[b] += trace.num_steps[b]


class NativeEngine:
    """Decodes with the hf/ model of a family (CPU or one GPU). Implements the rollout engine protocol."""

    def __init__(self, model: torch.nn.Module, arch: ModelArch, eos_token_id: int, pad_token_id: int = 0,
                 device: Optional[str] = None, use_cache: bool = True, full_attention_cache: str = "none"):
        if full_attention_cache not in ("none", "prefix", "dual"):
            raise ValueError(f"full_attention_cache={full_attention_cache!r}: choose none, prefix or dual")
        self.full_attention_cache = full_attention_cache
        self.model = model.eval()
        self.arch = arch
        self.eos = eos_token_id
        self.pad = pad_token_id
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model.to(self.device)
        self.use_cache = use_cache
        self.version = 0
        self.forwards = 0          # model forwards, all calls (benchmarks: forwards per token)
        self.asleep = False

    # ------------------------------------------------------------------ protocol
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Trajectory]:
        if self.asleep:
            raise RuntimeError("engine is asleep: call wake() before generate()")
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("generate needs non-empty prompts")
        if self.arch.attention == "block_causal":
            if params.block_size != self.arch.block_size:
                raise ValueError(f"sampling block_size={params.block_size} differs from the model's block size "
                                 f"{self.arch.block_size} ({self.arch.family}); they must agree")
            return self._block_diffusion(prompts, params)
        return self._semi_ar(prompts, params)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> dict[str, Any]:
        """Copy HF-named tensors into the model (any subset, e.g. one bucket); names must exist."""
        params = dict(self.model.named_parameters())
        params.update(dict(self.model.named_buffers()))
        n, nbytes = 0, 0
        with torch.no_grad():
            for name, t in named_tensors:
                if name not in params:
                    raise KeyError(f"update_weights: the {self.arch.family} model has no tensor {name!r}")
                if params[name].shape != t.shape:
                    raise ValueError(f"update_weights: {name} has shape {tuple(t.shape)}, model expects "
                                     f"{tuple(params[name].shape)}")
                params[name].copy_(t.to(params[name].device, params[name].dtype))
                n += 1
                nbytes += t.numel() * t.element_size()
        self.version = version
        return {"tensors": n, "bytes": nbytes, "version": version}

    def sleep(self) -> None:
        """Release accelerator memory (weights to host) while the trainer uses the GPU."""
        self.model.to("cpu")
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.asleep = True

    def wake(self) -> None:
        self.model.to(self.device)
        self.asleep = False

    @torch.no_grad()
    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Full logits of the engine's model for [B, S] ids under the family's inference mask (block-causal or
        bidirectional, Dream unshifted): what weight-sync checks compare with the trainer."""
        from megadare.models.attention import family_mask

        S = input_ids.shape[1]
        return self.model(input_ids.to(self.device), attention_mask=family_mask(self.arch).dense(S, S, device=self.device)).float().cpu()

    def health(self) -> dict[str, Any]:
        return {"alive": True, "version": self.version, "device": str(self.device), "asleep": self.asleep,
                "forwards": self.forwards}

    # ------------------------------------------------------------------ helpers
    def _forward(self, ids, allowed, pos, cache=None, commit=False) -> torch.Tensor:
        self.forwards += 1
        return self.model(ids, attention_mask=allowed, position_ids=pos, kv_cache=cache, commit=commit)

    @staticmethod
    def _generators(params: SamplingParams, n: int) -> list[torch.Generator]:
        """One CPU generator per prompt, seeded from (seed, prompt index) (``engine.prompt_seed``)."""
        return [torch.Generator().manual_seed(prompt_seed(params.seed, i)) for i in range(n)]

    # ------------------------------------------------------------------ block diffusion
    @torch.no_grad()
    def _block_diffusion(self, prompts: list[list[int]], params: SamplingParams) -> list[Trajectory]:
        dev, Bs, M = self.device, params.block_size, self.arch.mask_token_id
        n = len(prompts)
        pre = [len(p) // Bs * Bs for p in prompts]
        rem = [len(p) - q for p, q in zip(prompts, pre)]
        need = [math.ceil((r + params.max_new_tokens) / Bs) for r in rem]
        Q = max(pre)
        # prefix: complete prompt blocks, left-padded to Q columns
        prefix = torch.full((n, Q), self.pad, dtype=torch.long)
        prefix_pos = torch.zeros((n, Q), dtype=torch.long)
        valid = torch.zeros((n, Q), dtype=torch.bool)
        for b, p in enumerate(prompts):
            if pre[b]:
                prefix[b, Q - pre[b]:] = torch.tensor(p[:pre[b]])
                prefix_pos[b, Q - pre[b]:] = torch.arange(pre[b])
                valid[b, Q - pre[b]:] = True
        gens = self._generators(params, n)
        rec = _Recorder(n, params.record_steps)
        done = [False] * n
        blocks: list[torch.Tensor] = []        # decoded blocks [n, Bs]
        cache = KVCache(self.arch.num_layers) if self.use_cache else None
        if self.use_cache and Q:
            # padded rows see themselves (never NaN keys/values in the cache); real rows never see padding
            allowed = self._bc_mask(prefix_pos, valid, prefix_pos, Bs) | torch.eye(Q, dtype=torch.bool)[None, None]
            self._forward(prefix.to(dev), allowed.to(dev), prefix_pos.to(dev), cache, commit=True)
        for k in range(max(need)):
            active = [not done[b] and k < need[b] for b in range(n)]
            if not any(active):
                break
            cur = torch.full((n, Bs), M, dtype=torch.long)
            if k == 0:
                for b, p in enumerate(prompts):
                    cur[b, :rem[b]] = torch.tensor(p[pre[b]:], dtype=torch.long)
            pos = torch.tensor(pre).unsqueeze(1) + k * Bs + torch.arange(Bs)
            trace = BlockTrace(n, params.record_steps)
            refine = Refinement(cur == M, params) if params.algorithm == "editing" else None
            for s in range(params.block_forwards()):
                masked = (cur == M) & torch.tensor(active).unsqueeze(1)
                editable = refine.editable(cur, M) if refine is not None else None
                if not masked.any() and (editable is None or not editable.any()):
                    break
                logits = self._block_logits(cur, pos, prefix, prefix_pos, valid, blocks, cache, Bs)
                step = dllm_step(logits, cur, masked, s, params, gens, mask_token_id=M, editable=editable)
                if refine is not None:
                    refine.after(masked, step)
                trace.add(step, s)
                cur = step.tokens
            rec.absorb(trace, k * Bs)
            blocks.append(cur)
            if self.use_cache:
                all_valid = torch.cat([valid] + [torch.ones(n, Bs, dtype=torch.bool)] * (len(blocks) - 1), dim=1)
                allowed = torch.cat([all_valid, torch.ones(n, Bs, dtype=torch.bool)], dim=1)[:, None, None, :]
                self._forward(cur.to(dev), allowed.expand(n, 1, Bs, -1).to(dev), pos.to(dev), cache, commit=True)
            for b in range(n):
                if active[b] and params.stop_at_eos:
                    resp = torch.cat(blocks, dim=1)[b, rem[b]:]
                    if (resp == self.eos).any():
                        done[b] = True
        decoded = torch.cat(blocks, dim=1)
        return [self._trajectory(prompts[b], decoded[b, rem[b]:], rec, b, params, rem[b]) for b in range(n)]

    @staticmethod
    def _bc_mask(q_pos, k_valid, k_pos, Bs) -> torch.Tensor:
        """Block-causal allowed mask [n, 1, Q, K] from positions on each sample's own grid + key validity."""
        allowed = (k_pos[:, None, :] // Bs) <= (q_pos[:, :, None] // Bs)
        return (allowed & k_valid[:, None, :]).unsqueeze(1)

    def _block_logits(self, cur, pos, prefix, prefix_pos, valid, blocks, cache, Bs) -> torch.Tensor:
        n, dev = cur.shape[0], self.device
        if cache is not None:
            k_valid = torch.cat([valid] + [torch.ones(n, Bs, dtype=torch.bool)] * (len(blocks) + 1), dim=1)
            allowed = k_valid[:, None, None, :].expand(n, 1, Bs, k_valid.shape[1])
            return self._forward(cur.to(dev), allowed.to(dev), pos.to(dev), cache).float().cpu()
        ids = torch.cat([prefix] + blocks + [cur], dim=1)
        all_pos = torch.cat([prefix_pos] + [pos - Bs * (len(blocks) - j) for j in range(len(blocks))] + [pos], dim=1)
        k_valid = torch.cat([valid] + [torch.ones(n, Bs, dtype=torch.bool)] * (len(blocks) + 1), dim=1)
        allowed = self._bc_mask(all_pos, k_valid, all_pos, Bs)
        # padded query rows attend nothing: let them see themselves (their outputs are discarded)
        allowed = allowed | torch.eye(ids.shape[1], dtype=torch.bool)[None, None]
        return self._forward(ids.to(dev), allowed.to(dev), all_pos.to(dev))[:, -Bs:].float().cpu()

    # ------------------------------------------------------------------ full attention (LLaDA / Dream)
    @torch.no_grad()
    def _semi_ar(self, prompts: list[list[int]], params: SamplingParams) -> list[Trajectory]:
        Bs, M = params.block_size, self.arch.mask_token_id
        n = len(prompts)
        n_blocks = math.ceil(params.max_new_tokens / Bs)
        G = n_blocks * Bs
        P = max(len(p) for p in prompts)
        x = torch.full((n, P + G), M, dtype=torch.long)
        valid = torch.ones((n, P + G), dtype=torch.bool)
        pos = torch.zeros((n, P + G), dtype=torch.long)
        for b, p in enumerate(prompts):
            pad = P - len(p)
            x[b, :pad] = self.pad
            x[b, pad:P] = torch.tensor(p)
            valid[b, :pad] = False
            pos[b, pad:] = torch.arange(len(p) + G)
        allowed = bidirectional().dense(P + G, P + G) & valid[:, None, None, :]
        allowed = allowed | torch.eye(P + G, dtype=torch.bool)[None, None]
        gens = self._generators(params, n)
        rec = _Recorder(n, params.record_steps)
        done = [False] * n
        for k in range(n_blocks):
            active = torch.tensor([not d for d in done]).unsqueeze(1)
            if not active.any():
                break
            lo, hi = P + k * Bs, P + (k + 1) * Bs
            cache = None
            trace = BlockTrace(n, params.record_steps)
            refine = Refinement((x[:, lo:hi] == M) & active, params) if params.algorithm == "editing" else None
            for s in range(params.block_forwards()):
                masked = (x[:, lo:hi] == M) & active
                editable = refine.editable(x[:, lo:hi], M) if refine is not None else None
                if not masked.any() and (editable is None or not editable.any()):
                    break
                logits, cache = self._block_logits_full(x, allowed, pos, lo, hi, cache)
                step = dllm_step(logits, x[:, lo:hi], masked, s, params, gens, mask_token_id=M, editable=editable)
                if refine is not None:
                    refine.after(masked, step)
                trace.add(step, s)
                x[:, lo:hi] = step.tokens
            rec.absorb(trace, k * Bs)
            if params.stop_at_eos:
                for b in range(n):
                    if not done[b] and (x[b, P:hi] == self.eos).any():
                        done[b] = True
        return [self._trajectory(prompts[b], x[b, P:], rec, b, params, 0) for b in range(n)]

    def _block_logits_full(self, x, allowed, pos, lo: int, hi: int, cache: Optional[KVCache]
                           ) -> tuple[torch.Tensor, Optional[KVCache]]:
        """Logits predicting the tokens of block [lo, hi) (Dream: read one position to the left), and the block's
        prefix/dual cache: built by the block's first forward (full sequence), used by its later steps.

        Later steps recompute positions [qs, re): the block (from the query that predicts its first token) and,
        for 'prefix', everything after it; the keys of all other positions come from the cache."""
        dev, end = self.device, x.shape[1]
        qs, qe = lo - self.arch.logits_shift, hi - self.arch.logits_shift
        re = end if self.full_attention_cache == "prefix" else hi
        if self.full_attention_cache == "none" or cache is None:
            fresh = KVCache(self.arch.num_layers) if self.full_attention_cache != "none" else None
            out = self._forward(x.to(dev), allowed.to(dev), pos.to(dev), fresh, commit=fresh is not None)
            if fresh is not None:
                cache = fresh.select(torch.cat([torch.arange(qs), torch.arange(re, end)]).to(dev))
            return out[:, qs:qe].float().cpu(), cache
        cols = torch.cat([cache.columns, torch.arange(qs, re)])
        sub = allowed[:, :, qs:re][..., cols]
        out = self._forward(x[:, qs:re].to(dev), sub.to(dev), pos[:, qs:re].to(dev), cache)
        return out[:, : qe - qs].float().cpu(), cache

    # ------------------------------------------------------------------ result
    def _trajectory(self, prompt: list[int], decoded: torch.Tensor, rec: _Recorder, b: int,
                    params: SamplingParams, col_offset: int) -> Trajectory:
        """Response = decoded tokens up to the first EOS (inclusive) or max_new_tokens; without ``stop_at_eos``
        the whole canvas of max_new_tokens (finish 'eos' when it holds an EOS: the answer ended)."""
        toks = decoded.tolist()
        end = min(len(toks), params.max_new_tokens)
        finish = "eos" if self.eos in toks[:end] else "length"
        if params.stop_at_eos and finish == "eos":
            end = toks.index(self.eos) + 1
        commits = [rec.commit[b][c + col_offset] for c in range(end)]
        superseded = [Superseded(c, tok, g, s, lp) for c in range(end)
                      for g, s, lp, tok in rec.superseded[b].get(c + col_offset, [])]
        traj = Trajectory(
            prompt_ids=list(prompt), response_ids=toks[:end], commit_step=[c[0] for c in commits],
            block_step=[c[1] for c in commits], logprobs=[c[2] for c in commits], finish_reason=finish,
            num_forwards=rec.steps[b], params=params, policy_version=self.version,
            superseded=superseded if params.algorithm == "editing" else None)
        if rec.preds is not None and rec.confs is not None:
            traj.step_predictions, traj.step_confidences = _response_aligned(rec, b, col_offset, end)
        return traj.validate()


def _response_aligned(rec: _Recorder, b: int, col_offset: int, end: int) -> tuple[list[list[int]], list[list[float]]]:
    """Row ``b``'s per-step block proposals placed on its response positions [0, end): -1 (confidence 0) where
    the step predicted nothing (positions of other blocks; the prompt's remainder in the first block)."""
    preds, confs = [], []
    for block_preds, block_confs, first in zip(rec.preds[b], rec.confs[b], rec.pred_cols[b]):
        p, c = [-1] * end, [0.0] * end
        for i, (tok, conf) in enumerate(zip(block_preds, block_confs)):
            j = first + i - col_offset
            if 0 <= j < end:
                p[j], c[j] = int(tok), float(conf)
        preds.append(p)
        confs.append(c)
    return preds, confs
