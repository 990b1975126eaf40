"""megadare's dLLM algorithm for SGLang: sampled block diffusion that records the decoding trace.

SGLang's built-in dLLM algorithms (``LowConfidence``, ``JointThreshold``) decode greedily and return no trace. This
module adds one, ``MegadareBlockDiffusion``, that decodes a block exactly like megadare's built-in engine (the
shared step is :func:`megadare.rollout.dllm_step.dllm_step`: temperature / top-k / top-p sampling, static or
dynamic low-confidence or random remasking, a seeded random stream per request) and records, for every response token,
its global denoising step, its block-local step and its sampling log-prob.

Followed: sglang 0.5.20, 0.5.21, 0.5.22 and 0.5.23 (the wheels from PyPI), files

* ``sglang/srt/dllm/algorithm/__init__.py``: algorithms are the ``Algorithm`` attribute of the modules inside that
  package, found with ``pkgutil.iter_modules`` when the package is imported and stored in the module-global dict
  ``algo_name_to_cls`` keyed by class ``__name__``; ``--dllm-algorithm NAME`` resolves through
  ``algo_name_to_cls[NAME]`` (``get_algorithm_cls`` in 0.5.21+, ``get_algorithm`` in 0.5.20). A third-party
  package cannot add a module to that package, so :func:`register` inserts the class into that dict.
* ``sglang/srt/dllm/algorithm/base.py``: ``DllmAlgorithm(config)`` owns the loops (``run`` -> ``_run_sync`` or,
  with ``--dllm-fdfo`` (default on), ``_run_fdfo``); a subclass implements ``init_step_state(forward_batch)`` and
  ``step(forward_batch, full_logits, states) -> list[bool]`` (advance ``forward_batch.input_ids`` in place; report
  per block whether it was complete *on entry*, i.e. the forward that produced ``full_logits`` persisted its final
  tokens). ``full_logits`` is ``[batch * block_size, vocab]``. This step-based interface exists from 0.5.20 on
  (0.5.10-0.5.15 had a different ``run`` contract), hence the pinned range below.
* ``sglang/srt/dllm/config.py``: ``DllmConfig`` (``algorithm_config`` = the YAML of ``--dllm-algorithm-config``,
  ``block_size`` from it or the architecture default, ``mask_id``; ``max_running_requests`` defaults to 1).
* ``sglang/srt/managers/tp_worker.py``: ``TpModelWorker._forward_batch_generation_dllm(forward_batch, batch)``
  calls ``self.dllm_algorithm.run(self.model_runner, forward_batch, algo_states)``; ``batch.reqs`` are the
  scheduler's ``Req`` objects, one per row of the forward batch.
* ``sglang/srt/dllm/mixin/scheduler.py``: ``process_batch_result_dllm`` appends a finished block's tokens to
  ``req.output_ids`` and streams the output.
* ``sglang/srt/plugins/__init__.py`` + ``hook_registry.py``: ``load_plugins()`` runs every entry point of the group
  ``sglang.srt.plugins`` (in the Engine's process before ``ServerArgs`` are built, and in every scheduler process)
  and then ``HookRegistry.apply_hooks()``; ``SGLANG_PLUGINS`` (comma-separated names) can restrict which run.
* ``sglang/srt/managers/scheduler_components/output_streamer.py`` and ``tokenizer_manager.py``: per-token values in
  ``req.customized_info[key]`` (aligned with ``req.output_ids``) are sliced with the streamed tokens and returned
  to the caller as ``meta_info[key]`` (accumulated over the stream).

The metadata channel: sglang gives an algorithm no way to return per-request data (``run`` returns logits, token
ids, accept lengths, per-request algorithm states and a CUDA-graph flag), and the dLLM result path does not collect
``LogitsProcessorOutput.customized_info`` (the AR path does). So :func:`register` also installs an AROUND hook
(sglang's own ``HookRegistry``) on ``TpModelWorker._forward_batch_generation_dllm`` that hands ``batch.reqs`` to the
algorithm for the duration of the call; the algorithm reads each request's sampling parameters and seed from its
``Req`` and, when a block is done, appends one entry per emitted token to ``req.customized_info["megadare_trace"]``
*before* the scheduler appends the tokens, so sglang's own streamer slices the trace with the tokens and the
client finds it in ``meta_info["megadare_trace"]``: ``[global_step, block_step, logprob, forwards_so_far]`` per
token (``forwards_so_far``: denoising steps of the request up to and including the token's block; under token
editing a fifth item lists the commits of that position an edit overwrote, ``[[global_step, block_step,
logprob, token], ...]``). The step
counter, the per-request random stream and the request's parameters (built at its first block) live on the ``Req``
(``_megadare_forwards``, ``_megadare_rng``, ``_megadare_params``).

Per-request parameters: ``temperature`` / ``top_p`` / ``top_k`` of sglang's ``SamplingParams`` (sglang turns
temperature 0 into ``top_k=1``, which is greedy here too), the seed from ``custom_params["megadare"]["seed"]``,
else ``sampling_seed``, else a CRC of the request id (identical on every TP rank), and ``algorithm`` /
``steps_per_block`` / ``threshold`` and the decoder keys (Dream's ``confidence`` / ``schedule`` / ``eps`` /
``alg_temp``, LLaDA2.1's ``editing`` with ``editing_threshold`` / ``max_post_steps`` / ``num_to_transfer``) from
``custom_params["megadare"]`` over the YAML defaults. Token editing keeps a block open for up to block size +
``max_post_steps`` steps: the adapter answers sglang's ``max_steps`` (the synchronous loop's bound, 0.5.21+)
accordingly.

Structure: :class:`BlockDenoiser` (plain torch, tested without sglang) does the work; the sglang class built by
:func:`algorithm_class` is a thin adapter that subclasses sglang's ``DllmAlgorithm`` when sglang is importable.
Tests: tests/test_sglang_engine.py runs the adapter against a fake of the boundary above; tests/sglang_cpu/ runs
it in a real sglang 0.5.21 Engine on CPU (CI), loaded through the entry point, sync and FDFO loops, and compares
the trajectories with the built-in engine's. Unverified without a GPU: TP > 1 (the random streams are integer
arithmetic, the same on every device).

A fix for sglang's SDAR loader (0.5.20-0.5.23, ``sglang/srt/models/sdar.py`` ``SDARForCausalLM.load_weights``):
with ``tie_word_embeddings`` at TP 1 its ``lm_head`` *is* ``model.embed_tokens``, so the model has no
``lm_head.weight`` parameter, yet loading ``model.embed_tokens.weight`` looks one up (``KeyError:
'lm_head.weight'``): no tied SDAR checkpoint loads, at start or in a weight update. :func:`register` wraps that
method (:func:`tied_sdar_load_weights_hook`): while the head is the embedding, the load runs with the tie flag
down, so the embedding loads into the one shared tensor. SDAR-MoE's and LLaDA2's loaders handle ties already.

Cost: the step runs per request (its own stream and parameters), so each denoising step launches a few small
kernels per request and syncs on ``.any()``; fine for correctness-first RL rollouts, a batched fast path for
requests without a seed is future work.
"""

