"""The built-in engine as issue 27 made it: batched device sampling, a static KV cache, continuous batching, a
compiled step.

* every family and deterministic decoder reproduces the traces recorded from the engine before it
  (tests/native_traces.py: tokens, global and block-local steps, finish reasons, forwards, edits, MDPO step
  records), also when the prompts queue through a batch of 2 or 1 (continuous batching);
* sampled decoding does not depend on the batch: max_batch 1, 2 or all give the same trajectories (the random
  stream is keyed by the prompt's index; rows that finish leave, queued prompts enter);
* the random numbers: ``stream_uniforms`` equals SplitMix64 computed with Python integers; ``categorical`` is the
  exact inverse CDF (float64 enumeration) and never draws a zero weight;
* no host read inside a denoising step: one per block (who finished) and one per finished row;
* the static cache is allocated once and reused; the engine runs in the dtype it is given;
* ``compile=True`` gives the same tokens (dynamo with the ``aot_eager`` backend: inductor's C++ build takes
  minutes on a CPU).
(The publishers' samplers against the engine: tests/test_decoders.py; the SGLang plugin: tests/test_dllm_step.py.)
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys

import pytest
import torch
from torch.overrides import TorchFunctionMode

import native_traces as nt
from megadare.models.hf import common
from megadare.rollout import decoders, native
from megadare.rollout.engine import SamplingParams
from megadare.rollout.native import NativeEngine, NativeSettings
from megadare.rollout.dllm_step import Streams
from megadare.rollout.sampling import REMASK, SAMPLE, categorical, mix64, stream_uniforms

with open(nt.FIXTURE) as _f:
    RECORDED = json.load(_f)["cases"]
EXACT = ("response_ids", "commit_step", "block_step", "finish_reason", "num_forwards", "step_predictions")


def _same_as_recorded(case_id: str, got: list[dict]) -> None:
    want = RECORDED[case_id]["trajectories"]
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        for k in EXACT:
            assert g[k] == w[k], (case_id, i, k)
        assert g["logprobs"] == pytest.approx(w["logprobs"], abs=1e-6), (case_id, i)
        assert (g["superseded"] is None) == (w["superseded"] is None), case_id
        for a, b in zip(g["superseded"] or [], w["superseded"] or []):
            assert a[:4] == b[:4] and a[4] == pytest.approx(b[4], abs=1e-6), (case_id, i)
        for a, b in zip(g["step_confidences"] or [], w["step_confidences"] or []):
            assert a == pytest.approx(b, abs=1e-5), (case_id, i)


@pytest.mark.parametrize("case", nt.CASES, ids=[c[0] for c in nt.CASES])
def test_recorded_traces_of_the_previous_engine(case):
    assert nt.weights_sum(case) == pytest.approx(RECORDED[case[0]]["weights_sum"], rel=1e-12)  # same models
    _same_as_recorded(case[0], nt.run_case(case))


QUEUED = ["sdar-static-2steps-eos", "sdar-nocache-mdpo", "llada2-editing", "llada-dual-dynamic-eos", "dream-dare-block"]


@pytest.mark.parametrize("case_id", QUEUED)
def test_recorded_traces_through_a_batch_of_two(case_id):
    """Five prompts through two slots: rows finish at different blocks (EOS), queued prompts enter mid-way."""
    case = next(c for c in nt.CASES if c[0] == case_id)
    _same_as_recorded(case_id, nt.run_case(case, max_batch=2))


SAMPLED = [
    SamplingParams(
        max_new_tokens=12,
        block_size=4,
        steps_per_block=2,
        temperature=0.9,
        top_k=20,
        seed=4,
        algorithm="low_confidence_dynamic",
        threshold=0.2,
    ),
    SamplingParams(
        max_new_tokens=12,
        block_size=4,
        steps_per_block=4,
        temperature=1.0,
        algorithm="random",
        seed=7,
        stop_at_eos=False,
    ),
]


@pytest.mark.parametrize("family,eos", [("sdar", 41), ("llada", 37)])
@pytest.mark.parametrize("params", SAMPLED, ids=["dynamic-eos", "random"])
def test_sampled_trajectories_do_not_depend_on_the_batch_size(family, eos, params):
    model, arch = nt.build(family)
    runs = [
        NativeEngine(model, arch, eos_token_id=eos, device="cpu", settings=NativeSettings(max_batch=m)).generate(
            nt.PROMPTS, params
        )
        for m in (0, 2, 1)
    ]
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert (a.response_ids, a.commit_step, a.block_step, a.num_forwards, a.finish_reason) == (
                b.response_ids,
                b.commit_step,
                b.block_step,
                b.num_forwards,
                b.finish_reason,
            )
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    assert any(lp < 0 for t in runs[0] for lp in t.logprobs)
    if params.stop_at_eos:
        assert {t.finish_reason for t in runs[0]} == {"eos", "length"}


# ---------------------------------------------------------------------------------------------- random numbers
def _splitmix(z: int) -> int:
    m = (1 << 64) - 1
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return z ^ (z >> 31)


def test_stream_uniforms_are_splitmix64_in_python_integers():
    keys = [0, 1, 7, 1_000_003, 2**62 + 12345, 2**63 - 1]
    counters = [0, 3, 1, 2**30, 99, 12]
    got = stream_uniforms(torch.tensor(keys), torch.tensor(counters), 1, 5)
    for r, (k, c) in enumerate(zip(keys, counters)):
        base = _splitmix(k)
        for pos in range(5):
            index = (c << 21) + (1 << 20) + pos
            bits = _splitmix((base + (index + 1) * 0x9E3779B97F4A7C15) & ((1 << 64) - 1)) >> 12
            assert got[r, pos].item() == (bits + 0.5) / 2**52
    assert 0 < got.min() and got.max() < 1
    u = stream_uniforms(torch.zeros(4000, dtype=torch.long), torch.arange(4000), 0, 4).flatten()
    assert abs(u.mean().item() - 0.5) < 0.01 and abs((u < 0.1).double().mean().item() - 0.1) < 0.01


def test_a_blocks_numbers_drawn_ahead_are_the_per_step_numbers():
    """The engine draws a block's numbers once (``Streams.ahead``) and reads them per step (``at``): exactly the
    numbers each row's counter gives when drawn step by step, rows advancing unevenly (a row without work does not
    step)."""
    keys, counters = torch.tensor([3, 2**62 + 5, 17, 0]), torch.tensor([0, 9, 4, 2**30])
    streams = Streams(keys, counters, mix64(keys))
    block = streams.ahead((SAMPLE, REMASK), 6, 5)
    advanced = [None, torch.tensor([1, 1, 0, 1]), torch.tensor([2, 1, 1, 2]), torch.tensor([4, 3, 1, 2])]
    for a in advanced:
        now = counters if a is None else counters + a
        for purpose in (SAMPLE, REMASK):
            want = stream_uniforms(keys, now, purpose, 6)
            assert torch.equal(block.at(a).uniforms(purpose, 6), want)
        assert torch.equal(block.at(a).uniforms(SAMPLE, 9), stream_uniforms(keys, now, SAMPLE, 9))  # not drawn
    assert torch.equal(Streams(keys, counters).ahead((SAMPLE,), 6, 2).uniforms(SAMPLE, 6), streams.uniforms(SAMPLE, 6))


def test_categorical_is_the_exact_inverse_cdf():
    g = torch.Generator().manual_seed(0)
    w = torch.rand(3, 512, generator=g) ** 4
    w[:, ::3] = 0  # zero weights (filtered tokens, the mask token)
    w[2, 400:] = 0  # a zero tail: u near 1 must not land there
    u = torch.cat([torch.tensor([2.0**-53, 0.5, 1 - 2.0**-53]), torch.rand(61, generator=g, dtype=torch.float64)])
    for r in range(3):
        idx, total = categorical(w[r].expand(len(u), -1).contiguous(), u)
        cum = w[r].double().cumsum(0)
        want = [min(int((cum <= x * cum[-1]).sum()), int(w[r].nonzero().max())) for x in u.tolist()]
        assert idx.tolist() == want and (w[r][idx] > 0).all()
        assert total[0].item() == pytest.approx(cum[-1].item(), rel=1e-12)
    many = torch.arange(20000, dtype=torch.float64).add(0.5).div(20000)  # a fine grid of u: frequencies = weights
    idx, _ = categorical(w[0].expand(len(many), -1).contiguous(), many)
    freq = torch.bincount(idx, minlength=512).double() / len(many)
    assert torch.allclose(freq, w[0].double() / w[0].sum(), atol=1.5 / len(many))


# ---------------------------------------------------------------------------------------------- host reads
class HostReads(TorchFunctionMode):
    """Counts reads of tensor values into Python, by the function that made them."""

    READS = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "numpy"}

    def __init__(self):
        super().__init__()
        self.where: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in self.READS:
            frame = sys._getframe(1)
            self.where.append(f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_code.co_name}")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("deferred", [False, True], ids=["at-once", "deferred"])
@pytest.mark.parametrize("family", ["sdar", "llada", "sdar_moe", "llada2"])
def test_no_host_read_inside_a_denoising_step(family, deferred, monkeypatch):
    """One read of the stop flags per block: at once on a CPU, of the host copy sent a block earlier on CUDA
    (``deferred``, forced here)."""
    if deferred:
        monkeypatch.setattr(decoders, "DEFERRED_STOP_READS", ("cpu", "cuda"))
    rounds = []
    monkeypatch.setattr(
        decoders.Decoder, "record", lambda self, *a, _r=decoders.Decoder.record: (rounds.append(1), _r(self, *a))[1]
    )
    model, arch = nt.build(family)
    eng = NativeEngine(model, arch, eos_token_id=41, device="cpu", settings=NativeSettings(max_batch=3))
    params = SamplingParams(max_new_tokens=12, block_size=4, steps_per_block=2, temperature=1.0, seed=1)
    with HostReads() as reads:
        trajs = eng.generate(nt.PROMPTS, params)
    per_site = {site: reads.where.count(site) for site in set(reads.where)}
    assert not [s for s in per_site if s.split(":")[0] in ("dllm_step.py", "sampling.py", "common.py")], per_site
    if deferred:
        assert 3 <= per_site.pop("decoders.py:receive") <= len(rounds)  # per block once a row is sent: the host copy
    else:
        assert per_site.pop("decoders.py:record") == len(rounds)  # one read per block
    assert set(per_site) <= {"decoders.py:<dictcomp>", "decoders.py:_steps_needed", "engine.py:validate"}, per_site
    assert len(trajs) == len(nt.PROMPTS)


class ReadTensors(HostReads):
    """Host reads by function, with the address of the tensor read."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in self.READS:
            code = sys._getframe(1).f_code
            self.where.append((f"{code.co_filename.rsplit('/', 1)[-1]}:{code.co_name}", args[0].data_ptr()))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("family,eos", [("sdar", 41), ("llada", 37)])
