"""The built-in rollout engine: the family's hf/ model, batched dLLM decoding with a static KV cache, full traces.

Block diffusion (SDAR, TraDo, LLaDA2; SDAR's ``generate.py``): the prompt's first floor(P/B)*B tokens are
prefilled block-causally into the KV cache; its remainder sits, unmasked, at the start of the first decode
block. Each block of B tokens starts fully masked (apart from that remainder) and is denoised in at most S
forwards that see the cached earlier blocks and the whole current block; a finished block's final tokens are run
once more to store their keys/values (exact: under the block-causal mask earlier blocks never see later tokens),
as extra queries of the next block's first forward (no forward of its own). Every sample
sits on its own grid (position = cache column), so one forward serves the whole batch and the per-sample result
does not depend on who else is in the batch.

Full attention (LLaDA, Dream; LLaDA's ``generate``): prompt ++ masks, semi-autoregressive blocks over the
response, S steps per block, every step a full bidirectional forward whose head runs on the block alone (Dream
reads logits shifted by one). Positions beyond the current block are never committed. ``full_attention_cache``
(Fast-dLLM, arXiv:2505.22618): 'prefix' keeps the keys/values of everything before the current block from the
forward at the block's start, 'dual' also those after it, and later steps of the block recompute only the block
(an approximation: in a bidirectional model those keys would change as the block fills in); 'none' (default) is
exact.

How it runs (issue 27):

* The KV cache is static (:class:`~megadare.models.hf.common.KVCache`: max batch x max length per layer,
  allocated once per engine and reused while it fits) and written in place; the model runs in the engine's dtype
  (bf16 on CUDA, float32 on CPU) and looks up no module by name.
* Each denoising step of a block is ``dllm_step.dllm_step`` (shared with the SGLang plugin) over the whole batch on
  the model's device; each prompt samples from its own counter-based stream keyed (seed, prompt index)
  (``engine.prompt_seed``), so its trajectory depends on neither the batch nor the engine. The trace (global
  step, block-local step, log-prob of every commit) is kept on the device; the host reads one row of flags per
  block (who finished) and a finished row's trace once. A block's forwards run without a host read when the
  schedule is static (the number of steps follows from the masked counts); the dynamic threshold and token
  editing read one flag per step to stop early.
* Continuous batching at block boundaries: at most ``max_batch`` rows decode together (0: all prompts of a call);
  a row that finishes leaves at the end of its block, a queued prompt takes its place, and the batch is compacted
  so the forward never carries finished rows.
* ``compile=True`` runs the model forward through ``torch.compile`` (CUDA graphs on CUDA via ``reduce-overhead``);
  the key length is padded to a multiple of 64 columns so few shapes occur. Off by default: not measured faster
  on CPU (benchmarks/rollout_throughput.py).

Every committed token records its global step (the sample's denoising forward index), its block-local step and
its log-prob under the sampling distribution; ``use_cache=False`` recomputes the whole sequence each step (the
reference the cache is tested against). Token editing (LLaDA2.1, ``algorithm='editing'``) runs a block until
``editing.Refinement`` closes it and records the commits its edits overwrote (``Trajectory.superseded``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
import functools
import math
from collections import deque
from dataclasses import dataclass
from typing import Any, Iterable, Optional

import torch

from megadare.models.attention import family_mask
from megadare.models.family import ModelArch
from megadare.models.hf.common import DecoderLM, KVCache
from megadare.rollout.dllm_step import BlockState, BlockTrace, Streams, commit_counts, dllm_step, propose
from megadare.rollout.editing import Refinement
from megadare.rollout.engine import SamplingParams, Superseded, Trajectory, prompt_seed
from megadare.rollout.sampling import mix64

_KEY_BUCKET = 64  # compiled forwards: key lengths padded to a multiple of this (fewer shapes)


@dataclass(frozen=True)
class NativeSettings:
    """How the built-in engine decodes (rollout.max_batch / rollout.compile; the rest are for tests and
    benchmarks): ``use_cache`` (False: recompute the whole sequence each step, the reference the cache is tested
    against), ``full_attention_cache`` (none | prefix | dual, Fast-dLLM's approximate caches for full-attention
    families), ``max_batch`` (rows decoded together; 0: every prompt of a call), ``compile`` (``torch.compile``
    the forward) and ``pad_token_id``."""

    use_cache: bool = True
    full_attention_cache: str = "none"
    max_batch: int = 0
    compile: bool = False
    pad_token_id: int = 0

    def __post_init__(self) -> None:
        if self.full_attention_cache not in ("none", "prefix", "dual"):
            raise ValueError(f"full_attention_cache={self.full_attention_cache!r}: choose none, prefix or dual")
        if self.max_batch < 0:
            raise ValueError(f"max_batch={self.max_batch}: rows decoded together, >= 1 (0: every prompt of a call)")


class NativeEngine:
    """Decodes with the hf/ model of a family (CPU or one GPU). Implements the rollout engine protocol.
    ``device`` None: CUDA when available; ``dtype`` None: bfloat16 on CUDA, float32 on CPU."""

    def __init__(
        self,
        model: torch.nn.Module,
        arch: ModelArch,
        eos_token_id: int,
        device: Optional[str] = None,
        dtype: Optional[torch.dtype] = None,
        settings: NativeSettings = NativeSettings(),
    ):
        self.settings = settings
        self.full_attention_cache = settings.full_attention_cache
        self.arch = arch
        self.eos = eos_token_id
        self.pad = settings.pad_token_id
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        self.model = model.eval().to(self.device, self.dtype)
        self.grouped_experts = self._stack_experts()
        self.use_cache = settings.use_cache
        self.max_batch = settings.max_batch
        self.compile = settings.compile
        self.graphs = cuda_graphs(arch, settings, self.device)
        self._fn, self.step = self._compiled() if settings.compile else (self.model, dllm_step)
        self._cache: Optional[KVCache] = None
        self.version = 0
        self.forwards = 0  # model forwards, all calls (benchmarks: forwards per token)
        self.asleep = False

    # ------------------------------------------------------------------ protocol
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Trajectory]:
        if self.asleep:
            raise RuntimeError("engine is asleep: call wake() before generate()")
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("generate needs non-empty prompts")
        if self.arch.is_block_diffusion:
            if params.block_size != self.arch.block_size:
                raise ValueError(
                    f"sampling block_size={params.block_size} differs from the model's block size "
                    f"{self.arch.block_size} ({self.arch.family}); they must agree"
                )
            decoder: _Decoder = _BlockDiffusion(self, prompts, params)
        else:
            decoder = _SemiAR(self, prompts, params)
        with torch.no_grad():
            return decoder.run()

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
                    raise ValueError(
                        f"update_weights: {name} has shape {tuple(t.shape)}, model expects {tuple(params[name].shape)}"
                    )
                params[name].copy_(t.to(params[name].device, params[name].dtype))
                n += 1
                nbytes += t.numel() * t.element_size()
        self.version = version
        return {"tensors": n, "bytes": nbytes, "version": version}

    def sleep(self) -> None:
        """Release accelerator memory (weights and KV cache to host / freed) while the trainer uses the GPU."""
        self._unstack_experts()  # a move copies parameters one by one: the stacks would keep the device copies
        self.model.to("cpu")
        self._cache = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.asleep = True

    def wake(self) -> None:
        self.model.to(self.device)
        self._stack_experts()
        self.asleep = False

    @torch.no_grad()
    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Full logits of the engine's model for [B, S] ids under the family's inference mask (block-causal or
        bidirectional, Dream unshifted): what weight-sync checks compare with the trainer."""
        S = input_ids.shape[1]
        mask = family_mask(self.arch).dense(S, S, device=self.device)
        return self.model(input_ids.to(self.device), attention_mask=mask).float().cpu()

    def health(self) -> dict[str, Any]:
        return {
            "alive": True,
            "version": self.version,
            "device": str(self.device),
            "asleep": self.asleep,
            "forwards": self.forwards,
            "dtype": str(self.dtype).replace("torch.", ""),
        }

    # ------------------------------------------------------------------ helpers
    def forward(
        self,
        ids,
        allowed,
        pos,
        cache: Optional[KVCache] = None,
        logits_index: Optional[torch.Tensor] = None,
        eager: bool = False,
    ) -> Optional[torch.Tensor]:
        """One model forward (compiled when ``compile`` is on, unless ``eager``: prefills, whose shapes vary).
        Under CUDA graphs the rows are padded to :meth:`graph_rows` (padding rows attend everything, write only
        the cache's scratch column: :meth:`bind`) and the logits of the real rows returned."""
        self.forwards += 1
        if eager or not self.graphs:
            fn = self.model if eager else self._fn
            return fn(ids, attention_mask=allowed, position_ids=pos, kv_cache=cache, logits_index=logits_index)
        n = ids.shape[0]
        rows = self.graph_rows(n)
        ids, pos, logits_index = (_pad_rows(t, rows, 0) for t in (ids, pos, logits_index))
        allowed = _pad_rows(allowed, rows, True)
        torch.compiler.cudagraph_mark_step_begin()  # the previous forward's logits are consumed
        with torch._dynamo.config.patch(_graph_limits(cache)):
            out = self._fn(ids, attention_mask=allowed, position_ids=pos, kv_cache=cache, logits_index=logits_index)
        return None if out is None else out[:n]

    def bind(self, cache: KVCache, write_cols: torch.Tensor, key_len: int) -> None:
        """Bind ``cache`` for a decode forward of rows [0, n) (``KVCache.bind``); under CUDA graphs for
        :meth:`graph_rows` rows, the padding rows writing the scratch column."""
        cache.bind(0, _pad_rows(write_cols, self.graph_rows(write_cols.shape[0]), cache.length), key_len)

    def graph_rows(self, n: int) -> int:
        """Rows a forward runs: ``n``; under CUDA graphs the next power of two (one graph per bucket, not per
        batch size as rows leave and enter)."""
        return 1 << (n - 1).bit_length() if self.graphs else n

    def kv_cache(self, rows: int, length: int) -> KVCache:
        """The engine's static cache, reallocated only when a call needs more rows or columns than it has."""
        a = self.arch
        rows = self.graph_rows(rows)
        if self._cache is None or not self._cache.fits(rows, length, self.dtype, self.device):
            if self._cache is not None:
                rows, length = max(rows, self._cache.rows), max(length, self._cache.length)
            self._cache = None
            self._cache = KVCache(a, rows, length, self.dtype, self.device)
            if self.graphs:  # CUDA graphs write into it in place
                for t in self._cache.k + self._cache.v:
                    torch._dynamo.mark_static_address(t)
        return self._cache

    def key_len(self, need: int, limit: int) -> int:
        """Key columns a forward attends: ``need``; under CUDA graphs 64 times the next power of two of
        ``need / 64`` (a few graphs over a whole sequence), at most ``limit`` (the cache's length)."""
        if not self.graphs:
            return need
        return min(limit, _KEY_BUCKET << (-(-need // _KEY_BUCKET) - 1).bit_length())

    def _stack_experts(self) -> bool:
        """MoE experts as grouped GEMMs (``DecoderLM.stack_experts``: no host read per layer) where they run;
        another model, or a device without grouped GEMMs, decodes expert by expert."""
        return isinstance(self.model, DecoderLM) and self.model.stack_experts()

    def _unstack_experts(self) -> None:
        if isinstance(self.model, DecoderLM):
            self.model.unstack_experts()

    def _compiled(self):
        """The model forward and the denoising step through torch.compile: the cached block-diffusion forward on
        CUDA with CUDA graphs (``reduce-overhead``, static shapes: rows and key lengths bucketed, one graph per
        bucket), everything else with dynamic shapes (one graph for every batch and key length)."""
        if self.graphs:
            model = torch.compile(self.model, mode="reduce-overhead", dynamic=False)
        else:
            model = torch.compile(self.model, dynamic=True)
        return model, torch.compile(dllm_step, dynamic=True)


def cuda_graphs(arch: ModelArch, settings: NativeSettings, device: torch.device) -> bool:
    """Whether the engine runs its forwards as CUDA graphs (one per shape; :meth:`NativeEngine.graph_rows`,
    :meth:`NativeEngine.key_len` bucket the shapes): compiled, on CUDA, the cached block-diffusion forward of a
    dense model. Not MoE models yet: without grouped GEMMs their forward reads each layer's expert token counts on
    the host (a graph break), and the grouped path has not run under CUDA graphs."""
    cached_blocks = arch.is_block_diffusion and settings.use_cache and not arch.is_moe
    return settings.compile and torch.device(device).type == "cuda" and cached_blocks


def _pad_rows(t: Optional[torch.Tensor], rows: int, value) -> Optional[torch.Tensor]:
    """``t`` with rows appended up to ``rows`` (dim 0), filled with ``value``."""
    if t is None or t.shape[0] >= rows:
        return t
    return torch.cat([t, t.new_full((rows - t.shape[0], *t.shape[1:]), value)])


def _graph_limits(cache: Optional[KVCache]) -> dict[str, Any]:
    """Dynamo's recompile limit raised to the forward's graph count (row buckets x key buckets x the two query
    widths, doubled), and a limit hit is an error: past the default 8 dynamo would silently run eager."""
    rows = cache.rows.bit_length() if cache is not None else 1
    keys = (cache.length // _KEY_BUCKET + 1).bit_length() + 1 if cache is not None else 1
    limits = {"recompile_limit": 4 * rows * keys, "fail_on_recompile_limit_hit": True}
    limits["accumulated_recompile_limit"] = max(256, limits["recompile_limit"])
    return {k: v for k, v in limits.items() if hasattr(torch._dynamo.config, k)}


@functools.lru_cache(maxsize=256)
def _steps_needed(params: SamplingParams, masked: int) -> int:
    """Forwards a static schedule takes to commit ``masked`` positions (each step commits its count, clamped)."""
    left, s = masked, 0
    while left > 0:
        row = torch.zeros(1, params.block_size, dtype=torch.bool)
        row[0, :left] = True
        left -= min(int(commit_counts(row, s, params)[0]), left)
        s += 1
    return s


class _Decoder(ABC):
    """The continuous-batching driver and the per-slot state both decoders share.

    A slot is a row of the running batch (rows [0, n) are live). Device tensors per slot live in ``self.dev``
    (moved together when the batch is compacted), host lists in ``self.host``. Columns: every slot has a token
    store (block diffusion: the sample's grid from position 0; full attention: prompt ++ canvas) and the response
    trace buffers ``fwd`` / ``bstep`` / ``logp`` over decode columns (column 0 = the first decoded position of
    the first block, i.e. grid column ``first``)."""

    def __init__(
        self, engine: NativeEngine, prompts: list[list[int]], params: SamplingParams, width: int, decode_cols: int
    ):
        self.e, self.prompts, self.params = engine, prompts, params
        self.M, self.B = engine.arch.mask_token_id, params.block_size
        self.cap = min(engine.max_batch or len(prompts), len(prompts))
        dev, cap = engine.device, self.cap
        self.dev: dict[str, torch.Tensor] = {
            "tokens": torch.full((cap, width), self.M, dtype=torch.long, device=dev),
            "keys": torch.zeros(cap, dtype=torch.long, device=dev),
            "base": torch.zeros(cap, dtype=torch.long, device=dev),  # mix64(keys): the streams' start
            "steps": torch.zeros(cap, dtype=torch.long, device=dev),
            "start": torch.zeros(cap, dtype=torch.long, device=dev),  # grid column of the current block
            "first": torch.zeros(cap, dtype=torch.long, device=dev),  # grid column of decode column 0
            "resp": torch.zeros(cap, dtype=torch.long, device=dev),  # decode column of response token 0
            "fwd": torch.zeros((cap, decode_cols), dtype=torch.long, device=dev),
            "bstep": torch.zeros((cap, decode_cols), dtype=torch.long, device=dev),
            "logp": torch.zeros((cap, decode_cols), dtype=torch.float32, device=dev),
        }
        self.host: dict[str, list] = {k: [] for k in ("prompt", "block", "blocks", "start", "superseded", "preds")}
        self.static_steps = params.algorithm not in ("low_confidence_dynamic", "editing")

    # ------------------------------------------------------------------ driver
    def run(self) -> list[Trajectory]:
        queue = deque(range(len(self.prompts)))
        out: list[Optional[Trajectory]] = [None] * len(self.prompts)
        while queue or self.host["prompt"]:
            live = len(self.host["prompt"])
            if queue and live < self.cap:
                new = [queue.popleft() for _ in range(min(self.cap - live, len(queue)))]
                self.admit(live, new)
            done = self.round(len(self.host["prompt"]))
            for i in (i for i, d in enumerate(done) if d):
                out[self.host["prompt"][i]] = self.trajectory(i)
            self.compact([i for i, d in enumerate(done) if not d])
        return out  # type: ignore[return-value]

    def admit(self, start: int, indices: list[int]) -> None:
        """Put prompts ``indices`` into slots [start, start + len): subclass fills tokens / columns first."""
        dev = self.e.device
        seeds = [prompt_seed(self.params.seed, i) for i in indices]
        rows = slice(start, start + len(indices))
        self.dev["keys"][rows] = torch.tensor(seeds, dtype=torch.long, device=dev)
        self.dev["base"][rows] = mix64(self.dev["keys"][rows])
        self.dev["steps"][rows] = 0
        self.host["prompt"] += indices
        self.host["block"] += [0] * len(indices)
        self.host["superseded"] += [{} for _ in indices]
        self.host["preds"] += [[] for _ in indices]

    def compact(self, keep: list[int]) -> None:
        """Keep rows ``keep`` (in order) as rows [0, len(keep))."""
        moved = [(s, d) for d, s in enumerate(keep) if s != d]
        if moved:
            src = torch.tensor([s for s, _ in moved], device=self.e.device)
            dst = torch.tensor([d for _, d in moved], device=self.e.device)
            for t in self.dev.values():
                t.index_copy_(0, dst, t.index_select(0, src))
            self.move_cache(src, dst)
        for k, v in self.host.items():
            self.host[k] = [v[i] for i in keep]

    def move_cache(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Block diffusion keeps keys/values across blocks: they move with their rows."""

    # ------------------------------------------------------------------ one block of every live row
    def round(self, n: int) -> list[bool]:
        """Decode the current block of rows [0, n); returns per row whether it finished."""
        p, M = self.params, self.M
        cols = self.dev["start"][:n, None] + torch.arange(self.B, device=self.e.device)
        self.begin_block(n, cols)
        cur = self.dev["tokens"][:n].gather(1, cols)
        trace = BlockTrace(n, p.record_steps, keep_history=p.algorithm == "editing")
        refine = Refinement(cur == M, p) if p.algorithm == "editing" else None
        steps = self.block_steps(n) if self.static_steps else p.block_forwards()
        step_index = torch.zeros(n, dtype=torch.long, device=self.e.device)  # a tensor: no recompile per step
        for s in range(steps):
            masked = cur == M
            editable = refine.editable(cur, M) if refine is not None else None
            if not self.static_steps:  # dynamic threshold / token editing: one flag read per step
                work = masked.any() if editable is None else masked.any() | editable.any()
                if not bool(work):
                    break
            logits = self.block_logits(n, cols, s, cur)
            counters = self.dev["steps"][:n] if trace.count is None else self.dev["steps"][:n] + trace.count
            streams = Streams(self.dev["keys"][:n], counters, self.dev["base"][:n])
            later = None
            if logits.shape[1] > self.B:  # record_steps, full attention: the later blocks' predictions too
                logits, ahead = logits[:, : self.B], logits[:, self.B :]
                later = propose(ahead, p, streams, self.B, M)
            step = self.e.step(logits, BlockState(cur, masked, editable), step_index, p, streams, M)
            if refine is not None:
                refine.after(masked, step)
            trace.add(step, step_index, later)
            step_index = step_index + 1
            cur = step.tokens
        self.write_block(n, cols, cur)
        self.end_block(n, cols)
        return self.record(n, cols, cur, trace)

    def block_steps(self, n: int) -> int:
        """Forwards the block takes (static schedules): the most any live row needs."""
        return max(_steps_needed(self.params, self.masked_at_start(i)) for i in range(n))

    def record(self, n: int, cols: torch.Tensor, cur: torch.Tensor, trace: BlockTrace) -> list[bool]:
        """The block's trace into the rows' buffers (on the device), the host's per-block read, who finished."""
        d = self.dev
        if trace.count is not None:
            dcols = cols - d["first"][:n, None]
            committed = trace.forward >= 0
            for name, new in (
                ("fwd", d["steps"][:n, None] + trace.forward),
                ("bstep", trace.block_step),
                ("logp", trace.logprob),
            ):
                old = d[name][:n].gather(1, dcols)
                d[name][:n].scatter_(1, dcols, torch.where(committed, new, old))
            if trace.keep_history:
                self.record_history(n, trace)
            d["steps"][:n] += trace.count
        d["start"][:n] += self.B
        eos = torch.zeros(n, dtype=torch.bool, device=cur.device)
        if self.params.stop_at_eos:
            in_resp = (cols - d["first"][:n, None]) >= d["resp"][:n, None]
            eos = ((cur == self.e.eos) & in_resp).any(dim=1)
        flags = eos.tolist()
        for i in range(n):
            self.host["block"][i] += 1
            self.host["start"][i] += self.B
        return [f or self.host["block"][i] >= self.host["blocks"][i] for i, f in enumerate(flags)]

    def record_history(self, n: int, trace: BlockTrace) -> None:
        """Token editing's overwritten commits and MDPO's per-step proposals (host, once per block)."""
        before = self.dev["steps"][:n].tolist()
        first = (self.dev["start"][:n] - self.dev["first"][:n]).tolist()
        for i in range(n):
            for c, chain in trace.superseded[i].items():
                self.host["superseded"][i][c + first[i]] = [(before[i] + f, s, lp, tok) for f, s, lp, tok in chain]
            if trace.preds is not None and trace.confs is not None:
                self.host["preds"][i] += [(first[i], pr, cf) for pr, cf in zip(trace.preds[i], trace.confs[i])]

    # ------------------------------------------------------------------ result
    def trajectory(self, i: int) -> Trajectory:
        """Response = decoded tokens up to the first EOS (inclusive) or max_new_tokens; without ``stop_at_eos``
        the whole canvas of max_new_tokens (finish 'eos' when it holds an EOS: the answer ended)."""
        p, d = self.params, self.dev
        first, resp = int(d["first"][i]), int(d["resp"][i])
        cols = self.host["block"][i] * self.B - resp
        toks = d["tokens"][i, first + resp : first + resp + cols].tolist()
        end = min(len(toks), p.max_new_tokens)
        finish = "eos" if self.e.eos in toks[:end] else "length"
        if p.stop_at_eos and finish == "eos":
            end = toks.index(self.e.eos) + 1
        fwd = d["fwd"][i, resp : resp + end].tolist()
        bstep = d["bstep"][i, resp : resp + end].tolist()
        logp = d["logp"][i, resp : resp + end].tolist()
        superseded = [
            Superseded(c, tok, g, s, lp)
            for c in range(end)
            for g, s, lp, tok in self.host["superseded"][i].get(c + resp, [])
        ]
        traj = Trajectory(
            prompt_ids=list(self.prompts[self.host["prompt"][i]]),
            response_ids=toks[:end],
            commit_step=fwd,
            block_step=bstep,
            logprobs=logp,
            finish_reason=finish,
            num_forwards=int(d["steps"][i]),
            params=p,
            policy_version=self.e.version,
            superseded=superseded if p.algorithm == "editing" else None,
        )
        if p.record_steps:
            traj.step_predictions, traj.step_confidences = _response_aligned(self.host["preds"][i], resp, end)
        return traj.validate()

    # ------------------------------------------------------------------ per decoder
    def masked_at_start(self, i: int) -> int:
        return self.B

    def begin_block(self, n: int, cols: torch.Tensor) -> None:
        """Once per block, before its forwards (bind the cache, build the masks)."""

    @abstractmethod
    def block_logits(self, n: int, cols: torch.Tensor, s: int, cur: torch.Tensor) -> torch.Tensor:
        """Logits of step ``s`` of the block of rows [0, n) at their columns ``cols``, whose tokens are now ``cur``
        [n, B]: each decoder's own forward. The token store holds the block as it was at its start: a forward
        that reads the store beyond step 0 first writes ``cur`` (:meth:`write_block`)."""

    def write_block(self, n: int, cols: torch.Tensor, cur: torch.Tensor) -> None:
        """The block's tokens ``cur`` into the rows' token store (after every step that a forward reads from the
        store, and once at the end of the block)."""
        self.dev["tokens"][:n].scatter_(1, cols, cur)

    def end_block(self, n: int, cols: torch.Tensor) -> None:
        """Once per block, after its last step."""


class _BlockDiffusion(_Decoder):
    """Block diffusion over each sample's own grid; the static cache's column = the token's position."""

    def __init__(self, engine: NativeEngine, prompts: list[list[int]], params: SamplingParams):
        B = params.block_size
        self.pre = [len(p) // B * B for p in prompts]
        self.rem = [len(p) - q for p, q in zip(prompts, self.pre)]
        self.need = [math.ceil((r + params.max_new_tokens) / B) for r in self.rem]
        width = max(q + k * B for q, k in zip(self.pre, self.need))
        super().__init__(engine, prompts, params, width, max(self.need) * B)
        self.host.update(pre=[], rem=[], pending=[])
        self.cache = engine.kv_cache(self.cap, width) if engine.use_cache else None
        self._allowed: Optional[torch.Tensor] = None
        self._first: Optional[tuple[torch.Tensor, ...]] = None

    def admit(self, start: int, indices: list[int]) -> None:
        d, dev = self.dev, self.e.device
        for j, i in enumerate(indices):
            row, p = start + j, self.prompts[i]
            d["tokens"][row] = self.M
            d["tokens"][row, : len(p)] = torch.tensor(p, dtype=torch.long, device=dev)
        pre = torch.tensor([self.pre[i] for i in indices], dtype=torch.long, device=dev)
        rows = slice(start, start + len(indices))
        d["start"][rows], d["first"][rows] = pre, pre
        d["resp"][rows] = torch.tensor([self.rem[i] for i in indices], dtype=torch.long, device=dev)
        self.host["pre"] += [self.pre[i] for i in indices]
        self.host["rem"] += [self.rem[i] for i in indices]
        self.host["start"] += [self.pre[i] for i in indices]
        self.host["blocks"] += [self.need[i] for i in indices]
        self.host["pending"] += [False] * len(indices)
        super().admit(start, indices)
        if self.cache is not None:
            self._prefill(start, indices)

    def _prefill(self, start: int, indices: list[int]) -> None:
        """The prompts' complete blocks into the cache (block-causal), right-padded to the longest."""
        Q = max(self.pre[i] for i in indices)
        if Q == 0:
            return
        dev, m = self.e.device, len(indices)
        ids = self.dev["tokens"][start : start + m, :Q]
        pos = torch.arange(Q, device=dev).expand(m, Q)
        valid = pos < torch.tensor([self.pre[i] for i in indices], device=dev)[:, None]
        # padding queries see themselves (no NaN keys/values in the cache); real queries never see padding
        allowed = _bc_mask(pos, valid, pos, self.B) | torch.eye(Q, dtype=torch.bool, device=dev)
        self.cache.bind(start, pos, Q)
        self.e.forward(ids, allowed, pos, self.cache, logits_index=pos[:, :0], eager=True)

    def move_cache(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        if self.cache is not None:
            self.cache.move_rows(src, dst)

    def masked_at_start(self, i: int) -> int:
        return self.B - self.host["rem"][i] if self.host["block"][i] == 0 else self.B

    def begin_block(self, n: int, cols: torch.Tensor) -> None:
        """Masks and cache binding of the block's forwards. A row whose previous block is finished but not yet
        stored (``pending``) stores it in the block's first forward: its queries are [previous block, block]
        (the previous block's see the cache before it, the block's see both: exactly the keys/values a separate
        forward would store), so a block costs S forwards, not S + 1, and a finishing row never pays for it."""
        if self.cache is None:
            return
        dev, B = self.e.device, self.B
        T = self.e.key_len(max(self.host["start"][:n]) + B, self.cache.length)
        keys = torch.arange(T, device=dev)
        start = self.dev["start"][:n]
        self._allowed = (keys < start[:, None] + B)[:, None, None, :]
        self._first = None
        if any(self.host["pending"][:n]):
            pending = torch.tensor(self.host["pending"][:n], device=dev)
            prev = cols - B
            write = torch.cat([torch.where(pending[:, None], prev, self.cache.length), cols], dim=1)
            limit = torch.cat(
                [torch.where(pending, start, start + B)[:, None].expand(n, B), (start + B)[:, None].expand(n, B)], dim=1
            )
            queries = torch.cat([prev, cols], dim=1).clamp(min=0)
            self._first = (queries, write, (keys < limit[:, :, None])[:, None], T)
        self.e.bind(self.cache, cols, T)

    def block_logits(self, n: int, cols: torch.Tensor, s: int, cur: torch.Tensor) -> torch.Tensor:
        if self.cache is not None and s == 0 and self._first is not None:
            queries, write, allowed, T = self._first
            self.e.bind(self.cache, write, T)
            head = torch.arange(self.B, 2 * self.B, device=self.e.device).expand(n, self.B)
            out = self.e.forward(
                self.dev["tokens"][:n].gather(1, queries), allowed, queries, self.cache, logits_index=head
            )
            self.e.bind(self.cache, cols, T)
            return out
        if self.cache is not None:  # the queries are the block alone: its tokens are ``cur``
            return self.e.forward(cur, self._allowed, cols, self.cache)
        self.write_block(n, cols, cur)
        T = max(self.host["start"][:n]) + self.B  # no cache: the whole grid up to the block, every step
        pos = torch.arange(T, device=self.e.device).expand(n, T)
        valid = pos < self.dev["start"][:n, None] + self.B
        allowed = _bc_mask(pos, valid, pos, self.B) | torch.eye(T, dtype=torch.bool, device=self.e.device)
        return self.e.forward(self.dev["tokens"][:n, :T], allowed, pos, logits_index=cols)

    def end_block(self, n: int, cols: torch.Tensor) -> None:
        """The block's keys/values are stored by the next block's first forward (``begin_block``)."""
        self.host["pending"][:n] = [self.cache is not None] * n


def _bc_mask(q_pos: torch.Tensor, k_valid: torch.Tensor, k_pos: torch.Tensor, B: int) -> torch.Tensor:
    """Block-causal allowed mask [n, 1, Q, K] from positions on each sample's own grid + key validity."""
    allowed = (k_pos[:, None, :] // B) <= (q_pos[:, :, None] // B)
    return (allowed & k_valid[:, None, :]).unsqueeze(1)


class _SemiAR(_Decoder):
    """Full attention: every row is its prompt, left-padded to the longest of the call, then the canvas."""

    def __init__(self, engine: NativeEngine, prompts: list[list[int]], params: SamplingParams):
        B = params.block_size
        self.n_blocks = math.ceil(params.max_new_tokens / B)
        self.P = max(len(p) for p in prompts)
        self.L = self.P + self.n_blocks * B
        super().__init__(engine, prompts, params, self.L, self.n_blocks * B)
        cap, dev = self.cap, engine.device
        self.dev["valid"] = torch.zeros((cap, self.L), dtype=torch.bool, device=dev)
        self.dev["pos"] = torch.zeros((cap, self.L), dtype=torch.long, device=dev)
        self.shift = engine.arch.logits_shift
        self.mode = engine.full_attention_cache
        self.cache = engine.kv_cache(self.cap, self.L) if self.mode != "none" else None
        if params.record_steps and self.mode != "none" and self.n_blocks > 1:
            raise ValueError(
                f"record_steps (MDPO) predicts every later block from each step's full forward; "
                f"full_attention_cache={self.mode!r} does not compute them: use rollout.full_attention_cache=none"
            )

    def admit(self, start: int, indices: list[int]) -> None:
        d, dev, P = self.dev, self.e.device, self.P
        for j, i in enumerate(indices):
            row, p = start + j, self.prompts[i]
            pad = P - len(p)
            d["tokens"][row] = self.M
            d["tokens"][row, :pad] = self.e.pad
            d["tokens"][row, pad:P] = torch.tensor(p, dtype=torch.long, device=dev)
            d["valid"][row] = torch.arange(self.L, device=dev) >= pad
            d["pos"][row] = (torch.arange(self.L, device=dev) - pad).clamp(min=0)
        rows = slice(start, start + len(indices))
        d["start"][rows], d["first"][rows], d["resp"][rows] = P, P, 0
        self.host["start"] += [P] * len(indices)
        self.host["blocks"] += [self.n_blocks] * len(indices)
        super().admit(start, indices)

    def _predicted(self, n: int, cols: torch.Tensor) -> torch.Tensor:
        """The columns a forward predicts: the block; with ``record_steps`` (MDPO) also every later column, as
        DARE's MDPO rollouts (``round`` samples them apart from the block: ``dllm_step.propose``)."""
        later = self.L - min(self.host["start"][:n]) - self.B
        if not self.params.record_steps or later <= 0:
            return cols
        return torch.cat([cols, _later_columns(cols, later, self.L)], dim=1)

    def block_logits(self, n: int, cols: torch.Tensor, s: int, cur: torch.Tensor) -> torch.Tensor:
        """Logits predicting the block's tokens (Dream: read one position to the left). 'prefix' / 'dual': the
        block's first forward (the whole row) fills the cache, later ones recompute the block (and, for 'prefix',
        everything after it) and take the other keys/values from it."""
        self.write_block(n, cols, cur)
        d, L = self.dev, self.L
        ids, pos = d["tokens"][:n], d["pos"][:n]
        allowed = d["valid"][:n, None, None, :]
        if self.cache is None or s == 0:
            if self.cache is not None:
                self.cache.bind(0, torch.arange(L, device=self.e.device).expand(n, L), L)
            return self.e.forward(ids, allowed, pos, self.cache, logits_index=self._predicted(n, cols) - self.shift)
        W = self.B + self.shift if self.mode == "dual" else L - min(self.host["start"][:n]) + self.shift
        window = cols[:, :1] - self.shift + torch.arange(W, device=self.e.device)
        inside = window < L
        at = window.clamp(max=L - 1)
        self.cache.bind(0, torch.where(inside, window, self.cache.length), L)
        return self.e.forward(
            ids.gather(1, at),
            allowed,
            pos.gather(1, at),
            self.cache,
            logits_index=torch.arange(self.B, device=self.e.device).expand(n, self.B),
        )


def _later_columns(cols: torch.Tensor, width: int, length: int) -> torch.Tensor:
    """The ``width`` columns after each row's block ``cols`` [n, B], clamped to the row's last column
    ``length - 1`` (a row further along repeats it; its extra predictions fall past the response)."""
    return (cols[:, -1:] + 1 + torch.arange(width, device=cols.device)).clamp(max=length - 1)


def _response_aligned(
    preds: list[tuple[int, list[int], list[float]]], resp: int, end: int
) -> tuple[list[list[int]], list[list[float]]]:
    """A row's per-step proposals placed on its response positions [0, end): -1 (confidence 0) where the step
    predicted nothing (earlier blocks; later ones of a block-causal model; the prompt's remainder in the first
    block). ``preds``: (decode column of the block's first position, proposals, confidences from that column on)
    per step the row took."""
    out_p, out_c = [], []
    for first, block_preds, block_confs in preds:
        p, c = [-1] * end, [0.0] * end
        for j, (tok, conf) in enumerate(zip(block_preds, block_confs)):
            k = first + j - resp
            if 0 <= k < end:
                p[k], c[k] = int(tok), float(conf)
        out_p.append(p)
        out_c.append(c)
    return out_p, out_c
