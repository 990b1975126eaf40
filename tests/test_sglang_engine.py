"""The SGLang rollout path without sglang: the shared block step, the plugin's core loop, and the engine's
translation to and from sglang's API.

(a) ``dllm_step`` against an independent re-implementation of SDAR-style static / dynamic low-confidence decoding;
(b) the plugin's core loop (``BlockDenoiser``), driven block by block the way sglang's scheduler drives a request,
    reproduces the built-in engine (tokens, global and block-local steps, log-probs) and its output converts into
    a validated Trajectory;
(c) ``SGLangEngine`` against ``FakeSGLang``, a fake of the sglang module tree at the boundary megadare touches
    (``sglang.Engine``, ``sglang.srt.dllm.algorithm{,.base}``, ``sglang.srt.plugins.hook_registry``,
    ``sglang.srt.managers.tp_worker``, ``sglang.srt.utils``, ``sglang.srt.weight_sync.tensor_bucket``), installed
    into ``sys.modules`` per test;
(d) without sglang, constructing the engine raises ImportError with the install hint;
(e) ``register()`` makes ``MegadareBlockDiffusion`` resolvable through sglang's lookup and its worker hook lets the
    algorithm deliver the per-token trace onto the requests.
"""
from __future__ import annotations

import enum
import functools
import importlib
import json
import math
import socket
import subprocess
import sys
import textwrap
import types
from typing import Any, Optional

import pytest
import torch
import torch.nn.functional as F

from megadare.models.family import ModelArch
from megadare.rollout import sglang_engine as se
from megadare.rollout import sglang_plugin as sp
from megadare.rollout.dllm_step import BlockTrace, dllm_step
from megadare.rollout.engine import SamplingParams
from megadare.rollout.native import NativeEngine

V, MASK, EOS, B = 12, 11, 10, 4
PROMPTS = [[5, 1, 9, 3, 4, 7], [2, 8], [8, 8, 8, 8, 1, 6, 6, 0, 3], [4, 5, 6, 7]]


