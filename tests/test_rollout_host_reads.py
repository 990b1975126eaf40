"""What the built-in engine's block loop reads on the host, beyond the stop flags (tests/test_rollout_batched.py):
each read of a device value is a sync on CUDA, after which the GPU idles while the host launches the next work.

* token editing's overwritten commits and MDPO's per-step records (``BlockTrace`` history) are copied to the host
  at a block's end without a wait (``decoders.BlockHistory``) and read when a row finishes, not in the loop; the
  recorded traces exactly, through a batch of two and with the stop flags read a block late (frozen rows);
* under CUDA graphs (emulated) a batch that is not a power of two pads its rows without rebuilding, per step,
  the padding of what the block's steps share (``native.PaddedRows``);
* a compiled step makes no tensor of its float settings at each call, and a new value of one compiles nothing
  (``native.FloatInputs``: 0-dim tensors the engine owns);
* a block's random numbers are one compiled call and binding the cache makes no tensor (per-block eager ops).
"""

from __future__ import annotations

import sys

import pytest
import torch
from torch.overrides import TorchFunctionMode

import native_traces as nt
from megadare.rollout import decoders
from megadare.rollout.engine import SamplingParams
from megadare.rollout.native import NativeEngine, NativeSettings
from test_rollout_batched import _eager_ops, _same_as_recorded, graphs_emulated


class LoopReads(TorchFunctionMode):
    """Reads of tensor values into Python made while ``Decoder.round`` runs (the block loop), by function."""

    READS = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "numpy"}

    def __init__(self, monkeypatch):
        super().__init__()
        self.where: list[str] = []
        self.in_round = False
        round_ = decoders.Decoder.round

        def watched(decoder, n):
            self.in_round = True
            try:
                return round_(decoder, n)
            finally:
                self.in_round = False

        monkeypatch.setattr(decoders.Decoder, "round", watched)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.in_round and getattr(func, "__name__", "") in self.READS:
            code = sys._getframe(1).f_code
            self.where.append(f"{code.co_filename.rsplit('/', 1)[-1]}:{code.co_name}")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("deferred", [False, True], ids=["at-once", "deferred"])
@pytest.mark.parametrize("case_id", ["llada2-editing", "sdar-nocache-mdpo", "llada-none-mdpo"])
def test_kept_histories_reach_the_host_when_their_rows_finish(case_id, deferred, monkeypatch):
    """Token editing's ``superseded`` and MDPO's step records: before, ``record_history`` read the block's trace
    at its end (``BlockTrace.superseded`` / ``.preds``: 4 + 8 reads per step of the block, each a sync on CUDA)
    and two more buffers, before the next block was launched. Now the block loop reads nothing of them (only the
    per-step work flag of the editing decoder, in ``_editing_steps`` or ``_steps``, and the stop flags); the
    traces are those recorded."""
    if deferred:
        monkeypatch.setattr(decoders, "DEFERRED_STOP_READS", ("cpu", "cuda"))
    case = next(c for c in nt.CASES if c[0] == case_id)
    with LoopReads(monkeypatch) as reads:
        got = nt.run_case(case, max_batch=2)
    history_sites = [s for s in reads.where if s.startswith("dllm_step.py") or s.endswith(":record_history")]
    assert not history_sites, sorted(set(history_sites))
    allowed = {"decoders.py:_editing_steps", "decoders.py:_steps", "decoders.py:record", "decoders.py:receive"}
    allowed |= {"decoders.py:_steps_needed"}
    assert set(reads.where) <= allowed, sorted(set(reads.where))
    _same_as_recorded(case_id, got)


