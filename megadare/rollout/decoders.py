"""How the built-in engine decodes a call's prompts (``native.NativeEngine.generate``): the continuous-batching
driver (:class:`Decoder`: slots, admission at block boundaries, compaction, the per-block trace and host read) and
the two decoders over it, block diffusion on each sample's own grid (:class:`BlockDiffusionDecoder`: SDAR, TraDo,
LLaDA2) and semi-autoregressive full attention (:class:`SemiARDecoder`: LLaDA, Dream, exact or with Fast-dLLM caches).
The engine owns the model, the static cache and the compiled forward; a decoder calls them through it
(``self.e``) and never builds its own."""

from __future__ import annotations

from abc import ABC, abstractmethod
import functools
import math
from collections import deque
from typing import Any, Optional

import torch

from megadare.rollout.dllm_step import (
    BlockState,
    BlockTrace,
    commit_counts,
    history_from_host,
    propose,
    step_purposes,
    Streams,
)
from megadare.rollout.editing import Refinement, work_left
from megadare.rollout.engine import SamplingParams, Superseded, Trajectory, prompt_seed
from megadare.rollout.sampling import mix64


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


# device types whose reads wait for the device's queue: there ``stop_at_eos`` learns who found an EOS a block late
# (StopFlags); elsewhere (a CPU) the flags are read at once, since a delay would only cost a block's forwards
DEFERRED_STOP_READS = ("cuda",)


class StopFlags:
    """Which rows hold an EOS, on their way to the host without a wait: :meth:`send` starts the copy of the
    device's flags at a block's end (CUDA: into pinned memory, ``non_blocking``, then an event), :meth:`receive`
    takes them at the end of the next block, after that block's work is queued, so the host never drains the
    GPU's queue to learn who finished (a blocking read per block left the GPU idle while the host launched the
    next block). Used on :data:`DEFERRED_STOP_READS` only. Rows are those of the batch after the send's
    compaction; rows admitted since were not sent and have not stopped."""

    def __init__(self, rows: int, device: torch.device):
        self.cuda = device.type == "cuda"
        host = torch.zeros(rows, dtype=torch.bool)
        self.host = host.pin_memory() if self.cuda else host
        self.sent = 0
        self.event: Optional[Any] = None

    def send(self, flags: torch.Tensor) -> None:
        self.sent = flags.shape[0]
        self.host[: self.sent].copy_(flags, non_blocking=self.cuda)
        if self.cuda:
            self.event = torch.cuda.Event()
            self.event.record()

    def receive(self, n: int) -> list[bool]:
        """The flags of rows [0, n) as sent (False for rows admitted after the send); waits, on CUDA, only for
        the copy queued a block earlier."""
        if self.event is not None:
            self.event.synchronize()
            self.event = None
        got = self.host[: min(self.sent, n)].tolist() if self.sent else []
        return got + [False] * (n - len(got))


class FinishedRows:
    """The rows that finished at a block, on their way to the host without a wait: their device buffers are copied
    aside (their slots take queued prompts) and to the host (CUDA: pinned memory, ``non_blocking``, an event),
    with their host lists; :meth:`read` takes them once the next block is queued (or at the call's end). A read
    right away waited for the block just launched (a sync at every block where a row finished)."""

    NAMES = ("first", "resp", "steps", "tokens", "fwd", "bstep", "logp")

    def __init__(self, dev: dict[str, torch.Tensor], host: dict[str, list], rows: list[int]):
        device = dev["steps"].device
        index = _to_device(rows, torch.long, device)
        cuda = device.type == "cuda"
        self.tensors = {k: dev[k].index_select(0, index).to("cpu", non_blocking=cuda) for k in self.NAMES}
        self.event: Optional[Any] = torch.cuda.Event() if cuda else None
        if self.event is not None:
            self.event.record()
        self.host = {k: [v[i] for i in rows] for k, v in host.items()}

    def read(self) -> dict[str, list]:
        """The rows' buffers and host lists, row j of each for :meth:`Decoder.trajectory` (one read per buffer)."""
        if self.event is not None:
            self.event.synchronize()
        return {**{k: t.tolist() for k, t in self.tensors.items()}, **self.host}