def test_stop_flags_reach_the_host_a_block_late_without_a_wait(family, eos, monkeypatch):
    """stop_at_eos (RL's 'eos' canvas, evaluation) on CUDA (forced here: ``DEFERRED_STOP_READS``): the block loop
    reads no flag its own block computes (a ``.tolist()`` of them was a sync per block on CUDA, after which the GPU
    idled while the host launched the next block); it reads the host copy of the flags sent at the end of the
    previous block (``StopFlags``). A row found finished rides one more block frozen: the trajectories are the
    CPU's (which reads at once) exactly, and the call's forwards exceed its rows' own (and the prefills) by at most
    one block, S forwards, per row that stopped at an EOS (one row at a time: max_batch 1); at once, by none."""
    model, arch = nt.build(family)
    eng = NativeEngine(model, arch, eos_token_id=eos, device="cpu", settings=NativeSettings(max_batch=1))
    params = SamplingParams(max_new_tokens=24, block_size=4, steps_per_block=2, temperature=1.0, seed=1)
    prefills = sum(len(p) >= 4 for p in nt.PROMPTS) if arch.is_block_diffusion else 0

    def extra_forwards(trajs) -> int:
        return eng.forwards - prefills - sum(t.num_forwards for t in trajs)

    at_once = eng.generate(nt.PROMPTS, params)
    assert extra_forwards(at_once) == 0
    made = []
    init = decoders.Decoder.__init__
    monkeypatch.setattr(decoders.Decoder, "__init__", lambda self, *a: (made.append(self), init(self, *a))[1])
    monkeypatch.setattr(decoders, "DEFERRED_STOP_READS", ("cpu", "cuda"))
    eng.forwards = 0
    with ReadTensors() as reads:
        trajs = eng.generate(nt.PROMPTS, params)
    assert [dataclasses.asdict(t) for t in trajs] == [dataclasses.asdict(t) for t in at_once]
    stops = getattr(made[0], "stops", None)
    host_flags = stops.host.data_ptr() if stops is not None else None
    outside = ("decoders.py:<dictcomp>", "decoders.py:_steps_needed")  # finished rows' buffers; a host schedule
    loop_reads = [r for r in reads.where if r[0].startswith("decoders.py:") and r[0] not in outside]
    assert loop_reads and {ptr for _, ptr in loop_reads} == {host_flags}, (loop_reads, host_flags)
    stopped = sum(t.finish_reason == "eos" for t in trajs)
    assert 0 < stopped < len(trajs)
    assert 0 < extra_forwards(trajs) <= params.steps_per_block * stopped, (extra_forwards(trajs), stopped)