from __future__ import annotations

import logging
import zlib
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from megadare.rollout.dllm_step import BlockState, BlockTrace, Streams, dllm_step
from megadare.rollout.editing import Refinement
from megadare.rollout.choices import ALGORITHMS
from megadare.rollout.engine import SamplingParams

logger = logging.getLogger(__name__)

ALGORITHM_NAME = "MegadareBlockDiffusion"
TRACE_KEY = "megadare_trace"  # meta_info / req.customized_info key of the per-token trace
CUSTOM_PARAMS_KEY = "megadare"  # sampling_params["custom_params"][CUSTOM_PARAMS_KEY] = {...}
SUPPORTED_ARCHITECTURES = ("SDARForCausalLM", "SDARMoeForCausalLM", "LLaDA2MoeModelLM")
SGLANG_REQUIREMENT = "sglang>=0.5.20,<0.5.24"  # the versions whose dLLM/plugin internals this module follows
WORKER_HOOK_TARGET = "sglang.srt.managers.tp_worker.TpModelWorker._forward_batch_generation_dllm"
SDAR_LOAD_HOOK_TARGET = "sglang.srt.models.sdar.SDARForCausalLM.load_weights"
DECODER_KEYS = ("confidence", "schedule", "eps", "alg_temp", "editing_threshold", "max_post_steps", "num_to_transfer")
CONFIG_KEYS = ("block_size", "steps_per_block", "algorithm", "threshold", "seed") + DECODER_KEYS
REQUEST_KEYS = ("steps_per_block", "algorithm", "threshold", "seed") + DECODER_KEYS
_DECODER_TYPES = {
    "confidence": str,
    "schedule": str,
    "eps": float,
    "alg_temp": float,
    "editing_threshold": float,
    "max_post_steps": int,
    "num_to_transfer": int,
}
_TOP_K_ALL = 1 << 30  # sglang's "no top-k" (sampling_params.TOP_K_ALL)
_SEED_MOD = 2**63