class BlockHistory:
    """One block's kept steps (token editing's overwritten commits, MDPO's per-step proposals) of rows [0, n), on
    their way to the host without a wait: copied at the block's end (CUDA: ``non_blocking``, then an event) with
    each row's step count before the block and the decode column of the block's first position; read when a row
    that took part finishes (:meth:`Decoder.trajectory`), long after the copy. Read at the block's end, they cost
    4 + 8 * steps blocking reads per block on CUDA (``BlockTrace.superseded``, ``.preds``), with the next block
    not yet launched."""

    def __init__(self, trace: BlockTrace, before: torch.Tensor, first: torch.Tensor):
        cuda = before.device.type == "cuda"
        tensors = (before, first, *trace.stacked_history())
        self.tensors = [t.to("cpu", non_blocking=cuda, copy=True) for t in tensors]  # a copy: steps moves on
        self.event: Optional[Any] = torch.cuda.Event() if cuda else None
        if self.event is not None:
            self.event.record()
        self.n, self.record_steps = before.shape[0], trace.record_steps
        self.rows: Optional[list[tuple[dict, list]]] = None

    def row(self, i: int) -> tuple[dict, list]:
        """Row ``i``'s overwritten commits by decode column, ``(global step, block step, log-prob, token)`` each,
        and its ``(decode column of the block, proposals, confidences)`` per step (the block's rows read once)."""
        if self.rows is None:
            if self.event is not None:
                self.event.synchronize()
            before, first, *fields = (t.tolist() for t in self.tensors)
            superseded, preds, confs = history_from_host(fields, self.n, self.record_steps)
            self.rows = [
                (
                    {
                        c + first[b]: [(before[b] + f, s, lp, tok) for f, s, lp, tok in chain]
                        for c, chain in sup.items()
                    },
                    [(first[b], pr, cf) for pr, cf in zip(preds[b], confs[b])],
                )
                for b, sup in enumerate(superseded)
            ]
            self.tensors = []
        return self.rows[i]


def _row_history(blocks: list[tuple[BlockHistory, int]]) -> tuple[dict, list]:
    """A row's overwritten commits (by decode column) and per-step proposals over its blocks ``blocks``
    (:class:`BlockHistory` and the row's index in it, in block order)."""
    superseded: dict = {}
    preds: list = []
    for block, i in blocks:
        sup, pr = block.row(i)
        superseded.update(sup)
        preds += pr
    return superseded, preds