# ---------------------------------------------------------------------------------------------- a toy dLLM
class ToyBlockLM(torch.nn.Module):
    """Logits = token term + visible-context counts + position term, integer-valued then scaled by 1/8, so every
    forward is exact in float32 whatever the batch or padding: the two engines see bit-identical logits."""

    def __init__(self, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.register_buffer("W", torch.randint(-6, 7, (V, V), generator=g).float())
        self.register_buffer("U", torch.randint(-2, 3, (V, V), generator=g).float())
        self.register_buffer("P", torch.randint(-4, 5, (64, V), generator=g).float())

    def forward(self, ids, attention_mask=None, position_ids=None, **_):
        n, L = ids.shape
        onehot = F.one_hot(ids, V).float()
        vis = attention_mask[:, 0].float() if attention_mask is not None else torch.ones(n, L, L)
        pos = position_ids if position_ids is not None else torch.arange(L).expand(n, L)
        return (onehot @ self.W + (vis @ onehot) @ self.U + self.P[pos]) * 0.125


def toy_arch() -> ModelArch:
    return ModelArch(family="sdar", architecture="SDARForCausalLM", vocab_size=V, hidden_size=8, num_layers=1,
                     num_attention_heads=1, num_kv_heads=1, head_dim=8, ffn_hidden_size=8, rms_norm_eps=1e-6,
                     rope_theta=1e4, max_position_embeddings=64, mask_token_id=MASK, attention="block_causal",
                     block_size=B)


def block_logits(model: ToyBlockLM, grid: list[int], block: torch.Tensor) -> torch.Tensor:
    """What sglang's model runner gives the algorithm: logits of the current block [n=1, B, V] given the
    committed grid before it (prompt blocks and earlier blocks, block-causal)."""
    ids = torch.cat([torch.tensor(grid, dtype=torch.long), block[0]])[None]
    bl = torch.arange(ids.shape[1]) // B
    return model(ids, attention_mask=(bl[None, :] <= bl[:, None])[None, None])[:, -B:]


# ---------------------------------------------------------------------------------------------- (a) the step
def _ref_filter(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    out = logits.clone()
    if top_k > 0:
        kth = logits.sort(dim=-1, descending=True).values[..., top_k - 1:top_k]
        out[logits < kth] = -math.inf
    if top_p < 1.0:
        probs, order = F.softmax(out, -1).sort(dim=-1, descending=True)
        before = probs.cumsum(-1) - probs             # mass of strictly more likely tokens
        drop_sorted = before > top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        out[drop] = -math.inf
    return out


def _ref_step(logits, tokens, masked, s, params, gen):
    """SDAR generate.py's step (block of B, S steps) with LLaDA-style temperature/top-k/top-p sampling."""
    logits = logits.clone().float()
    logits[..., MASK] = -math.inf
    n, Bn, _ = logits.shape
    if params.temperature == 0:
        tok = logits.argmax(-1)
        logp = torch.zeros(n, Bn)
    else:
        lp_all = F.log_softmax(_ref_filter(logits / params.temperature, params.top_k, params.top_p), -1)
        tok = torch.multinomial(lp_all.exp().reshape(-1, V), 1, generator=gen).view(n, Bn)
        logp = lp_all.gather(-1, tok[..., None])[..., 0]
    conf = F.softmax(logits, -1).gather(-1, tok[..., None])[..., 0]
    S = params.steps_per_block
    quota = Bn // S + (1 if s < Bn % S else 0)
    pick = torch.zeros(n, Bn, dtype=torch.bool)
    for b in range(n):
        k = min(quota, int(masked[b].sum()))
        if k == 0:
            continue
        c = torch.where(masked[b], conf[b], torch.tensor(-math.inf))
        high = (c > params.threshold) & masked[b]
        if params.algorithm == "low_confidence_dynamic" and int(high.sum()) >= k:
            pick[b] = high
        else:
            pick[b, c.topk(k).indices] = True
    return torch.where(pick, tok, tokens), pick, logp, conf


STEP_PARAMS = [
    SamplingParams(block_size=8, steps_per_block=4, algorithm="low_confidence_static"),
    SamplingParams(block_size=8, steps_per_block=3, algorithm="low_confidence_dynamic", threshold=0.3),
    SamplingParams(block_size=8, steps_per_block=4, algorithm="low_confidence_static", temperature=0.9, top_k=6,
                   top_p=0.85),
    SamplingParams(block_size=8, steps_per_block=2, algorithm="low_confidence_dynamic", threshold=0.25,
                   temperature=1.3, top_p=0.9),
]


@pytest.mark.parametrize("params", STEP_PARAMS, ids=["static", "dynamic", "static-sampled", "dynamic-sampled"])
def test_dllm_step_matches_reference(params):
    torch.manual_seed(0)
    W, Pz, U = torch.randn(V, V) * 2.5, torch.randn(8, V) * 2.0, torch.randn(V, V) * 0.5
    tokens = torch.full((3, 8), MASK)
    tokens[0, :3] = torch.tensor([1, 2, 3])          # a prompt remainder at the block start
    tokens[2, :1] = torch.tensor([4])
    ref_tokens = tokens.clone()
    g, g_ref = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    trace = BlockTrace(3)
    for s in range(params.steps_per_block):
        masked = tokens == MASK
        if not masked.any():
            break
        # a function of the block's current tokens: token, position and block-context terms
        logits = W[tokens] + Pz + (F.one_hot(tokens, V).float().sum(1) @ U)[:, None]
        res = dllm_step(logits, tokens, masked, s, params, g, mask_token_id=MASK)
        ref_new, ref_pick, ref_logp, ref_conf = _ref_step(logits, ref_tokens, ref_tokens == MASK, s, params, g_ref)
        assert torch.equal(res.committed, ref_pick) and torch.equal(res.tokens, ref_new)
        assert torch.allclose(res.logprobs[res.committed], ref_logp[ref_pick], atol=1e-6)
        assert torch.allclose(res.confidence, ref_conf, atol=1e-6)
        assert (res.tokens != MASK).sum() > (tokens != MASK).sum()       # every step commits something
        trace.add(res, s)
        tokens, ref_tokens = res.tokens, ref_new
    assert not (tokens == MASK).any()                 # S steps finish a block
    for b in range(3):                                # every decoded position recorded once, at its step
        decoded = [c for c in range(8) if c not in trace.records[b]]
        assert len(decoded) == (3, 0, 1)[b]
        assert all(f == s for f, s, _ in trace.records[b].values())
        assert all(lp <= 0 for _, _, lp in trace.records[b].values())


def test_dllm_step_never_predicts_mask_and_finishes_past_schedule():
    logits = torch.zeros(1, 4, V)
    logits[..., MASK] = 100.0                        # the model loves the mask token
    tokens = torch.full((1, 4), MASK)
    res = dllm_step(logits, tokens, tokens == MASK, 9, SamplingParams(block_size=4, steps_per_block=2), None,
                    mask_token_id=MASK)
    assert res.committed.all() and not (res.tokens == MASK).any()   # step 9 > S: commits every masked position
    with pytest.raises(ValueError, match="block has 3 positions"):
        dllm_step(torch.zeros(1, 3, V), torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 3, dtype=torch.bool), 0,
                  SamplingParams(block_size=4, steps_per_block=2), None)


# ---------------------------------------------------------------------------------------------- (b) the core loop
def drive_request(core: sp.BlockDenoiser, model: ToyBlockLM, prompt: list[int], params: SamplingParams
                  ) -> dict[str, Any]:
    """One request through the plugin core the way sglang serves it: complete prompt blocks are prefilled, the
    first decode block starts with the prompt's remainder, each block is denoised by ``denoise_block`` (forward,
    step, ..., final forward), the trace goes out per emitted token; stop after the block holding EOS.
    Returns what sglang's generate() returns for the request."""
    pre = len(prompt) // B * B
    grid, out, trace, forwards = list(prompt[:pre]), [], [], 0
    custom = {sp.CUSTOM_PARAMS_KEY: {"algorithm": params.algorithm, "steps_per_block": params.steps_per_block,
                                     "threshold": params.threshold, "seed": params.seed}}
    rparams = core.params_for(params.temperature if params.temperature > 0 else 0.0, params.top_p,
                              params.top_k if params.top_k > 0 else -1, custom)
    rng = sp.RequestRng(rparams.seed)              # lives on the Req for the whole generation
    first = True
    while len(out) < params.max_new_tokens:
        head = list(prompt[pre:]) if first else []
        block = torch.tensor([head + [MASK] * (B - len(head))])
        state = core.new_state(rparams, rng)
        block = core.denoise_block(lambda t: block_logits(model, grid, t), block, [state])
        entries, forwards = core.trace_entries(state, forwards)
        emitted = block[0, len(head):].tolist()
        assert len(entries) == len(emitted)
        out += emitted
        trace += entries
        grid += block[0].tolist()
        first = False
        if params.stop_at_eos and EOS in emitted:
            break
    finish: dict[str, Any] = {"type": "length"}
    if params.stop_at_eos and EOS in out[:params.max_new_tokens]:
        out = out[:out.index(EOS) + 1]
        finish = {"type": "stop", "matched": EOS}
    out = out[:params.max_new_tokens]
    return {"output_ids": out, "meta_info": {"finish_reason": finish, sp.TRACE_KEY: trace[:len(out)]}}


CORE_PARAMS = [
    SamplingParams(max_new_tokens=10, block_size=B, steps_per_block=4, stop_at_eos=False),
    SamplingParams(max_new_tokens=10, block_size=B, steps_per_block=2, algorithm="low_confidence_dynamic",
                   threshold=0.6, stop_at_eos=False),
    SamplingParams(max_new_tokens=9, block_size=B, steps_per_block=4, temperature=0.8, top_k=8, top_p=0.95,
                   seed=3, stop_at_eos=False),
    SamplingParams(max_new_tokens=12, block_size=B, steps_per_block=2, algorithm="random", temperature=1.0,
                   seed=11, stop_at_eos=False),
    SamplingParams(max_new_tokens=16, block_size=B, steps_per_block=4, temperature=1.2, seed=5),
]


@pytest.mark.parametrize("params", CORE_PARAMS, ids=["static", "dynamic", "sampled", "random", "sampled-eos"])
def test_plugin_core_reproduces_native_engine(params):
    model = ToyBlockLM()
    native = NativeEngine(model, toy_arch(), eos_token_id=EOS, device="cpu", use_cache=False)
    core = sp.BlockDenoiser(B, MASK, {"block_size": B, "steps_per_block": 4})
    greedy = params.temperature == 0
    # greedy: one batched native call (the batch changes no sample); sampled: one prompt per native call, so the
    # native engine's single generator and the request's generator draw the same stream
    natives = native.generate(PROMPTS, params) if greedy else [native.generate([p], params)[0] for p in PROMPTS]
    finishes = set()
    for prompt, nat in zip(PROMPTS, natives):
        out = drive_request(core, model, prompt, params)
        traj = se.trajectory_from_output(prompt, out, params, EOS, policy_version=4)   # validates
        assert traj.response_ids == nat.response_ids
        assert traj.commit_step == nat.commit_step and traj.block_step == nat.block_step
        assert traj.logprobs == pytest.approx(nat.logprobs, abs=1e-6)
        assert traj.finish_reason == nat.finish_reason and traj.policy_version == 4
        assert traj.num_forwards == nat.num_forwards
        finishes.add(traj.finish_reason)
        if not greedy:
            assert any(lp < 0 for lp in traj.logprobs)
        assert len(set(traj.commit_step)) > 1
    if params.stop_at_eos:
        assert "eos" in finishes                       # the EOS path was exercised


def test_request_params_translate_sglang_conventions():
    core = sp.BlockDenoiser(B, MASK, {"steps_per_block": 2, "algorithm": "low_confidence_dynamic", "threshold": 0.7})
    greedy = core.params_for(temperature=1.0, top_p=1.0, top_k=1, rid="abc")   # sglang's form of temperature 0
    assert greedy.temperature == 0 and greedy.top_k == 0 and greedy.steps_per_block == 2
    assert greedy.algorithm == "low_confidence_dynamic" and greedy.threshold == 0.7
    assert greedy.seed == core.params_for(top_k=1, rid="abc").seed != core.params_for(top_k=1, rid="abd").seed
    sampled = core.params_for(temperature=0.7, top_p=0.9, top_k=1 << 30, sampling_seed=5,
                              custom_params={"megadare": {"algorithm": "random", "steps_per_block": 4}})
    assert (sampled.temperature, sampled.top_k, sampled.top_p, sampled.seed) == (0.7, 0, 0.9, 5)
    assert sampled.algorithm == "random" and sampled.steps_per_block == 4
    assert core.params_for(temperature=0.7, sampling_seed=5, custom_params={"megadare": {"seed": 9}}).seed == 9
    with pytest.raises(ValueError, match="unknown keys"):
        core.params_for(custom_params={"megadare": {"steps": 2}})
    with pytest.raises(ValueError, match="steps_per_block=8 > block_size=4"):
        core.params_for(custom_params={"megadare": {"steps_per_block": 8}})
    with pytest.raises(ValueError, match="unknown keys"):
        sp.BlockDenoiser(B, MASK, {"temperature": 1.0})


# ---------------------------------------------------------------------------------------------- the fake sglang
class FakeSGLang:
    """A fake of sglang's module tree at megadare's boundary (not sglang: just the names and contracts the
    plugin and engine use, as read in sglang 0.5.20-0.5.23). Records every Engine call."""

    MODULES = ["sglang", "sglang.srt", "sglang.srt.dllm", "sglang.srt.dllm.algorithm",
               "sglang.srt.dllm.algorithm.base", "sglang.srt.plugins", "sglang.srt.plugins.hook_registry",
               "sglang.srt.managers", "sglang.srt.managers.tp_worker", "sglang.srt.utils", "sglang.srt.weight_sync",
               "sglang.srt.weight_sync.tensor_bucket"]

    def __init__(self):
        self.mods = {name: types.ModuleType(name) for name in self.MODULES}
        for name, mod in self.mods.items():
            mod.__path__ = []  # packages
            parent, _, child = name.rpartition(".")
            if parent:
                setattr(self.mods[parent], child, mod)
        self.calls: list[tuple[str, dict]] = []
        self.flush_results: list[bool] = []
        self.outputs: Optional[list[dict]] = None
        fake = self

        class Engine:
            def __init__(self, **kwargs):
                fake.calls.append(("Engine", kwargs))

            def __getattr__(self, name):
                def call(*args, **kwargs):
                    fake.calls.append((name, {"args": args, **kwargs}))
                    if name == "generate":
                        return fake.outputs
                    if name == "flush_cache":
                        return types.SimpleNamespace(success=fake.flush_results.pop(0) if fake.flush_results
                                                     else True)
                    if name == "get_model_info":
                        return {"weight_version": "default"}
                    if name == "get_server_info":
                        return {"version": "0.5.23", "dllm_algorithm": sp.ALGORITHM_NAME, "max_running_requests": 64}
                    return True, "Success"
                return call

        self.mods["sglang"].Engine = Engine
        self.mods["sglang"].__version__ = "0.5.23"

        # sglang/srt/dllm/algorithm/__init__.py: the name -> class registry and its lookup
        algo = self.mods["sglang.srt.dllm.algorithm"]
        algo.algo_name_to_cls = {"LowConfidence": object}

        def get_algorithm_cls(name):
            try:
                return algo.algo_name_to_cls[name]
            except KeyError as exc:
                raise RuntimeError(f"Unknown diffusion LLM algorithm: {name}") from exc

        algo.get_algorithm_cls = get_algorithm_cls
        algo.get_algorithm = lambda config: get_algorithm_cls(config.algorithm)(config)
        self.mods["sglang.srt.dllm.algorithm.base"].DllmAlgorithm = FakeDllmAlgorithm

        class HookType(enum.Enum):
            BEFORE, AFTER, AROUND, REPLACE = "before", "after", "around", "replace"

        class HookRegistry:
            hooks: list = []

            @classmethod
            def register(cls, target, hook, hook_type=HookType.AFTER):
                cls.hooks.append((target, hook, hook_type))

            @classmethod
            def apply_hooks(cls):
                for target, hook, hook_type in cls.hooks:
                    assert hook_type is HookType.AROUND
                    owner_path, attr = target.rsplit(".", 1)
                    mod_path, cls_name = owner_path.rsplit(".", 1)
                    owner = getattr(importlib.import_module(mod_path), cls_name)
                    original = getattr(owner, attr)
                    setattr(owner, attr, functools.wraps(original)(
                        lambda *a, _o=original, _h=hook, **k: _h(_o, *a, **k)))

        HookRegistry.hooks = []
        self.mods["sglang.srt.plugins.hook_registry"].HookRegistry = HookRegistry
        self.mods["sglang.srt.plugins.hook_registry"].HookType = HookType
        self.mods["sglang.srt.managers.tp_worker"].TpModelWorker = FakeTpModelWorker
        self.mods["sglang.srt.utils"].MultiprocessingSerializer = FakeSerializer
        self.mods["sglang.srt.weight_sync.tensor_bucket"].FlattenedTensorBucket = FakeFlattenedBucket

    def install(self, monkeypatch) -> "FakeSGLang":
        for name, mod in self.mods.items():
            monkeypatch.setitem(sys.modules, name, mod)
        monkeypatch.setattr(sp, "_ALGORITHM_CLASS", None)
        monkeypatch.setattr(sp, "_HOOK_REGISTERED", False)
        return self

    def named(self, name: str) -> list[dict]:
        return [kw for n, kw in self.calls if n == name]


class FakeDllmAlgorithm:
    """sglang's DllmAlgorithm contract: __init__(config); run() drives init_step_state / step over model forwards,
    synchronously (all steps of the block in one run) or first-done-first-out (one forward + step per run)."""

    def __init__(self, config):
        self.block_size, self.mask_id = config.block_size, config.mask_id
        self.fdfo = config.first_done_first_out_mode

    def init_step_state(self, forward_batch):
        return [None] * forward_batch.batch_size

    def run(self, model_runner, forward_batch, algo_states=None):
        n, Bs = forward_batch.batch_size, self.block_size
        start = (forward_batch.input_ids.view(n, Bs) != self.mask_id).sum(1).tolist()
        if self.fdfo:
            fresh = self.init_step_state(forward_batch)
            states = [c if c is not None else f for c, f in zip(algo_states or [None] * n, fresh)]
            out = model_runner.forward(forward_batch)
            done = self.step(forward_batch, out.full_logits, states)
            ids = forward_batch.input_ids.view(n, Bs).tolist()
            return out, ids, [Bs if d else 0 for d in done], [None if d else s for d, s in zip(done, states)], False
        states = self.init_step_state(forward_batch)
        out = model_runner.forward(forward_batch)
        if all(s == Bs for s in start):
            return out, [], None, None, False
        for _ in range(Bs + 1):
            if all(self.step(forward_batch, out.full_logits, states)):
                break
            out = model_runner.forward(forward_batch)
        ids = forward_batch.input_ids.view(n, Bs)
        return out, [ids[i, start[i]:] for i in range(n)], None, None, False


class FakeTpModelWorker:
    def __init__(self, algorithm, model_runner):
        self.dllm_algorithm, self.model_runner = algorithm, model_runner

    def _forward_batch_generation_dllm(self, forward_batch, batch=None):
        states = [r.dllm_algo_state for r in batch.reqs] if self.dllm_algorithm.fdfo and batch is not None else None
        return self.dllm_algorithm.run(self.model_runner, forward_batch, states)


class FakeSerializer:
    @staticmethod
    def serialize(obj, output_str=False):
        return ("serialized", obj, output_str)


class FakeFlattenedBucket:
    def __init__(self, named_tensors):
        parts, self.meta, off = [], [], 0
        for name, t in named_tensors:
            flat = t.flatten().view(torch.uint8)
            self.meta.append(types.SimpleNamespace(name=name, shape=t.shape, dtype=t.dtype, start_idx=off,
                                                   end_idx=off + flat.numel()))
            parts.append(flat)
            off += flat.numel()
        self.flat = torch.cat(parts)

    def get_flattened_tensor(self):
        return self.flat

    def get_metadata(self):
        return self.meta


def unpack(payload) -> dict[str, torch.Tensor]:
    tag, data, as_str = payload
    assert tag == "serialized" and as_str
    return {m.name: data["flattened_tensor"][m.start_idx:m.end_idx].view(m.dtype).reshape(m.shape)
            for m in data["metadata"]}


@pytest.fixture
def fake_sglang(monkeypatch):
    return FakeSGLang().install(monkeypatch)


@pytest.fixture
def ckpt(tmp_path):
    def make(arch="SDARForCausalLM", **extra):
        d = tmp_path / arch
        d.mkdir(exist_ok=True)
        (d / "config.json").write_text(json.dumps({"architectures": [arch], **extra}))
        return str(d)
    return make


# ---------------------------------------------------------------------------------------------- (c) the engine
def test_engine_launch_arguments(fake_sglang, ckpt):
    eng = se.SGLangEngine(ckpt(), EOS, steps_per_block=2, algorithm="low_confidence_dynamic", threshold=0.8,
                          max_running_requests=64, tp_size=2, engine_kwargs={"dllm_fdfo": False}, check_plugin=False)
    (kw,) = fake_sglang.named("Engine")
    assert kw["dllm_algorithm"] == "MegadareBlockDiffusion" and kw["max_running_requests"] == 64
    assert kw["tp_size"] == 2 and kw["enable_memory_saver"] is True and kw["skip_tokenizer_init"] is True
    assert kw["dllm_fdfo"] is False
    import yaml

    with open(kw["dllm_algorithm_config"]) as f:
        assert yaml.safe_load(f) == {"block_size": 4, "steps_per_block": 2, "algorithm": "low_confidence_dynamic",
                                     "threshold": 0.8}
    eng.shutdown()
    assert fake_sglang.named("shutdown")
    se.SGLangEngine(ckpt("LLaDA2MoeModelLM"), EOS, check_plugin=False)
    assert fake_sglang.named("Engine")[-1]["max_running_requests"] == 128     # explicit even by default
    assert se.SGLangEngine(ckpt("LLaDA2MoeModelLM"), EOS, check_plugin=False).block_size == 32
    assert se.SGLangEngine(ckpt("SDARMoeForCausalLM", block_size=8), EOS, check_plugin=False).block_size == 8
    with pytest.raises(ValueError, match="supports .*SDARForCausalLM.*'LLaDAModelLM'"):
        se.SGLangEngine(ckpt("LLaDAModelLM"), EOS, check_plugin=False)
    with pytest.raises(ValueError, match="engine_kwargs may not set"):
        se.SGLangEngine(ckpt(), EOS, engine_kwargs={"dllm_algorithm": "LowConfidence"}, check_plugin=False)
    with pytest.raises(ValueError, match="max_running_requests"):
        se.SGLangEngine(ckpt(), EOS, max_running_requests=0, check_plugin=False)


def test_engine_requires_the_plugin_entry_point(fake_sglang, ckpt, monkeypatch):
    import importlib.metadata as md

    ours = md.EntryPoint(name="megadare", value=se.PLUGIN_ENTRY_POINT, group=se.PLUGIN_GROUP)
    monkeypatch.setattr(md, "entry_points", lambda group=None: [ours] if group == se.PLUGIN_GROUP else [])
    monkeypatch.delenv("SGLANG_PLUGINS", raising=False)
    se.SGLangEngine(ckpt(), EOS)                                   # found
    monkeypatch.setenv("SGLANG_PLUGINS", "someone_else")
    with pytest.raises(RuntimeError, match="plugin is not registered"):
        se.SGLangEngine(ckpt(), EOS)
    monkeypatch.setenv("SGLANG_PLUGINS", "someone_else, megadare")
    se.SGLangEngine(ckpt(), EOS)
    monkeypatch.setattr(md, "entry_points", lambda group=None: [])
    with pytest.raises(RuntimeError, match="plugin is not registered"):
        se.SGLangEngine(ckpt(), EOS)


def test_engine_generate_translates_params_and_outputs(fake_sglang, ckpt):
    eng = se.SGLangEngine(ckpt(), EOS, check_plugin=False)
    eng.version = 7
    prompts = [[1, 2, 3], [4, 5]]
    fake_sglang.outputs = [
        {"output_ids": [6, 7, EOS], "meta_info": {"finish_reason": {"type": "stop", "matched": EOS},
                                                  "weight_version": "7",
                                                  sp.TRACE_KEY: [[0, 0, -0.5, 2], [1, 1, -0.25, 2], [1, 1, -1.0, 2]]}},
        {"output_ids": [3, 3, 3, 3, 2], "meta_info": {"finish_reason": {"type": "length"},
                                                      sp.TRACE_KEY: [[0, 0, -0.1, 2], [1, 1, -0.2, 2],
                                                                     [2, 0, -0.3, 4], [3, 1, -0.4, 4],
                                                                     [4, 0, -0.5, 6]]}}]
    params = SamplingParams(max_new_tokens=5, block_size=4, steps_per_block=2, temperature=0.7, top_p=0.9, seed=3)
    t1, t2 = eng.generate(prompts, params)
    (call,) = fake_sglang.named("generate")
    assert call["input_ids"] == prompts
    s0, s1 = call["sampling_params"]
    assert s0["temperature"] == 0.7 and s0["top_p"] == 0.9 and s0["top_k"] == -1 and s0["max_new_tokens"] == 5
    assert s0["sampling_seed"] == 3 and s1["sampling_seed"] == se.prompt_seed(3, 1) != 3
    assert s0["ignore_eos"] is False and s0["stop_token_ids"] == [EOS]
    assert s1["custom_params"] == {"megadare": {"algorithm": "low_confidence_static", "steps_per_block": 2,
                                                "threshold": 0.9, "seed": se.prompt_seed(3, 1)}}
    assert t1.response_ids == [6, 7, EOS] and t1.finish_reason == "eos" and t1.commit_step == [0, 1, 1]
    assert t1.block_step == [0, 1, 1] and t1.logprobs == [-0.5, -0.25, -1.0] and t1.num_forwards == 2
    assert t1.policy_version == 7 and t1.extra["sglang_weight_version"] == "7"
    assert t2.finish_reason == "length" and t2.num_forwards == 6 and t2.commit_step == [0, 1, 2, 3, 4]
    greedy = SamplingParams(max_new_tokens=5, block_size=4, top_k=20, stop_at_eos=False)
    eng.generate(prompts, greedy)
    g0 = fake_sglang.named("generate")[-1]["sampling_params"][0]
    assert g0["temperature"] == 0.0 and g0["top_k"] == 20 and g0["ignore_eos"] is True and "stop_token_ids" not in g0
    with pytest.raises(ValueError, match="block_size=8 differs"):
        eng.generate(prompts, SamplingParams(block_size=8, steps_per_block=4))
    with pytest.raises(ValueError, match="record_steps"):
        eng.generate(prompts, SamplingParams(block_size=4, record_steps=True))
    fake_sglang.outputs[0]["meta_info"].pop(sp.TRACE_KEY)
    with pytest.raises(RuntimeError, match="dLLM algorithm did not run"):
        eng.generate(prompts, params)
    fake_sglang.outputs[0] = {"output_ids": [], "meta_info": {"finish_reason": {"type": "abort", "message": "x"}}}
    with pytest.raises(RuntimeError, match="aborted"):
        eng.generate(prompts, params)


def test_engine_update_weights_chunks_and_flushes(fake_sglang, ckpt):
    eng = se.SGLangEngine(ckpt(), EOS, tp_size=2, chunk_bytes=64, flush_interval_s=0.0, check_plugin=False)
    named = [("a", torch.randn(4, 4)), ("b", torch.randn(3, dtype=torch.bfloat16)), ("c", torch.randn(30)),
             ("d", torch.randn(5, dtype=torch.bfloat16)), ("e", torch.randn(2))]
    fake_sglang.flush_results = [False, False, True]       # requests still in flight twice
    info = eng.update_weights(named, version=3)
    names = [n for n, _ in fake_sglang.calls]
    loads = fake_sglang.named("update_weights_from_tensor")
    assert names[1] == "begin_weight_update" and names.index("end_weight_update") > names.index(
        "update_weights_from_tensor")
    assert names.count("flush_cache") == 3 and names[-1] == "flush_cache"
    got: dict[str, torch.Tensor] = {}
    for call in loads:
        assert call["load_format"] == "flattened_bucket" and call["flush_cache"] is False
        assert len(call["named_tensors"]) == 2                  # one payload per TP rank
        chunk = unpack(call["named_tensors"][0])
        assert len({t.dtype for t in chunk.values()}) == 1      # a flattened bucket holds one dtype
        size = sum(t.numel() * t.element_size() for t in chunk.values())
        assert size <= 64 or len(chunk) == 1
        got.update(chunk)
    assert len(loads) == info["chunks"] >= 3 and set(got) == {n for n, _ in named}
    assert all(torch.equal(got[n], t) for n, t in named)
    assert eng.version == 3 and eng.health()["version"] == 3
    # inside pause()/resume() (what sync_weights does): one session and one flush for all buckets
    fake_sglang.calls.clear()
    eng.pause()
    eng.update_weights(named[:2], version=4)
    eng.update_weights(named[2:], version=4)
    eng.resume()
    names = [n for n, _ in fake_sglang.calls]
    assert names.count("begin_weight_update") == 1 and names.count("end_weight_update") == 1
    assert names.count("flush_cache") == 1 and names[-1] == "flush_cache"
    fake_sglang.flush_results = [False] * 5
    eng.flush_retries = 5
    with pytest.raises(RuntimeError, match="flush_cache still failing after 5"):
        eng.update_weights(named[:1], version=5)


def test_engine_sleep_wake_health(fake_sglang, ckpt):
    eng = se.SGLangEngine(ckpt(), EOS, check_plugin=False)
    eng.sleep()
    with pytest.raises(RuntimeError, match="asleep"):
        eng.generate([[1]], SamplingParams(block_size=4))
    eng.wake()
    assert fake_sglang.named("release_memory_occupation") and fake_sglang.named("resume_memory_occupation")
    h = eng.health()
    assert h["alive"] and h["weight_version"] == "default" and h["dllm_algorithm"] == sp.ALGORITHM_NAME
    assert h["asleep"] is False and h["max_running_requests"] == 128
    no_saver = se.SGLangEngine(ckpt(), EOS, enable_memory_saver=False, check_plugin=False)
    with pytest.raises(RuntimeError, match="enable_memory_saver"):
        no_saver.sleep()


def test_engine_distributed_receiver_and_sender(fake_sglang, ckpt):
    eng = se.SGLangEngine(ckpt(), EOS, tp_size=2, flush_interval_s=0.0, check_plugin=False)
    eng.connect_distributed("10.0.0.1", 29600, world_size=3, rank_offset=1)
    (init,) = fake_sglang.named("init_weights_update_group")
    assert (init["master_address"], init["master_port"], init["rank_offset"], init["world_size"]) == \
        ("10.0.0.1", 29600, 1, 3) and init["group_name"] == "megadare_weights" and init["backend"] == "nccl"
    sent: list[tuple[str, torch.Tensor]] = []
    started: list[list] = []

    def receiver(meta, version):           # what ray_receiver does for an engine actor, inline
        started.append(meta)
        return lambda: eng.receive_weights(meta, version)

    sender = se.DistributedWeightSender(group="G", receivers=[receiver], chunk_bytes=100, device="cpu",
                                        broadcast=lambda t, src, group: sent.append((src, group, t.clone())))
    named = [("x", torch.randn(10)), ("y", torch.randn(20, dtype=torch.bfloat16)), ("z", torch.randn(30))]
    out = sender.update_weights(named, version=9)
    assert out["chunks"] == len(started) == 2 and eng.version == 9
    flat_meta = [m for chunk in started for m in chunk]
    assert flat_meta == [("x", "float32", [10]), ("y", "bfloat16", [20]), ("z", "float32", [30])]
    assert [s[:2] for s in sent] == [(0, "G")] * 3 and all(torch.equal(s[2], t) for s, (_, t) in zip(sent, named))
    recv = fake_sglang.named("update_weights_from_distributed")
    assert [c["names"] for c in recv] == [[m[0] for m in chunk] for chunk in started]
    assert recv[0]["dtypes"] == ["float32", "bfloat16"] and recv[0]["flush_cache"] is False
    assert recv[0]["group_name"] == "megadare_weights"


_RECEIVER = textwrap.dedent("""
    import json, sys, torch, torch.distributed as dist
    from torch.distributed.distributed_c10d import (Backend, PrefixStore, _new_process_group_helper, _world,
                                                    default_pg_timeout, rendezvous)
    addr, port, group_name = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    store, rank, world = next(rendezvous(f"tcp://{addr}:{port}", 1, 2, timeout=default_pg_timeout))
    pg, _ = _new_process_group_helper(world, rank, [], Backend("gloo"), PrefixStore(group_name, store),
                                      group_name=group_name, backend_options=None, timeout=default_pg_timeout)
    _world.pg_group_ranks[pg] = {0: 0, 1: 1}
    for line in sys.stdin:                       # one chunk's (name, dtype, shape) list per line
        meta = json.loads(line)
        bufs = [torch.empty(shape, dtype=getattr(torch, dtype)) for _, dtype, shape in meta]
        for b in bufs:                           # sglang's receiver: one broadcast from rank 0 per listed tensor
            dist.broadcast(b, src=0, group=pg)
        print(json.dumps([[n, float(b.float().sum())] for (n, _, _), b in zip(meta, bufs)]), flush=True)
""")


def test_sender_group_broadcasts_chunks_to_a_receiver_process():
    """The trainer-side group and sender over gloo against a receiver process that joins the group and receives
    the way sglang's ``init_weights_update_group`` / ``update_weights_from_distributed`` do."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    proc = subprocess.Popen([sys.executable, "-c", _RECEIVER, "127.0.0.1", str(port), "mg_weights"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        pg = se.init_weight_sender_group("127.0.0.1", port, world_size=2, group_name="mg_weights", backend="gloo")
        results: list = []

        def receiver(meta, version):
            proc.stdin.write(json.dumps(meta) + "\n")
            proc.stdin.flush()
            return lambda: results.append(json.loads(proc.stdout.readline()))

        named = [("w1", torch.arange(6.).reshape(2, 3)), ("w2", torch.ones(4, dtype=torch.bfloat16)),
                 ("w3", torch.full((5,), 2.0))]
        out = se.DistributedWeightSender(pg, [receiver], chunk_bytes=30, device="cpu").update_weights(named, 1)
        assert out["chunks"] == 2
        assert [r for chunk in results for r in chunk] == [["w1", 15.0], ["w2", 4.0], ["w3", 10.0]]
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)
        import torch.distributed as dist

        dist.destroy_process_group(pg) if "pg" in locals() else None
    assert proc.returncode == 0


# ---------------------------------------------------------------------------------------------- (d) no sglang
def test_without_sglang_the_engine_says_how_to_install(monkeypatch, ckpt):
    monkeypatch.setitem(sys.modules, "sglang", None)          # import sglang -> ImportError
    with pytest.raises(ImportError, match=r'pip install "megadare\[sglang\]".*sglang>=0\.5\.20,<0\.5\.24'):
        se.SGLangEngine(ckpt(), EOS)
    with pytest.raises(ImportError):
        sp.register()


# ---------------------------------------------------------------------------------------------- (e) register()
def _fake_reqs(specs):
    return [types.SimpleNamespace(rid=f"r{i}", output_ids=[], customized_info=None, dllm_algo_state=None,
                                  sampling_params=types.SimpleNamespace(temperature=t, top_p=1.0, top_k=k,
                                                                        sampling_seed=seed, custom_params=cp))
            for i, (t, k, seed, cp) in enumerate(specs)]


@pytest.mark.parametrize("fdfo", [False, True], ids=["sync", "fdfo"])
def test_register_resolves_the_algorithm_and_delivers_traces(fake_sglang, fdfo):
    algos = sys.modules["sglang.srt.dllm.algorithm"]
    with pytest.raises(RuntimeError, match="Unknown diffusion LLM algorithm"):
        algos.get_algorithm_cls(sp.ALGORITHM_NAME)
    sp.register()
    cls = algos.get_algorithm_cls(sp.ALGORITHM_NAME)          # the lookup --dllm-algorithm goes through
    assert cls.__name__ == sp.ALGORITHM_NAME and issubclass(cls, FakeDllmAlgorithm)
    assert set(cls.supported_architectures) == {"SDARForCausalLM", "SDARMoeForCausalLM", "LLaDA2MoeModelLM"}
    registry = sys.modules["sglang.srt.plugins.hook_registry"].HookRegistry
    assert [(t, h.name) for t, _, h in registry.hooks] == [(sp.WORKER_HOOK_TARGET, "AROUND")]
    sp.register()                                             # idempotent
    assert len(registry.hooks) == 1
    registry.apply_hooks()                                    # what load_plugins() does after the plugins ran

    config = types.SimpleNamespace(algorithm=sp.ALGORITHM_NAME, block_size=B, mask_id=MASK,
                                   first_done_first_out_mode=fdfo,
                                   algorithm_config={"block_size": B, "steps_per_block": 2,
                                                     "algorithm": "low_confidence_dynamic", "threshold": 0.5})
    algo = algos.get_algorithm(config)
    model = ToyBlockLM(1)
    specs = [(1.0, 1, None, None),                              # greedy, sglang style (top_k=1)
             (0.9, 5, None, {"megadare": {"seed": 3, "algorithm": "random", "steps_per_block": 4}})]
    reqs = _fake_reqs(specs)
    grids = [[5, 1, 9, 3], [2, 8, 8, 1]]                       # committed context of each request (sglang's KV)
    heads = [[4, 7], []]                                      # the prompt's remainder in the first block

    class Runner:
        def forward(self, fb):
            ids = fb.input_ids.view(2, B)
            logits = torch.cat([block_logits(model, g, ids[i:i + 1]) for i, g in enumerate(grids)])
            return types.SimpleNamespace(full_logits=logits.reshape(2 * B, V))

    worker = sys.modules["sglang.srt.managers.tp_worker"].TpModelWorker(algo, Runner())
    batch = types.SimpleNamespace(reqs=reqs)
    core = sp.BlockDenoiser(B, MASK, config.algorithm_config)   # the reference: the core run directly
    ref = []
    for r, grid in zip(reqs, grids):
        params = core.params_for(r.sampling_params.temperature, 1.0, r.sampling_params.top_k,
                                 r.sampling_params.custom_params, None, r.rid)
        ref.append({"params": params, "rng": sp.RequestRng(params.seed), "forwards": 0, "trace": [],
                    "grid": list(grid)})
    for blk in range(2):                                      # two blocks: global steps continue across them
        hd = heads if blk == 0 else [[], []]
        start = torch.tensor([h + [MASK] * (B - len(h)) for h in hd])
        fb = types.SimpleNamespace(batch_size=2, input_ids=start.flatten().clone(), dllm_prompt_mask=None)
        emitted: list = [None, None]
        for _ in range(10):                                   # the scheduler: run, append emitted tokens
            _, next_ids, accept, states, _ = worker._forward_batch_generation_dllm(fb, batch)
            for i, r in enumerate(reqs):
                if fdfo:
                    r.dllm_algo_state = states[i]
                    if accept[i] and emitted[i] is None:
                        emitted[i] = next_ids[i][len(hd[i]):]
                        r.output_ids.extend(emitted[i])
                elif emitted[i] is None:
                    emitted[i] = next_ids[i].tolist()
                    r.output_ids.extend(emitted[i])
            if all(e is not None for e in emitted):
                break
        assert algo._reqs is None                             # unbound after the call
        for i, r in enumerate(reqs):
            R = ref[i]
            state = core.new_state(R["params"], R["rng"])
            block = core.denoise_block(lambda t: block_logits(model, R["grid"], t), start[i:i + 1].clone(), [state])
            entries, R["forwards"] = core.trace_entries(state, R["forwards"])
            R["trace"] += entries
            R["grid"] += block[0].tolist()
            assert emitted[i] == block[0, len(hd[i]):].tolist()
            grids[i] += fb.input_ids.view(2, B)[i].tolist()
    for r, R in zip(reqs, ref):
        trace = r.customized_info[sp.TRACE_KEY]
        assert trace == R["trace"] and len(trace) == len(r.output_ids) == 2 + 4 + (0 if r.rid == "r0" else 2)
        assert r._megadare_forwards == R["forwards"] == max(e[3] for e in trace)
        assert min(e[0] for e in trace[-4:]) > max(e[0] for e in trace[:-4])    # the 2nd block's steps follow
    trace0, trace1 = (r.customized_info[sp.TRACE_KEY] for r in reqs)
    assert all(e[2] == 0.0 for e in trace0)                   # greedy: point-mass log-probs
    assert any(e[2] < 0 for e in trace1) and sorted(e[1] for e in trace1[-4:]) == [0, 1, 2, 3]  # 1 per step