@pytest.mark.parametrize("family,eos", [("sdar", 41), ("llada", 37)])
def test_finished_rows_reach_the_host_after_the_next_block_is_queued(family, eos, monkeypatch):
    """The rows that finish at a block are read (one read per buffer, each a sync on CUDA that waited for the
    block just launched) only once the next block is queued (``FinishedRows``: copied aside and to pinned memory
    without a wait), or at the call's end; their slots take queued prompts meanwhile."""
    events: list[tuple[str, list[int]]] = []
    round_, trajectory = decoders.Decoder.round, decoders.Decoder.trajectory

    def logged_round(self, n):
        done = round_(self, n)
        events.append(("block", [self.host["prompt"][i] for i, d in enumerate(done) if d]))
        return done

    def logged_trajectory(self, *a):
        t = trajectory(self, *a)
        events.append(("read", [nt.PROMPTS.index(t.prompt_ids)]))
        return t

    monkeypatch.setattr(decoders.Decoder, "round", logged_round)
    monkeypatch.setattr(decoders.Decoder, "trajectory", logged_trajectory)
    model, arch = nt.build(family)
    eng = NativeEngine(model, arch, eos_token_id=eos, device="cpu", settings=NativeSettings(max_batch=2))
    params = SamplingParams(max_new_tokens=16, block_size=4, steps_per_block=2, temperature=1.0, seed=1)
    trajs = eng.generate(nt.PROMPTS, params)
    blocks = [k for k, (kind, _) in enumerate(events) if kind == "block"]
    read_at = {rows[0]: k for k, (kind, rows) in enumerate(events) if kind == "read"}
    for b in blocks[:-1]:
        queued = next(k for k in blocks if k > b)  # the next block
        assert all(read_at[i] > queued for i in events[b][1]), (b, events)
    assert sorted(read_at) == list(range(len(nt.PROMPTS))) and len(trajs) == len(nt.PROMPTS)
    assert {t.finish_reason for t in trajs} == {"eos", "length"}


