"""``FakeSGLang``: a fake of the sglang module tree at the boundary megadare touches (``sglang.Engine``,
``sglang.srt.dllm.algorithm{,.base}``, ``sglang.srt.plugins.hook_registry``, ``sglang.srt.managers.tp_worker``,
``sglang.srt.utils``, ``sglang.srt.weight_sync.tensor_bucket``), installed into ``sys.modules`` per test by the
``fake_sglang`` fixture. It records what the engine asks of sglang; it is not sglang."""

from __future__ import annotations

import enum
import functools
import importlib
import json
import sys
import types
from typing import Optional

import pytest
import torch

from megadare.rollout import sglang_plugin as sp


# ---------------------------------------------------------------------------------------------- the fake sglang
class FakeSGLang:
    """A fake of sglang's module tree at megadare's boundary (not sglang: just the names and contracts the
    plugin and engine use, as read in sglang 0.5.20-0.5.23). Records every Engine call."""

    MODULES = [
        "sglang",
        "sglang.srt",
        "sglang.srt.dllm",
        "sglang.srt.dllm.algorithm",
        "sglang.srt.dllm.algorithm.base",
        "sglang.srt.plugins",
        "sglang.srt.plugins.hook_registry",
        "sglang.srt.managers",
        "sglang.srt.managers.tp_worker",
        "sglang.srt.utils",
        "sglang.srt.weight_sync",
        "sglang.srt.weight_sync.tensor_bucket",
        "sglang.srt.models",
        "sglang.srt.models.sdar",
    ]

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
                        return types.SimpleNamespace(success=fake.flush_results.pop(0) if fake.flush_results else True)
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
                    setattr(
                        owner, attr, functools.wraps(original)(lambda *a, _o=original, _h=hook, **k: _h(_o, *a, **k))
                    )

        HookRegistry.hooks = []
        self.mods["sglang.srt.plugins.hook_registry"].HookRegistry = HookRegistry
        self.mods["sglang.srt.plugins.hook_registry"].HookType = HookType
        # per-fake subclasses: the hooks a test applies patch these, not the classes below
        self.mods["sglang.srt.managers.tp_worker"].TpModelWorker = type("TpModelWorker", (FakeTpModelWorker,), {})
        self.mods["sglang.srt.models.sdar"].SDARForCausalLM = type("SDARForCausalLM", (FakeSDARForCausalLM,), {})
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

    def max_steps(self, block_size):
        return block_size + 1

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
        for _ in range(self.max_steps(Bs)):
            if all(self.step(forward_batch, out.full_logits, states)):
                break
            out = model_runner.forward(forward_batch)
        ids = forward_batch.input_ids.view(n, Bs)
        return out, [ids[i, start[i] :] for i in range(n)], None, None, False


class FakeTpModelWorker:
    def __init__(self, algorithm, model_runner):
        self.dllm_algorithm, self.model_runner = algorithm, model_runner

    def _forward_batch_generation_dllm(self, forward_batch, batch=None):
        states = [r.dllm_algo_state for r in batch.reqs] if self.dllm_algorithm.fdfo and batch is not None else None
        return self.dllm_algorithm.run(self.model_runner, forward_batch, states)


class FakeSDARForCausalLM(torch.nn.Module):
    """sglang 0.5.20-0.5.23's SDARForCausalLM at the point megadare fixes: with tied embeddings at TP 1 ``lm_head``
    is ``model.embed_tokens`` (no ``lm_head.weight`` parameter), and ``load_weights`` looks one up for the
    embedding when ``config.tie_word_embeddings`` (sglang/srt/models/sdar.py, the ``model.embed_tokens.weight``
    branch); other names load into ``named_parameters()`` or are skipped with a warning."""

    def __init__(self, tie: bool):
        super().__init__()
        self.config = types.SimpleNamespace(tie_word_embeddings=tie)
        self.model = torch.nn.Module()
        self.model.embed_tokens = torch.nn.Embedding(8, 4)
        self.lm_head = self.model.embed_tokens if tie else torch.nn.Linear(4, 8, bias=False)
        self.skipped: list[str] = []

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        for name, w in weights:
            if name == "model.embed_tokens.weight" and self.config.tie_word_embeddings:
                params["lm_head.weight"].data.copy_(w)  # KeyError when lm_head is the embedding
            if name in params:
                params[name].data.copy_(w)
            else:
                self.skipped.append(name)


class FakeSerializer:
    @staticmethod
    def serialize(obj, output_str=False):
        return ("serialized", obj, output_str)


class FakeFlattenedBucket:
    def __init__(self, named_tensors):
        parts, self.meta, off = [], [], 0
        for name, t in named_tensors:
            flat = t.flatten().view(torch.uint8)
            self.meta.append(
                types.SimpleNamespace(
                    name=name, shape=t.shape, dtype=t.dtype, start_idx=off, end_idx=off + flat.numel()
                )
            )
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
    return {
        m.name: data["flattened_tensor"][m.start_idx : m.end_idx].view(m.dtype).reshape(m.shape)
        for m in data["metadata"]
    }


@pytest.fixture
def fake_sglang(monkeypatch):
    return FakeSGLang().install(monkeypatch)


SERVABLE_VOCAB = 157184  # holds sglang's mask ids (SDAR 151669, LLaDA2 156895)


@pytest.fixture
def ckpt(tmp_path):
    """A config.json (no weights) of the family serving ``arch``: its tiny config with sglang's mask id and a
    vocabulary that holds it, ``extra`` on top."""
    from megadare.models.family import family_of
    from megadare.rollout.sglang_engine import SGLANG_MASK_ID

    def make(arch="SDARForCausalLM", **extra):
        d = tmp_path / arch
        d.mkdir(exist_ok=True)
        over = {"vocab_size": SERVABLE_VOCAB, "mask_token_id": SGLANG_MASK_ID[arch]} if arch in SGLANG_MASK_ID else {}
        cfg = family_of({"architectures": [arch]}).tiny_config(**over)
        (d / "config.json").write_text(json.dumps({**cfg, **extra}))
        return str(d)

    return make