# ---------------------------------------------------------------------------------------------- request params
def check_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The algorithm's YAML (``--dllm-algorithm-config``): only known keys, valid values."""
    unknown = sorted(set(config) - set(CONFIG_KEYS))
    if unknown:
        raise ValueError(f"{ALGORITHM_NAME} config: unknown keys {unknown}; known: {list(CONFIG_KEYS)}")
    out = dict(config)
    if "algorithm" in out and out["algorithm"] not in ALGORITHMS:
        raise ValueError(f"{ALGORITHM_NAME} config: algorithm {out['algorithm']!r} not in {ALGORITHMS}")
    return out


@dataclass(frozen=True)
class RequestSampling:
    """An sglang request's sampling fields as sglang stores them: ``temperature`` / ``top_p`` / ``top_k``
    (``top_k`` -1, 0 or ``1 << 30`` = off; ``top_k == 1`` or temperature 0 = greedy), ``custom_params``,
    ``sampling_seed`` and the request id ``rid``."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    custom_params: Optional[Mapping[str, Any]] = None
    sampling_seed: Optional[int] = None
    rid: str = ""


def request_params(
    block_size: int, defaults: Mapping[str, Any], request: RequestSampling = RequestSampling()
) -> SamplingParams:
    """megadare ``SamplingParams`` of one sglang request (only the fields a block step uses are meaningful).

    ``request``: its sampling fields (:class:`RequestSampling`); ``custom_params[CUSTOM_PARAMS_KEY]`` overrides
    ``defaults`` (the YAML) for ``steps_per_block`` / ``algorithm`` / ``threshold`` / ``seed`` and the decoder
    keys (``DECODER_KEYS``: Dream's confidence rules and schedule, LLaDA2.1's token editing). Raises ValueError on
    bad values."""
    over = dict((request.custom_params or {}).get(CUSTOM_PARAMS_KEY) or {})
    unknown = sorted(set(over) - set(REQUEST_KEYS))
    if unknown:
        raise ValueError(f"custom_params[{CUSTOM_PARAMS_KEY!r}]: unknown keys {unknown}; known: {list(REQUEST_KEYS)}")
    merged = {**{k: v for k, v in defaults.items() if k in REQUEST_KEYS}, **over}
    top_k = int(request.top_k) if request.top_k is not None else -1
    temperature = 1.0 if request.temperature is None else float(request.temperature)  # sglang's default
    greedy = temperature <= 1e-6 or top_k == 1
    if "seed" in over:
        seed = int(over["seed"])
    elif request.sampling_seed is not None:
        seed = int(request.sampling_seed)
    elif request.rid:
        seed = zlib.crc32(str(request.rid).encode())
    else:
        seed = int(merged.get("seed", 0))
    return SamplingParams(
        max_new_tokens=1,
        block_size=int(block_size),
        steps_per_block=int(merged.get("steps_per_block", block_size)),
        algorithm=str(merged.get("algorithm", "low_confidence_static")),
        threshold=float(merged.get("threshold", 0.9)),
        temperature=0.0 if greedy else temperature,
        top_k=0 if (greedy or top_k <= 0 or top_k >= _TOP_K_ALL) else top_k,
        top_p=float(request.top_p if request.top_p is not None else 1.0),
        seed=seed % _SEED_MOD,
        **_decoder_fields(merged),
    )


def _decoder_fields(merged: Mapping[str, Any]) -> dict[str, Any]:
    out = {}
    for k in DECODER_KEYS:
        if k in merged:
            try:
                out[k] = _DECODER_TYPES[k](merged[k])
            except (TypeError, ValueError):
                raise ValueError(f"{k}={merged[k]!r} is not a {_DECODER_TYPES[k].__name__}") from None
    return out


class RequestStream:
    """A request's random stream, kept for its whole generation (across blocks): its key (the seed,
    ``engine.prompt_seed`` of the prompt's index when it comes from ``SGLangEngine``) and its counter, the
    denoising steps it took so far (``dllm_step.Streams``); the built-in engine keeps the same two numbers per
    prompt, so a request reproduces its trajectory exactly."""

    def __init__(self, seed: int):
        self.seed = int(seed)
        self.steps = 0

    def streams(self, device: torch.device) -> Streams:
        return Streams.of([self.seed], [self.steps], device=device)


@dataclass
class RequestState:
    """One request's progress through one block."""

    params: SamplingParams
    rng: RequestStream
    block_step: int = 0
    emit: Optional[list[int]] = None  # positions masked when the block started: the tokens it emits
    trace: BlockTrace = field(default_factory=lambda: BlockTrace(1, keep_history=True))
    delivered: bool = False
    refine: Optional[Refinement] = None  # token editing: the block's post-step bookkeeping