def test_full_canvas_reads_the_device_once_per_buffer_at_the_end():
    """Without stop_at_eos no row ends early: a block needs no host read (each one a sync on CUDA, which drained
    the GPU's queue at every block boundary), and the rows that finish together are read once per buffer, not
    once per row and buffer (7 x 32 syncs at the end of a 32-row call on the H200)."""
    model, arch = nt.build("sdar")
    eng = NativeEngine(model, arch, eos_token_id=41, device="cpu")
    params = SamplingParams(max_new_tokens=12, block_size=4, steps_per_block=2, temperature=1.0, seed=1)
    full = dataclasses.replace(params, stop_at_eos=False)
    with HostReads() as reads:
        trajs = eng.generate(nt.PROMPTS, full)
    device_reads = [s for s in reads.where if s.startswith("decoders.py:") and s != "decoders.py:_steps_needed"]
    ends = {-(-(len(p) % 4 + 12) // 4) for p in nt.PROMPTS}  # the blocks at which rows finish
    assert len(ends) < len(nt.PROMPTS), ends  # some rows finish together
    assert device_reads == ["decoders.py:<dictcomp>"] * 7 * len(ends), device_reads  # 7 buffers per finishing block
    assert [len(t.response_ids) for t in trajs] == [12] * len(nt.PROMPTS)
    with_eos = eng.generate(nt.PROMPTS, dataclasses.replace(params, stop_at_eos=True, max_new_tokens=64))
    assert any(t.finish_reason == "eos" for t in with_eos)  # the per-block read still ends rows at their EOS


@pytest.mark.parametrize("family", ["sdar", "dream", "sdar_moe", "llada2"])
def test_packed_weights_decode_as_the_layout_and_follow_weight_syncs(family):
    """The engine's packed weights (q/k/v and gate/up fused into one GEMM each; MoE experts stacked for grouped
    GEMMs: no host read per layer) give the trajectories of the model as the HF layout has it; a weight sync
    writes the fused weights and the stacks (the parameters are views of them), and sleep / wake keeps that so.
    (sdar: separate q/k/v; dream: with biases; sdar_moe: experts; llada2: fused query_key_value, a dense first
    layer and shared experts.)"""
    model, arch = nt.build(family)
    plain_model, _ = nt.build(family)
    params = SamplingParams(max_new_tokens=8, block_size=4, steps_per_block=2, temperature=1.0, seed=5)
    packed = NativeEngine(model, arch, eos_token_id=-1, device="cpu")
    plain = NativeEngine(plain_model, arch, eos_token_id=-1, device="cpu")
    plain.model.unfuse_projections()
    plain.model.unstack_experts()
    first = model._layers[0]
    assert (first.fused_qkv is None) == (first.qkv is not None)
    assert all((lay.fused_gate_up is None) == lay.moe for lay in model._layers)
    assert all((lay.fused_shared_gate_up is None) == (lay.shared is None) for lay in model._layers)
    assert packed.grouped_experts == arch.is_moe and all(lay.stacked is not None for lay in model._layers if lay.moe)

    def same() -> None:
        a, b = packed.generate(nt.PROMPTS, params), plain.generate(nt.PROMPTS, params)
        assert [t.response_ids for t in a] == [t.response_ids for t in b]
        assert [t.commit_step for t in a] == [t.commit_step for t in b]
        for x, y in zip(a, b):
            assert x.logprobs == pytest.approx(y.logprobs, abs=1e-6)

    same()
    g = torch.Generator().manual_seed(7)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in model.state_dict().items()}
    for eng in (packed, plain):
        eng.update_weights(new.items(), version=1)
    for lay in model._layers:  # the fused weights hold the synced ones
        if lay.fused_gate_up is not None:
            assert torch.equal(lay.fused_gate_up, torch.cat([new[k] for k in _names(model, *lay.mlp[:2])]))
        if lay.fused_shared_gate_up is not None:
            assert torch.equal(lay.fused_shared_gate_up, torch.cat([new[k] for k in _names(model, *lay.shared[:2])]))
    if first.fused_qkv is not None:
        qkv_names = _names(model, first.q, first.k, first.v)
        assert torch.equal(first.fused_qkv[0], torch.cat([new[k] for k in qkv_names]))
        if arch.qkv_bias:
            biases = [k.replace(".weight", ".bias") for k in qkv_names]
            assert torch.equal(first.fused_qkv[1], torch.cat([new[k] for k in biases]))
    if arch.is_moe:
        layer = next(lay for lay in model._layers if lay.moe)
        assert torch.equal(layer.stacked[0][0], layer.experts[0][0].weight)  # the stack holds the synced weights
    same()
    packed.sleep()
    packed.wake()
    same()


def _names(model: torch.nn.Module, *linears: torch.nn.Module) -> list[str]:
    """The HF names of the Linears' weights."""
    return [next(n for n, p in model.named_parameters() if p is m.weight) for m in linears]


def test_grouped_experts_only_where_the_probe_passes(monkeypatch):
    """A device whose grouped GEMM raises, or gives other numbers (an empty group among the experts, groups of any
    size), decodes expert by expert."""
    from megadare.models.hf import common

    like = torch.zeros(1)
    assert common.grouped_gemm_runs(like)

    def raises(*a, **kw):
        raise RuntimeError("grouped gemm: offsets must be multiples of 16")

    def skips_empty_groups(a, b, offs):
        return torch.cat([a[:1] @ b[0], a[1:] @ b[1]])  # uses expert 1 for rows [1, 3): wrong

    for broken in (raises, skips_empty_groups):
        monkeypatch.setattr(common, "grouped_mm", broken)
        assert not common.grouped_gemm_runs(like)
        model, arch = nt.build("sdar_moe")
        eng = NativeEngine(model, arch, eos_token_id=-1, device="cpu")
        assert not eng.grouped_experts and all(lay.stacked is None for lay in model._layers)


# ---------------------------------------------------------------------------------------------- cache, dtype
def test_static_cache_is_reused_and_the_engine_keeps_its_dtype():
    model, arch = nt.build("sdar")
    eng = NativeEngine(model, arch, eos_token_id=253, device="cpu", dtype=torch.bfloat16)
    assert {p.dtype for p in eng.model.parameters()} == {torch.bfloat16}
    params = SamplingParams(max_new_tokens=8, block_size=4, steps_per_block=4, stop_at_eos=False)
    first = eng.generate(nt.PROMPTS, params)
    cache = eng._cache
    assert cache is not None and cache.k[0].dtype == torch.bfloat16
    again = eng.generate(nt.PROMPTS[:2], params)
    assert eng._cache is cache  # fits: not reallocated
    assert [t.response_ids for t in again] == [t.response_ids for t in first[:2]]
    assert all(len(t.response_ids) == 8 for t in first)


def test_compiled_step_gives_the_same_tokens(monkeypatch):
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda m, **kw: compile_(m, backend="aot_eager", dynamic=False))
    model, arch = nt.build("sdar")
    params = SamplingParams(
        max_new_tokens=8, block_size=4, steps_per_block=2, temperature=1.0, seed=3, stop_at_eos=False
    )
    prompts = nt.PROMPTS[:3]
    eager = NativeEngine(model, arch, eos_token_id=253, device="cpu").generate(prompts, params)
    compiled = NativeEngine(model, arch, eos_token_id=253, device="cpu", settings=NativeSettings(compile=True))
    assert compiled._fn is not compiled.model and compiled.step is not native.dllm_step
    got = compiled.generate(prompts, params)
    assert [t.response_ids for t in got] == [t.response_ids for t in eager]
    assert [t.commit_step for t in got] == [t.commit_step for t in eager]
    for a, b in zip(got, eager):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    assert any(lp < 0 for t in got for lp in t.logprobs)


