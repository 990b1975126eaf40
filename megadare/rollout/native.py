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

How it runs (issue 27; this module: the engine, its cache and compiled forward; ``decoders.py``: the batching
driver and the two decoders):

* The KV cache is static (:class:`~megadare.models.hf.common.KVCache`: max batch x max length per layer,
  allocated once per engine and reused while it fits) and written in place; the model runs in the engine's dtype
  (bf16 on CUDA, float32 on CPU) and looks up no module by name.
* Each denoising step of a block is ``dllm_step.dllm_step`` (shared with the SGLang plugin) over the whole batch on
  the model's device; each prompt samples from its own counter-based stream keyed (seed, prompt index)
  (``engine.prompt_seed``), so its trajectory depends on neither the batch nor the engine. The trace (global
  step, block-local step, log-prob of every commit) is kept on the device; the host reads one row of flags per
  block (who found an EOS; none without ``stop_at_eos``: no row ends early), on CUDA a block late, from a copy
  started without a wait (``decoders.StopFlags``; the row rides that block frozen), and the rows that finish at
  a block once per buffer, after the next block is queued (``decoders.FinishedRows``). A block's forwards run without a
  host read when the schedule is static (the number of steps follows from the masked counts); the dynamic
  threshold and token editing read one flag per step to stop early (it must reach the host before the next
  forward is launched or not: reading it a step late would run a wasted forward per block, a whole forward of
  GPU work against the launch gap the read leaves). Token editing's overwritten commits and MDPO's per-step
  records go to the host without a wait and are read when their row finishes (``decoders.BlockHistory``).
  A step and its record are one call (``dllm_step.denoise_step``; compiled: one graph, no eager op between two
  forwards), token editing's with its history entry and its bookkeeping too (``editing.editing_step``); per-step
  records (MDPO) run step by step. The compiled steps take their float settings (temperature, thresholds, top_p)
  as tensors the engine owns (:class:`FloatInputs`): a new value compiles nothing.
* Continuous batching at block boundaries: at most ``max_batch`` rows decode together (0: all prompts of a call);
  a row that finishes leaves at the end of its block (at an EOS on CUDA: of the next one), a queued prompt takes
  its place, and the batch is compacted so the forward never carries finished rows.
* ``compile=True`` runs the model forward through ``torch.compile`` (CUDA graphs on CUDA via ``reduce-overhead``);
  the key length is padded to a multiple of 64 columns so few shapes occur. Off by default: not measured faster
  on CPU (benchmarks/rollout_throughput.py).