class Decoder(ABC):
    """The continuous-batching driver and the per-slot state both decoders share (``engine``: the
    ``native.NativeEngine`` that runs the forwards).

    A slot is a row of the running batch (rows [0, n) are live). Device tensors per slot live in ``self.dev``
    (moved together when the batch is compacted), host lists in ``self.host``. Columns: every slot has a token
    store (block diffusion: the sample's grid from position 0; full attention: prompt ++ canvas) and the response
    trace buffers ``fwd`` / ``bstep`` / ``logp`` over decode columns (column 0 = the first decoded position of
    the first block, i.e. grid column ``first``)."""

    def __init__(self, engine: Any, prompts: list[list[int]], params: SamplingParams, width: int, decode_cols: int):
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
            "stopped": torch.zeros(cap, dtype=torch.bool, device=dev),  # an EOS in the response: frozen, leaving
        }
        # a row found stopped rides a block frozen: stop_at_eos where reads wait for the device (StopFlags)
        self.freezes = params.stop_at_eos and engine.device.type in DEFERRED_STOP_READS
        self.stops = StopFlags(cap, engine.device) if self.freezes else None
        self.host: dict[str, list] = {k: [] for k in ("prompt", "block", "blocks", "start", "history")}
        self.static_steps = params.algorithm not in ("low_confidence_dynamic", "editing")

    # ------------------------------------------------------------------ driver
    def run(self) -> list[Trajectory]:
        queue = deque(range(len(self.prompts)))
        out: list[Optional[Trajectory]] = [None] * len(self.prompts)
        finished: Optional[FinishedRows] = None  # the previous block's, on their way to the host
        while queue or self.host["prompt"]:
            live = len(self.host["prompt"])
            if queue and live < self.cap:
                new = [queue.popleft() for _ in range(min(self.cap - live, len(queue)))]
                self.admit(live, new)
            done = self.round(len(self.host["prompt"]))
            if finished is not None:  # now that this block is queued: no wait for it
                self.deliver(finished, out)
            finished = FinishedRows(self.dev, self.host, [i for i, d in enumerate(done) if d]) if any(done) else None
            keep = [i for i, d in enumerate(done) if not d]
            self.compact(keep)
            if self.freezes:  # who found an EOS, for the host at the end of the next block
                self.stops.send(self.dev["stopped"][: len(keep)])
        if finished is not None:
            self.deliver(finished, out)
        return out  # type: ignore[return-value]

    def deliver(self, finished: FinishedRows, out: list[Optional[Trajectory]]) -> None:
        """The trajectories of ``finished`` into ``out`` (by prompt index)."""
        rows = finished.read()
        for j, prompt in enumerate(rows["prompt"]):
            out[prompt] = self.trajectory(j, rows)

    def admit(self, start: int, indices: list[int]) -> None:
        """Put prompts ``indices`` into slots [start, start + len): subclass fills tokens / columns first."""
        dev = self.e.device
        seeds = [prompt_seed(self.params.seed, i) for i in indices]
        rows = slice(start, start + len(indices))
        self.dev["keys"][rows] = _to_device(seeds, torch.long, dev)
        self.dev["base"][rows] = mix64(self.dev["keys"][rows])
        self.dev["steps"][rows] = 0
        self.dev["stopped"][rows].fill_(False)
        self.host["prompt"] += indices
        self.host["block"] += [0] * len(indices)
        self.host["history"] += [[] for _ in indices]  # (BlockHistory, row in it) per block

    def compact(self, keep: list[int]) -> None:
        """Keep rows ``keep`` (in order) as rows [0, len(keep))."""
        moved = [(s, d) for d, s in enumerate(keep) if s != d]
        if moved:
            src = _to_device([s for s, _ in moved], torch.long, self.e.device)
            dst = _to_device([d for _, d in moved], torch.long, self.e.device)
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
        p = self.params
        cols = self.dev["start"][:n, None] + torch.arange(self.B, device=self.e.device)
        self.begin_block(n, cols)
        cur = start_tokens = self.dev["tokens"][:n].gather(1, cols)
        trace = BlockTrace(n, p.record_steps, keep_history=p.algorithm == "editing")
        steps = self.block_steps(n) if self.static_steps else p.block_forwards()
        block_streams = Streams(self.dev["keys"][:n], self.dev["steps"][:n], self.dev["base"][:n])
        # a row steps at most once a forward: ``steps`` numbers ahead per row
        block_streams = block_streams.ahead(step_purposes(p), self.B, steps, self.e.draw_ahead)
        if p.algorithm == "editing" and not self.predicts_later():
            cur = self._editing_steps(trace, block_streams, (n, cols, steps, cur))
        else:
            cur = self._steps(trace, block_streams, (n, cols, steps, cur))
        if self.freezes:  # a row stopped a block ago keeps its tokens (it leaves at this block's end)
            cur = torch.where(self.dev["stopped"][:n, None], start_tokens, cur)
        self.write_block(n, cols, cur)
        self.end_block(n, cols)
        return self.record(n, cols, cur, trace)

    def _steps(
        self, trace: BlockTrace, block_streams: Streams, at: tuple[int, torch.Tensor, int, torch.Tensor]
    ) -> torch.Tensor:
        """The block's steps (``at``: n, the block's columns, its most steps, its tokens): a static schedule's as
        one compiled call each (:meth:`_fused_step`); the dynamic threshold's, per-step records', and token
        editing's with predictions of later blocks (:meth:`predicts_later`), step by step, one flag read per step.
        Returns the block's tokens."""
        p, M = self.params, self.M
        n, cols, steps, cur = at
        refine = Refinement(cur == M, p) if p.algorithm == "editing" else None
        step_index = torch.zeros(n, dtype=torch.long, device=self.e.device)  # a tensor: no recompile per step
        fused = refine is None and not trace.keep_history  # the step and its record: one compiled call
        for s in range(steps):
            if not (fused and self.static_steps):
                masked = cur == M
                editable = refine.editable(cur, M) if refine is not None else None
            if not self.static_steps:  # dynamic threshold / token editing: one flag read per step
                work = work_left(BlockState(cur, masked, editable), self.dev["stopped"][:n] if self.freezes else None)
                if not bool(work):
                    break
            if fused:
                cur = self._fused_step(trace, block_streams, (n, cols, s, cur))
                continue
            logits = self.block_logits(n, cols, s, cur)
            streams = block_streams.at(trace.count)
            later = None
            if logits.shape[1] > self.B:  # record_steps, full attention: the later blocks' predictions too
                logits, ahead = logits[:, : self.B], logits[:, self.B :]
                later = propose(ahead, p, streams, self.B, M)
            step = self.e.dllm_step(logits, BlockState(cur, masked, editable), step_index, p, streams, M)
            if refine is not None:
                refine.after(masked, step)
            trace.add(step, step_index, later)
            step_index = step_index + 1
            cur = step.tokens
        return cur

    def _editing_steps(
        self, trace: BlockTrace, block_streams: Streams, at: tuple[int, torch.Tensor, int, torch.Tensor]
    ) -> torch.Tensor:
        """Token editing's block (``at`` as :meth:`_steps`): per step a forward, one compiled call
        (``editing.editing_step``: the step, its history entry, the refinement's bookkeeping and the next step's
        editable positions; ~70 eager ops a step when run one by one) and the read of its work flag (whether to
        launch another forward). The same numbers as :meth:`_steps`. Returns the block's tokens."""
        n, cols, steps, cur = at
        stopped = self.dev["stopped"][:n] if self.freezes else None
        block, state, work = self.e.editing_start(cur, stopped, self.M, self.params.max_post_steps)
        for s in range(steps):
            if not bool(work):
                break
            logits = self.block_logits(n, cols, s, block.tokens)
            block, state, work, entry = self.e.editing_step(logits, block, state, self.params, block_streams, self.M)
            trace.keep(entry, state.trace)
        return block.tokens

    def _fused_step(
        self, trace: BlockTrace, streams: Streams, at: tuple[int, torch.Tensor, int, torch.Tensor]
    ) -> torch.Tensor:
        """One denoising step of rows [0, n) (``at``: n, the block's columns, the block-local step, its tokens)
        whose trace keeps no history: the forward, then sampling, commits and the record in one (compiled)
        call, ``dllm_step.denoise_step`` (the step index lives in the trace). Returns the block's tokens."""
        n, cols, s, cur = at
        logits = self.block_logits(n, cols, s, cur)
        step, state = self.e.step(logits, cur, trace.state(cur), self.params, streams, self.M)
        trace.load(state)
        return step.tokens

    def block_steps(self, n: int) -> int:
        """Forwards the block takes (static schedules): the most any live row needs."""
        return max(_steps_needed(self.params, self.masked_at_start(i)) for i in range(n))

    def record(self, n: int, cols: torch.Tensor, cur: torch.Tensor, trace: BlockTrace) -> list[bool]:
        """The block's trace into the rows' buffers (on the device) and who finished. ``stop_at_eos``: a row whose
        response holds an EOS is marked ``stopped`` on the device; on a CPU the host reads the flags at once and the
        row leaves at this block's end; on CUDA (``freezes``) it learns them at the end of the next block
        (:class:`StopFlags`: no wait for the block just launched), in which the row changes nothing (no commit,
        step or token recorded) and then leaves, so its trajectory is the one it had."""
        d = self.dev
        frozen = self.stops.receive(n) if self.freezes else [False] * n
        stopped = d["stopped"][:n]
        if trace.count is not None:
            dcols = cols - d["first"][:n, None]
            committed = trace.forward >= 0
            if self.freezes:
                committed = committed & ~stopped[:, None]
            for name, new in (
                ("fwd", d["steps"][:n, None] + trace.forward),
                ("bstep", trace.block_step),
                ("logp", trace.logprob),
            ):
                old = d[name][:n].gather(1, dcols)
                d[name][:n].scatter_(1, dcols, torch.where(committed, new, old))
            if trace.keep_history:
                self.record_history(n, trace, frozen)
            d["steps"][:n] += trace.count.masked_fill(stopped, 0) if self.freezes else trace.count
        d["start"][:n] += self.B
        if self.params.stop_at_eos:
            in_resp = (cols - d["first"][:n, None]) >= d["resp"][:n, None]
            stopped |= ((cur == self.e.eos) & in_resp).any(dim=1)
        ends = frozen if self.freezes or not self.params.stop_at_eos else stopped.tolist()  # a read at once: CPU
        for i in (i for i in range(n) if not frozen[i]):
            self.host["block"][i] += 1
            self.host["start"][i] += self.B
        return [f or self.host["block"][i] >= self.host["blocks"][i] for i, f in enumerate(ends)]

    def record_history(self, n: int, trace: BlockTrace, frozen: list[bool]) -> None:
        """Token editing's overwritten commits and MDPO's per-step proposals of the rows not ``frozen`` (stopped
        a block ago: :meth:`record`): sent to the host without a wait (:class:`BlockHistory`), read when the row
        finishes."""
        sent = BlockHistory(trace, self.dev["steps"][:n], self.dev["start"][:n] - self.dev["first"][:n])
        for i in (i for i in range(n) if not frozen[i]):
            self.host["history"][i].append((sent, i))

    # ------------------------------------------------------------------ result
    def trajectory(self, i: int, rows: dict[str, list]) -> Trajectory:
        """Response = decoded tokens up to the first EOS (inclusive) or max_new_tokens; without ``stop_at_eos``
        the whole canvas of max_new_tokens (finish 'eos' when it holds an EOS: the answer ended). ``rows``: the
        buffers and host lists of the rows that finished with it (:meth:`FinishedRows.read`), ``i`` its row."""
        p = self.params
        first, resp = rows["first"][i], rows["resp"][i]
        cols = rows["block"][i] * self.B - resp
        toks = rows["tokens"][i][first + resp : first + resp + cols]
        end = min(len(toks), p.max_new_tokens)
        finish = "eos" if self.e.eos in toks[:end] else "length"
        if p.stop_at_eos and finish == "eos":
            end = toks.index(self.e.eos) + 1
        fwd = rows["fwd"][i][resp : resp + end]
        bstep = rows["bstep"][i][resp : resp + end]
        logp = rows["logp"][i][resp : resp + end]
        history, step_preds = _row_history(rows["history"][i])
        superseded = [Superseded(c, tok, g, s, lp) for c in range(end) for g, s, lp, tok in history.get(c + resp, [])]
        traj = Trajectory(
            prompt_ids=list(self.prompts[rows["prompt"][i]]),
            response_ids=toks[:end],
            commit_step=fwd,
            block_step=bstep,
            logprobs=logp,
            finish_reason=finish,
            num_forwards=rows["steps"][i],
            params=p,
            policy_version=self.e.version,
            superseded=superseded if p.algorithm == "editing" else None,
        )
        if p.record_steps:
            traj.step_predictions, traj.step_confidences = _response_aligned(step_preds, resp, end)
        return traj.validate()

    # ------------------------------------------------------------------ per decoder
    def masked_at_start(self, i: int) -> int:
        return self.B

    def predicts_later(self) -> bool:
        """Whether a step's forward may also predict columns after the block (full attention's MDPO records)."""
        return False

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