def test_cuda_graph_shapes_are_bucketed_and_never_fall_back(monkeypatch):
    """Under CUDA graphs (one graph per input shape; emulated here: dynamo with static shapes, the engine's
    ``graphs`` policy on) a long rollout whose rows end at different blocks while queued prompts enter runs on a
    few bucketed shapes: rows padded to a power of two, key lengths to 64 x a power of two. Before, each batch
    size x key length was its own graph, and past dynamo's recompile limit (8) the forward silently ran eager."""
    shapes: set[tuple] = set()
    compile_ = torch.compile

    def static_compile(fn, **kw):
        def backend(gm, inputs):
            if fn not in (native.dllm_step, native.denoise_step, native.draw_ahead):  # the forward's graphs
                shapes.add(tuple(tuple(t.shape) for t in inputs if isinstance(t, torch.Tensor) and t.dim() == 4)[:1])
            return gm.forward

        return compile_(fn, backend=backend, dynamic=False)

    monkeypatch.setattr(torch, "compile", static_compile)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model, arch = nt.build("sdar")
    params = SamplingParams(max_new_tokens=72, block_size=4, steps_per_block=2, temperature=1.0, seed=3)
    eos = 43  # in the responses of prompts 1 and 3 within their first 3 blocks: they end early, others run on
    eager = NativeEngine(model, arch, eos_token_id=eos, device="cpu", settings=NativeSettings(max_batch=3))
    want = eager.generate(nt.PROMPTS, params)
    assert sorted(len(t.response_ids) for t in want)[:2] == [1, 2] and max(len(t.response_ids) for t in want) == 72
    eng = NativeEngine(model, arch, eos_token_id=eos, device="cpu", settings=NativeSettings(max_batch=3, compile=True))
    eng.graphs = True
    got = eng.generate(nt.PROMPTS, params)
    assert [t.response_ids for t in got] == [t.response_ids for t in want]
    assert [t.commit_step for t in got] == [t.commit_step for t in want]
    for a, b in zip(got, want):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    masks = {s[0] for s in shapes}  # [rows, 1, queries, keys]
    assert {m[0] for m in masks} <= {1, 2, 4} and 4 in {m[0] for m in masks}  # 3 live rows run padded to 4
    assert {m[3] for m in masks} <= {64, 128, eng._cache.length}
    assert not any("recompile limit" in k for k in torch._dynamo.utils.counters["unimplemented"])