@pytest.mark.parametrize("record_steps", [False, True], ids=["editing", "editing-mdpo"])
def test_frozen_rows_keep_no_history_of_their_last_block(record_steps, monkeypatch):
    """stop_at_eos with the stop flags read a block late (CUDA, forced here): a row found stopped rides one block
    frozen and records nothing of it; its edits and step records, sent at each block's end and read at its
    finish (never in the block loop), are the ones read at once (sampled, through a batch of two)."""
    model, arch = nt.build("llada2", **nt.LLADA2_SMALL)
    params = SamplingParams(
        max_new_tokens=16,
        block_size=4,
        temperature=0.9,
        seed=5,
        algorithm="editing",
        threshold=0.5,
        editing_threshold=0.3,
        record_steps=record_steps,
    )

    def run(eos: int) -> list:
        eng = NativeEngine(model, arch, eos_token_id=eos, device="cpu", settings=NativeSettings(max_batch=2))
        return eng.generate(nt.PROMPTS, params)

    first = run(-1)[0].response_ids
    eos = first[len(first) // 3]
    at_once = run(eos)
    monkeypatch.setattr(decoders, "DEFERRED_STOP_READS", ("cpu", "cuda"))
    with LoopReads(monkeypatch) as reads:
        deferred = run(eos)
    loops = {"decoders.py:_editing_steps", "decoders.py:_steps"}  # the work flag
    assert set(reads.where) <= loops | {"decoders.py:receive"}, sorted(set(reads.where))
    for a, b in zip(deferred, at_once):  # a frozen row changes the batch's shape: float rounding may move
        assert _exact(a) == _exact(b)
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
        assert [e.logprob for e in a.superseded] == pytest.approx([e.logprob for e in b.superseded], abs=1e-5)
        for x, y in zip(a.step_confidences or [], b.step_confidences or []):
            assert x == pytest.approx(y, abs=1e-5)
    assert 0 < sum(t.finish_reason == "eos" for t in at_once) < len(at_once)
    assert sum(len(t.superseded) for t in at_once) > 0


def _exact(t) -> tuple:
    """What a trajectory must reproduce exactly: tokens, steps, finish, forwards, edits, step predictions."""
    edits = [(e.position, e.token, e.commit_step, e.block_step) for e in t.superseded or []]
    return (t.response_ids, t.commit_step, t.block_step, t.finish_reason, t.num_forwards, edits, t.step_predictions)


def test_padding_rows_for_cuda_graphs_costs_one_op_per_step(monkeypatch):
    """Under rollout.compile on CUDA (emulated: static shapes, dynamo's aot_eager, graph calls marked) 3 rows run
    in the graphs of 4: each forward's inputs get a padding row. Before, every input was padded anew at every
    step (``new_full`` + ``cat`` for the tokens, the positions and the attention mask: 6 eager ops between two
    graph replays); now the block's positions and mask, the same tensors at every step, are padded once per block
    and the tokens' padding row is made once: one ``cat`` per step, and the logits' slice to the live rows.
    Counted as the difference between 4 and 2 steps per block: eager ops per extra forward."""
    model, arch = nt.build("sdar")
    eng = graphs_emulated(model, arch, monkeypatch)
    short = min(len(p) for p in nt.PROMPTS[:3])
    prompts = [p[:short] for p in nt.PROMPTS[:3]]  # 3 rows that finish together: one padding row throughout
    counts, trajs = {}, {}
    for steps in (4, 2):
        params = SamplingParams(
            max_new_tokens=8, block_size=4, steps_per_block=steps, temperature=1.0, seed=1, stop_at_eos=False
        )
        trajs[steps] = eng.generate(prompts, params)  # compiles, fills the host-side caches
        counts[steps] = _eager_ops(eng, prompts, params)
        eager = NativeEngine(model, arch, eos_token_id=-1, device="cpu").generate(prompts, params)
        assert [_exact(t) for t in trajs[steps]] == [_exact(t) for t in eager]
    (ops4, fwd4), (ops2, fwd2) = counts[4], counts[2]
    assert fwd4 > fwd2, counts
    assert (ops4 - ops2) / (fwd4 - fwd2) <= 2, counts


def _tensors_made_by_steps(eng: NativeEngine, prompts, params) -> tuple[int, int]:
    """(tensors made from Python values, ``aten::lift_fresh``, inside the compiled steps' calls; the calls) in one
    generate call."""
    from torch.profiler import ProfilerActivity, profile, record_function

    def marked(step):
        def call(*args, **kwargs):
            with record_function("step call"):
                return step(*args, **kwargs)

        return call

    compiled = (eng.step, eng.dllm_step, eng.editing_step)
    eng.step, eng.dllm_step, eng.editing_step = (marked(f) for f in compiled)
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            eng.generate(prompts, params)
    finally:
        eng.step, eng.dllm_step, eng.editing_step = compiled
    made = 0
    for e in prof.events():
        p = e.cpu_parent
        while p is not None and p.name != "step call":
            p = p.cpu_parent
        made += e.name == "aten::lift_fresh" and p is not None
    return made, sum(e.name == "step call" for e in prof.events())


@pytest.mark.parametrize("algorithm", ["low_confidence_static", "low_confidence_dynamic", "editing"])
def test_a_compiled_step_makes_no_tensor_of_its_settings(algorithm, monkeypatch):
    """Dynamo made every float a compiled step uses (temperature, threshold, editing_threshold) a graph input and
    wrapped it in a new tensor at every call: ``torch.tensor`` + ``to`` + ``empty`` per float per step between
    two forwards (on CUDA a host-to-device copy if it went to the GPU). Traced as constants, a step makes none.
    Same tokens as eager."""
    model, arch = nt.build("sdar")
    eng = graphs_emulated(model, arch, monkeypatch)
    prompts = [p[:4] for p in nt.PROMPTS[:4]]
    params = SamplingParams(
        max_new_tokens=8, block_size=4, temperature=0.7, threshold=0.5, seed=1, stop_at_eos=False, algorithm=algorithm
    )
    got = eng.generate(prompts, params)  # compiles
    made, calls = _tensors_made_by_steps(eng, prompts, params)
    assert calls > 0 and made == 0, (made, calls)
    eager = NativeEngine(model, arch, eos_token_id=-1, device="cpu").generate(prompts, params)
    assert [_exact(t) for t in got] == [_exact(t) for t in eager]


def test_new_float_settings_compile_no_step_again(monkeypatch):
    """The step's floats were constants of its graph: each new temperature (threshold, top_p, editing_threshold)
    compiled the step again, and past dynamo's recompile limit (8; an eval sweeping temperatures, a schedule) the
    step silently ran eager for the rest of the run. Now they are graph inputs: 10 distinct temperatures and
    thresholds through one compiled engine compile no step after the first call, and each decodes what the eager
    engine decodes at that value (tokens, steps, log-probs, finish, forwards, edits: exactly)."""
    compiles: dict[str, int] = {}
    compile_ = torch.compile

    def counted(fn, **kw):
        def backend(gm, inputs):
            name = getattr(fn, "__name__", "forward")
            compiles[name] = compiles.get(name, 0) + 1
            return gm.forward

        return compile_(fn, backend=backend, dynamic=kw.get("dynamic"))

    monkeypatch.setattr(torch, "compile", counted)
    torch._dynamo.reset()
    model, arch = nt.build("sdar")
    eng = NativeEngine(model, arch, eos_token_id=-1, device="cpu", settings=NativeSettings(compile=True))
    ref = NativeEngine(model, arch, eos_token_id=-1, device="cpu")
    prompts = [p[:4] for p in nt.PROMPTS[:2]]
    first = None
    for i, temperature in enumerate([0.3 + 0.15 * k for k in range(10)]):
        params = SamplingParams(
            max_new_tokens=4, temperature=temperature, threshold=0.3 + 0.05 * i, top_p=0.95, seed=1, stop_at_eos=False
        )
        got = eng.generate(prompts, params)
        first = first or dict(compiles)
        assert [_exact(t) + (t.logprobs,) for t in got] == [
            _exact(t) + (t.logprobs,) for t in ref.generate(prompts, params)
        ]
    assert compiles == first, (first, compiles)


def test_a_blocks_numbers_and_cache_binding_run_no_eager_op(monkeypatch):
    """Per block, outside the compiled step: ``Streams.ahead`` drew the block's numbers in ~30 eager ops (the
    counters, ``repeat_interleave``, SplitMix64's shifts and products per purpose) and every ``KVCache.bind``
    made its row index anew (``arange`` + a view). Now the numbers are one compiled call
    (``dllm_step.draw_ahead``, integer arithmetic: the same numbers) and the row index is made once per shape:
    no eager op of either runs in the block loop (admission still mixes the keys once). Same tokens as eager."""
    from torch.profiler import ProfilerActivity, profile

    model, arch = nt.build("sdar")
    eng = graphs_emulated(model, arch, monkeypatch)
    prompts = [p[:4] for p in nt.PROMPTS[:4]]
    params = SamplingParams(max_new_tokens=12, block_size=4, steps_per_block=2, temperature=0.7, seed=1)
    got = eng.generate(prompts, params)  # compiles
    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        eng.generate(prompts, params)
    sites = []
    for e in prof.events():
        p, nested, site = e.cpu_parent, False, []
        while p is not None and not nested:
            nested = p.name.startswith(("aten::", "compiled graph"))
            site.append(p.name)
            p = p.cpu_parent
        in_loop = any("decoders.py" in f and f.endswith(": round") for f in site)  # the block loop
        if e.name.startswith("aten::") and not nested and in_loop:
            sites += [f for f in site if "sampling.py" in f or f.endswith(": bind") and "common.py" in f]
    assert not sites, sorted(set(sites))
    eager = NativeEngine(model, arch, eos_token_id=-1, device="cpu").generate(prompts, params)
    assert [_exact(t) for t in got] == [_exact(t) for t in eager]


def test_padded_rows_are_reused_only_for_the_same_input_fill_and_version():
    """``PaddedRows`` hands back its padded copy of a slot's last input only when the input is the same tensor,
    unchanged (version counter), padded to the same rows with the same fill (``bind`` pads with the cache's
    scratch column: another cache, another fill)."""
    from megadare.rollout.native import PaddedRows

    pad = PaddedRows()
    t = torch.arange(6).view(3, 2)
    zeros = pad.rows("x", t, 4, 0)
    assert pad.rows("x", t, 4, 0) is zeros and zeros[3].tolist() == [0, 0]
    assert pad.rows("x", t, 4, 9)[3].tolist() == [9, 9]
    t.add_(1)
    assert pad.rows("x", t, 4, 9)[:, 0].tolist() == [1, 3, 5, 9]
    assert pad.rows("x", t, 3, 9) is t


@pytest.mark.parametrize("record_steps", [False, True], ids=["editing", "editing-mdpo"])
def test_a_token_editing_step_runs_one_compiled_call_between_forwards(record_steps, monkeypatch):
    """Token editing (LLaDA2.1) under rollout.compile (the CUDA-graph path emulated): between two forwards the
    refinement's bookkeeping (post steps, closed rows, the editable positions), the streams' advance, the trace
    record and its history entry ran eagerly around the compiled step: ~70 eager ops per step, each a kernel
    launch from Python on CUDA. Now one compiled call (``editing.editing_step``) and the read of its work flag.
    Counted as the difference between committing 1 and 2 tokens a step (5 and 3 forwards a block; thresholds
    of 0.99: a random model's predictions pass neither): eager ops per extra forward; with MDPO's per-step records
    too (block diffusion: no predictions past the block). Same trajectories as eager."""
    model, arch = nt.build("sdar")
    eng = graphs_emulated(model, arch, monkeypatch)
    short = min(len(p) for p in nt.PROMPTS[:4])
    prompts = [p[:short] for p in nt.PROMPTS[:4]]  # 4 rows that finish together: no padding rows (a power of two)
    counts = {}
    for per_step in (1, 2):
        params = SamplingParams(
            max_new_tokens=8,
            temperature=0.7,
            seed=1,
            stop_at_eos=False,
            algorithm="editing",
            threshold=0.99,
            editing_threshold=0.99,
            num_to_transfer=per_step,
            record_steps=record_steps,
        )
        got = eng.generate(prompts, params)  # compiles, fills the host-side caches
        counts[per_step] = _eager_ops(eng, prompts, params)
        eager = NativeEngine(model, arch, eos_token_id=-1, device="cpu").generate(prompts, params)
        assert [_exact(t) for t in got] == [_exact(t) for t in eager]
        for a, b in zip(got, eager):  # aot_eager's decomposed forward rounds otherwise (1e-6)
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    (ops1, fwd1), (ops2, fwd2) = counts[1], counts[2]
    assert fwd1 > fwd2, counts
    assert (ops1 - ops2) / (fwd1 - fwd2) <= 3, counts  # the work flag's read, the logits' slice to the live rows