class BlockDiffusionDecoder(Decoder):
    """Block diffusion over each sample's own grid; the static cache's column = the token's position."""

    def __init__(self, engine: Any, prompts: list[list[int]], params: SamplingParams):
        B = params.block_size
        self.pre = [len(p) // B * B for p in prompts]
        self.rem = [len(p) - q for p, q in zip(prompts, self.pre)]
        self.need = [math.ceil((r + params.max_new_tokens) / B) for r in self.rem]
        width = max(q + k * B for q, k in zip(self.pre, self.need))
        super().__init__(engine, prompts, params, width, max(self.need) * B)
        self.host.update(pre=[], rem=[], pending=[])
        self.dev["pending"] = torch.zeros(self.cap, dtype=torch.bool, device=engine.device)  # host["pending"]
        self.cache = engine.kv_cache(self.cap, width) if engine.use_cache else None
        self._allowed: Optional[torch.Tensor] = None
        self._first: Optional[tuple[torch.Tensor, ...]] = None

    def admit(self, start: int, indices: list[int]) -> None:
        d, dev = self.dev, self.e.device
        width = d["tokens"].shape[1]
        tokens = [list(self.prompts[i]) + [self.M] * (width - len(self.prompts[i])) for i in indices]
        d["tokens"][start : start + len(indices)] = _to_device(tokens, torch.long, dev)  # one copy
        pre = _to_device([self.pre[i] for i in indices], torch.long, dev)
        rows = slice(start, start + len(indices))
        d["start"][rows], d["first"][rows] = pre, pre
        d["resp"][rows] = _to_device([self.rem[i] for i in indices], torch.long, dev)
        self.host["pre"] += [self.pre[i] for i in indices]
        self.host["rem"] += [self.rem[i] for i in indices]
        self.host["start"] += [self.pre[i] for i in indices]
        self.host["blocks"] += [self.need[i] for i in indices]
        self.host["pending"] += [False] * len(indices)
        d["pending"][rows].fill_(False)  # fill_: no host tensor to copy (a sync on CUDA)
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
        valid = pos < _to_device([self.pre[i] for i in indices], torch.long, dev)[:, None]
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
            pending = self.dev["pending"][:n]  # host["pending"] on the device (no host-to-device copy, a sync on CUDA)
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
        self.dev["pending"][:n].fill_(self.cache is not None)


def _to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host ``values`` on ``device`` without a wait: on CUDA through pinned memory, ``non_blocking``
    (``torch.tensor(values, device=...)`` copies from pageable memory and then waits for the GPU's queue)."""
    t = torch.tensor(values, dtype=dtype)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)


def _bc_mask(q_pos: torch.Tensor, k_valid: torch.Tensor, k_pos: torch.Tensor, B: int) -> torch.Tensor:
    """Block-causal allowed mask [n, 1, Q, K] from positions on each sample's own grid + key validity."""
    allowed = (k_pos[:, None, :] // B) <= (q_pos[:, :, None] // B)
    return (allowed & k_valid[:, None, :]).unsqueeze(1)


class SemiARDecoder(Decoder):
    """Full attention: every row is its prompt, left-padded to the longest of the call, then the canvas."""

    def __init__(self, engine: Any, prompts: list[list[int]], params: SamplingParams):
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
            d["tokens"][row, pad:P] = _to_device(p, torch.long, dev)
            d["valid"][row] = torch.arange(self.L, device=dev) >= pad
            d["pos"][row] = (torch.arange(self.L, device=dev) - pad).clamp(min=0)
        rows = slice(start, start + len(indices))
        d["start"][rows], d["first"][rows], d["resp"][rows] = P, P, 0
        self.host["start"] += [P] * len(indices)
        self.host["blocks"] += [self.n_blocks] * len(indices)
        super().admit(start, indices)

    def predicts_later(self) -> bool:
        return self.params.record_steps

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