@pytest.mark.parametrize(
    "family,cache,algorithm",
    [
        ("sdar_moe", "none", "low_confidence_static"),
        ("llada", "dual", "low_confidence_static"),
        ("dream", "none", "low_confidence_static"),
        ("llada2", "none", "editing"),
    ],
)
def test_every_family_compiles_to_the_same_tokens(monkeypatch, family, cache, algorithm):
    """rollout.compile=true for the other families (dynamic shapes; dynamo with the aot_eager backend). The MoE
    families crashed: their grouped GEMMs run eagerly in float32 on the CPU, but the op's fake-tensor kernel that
    torch.compile traces with accepts bfloat16 only; a compiled engine now stacks the experts only where the op
    also traces, else decodes expert by expert."""
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda m, **kw: compile_(m, backend="aot_eager", dynamic=True))
    model, arch = nt.build(family, **(nt.LLADA2_SMALL if family == "llada2" else {}))
    block = 4 if arch.is_block_diffusion else 8
    params = SamplingParams(
        max_new_tokens=16,
        block_size=block,
        steps_per_block=4,
        temperature=1.0,
        seed=3,
        stop_at_eos=False,
        algorithm=algorithm,
    )
    settings = NativeSettings(full_attention_cache=cache)
    want = NativeEngine(model, arch, eos_token_id=253, device="cpu", settings=settings).generate(nt.PROMPTS[:3], params)
    compiled = NativeEngine(
        model, arch, eos_token_id=253, device="cpu", settings=NativeSettings(full_attention_cache=cache, compile=True)
    )
    got = compiled.generate(nt.PROMPTS[:3], params)
    assert [t.response_ids for t in got] == [t.response_ids for t in want]
    assert [t.commit_step for t in got] == [t.commit_step for t in want]
    if arch.is_moe:  # float32 on the CPU: grouped GEMMs run, but do not trace
        assert common.grouped_gemm_runs(torch.zeros(1)) and not compiled.grouped_experts
        assert common.grouped_gemm_runs(torch.zeros(1, dtype=torch.bfloat16), traced=True)