# ---------------------------------------------------------------------------------------------- the core
class BlockDenoiser:
    """The algorithm without sglang: denoise blocks of ``block_size`` tokens (rows = requests).

    ``step`` is what sglang's ``DllmAlgorithm.step`` must do: given the logits of the forward that just ran on the
    current block tokens, report per row whether the block was already complete (done: nothing masked on entry),
    otherwise take one :func:`dllm_step` with the row's own parameters and stream. ``denoise_block`` is the
    synchronous loop (forward, step, ..., until every row reports done after a final forward) as
    ``DllmAlgorithm._run_sync`` drives it."""

    def __init__(self, block_size: int, mask_id: int, config: Optional[Mapping[str, Any]] = None):
        self.block_size = int(block_size)
        self.mask_id = int(mask_id)
        self.config = check_config(config or {})
        if "block_size" in self.config and int(self.config["block_size"]) != self.block_size:
            raise ValueError(
                f"{ALGORITHM_NAME}: config block_size={self.config['block_size']} but the engine "
                f"decodes blocks of {self.block_size}"
            )
        self.defaults = request_params(self.block_size, self.config)  # the YAML's (raises on bad defaults)

    def params_for(
        self,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = -1,
        custom_params: Optional[Mapping[str, Any]] = None,
        sampling_seed: Optional[int] = None,
        rid: str = "",
    ) -> SamplingParams:
        request = RequestSampling(temperature, top_p, top_k, custom_params, sampling_seed, rid)
        return request_params(self.block_size, self.config, request)

    def new_state(self, params: SamplingParams, rng: Optional[RequestStream] = None) -> RequestState:
        return RequestState(params=params, rng=rng if rng is not None else RequestStream(params.seed))

    def step(
        self,
        logits: torch.Tensor,
        tokens: torch.Tensor,
        states: Sequence[RequestState],
        prompt_mask: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, list[bool]]:
        """logits [n, B, V], tokens [n, B] (the block as the forward saw it), prompt_mask [n, B] (prompt
        positions, never decoded; by default every non-mask token at the block's start) -> (new tokens, done)."""
        n = tokens.shape[0]
        if logits.shape[:2] != tokens.shape or tokens.shape[1] != self.block_size or len(states) != n:
            raise ValueError(
                f"{ALGORITHM_NAME}: logits {tuple(logits.shape)}, tokens {tuple(tokens.shape)}, "
                f"{len(states)} states for block size {self.block_size}"
            )
        masked = tokens == self.mask_id
        if prompt_mask is not None:
            masked = masked & ~prompt_mask.to(masked.device, torch.bool)
        new = tokens.clone()
        done: list[bool] = []
        for i, st in enumerate(states):
            row = masked[i : i + 1]
            if st.emit is None:
                st.emit = row[0].nonzero().squeeze(1).tolist()
                if st.params.algorithm == "editing":
                    st.refine = Refinement(row, st.params)
            editable = st.refine.editable(tokens[i : i + 1], self.mask_id) if st.refine is not None else None
            if not bool(row.any()) and (editable is None or not bool(editable.any())):
                done.append(True)
                continue
            res = dllm_step(
                logits[i : i + 1],
                BlockState(tokens[i : i + 1], row, editable),
                st.block_step,
                st.params,
                st.rng.streams(logits.device),
                mask_token_id=self.mask_id,
            )
            if st.refine is not None:
                st.refine.after(row, res)
            st.trace.add(res, st.block_step)
            st.rng.steps += int(res.active[0])
            st.block_step += 1
            new[i] = res.tokens[0]
            done.append(st.refine is not None and st.refine.is_closed(0))  # a step that edited nothing closed it
        return new, done

    def max_steps(self, params: Sequence[SamplingParams] = ()) -> int:
        """Step calls a block may need in sglang's synchronous loop: one per denoising step plus the one that
        reports the block done (token editing: up to block size + max_post_steps steps)."""
        return max([p.block_forwards() for p in params] + [self.block_size]) + 1

    def denoise_block(
        self,
        forward: Callable[[torch.Tensor], torch.Tensor],
        tokens: torch.Tensor,
        states: Sequence[RequestState],
        prompt_mask: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Synchronous loop over one block: ``forward(tokens [n, B]) -> logits [n, B, V]``."""
        logits = forward(tokens)
        for _ in range(self.max_steps([st.params for st in states])):
            tokens, done = self.step(logits, tokens, states, prompt_mask)
            if all(done):
                break
            logits = forward(tokens)
        return tokens

    @staticmethod
    def trace_entries(state: RequestState, forwards_before: int) -> tuple[list[list[Any]], int]:
        """Per emitted token ``[global_step, block_step, logprob, forwards_after]`` (token editing: a fifth item,
        the commits an edit overwrote, ``[[global_step, block_step, logprob, token], ...]``, when there are
        any) and the request's step count after the block."""
        after = forwards_before + state.trace.num_steps[0]
        emit = state.emit or []
        entries = state.trace.entries(0, emit, forwards_before)
        out: list[list[Any]] = []
        for p, (g, s, lp) in zip(emit, entries):
            old = state.trace.superseded_entries(0, p, forwards_before)
            out.append([g, s, lp, after, old] if old else [g, s, lp, after])
        return out, after


# ---------------------------------------------------------------------------------------------- sglang adapter
def _deliver(req: Any, state: RequestState) -> None:
    """Append a finished block's per-token trace to ``req.customized_info[TRACE_KEY]`` (before sglang appends the
    block's tokens to ``req.output_ids``, so both stay aligned)."""
    if state.delivered:
        return
    state.delivered = True
    before = int(getattr(req, "_megadare_forwards", 0))
    entries, after = BlockDenoiser.trace_entries(state, before)
    req._megadare_forwards = after
    info = getattr(req, "customized_info", None)
    if info is None:
        info = {}
        req.customized_info = info
    trace = info.setdefault(TRACE_KEY, [])
    n_out = len(getattr(req, "output_ids", ()))
    if len(trace) != n_out:  # e.g. a retracted request re-encoded: keep alignment, mark the unknown tokens
        logger.warning(
            "%s: request %s has %d trace entries for %d output tokens",
            ALGORITHM_NAME,
            getattr(req, "rid", "?"),
            len(trace),
            n_out,
        )
        del trace[n_out:]
        trace.extend([None] * (n_out - len(trace)))
    trace.extend(entries)


def _request_sampling(req: Any) -> RequestSampling:
    """The sampling fields of sglang request ``req`` (its ``sampling_params`` and id)."""
    sp = req.sampling_params
    return RequestSampling(
        sp.temperature,
        sp.top_p,
        sp.top_k,
        getattr(sp, "custom_params", None),
        getattr(sp, "sampling_seed", None),
        str(getattr(req, "rid", "")),
    )


def _request_params(core: BlockDenoiser, req: Any) -> SamplingParams:
    """``req``'s megadare ``SamplingParams``, built at its first block and kept on it (``_megadare_params``): its
    sampling fields stay as they are while it runs, and sglang asks at every block (FDFO: every forward) in
    ``init_step_state`` and again in ``max_steps``."""
    params = getattr(req, "_megadare_params", None)
    if params is None:
        request = _request_sampling(req)
        try:
            params = request_params(core.block_size, core.config, request)
        except ValueError as e:  # validate_request rejects these before they get here; never crash the scheduler
            logger.error("%s: request %s: %s; using the engine defaults", ALGORITHM_NAME, request.rid, e)
            params = request_params(core.block_size, core.config, replace(request, custom_params=None))
        req._megadare_params = params
    return params


def _request_state(core: BlockDenoiser, req: Any) -> RequestState:
    params = _request_params(core, req)
    rng = getattr(req, "_megadare_rng", None)
    if rng is None or rng.seed != params.seed:
        rng = RequestStream(params.seed)
        req._megadare_rng = rng
    return core.new_state(params, rng)


class _AdapterMixin:
    """The sglang-facing methods; combined with sglang's ``DllmAlgorithm`` by :func:`algorithm_class`."""

    supported_architectures = SUPPORTED_ARCHITECTURES
    core: BlockDenoiser
    block_size: int
    _reqs: Optional[list]
    _warned_unbound: bool

    def _setup(self, config: Any) -> None:
        self.core = BlockDenoiser(config.block_size, config.mask_id, getattr(config, "algorithm_config", None))
        self._reqs = None
        self._warned_unbound = False

    def max_steps(self, block_size: int) -> int:
        """sglang's ``DllmAlgorithm.max_steps`` (0.5.21+; the synchronous loop's bound): room for token editing's
        refinement steps of the bound requests (the YAML defaults otherwise)."""
        params = [_request_params(self.core, r) for r in self._reqs or [] if getattr(r, "sampling_params", None)]
        return self.core.max_steps(params + [self.core.defaults])

    def bind_requests(self, reqs: Optional[Sequence[Any]]) -> None:
        """Set by the worker hook for the duration of one ``run``: the ``Req`` of every forward-batch row."""
        self._reqs = list(reqs) if reqs is not None else None

    @classmethod
    def validate_request(cls, req: Any) -> Optional[str]:
        sp = getattr(req, "sampling_params", None)
        if sp is None:
            return None
        block = getattr(getattr(req, "dllm_config", None), "block_size", None) or 1 << 20
        try:
            request_params(block, {}, _request_sampling(req))
        except ValueError as e:
            return f"{ALGORITHM_NAME}: {e}"
        return None

    def init_step_state(self, forward_batch: Any) -> list:
        n = forward_batch.batch_size
        reqs = self._reqs
        if reqs is not None and len(reqs) == n:
            return [_request_state(self.core, r) for r in reqs]
        if not self._warned_unbound:
            logger.error(
                "%s: the worker hook did not bind the batch's requests (is megadare's sglang plugin "
                "loaded? see SGLANG_PLUGINS); decoding with the engine defaults and recording no trace",
                ALGORITHM_NAME,
            )
            self._warned_unbound = True
        info = getattr(forward_batch, "sampling_info", None)
        states = []
        for i in range(n):
            t = float(info.temperatures.view(-1)[i]) if info is not None else 0.0
            p = float(info.top_ps.view(-1)[i]) if info is not None else 1.0
            k = int(info.top_ks.view(-1)[i]) if info is not None else -1
            states.append(self.core.new_state(self.core.params_for(t, p, k)))
        return states

    def step(self, forward_batch: Any, full_logits: torch.Tensor, states: list) -> list[bool]:
        n = forward_batch.batch_size
        logits = full_logits.view(n, self.block_size, -1)
        tokens = forward_batch.input_ids.view(n, self.block_size)
        prompt_mask = getattr(forward_batch, "dllm_prompt_mask", None)
        new, done = self.core.step(logits, tokens, states, prompt_mask)
        forward_batch.input_ids.copy_(new.view(-1))  # in place: keeps the tensor CUDA-graph safe
        reqs = self._reqs
        if reqs is not None and len(reqs) == n:
            for i, d in enumerate(done):
                if d and states[i] is not None:
                    _deliver(reqs[i], states[i])
        return done


_ALGORITHM_CLASS: Optional[type] = None


def algorithm_class() -> type:
    """The sglang algorithm class ``MegadareBlockDiffusion`` (a subclass of sglang's ``DllmAlgorithm``); needs
    sglang importable. Built once."""
    global _ALGORITHM_CLASS
    if _ALGORITHM_CLASS is None:
        from sglang.srt.dllm.algorithm.base import DllmAlgorithm  # optional: sglang

        def __init__(self, config):
            DllmAlgorithm.__init__(self, config)
            self._setup(config)

        _ALGORITHM_CLASS = type(
            ALGORITHM_NAME,
            (_AdapterMixin, DllmAlgorithm),
            {
                "__init__": __init__,
                "__module__": __name__,
                "__doc__": "megadare's sampled block diffusion with a per-token trace (see megadare.rollout."
                "sglang_plugin).",
            },
        )
    return _ALGORITHM_CLASS


def bind_requests_hook(original: Callable, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook on ``TpModelWorker._forward_batch_generation_dllm(self, forward_batch, batch=None)``: give the
    worker's dLLM algorithm the batch's requests while it runs."""
    worker = args[0]
    batch = args[2] if len(args) > 2 else kwargs.get("batch")
    algo = getattr(worker, "dllm_algorithm", None)
    bind = getattr(algo, "bind_requests", None)
    if bind is None:
        return original(*args, **kwargs)
    bind(getattr(batch, "reqs", None) if batch is not None else None)
    try:
        return original(*args, **kwargs)
    finally:
        bind(None)


def tied_sdar_load_weights_hook(original: Callable, model: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook on sglang's ``SDARForCausalLM.load_weights(self, weights)``: when the model's ``lm_head`` is its
    ``model.embed_tokens`` (tied embeddings, one shared tensor), run the load with ``config.tie_word_embeddings``
    down, so sglang loads the embedding as a plain parameter instead of looking up the missing
    ``lm_head.weight`` (see the module docstring). Anything else goes to the original unchanged."""
    config = getattr(model, "config", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    shared = embed is not None and getattr(model, "lm_head", None) is embed
    if not (shared and getattr(config, "tie_word_embeddings", False)):
        return original(model, *args, **kwargs)
    config.tie_word_embeddings = False
    try:
        return original(model, *args, **kwargs)
    finally:
        config.tie_word_embeddings = True


_HOOK_REGISTERED = False


def register() -> None:
    """Entry point of the ``sglang.srt.plugins`` group (setup.py: ``megadare = megadare.rollout.sglang_plugin:
    register``), run by sglang's ``load_plugins()`` in every sglang process: makes ``--dllm-algorithm
    MegadareBlockDiffusion`` resolvable and installs the request-binding worker hook and the tied-SDAR load fix."""
    global _HOOK_REGISTERED
    import sglang.srt.dllm.algorithm as algorithms  # optional: sglang
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType  # optional: sglang

    algorithms.algo_name_to_cls[ALGORITHM_NAME] = algorithm_class()
    if not _HOOK_REGISTERED:
        HookRegistry.register(WORKER_HOOK_TARGET, bind_requests_hook, HookType.AROUND)
        HookRegistry.register(SDAR_LOAD_HOOK_TARGET, tied_sdar_load_weights_hook, HookType.AROUND)
        _HOOK_REGISTERED = True