Every committed token records its global step (the sample's denoising forward index), its block-local step and
its log-prob under the sampling distribution; ``use_cache=False`` recomputes the whole sequence each step (the
reference the cache is tested against). Token editing (LLaDA2.1, ``algorithm='editing'``) runs a block until
``editing.Refinement`` closes it and records the commits its edits overwrote (``Trajectory.superseded``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Optional

import torch

from megadare.models.attention import family_mask
from megadare.models.family import ModelArch
from megadare.models.hf.common import DecoderLM, KVCache
from megadare.rollout.decoders import BlockDiffusionDecoder, Decoder, SemiARDecoder
from megadare.rollout.dllm_step import StepFloats, TracedParams, branch_params, denoise_step, dllm_step, draw_ahead
from megadare.rollout.editing import editing_start, editing_step
from megadare.rollout.engine import SamplingParams, Trajectory, check_generate_call

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
        self.grouped_experts = self._pack_weights()
        self.use_cache = settings.use_cache
        self.max_batch = settings.max_batch
        self.compile = settings.compile
        self.graphs = cuda_graphs(arch, settings, self.device)
        self._fn, self.step, self.dllm_step, self.draw_ahead = self.model, denoise_step, dllm_step, draw_ahead
        self.editing_start, self.editing_step = editing_start, editing_step
        if settings.compile:
            self.use_compiled()
        self._cache: Optional[KVCache] = None
        self._padded = PaddedRows()
        self.version = 0
        self.forwards = 0  # model forwards, all calls (benchmarks: forwards per token)
        self.asleep = False

    # ------------------------------------------------------------------ protocol
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Trajectory]:
        check_generate_call(self.asleep, prompts)
        if self.arch.is_block_diffusion:
            if params.block_size != self.arch.block_size:
                raise ValueError(
                    f"sampling block_size={params.block_size} differs from the model's block size "
                    f"{self.arch.block_size} ({self.arch.family}); they must agree"
                )
            decoder: Decoder = BlockDiffusionDecoder(self, prompts, params)
        else:
            decoder = SemiARDecoder(self, prompts, params)
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
        self._unpack_weights()
        self.model.to("cpu")
        self._cache = None
        self._padded = PaddedRows()  # its padding rows live on the device too
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.asleep = True

    def wake(self) -> None:
        self.model.to(self.device)
        self._pack_weights()
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
        pad = self._padded
        ids, pos = pad.rows("ids", ids, rows, 0), pad.rows("pos", pos, rows, 0)
        logits_index, allowed = pad.rows("index", logits_index, rows, 0), pad.rows("allowed", allowed, rows, True)
        torch.compiler.cudagraph_mark_step_begin()  # the previous forward's logits are consumed
        with torch._dynamo.config.patch(_graph_limits(cache)):
            out = self._fn(ids, attention_mask=allowed, position_ids=pos, kv_cache=cache, logits_index=logits_index)
        return None if out is None else out[:n]

    def bind(self, cache: KVCache, write_cols: torch.Tensor, key_len: int) -> None:
        """Bind ``cache`` for a decode forward of rows [0, n) (``KVCache.bind``); under CUDA graphs for
        :meth:`graph_rows` rows, the padding rows writing the scratch column."""
        cache.bind(
            0, self._padded.rows("write", write_cols, self.graph_rows(write_cols.shape[0]), cache.length), key_len
        )

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

    def _pack_weights(self) -> bool:
        """Each layer's projections fused (``DecoderLM.fuse_projections``: q/k/v and gate/up as one GEMM each) and
        the MoE experts as grouped GEMMs (``DecoderLM.stack_experts``: no host read per layer) where they run;
        another model, or a device without grouped GEMMs, decodes expert by expert. Returns whether the experts
        are grouped."""
        if not isinstance(self.model, DecoderLM):
            return False
        self.model.fuse_projections()
        return self.model.stack_experts(traced=self.settings.compile)

    def _unpack_weights(self) -> None:
        """Undo :meth:`_pack_weights` (before a move: it copies parameters one by one, the fused weights and
        stacks would keep the old copies)."""
        if isinstance(self.model, DecoderLM):
            self.model.unfuse_projections()
            self.model.unstack_experts()

    def use_compiled(self) -> None:
        """The model forward and the denoising steps through torch.compile (``step``: ``dllm_step.denoise_step``,
        the step with its record, what a static block's steps run; ``dllm_step``: the bare step, for the dynamic
        threshold and per-step records; ``editing_start`` / ``editing_step``: token editing's block start and step
        with its bookkeeping, ``editing.py``): the cached block-diffusion forward on CUDA with CUDA graphs
        (``reduce-overhead``, static shapes: rows and key lengths bucketed, one graph per bucket), everything else
        with dynamic shapes (one graph for every batch and key length). The steps' float settings are inputs of
        their graphs, one-element tensors the engine owns (:class:`FloatInputs`). ``draw_ahead``: a block's random
        numbers (``dllm_step.draw_ahead``), one graph (integer arithmetic: exact on every backend)."""
        if self.graphs:
            model = torch.compile(self.model, mode="reduce-overhead", dynamic=False)
        else:
            model = torch.compile(self.model, dynamic=True)
        floats = FloatInputs(self.device)
        self._fn, self.draw_ahead = model, torch.compile(draw_ahead, dynamic=True)
        self.step, self.dllm_step, self.editing_step = (
            floats.wrap(torch.compile(f, dynamic=True)) for f in (denoise_step, dllm_step, editing_step)
        )
        self.editing_start = torch.compile(editing_start, dynamic=True)


class FloatInputs:
    """The compiled steps' float settings (``dllm_step.StepFloats``: temperature, top_p, threshold,
    editing_threshold, alg_temp) as one-element tensors on the engine's device: made once (stable addresses),
    filled only when a call's value changes, passed as graph inputs with ``dllm_step.branch_params`` (what dynamo
    guards on). Before, the floats were constants of the step's graph (``specialize_float``): each new value
    compiled the step again, and past dynamo's recompile limit (8: a temperature sweep, a schedule) the step ran
    eager for the rest of the run; as plain floats dynamo would wrap each in a new tensor at every call (three
    eager ops per float per step). In the dtype the step computes them in (float32; alg_temp float64), as it
    rounds a Python float; shape [1], not 0-dim: dynamo reads a 0-dim CPU tensor as a float it guards with an
    ``item()`` at every call."""

    def __init__(self, device: torch.device):
        dtypes = {"alg_temp": torch.float64}  # its division runs in float64; the others meet float32 tensors
        self.values = StepFloats(
            *(torch.zeros(1, dtype=dtypes.get(name, torch.float32), device=device) for name in StepFloats._fields)
        )
        self._held: Optional[tuple[float, ...]] = None
        self._last: Optional[tuple[SamplingParams, TracedParams]] = None

    def traced(self, params: SamplingParams) -> TracedParams:
        """``params`` for a compiled step: its floats written into the tensors (only those that changed)."""
        if self._last is not None and self._last[0] is params:  # a block's steps: the call's params
            return self._last[1]
        values = StepFloats.of(params)
        if values != self._held:
            for t, v, old in zip(self.values, values, self._held or (None,) * len(values)):
                if v != old:
                    t.fill_(v)
            self._held = values
        self._last = (params, TracedParams(branch_params(params), self.values))
        return self._last[1]

    def wrap(self, compiled):
        """``compiled`` (a step: ``dllm_step.denoise_step``, ``dllm_step.dllm_step`` or ``editing.editing_step``,
        its ``SamplingParams`` the fourth argument of six) called with :meth:`traced` params; its other floats
        (``eps``, the branch values) traced as constants."""

        def call(a, b, c, params: SamplingParams, streams, mask_token_id):
            with torch._dynamo.config.patch(specialize_float=True):
                return compiled(a, b, c, self.traced(params), streams, mask_token_id)

        return call


def cuda_graphs(arch: ModelArch, settings: NativeSettings, device: torch.device) -> bool:
    """Whether the engine runs its forwards as CUDA graphs (one per shape; :meth:`NativeEngine.graph_rows`,
    :meth:`NativeEngine.key_len` bucket the shapes): compiled, on CUDA, the cached block-diffusion forward of a
    dense model. Not MoE models yet: without grouped GEMMs their forward reads each layer's expert token counts on
    the host (a graph break), and the grouped path has not run under CUDA graphs."""
    cached_blocks = arch.is_block_diffusion and settings.use_cache and not arch.is_moe
    return settings.compile and torch.device(device).type == "cuda" and cached_blocks


class PaddedRows:
    """A forward's inputs padded with rows up to a CUDA graph's row bucket, without rebuilding what a block's
    steps share: the padding rows of a shape and fill are made once (never written: ``cat`` copies them), and an
    input passed again unchanged (a block's columns, its attention mask: the same tensor at every step, same
    version counter) reuses its padded copy. Padding each input anew cost two eager ops per input per step
    (``new_full``, ``cat``) between two graph replays on CUDA; now one per step (the block's tokens)."""

    def __init__(self) -> None:
        self._tails: dict[tuple, torch.Tensor] = {}
        self._last: dict[str, tuple] = {}  # slot -> (input, its version, rows, fill, padded)

    def rows(self, slot: str, t: Optional[torch.Tensor], rows: int, value) -> Optional[torch.Tensor]:
        """``t`` with rows appended up to ``rows`` (dim 0), filled with ``value`` (``slot``: which input it is,
        e.g. the forward's positions; the last input of a slot is remembered)."""
        if t is None or t.shape[0] >= rows:
            return t
        last = self._last.get(slot)
        if last is not None and last[0] is t and last[1:4] == (t._version, rows, value):
            return last[4]
        shape = (rows - t.shape[0], *t.shape[1:])
        key = (shape, t.dtype, t.device, value)
        if key not in self._tails:
            if len(self._tails) >= 64:  # shapes are bucketed: a few per call; bounded all the same
                self._tails.clear()
            self._tails[key] = t.new_full(shape, value)
        padded = torch.cat([t, self._tails[key]])
        self._last[slot] = (t, t._version, rows, value, padded)
        return padded


def _graph_limits(cache: Optional[KVCache]) -> dict[str, Any]:
    """Dynamo's recompile limit raised to the forward's graph count (row buckets x key buckets x the two query
    widths, doubled), and a limit hit is an error: past the default 8 dynamo would silently run eager."""
    rows = cache.rows.bit_length() if cache is not None else 1
    keys = (cache.length // _KEY_BUCKET + 1).bit_length() + 1 if cache is not None else 1
    limits = {"recompile_limit": 4 * rows * keys, "fail_on_recompile_limit_hit": True}
    limits["accumulated_recompile_limit"] = max(256, limits["recompile_limit"])
    return {k: v for k, v in limits.items() if hasattr(torch._dynamo.config, k)}