def test_compiled_cache_write_stays_in_place():
    """The cached block forward, compiled with static shapes as under CUDA graphs, writes the new keys/values into
    the static cache in place. Before, a ``scatter_`` into a row slice of the cache was functionalised into a copy
    of the whole slice plus a copy back, per layer and forward (on an H200 at the SDAR-1.7B shape: 0.9 ms of a
    4.2 ms forward). A loop over the cache's element count in the generated code is such a copy."""
    from torch._inductor.utils import run_and_get_code

    from megadare.models.hf.common import KVCache

    model, arch = nt.build("sdar", num_hidden_layers=1)
    rows, length, width, keys = 3, 37, 4, 24  # a cache of 3 x kv_heads x 38 x head_dim: a count no other tensor has
    cache = KVCache(arch, rows, length)
    for t in cache.k + cache.v:
        torch._dynamo.mark_static_address(t)
    cols = torch.arange(16, 16 + width).expand(rows, width).contiguous()
    cache.bind(0, cols, keys)
    ids = torch.randint(0, 100, (rows, width))
    allowed = torch.ones(rows, 1, width, keys, dtype=torch.bool)
    torch._dynamo.reset()
    fn = torch.compile(model, dynamic=False)
    with torch.no_grad():
        got, code = run_and_get_code(lambda: fn(ids, attention_mask=allowed, position_ids=cols, kv_cache=cache))
        k_written = cache.k[0][:, :, 16 : 16 + width].clone()
        cache.k[0].zero_()
        want = model(ids, attention_mask=allowed, position_ids=cols, kv_cache=cache)
    assert k_written.abs().sum() > 0  # the compiled forward wrote its keys into the cache itself
    torch.testing.assert_close(k_written, cache.k[0][:, :, 16 : 16 + width], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    numel = cache.k[0].numel()
    assert not re.search(rf"\b{numel}L?\b", "\n".join(code)), f"a loop over the whole cache ({numel} elements)"


def test_cuda_graphs_only_for_dense_cached_block_diffusion():
    on = NativeSettings(compile=True)
    dense, moe = nt.build("sdar")[1], nt.build("sdar_moe")[1]
    llada = nt.build("llada")[1]
    assert native.cuda_graphs(dense, on, "cuda")
    assert not native.cuda_graphs(moe, on, "cuda")  # host reads of expert counts: a graph break per layer
    assert not native.cuda_graphs(llada, on, "cuda")  # full attention: dynamic shapes instead
    assert not native.cuda_graphs(dense, on, "cpu") and not native.cuda_graphs(dense, NativeSettings(), "cuda")
    assert not native.cuda_graphs(dense, NativeSettings(compile=True, use_cache=False), "cuda")


def test_rollout_keys_reach_the_engine(tmp_path):
    """rollout.dtype / max_batch / compile -> the actors' engine factory -> the engine (loaded in its dtype)."""
    from types import SimpleNamespace

    from megadare.config import load_config
    from megadare.trainer.checks import validate
    from megadare.errors import ConfigError
    from megadare.rollout.manager import build_native_engine
    from megadare.rollout.setup import engine_spec
    from tiny import write_tiny_hf

    cfg = load_config(None, ["rollout.dtype=bfloat16", "rollout.max_batch=3"])
    spec = engine_spec(cfg, SimpleNamespace(hf_dir=write_tiny_hf(tmp_path, "sdar", 0)), SimpleNamespace(eos_token_id=2))
    eng = spec.factory(**spec.kwargs)
    assert (eng.dtype, eng.max_batch, eng.compile) == (torch.bfloat16, 3, False)
    assert {p.dtype for p in eng.model.parameters()} == {torch.bfloat16}
    with pytest.raises(ValueError, match="rollout.dtype='fp16'"):
        build_native_engine(spec.kwargs["hf_dir"], 2, dtype="fp16")
    for bad, key in (("rollout.dtype=fp16", "rollout.dtype"), ("rollout.max_batch=-1", "rollout.max_batch")):
        with pytest.raises(ConfigError, match=key):
            validate(load_config(None, [bad]), None)


def test_full_attention_cache_key_reaches_the_engine_and_is_refused_where_it_cannot_apply(tmp_path):
    """rollout.full_attention_cache (DARE's use_cache=True: Fast-dLLM's prefix cache) -> the LLaDA engine's
    decoder; refused for block-diffusion families (their cache is exact) and for MDPO (it scores each step's
    exact prediction of the whole canvas)."""
    from types import SimpleNamespace

    from megadare.algos import build_algorithm
    from megadare.config import load_config
    from megadare.trainer.checks import validate
    from megadare.errors import ConfigError
    from megadare.models import get_family
    from megadare.rollout.setup import engine_spec
    from tiny import write_tiny_hf

    cfg = load_config(None, ["rollout.full_attention_cache=prefix"])
    spec = engine_spec(
        cfg, SimpleNamespace(hf_dir=write_tiny_hf(tmp_path, "llada", 0)), SimpleNamespace(eos_token_id=2)
    )
    eng = spec.factory(**spec.kwargs)
    assert eng.full_attention_cache == "prefix"
    params = SamplingParams(max_new_tokens=8, block_size=4, steps_per_block=4, stop_at_eos=False)
    before = eng.forwards
    eng.generate([[5, 6, 7]], params)
    assert eng.forwards - before == 8 and eng._cache is not None  # the cached decoder ran (a cache was allocated)
    sdar = get_family("sdar")
    with pytest.raises(ConfigError, match="rollout.full_attention_cache=prefix: the sdar family"):
        validate(cfg, sdar.arch(sdar.tiny_config()))
    mdpo = load_config(None, ["rollout.full_attention_cache=dual", "algo.name=mdpo"])
    with pytest.raises(ConfigError, match="rollout.full_attention_cache=none"):
        build_algorithm("mdpo").check_config(mdpo, None)


def test_evaluation_decodes_with_its_own_steps_per_block():
    """rollout.eval_steps_per_block (DARE validates with one token per step) -> the evaluation SamplingParams only;
    0 keeps steps_per_block; too many steps for the block are refused under the key the user set."""
    from megadare.config import load_config
    from megadare.trainer.checks import validate
    from megadare.errors import ConfigError
    from megadare.models import get_family
    from megadare.rollout.setup import sampling_params

    llada = get_family("llada")
    arch = llada.arch(llada.tiny_config())
    over = ["rollout.block_size=8", "rollout.steps_per_block=4"]
    cfg = load_config(None, over + ["rollout.eval_steps_per_block=8"])
    assert sampling_params(cfg, arch, 0).steps_per_block == 4
    assert sampling_params(cfg, arch, 0, evaluation=True).steps_per_block == 8
    assert sampling_params(load_config(None, over), arch, 0, evaluation=True).steps_per_block == 4
    with pytest.raises(ConfigError, match="rollout.eval_steps_per_block: steps_per_block=9"):
        validate(load_config(None, over + ["rollout.eval_steps_per_block=9"]), arch)


def _eager_ops(eng: NativeEngine, prompts, params) -> tuple[int, int]:
    """(aten ops run outside compiled graphs, forwards) of one generate call (graphs marked by the backend)."""
    from torch.profiler import ProfilerActivity, profile

    forwards = eng.forwards
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        eng.generate(prompts, params)
    count = 0
    for e in prof.events():
        p, nested = e.cpu_parent, False
        while p is not None and not nested:
            nested = p.name.startswith(("aten::", "compiled graph"))
            p = p.cpu_parent
        count += e.name.startswith("aten::") and not nested
    return count, eng.forwards - forwards


def graphs_emulated(model, arch, monkeypatch) -> NativeEngine:
    """A compiled engine on the CUDA-graph path, emulated on the CPU as benchmarks/rollout_compile.py ``--ops``
    does: dynamo's aot_eager, the forward with static shapes, the steps as compiled (dynamic), each graph call
    marked for the profiler (``_eager_ops``)."""
    compile_ = torch.compile

    def marked(fn, **kw):
        def backend(gm, inputs):
            def call(*args):
                with torch.profiler.record_function("compiled graph"):
                    return gm.forward(*args)

            return call

        return compile_(fn, backend=backend, dynamic=kw.get("dynamic") if kw.get("mode") is None else False)

    monkeypatch.setattr(torch, "compile", marked)
    torch._dynamo.reset()
    eng = NativeEngine(model, arch, eos_token_id=-1, device="cpu", settings=NativeSettings(compile=True))
    eng.graphs = True
    eng.use_compiled()  # as on CUDA: the forward's graphs static
    return eng


def test_a_compiled_denoising_step_runs_no_eager_op_between_forwards(monkeypatch):
    """Under rollout.compile (the CUDA-graph path emulated: static shapes, dynamo's aot_eager) a block's step is
    the forward and one compiled call: sampling, commits, the trace record, the next step index and the streams'
    advance. Before, ~15 eager ops ran per step between the two graphs (BlockTrace.add's wheres, the step index,
    the masked positions, the streams' counters): each a kernel launch from Python on CUDA, where the H200 profile
    showed the GPU idle a quarter of a call. Counted as the difference between 4 and 2 steps per block (the
    blocks, the prefill and the results the same): eager ops per extra forward."""
    model, arch = nt.build("sdar")
    eng = graphs_emulated(model, arch, monkeypatch)
    short = min(len(p) for p in nt.PROMPTS[:4])
    prompts = [p[:short] for p in nt.PROMPTS[:4]]  # 4 rows that finish together: no padding rows (a power of two)
    counts = {}
    for steps in (4, 2):
        params = SamplingParams(
            max_new_tokens=8, block_size=4, steps_per_block=steps, temperature=1.0, seed=1, stop_at_eos=False
        )
        eng.generate(prompts, params)  # compiles, fills the host-side caches
        counts[steps] = _eager_ops(eng, prompts, params)
    (ops4, fwd4), (ops2, fwd2) = counts[4], counts[2]
    assert fwd4 > fwd2, counts
    assert (ops4 - ops2) / (fwd4 - fwd2) <= 1, counts  # the forward's logits sliced to the live rows: a view
