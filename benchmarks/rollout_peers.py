"""The engines benchmarks/rollout_throughput.py compares against: today's engine (a git ref, imported from its
source as a private package) and DARE's generate loops (``--peer-repo``) on the same model through a thin adapter
with the publishers' calling conventions and cache behaviour. See rollout_throughput.py's docstring."""

from __future__ import annotations

import atexit
import importlib
import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import types
from typing import Callable, Optional

import torch

from megadare.rollout.engine import SamplingParams

from rollout_timing import ForwardClock, Runner

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASELINE_REF = "ce9edaf"  # main before issue 27 (per-row host sampling, growing KV cache)
BASELINE_FILES = {  # the files of today's engine, copied together: each imports the others' copies, not the package's
    "common": "megadare/models/hf/common.py",
    "sampling": "megadare/rollout/sampling.py",
    "dllm_step": "megadare/rollout/dllm_step.py",
    "editing": "megadare/rollout/editing.py",
    "decoders": "megadare/rollout/decoders.py",
    "native": "megadare/rollout/native.py",
}
# files a ref may predate: skipped where no other file of the copy imports them (decoders.py left native.py at 967ce25)
LATER_FILES = ("decoders",)


def _git_show(ref: str, path: str) -> tuple[Optional[str], str]:
    """(``path`` at ``ref``, or None; git's reason when None)."""
    try:
        return subprocess.run(
            ["git", "-C", REPO, "show", f"{ref}:{path}"], check=True, capture_output=True, text=True
        ).stdout, ""
    except (OSError, subprocess.CalledProcessError) as e:
        return None, (str(getattr(e, "stderr", "") or e).strip().splitlines() or ["git failed"])[0][:120]


def _module(path: str) -> str:
    return path[:-3].replace("/", ".")


def _baseline_sources(ref: str) -> Optional[dict[str, str]]:
    """The sources of :data:`BASELINE_FILES` at ``ref`` (a :data:`LATER_FILES` one absent there and imported by
    none of the others left out); None (and a note) when the checkout cannot show them (no git, a shallow clone)."""
    sources, missing = {}, {}
    for name, path in BASELINE_FILES.items():
        sources[name], missing[name] = _git_show(ref, path)
    for name in LATER_FILES:
        if sources[name] is None and not any(_module(BASELINE_FILES[name]) in s for s in sources.values() if s):
            del sources[name]
    for name, src in sources.items():
        if src is None:
            print(
                f"baseline: cannot read {BASELINE_FILES[name]} at {ref} ({missing[name]}); skipping today's engine "
                "(a shallow clone: git fetch --unshallow; or --baseline-ref none)"
            )
            return None
    return sources


# ---------------------------------------------------------------------------------------------- today's engine
def load_baseline(ref: str) -> Optional[types.SimpleNamespace]:
    """Today's engine at git ``ref``, imported from its source as a private package; None (and a note) when the
    checkout cannot show it (no git, a shallow clone)."""
    pkg = "_megadare_baseline_" + "".join(c for c in ref if c.isalnum())
    root = tempfile.mkdtemp(prefix="megadare-baseline-")
    atexit.register(shutil.rmtree, root, True)  # the private copy lives as long as the run
    os.makedirs(os.path.join(root, pkg))
    open(os.path.join(root, pkg, "__init__.py"), "w").close()
    sources = _baseline_sources(ref)
    if sources is None:
        return None
    for name, src in sources.items():
        for mod in sources:
            src = src.replace(f"{_module(BASELINE_FILES[mod])}", f"{pkg}.{mod}")
        with open(os.path.join(root, pkg, f"{name}.py"), "w") as f:
            f.write(src)
    sys.path.insert(0, root)
    try:
        return types.SimpleNamespace(**{m: importlib.import_module(f"{pkg}.{m}") for m in sources})
    except ImportError as e:  # the copy imports megadare's other modules (engine.py, models/) from this checkout
        raise SystemExit(_unloadable(ref, e, os.path.join(root, pkg))) from e


def _unloadable(ref: str, e: ImportError, copy: str) -> str:
    """The line refusing ``ref``: the file of the copy whose import failed, and what it could not import."""
    names, tb = [], e.__traceback__
    while tb is not None:
        path = tb.tb_frame.f_code.co_filename
        if os.path.dirname(path) == copy and os.path.basename(path)[:-3] in BASELINE_FILES:
            names.append(os.path.basename(path)[:-3])
        tb = tb.tb_next
    where = BASELINE_FILES[names[-1]] if names else "today's engine"
    what = (str(e).splitlines() or [type(e).__name__])[0].split(" (/")[0]
    return (
        f"baseline: {where} at {ref} does not load against this checkout ({what}): the copy takes the files it "
        f"does not list in BASELINE_FILES (benchmarks/rollout_peers.py) from this checkout; pick a ref that loads "
        f"(HEAD, the default {BASELINE_REF}) or --baseline-ref none"
    )


def baseline_model(base: types.SimpleNamespace, model: torch.nn.Module) -> torch.nn.Module:
    """Today's hf/ model class holding the same weight tensors as ``model``."""
    with torch.device("meta"):
        old = base.common.DecoderLM(model.arch, model.names)
    old.load_state_dict(model.state_dict(), assign=True)
    return old.eval()


# ---------------------------------------------------------------------------------------------- DARE's loops
def import_peer(repo: str, rel: str, name: str, patch: Optional[dict[str, str]] = None) -> types.ModuleType:
    """A peer file as a module (``patch``: textual replacements, each must apply); modules it imports but its
    generate functions never use are stubbed if absent."""
    for mod in ("pandas", "tqdm"):
        try:
            importlib.import_module(mod)
        except ImportError:
            stub = types.ModuleType(mod)
            stub.__spec__ = importlib.machinery.ModuleSpec(mod, None)
            stub.tqdm = None
            sys.modules[mod] = stub
            print(f"peer: {mod} is not installed; stubbed (DARE's generate functions do not use it)")
    path = os.path.join(repo, rel)
    if not os.path.isfile(path):
        raise SystemExit(
            f"peer: {path} not found; --peer-repo must be a full DARE checkout (this benchmark follows 83ae8a3)"
        )
    with open(path) as f:
        src = f.read()
    for old, new in (patch or {}).items():
        if old not in src:
            raise SystemExit(f"peer: {rel} has no {old!r} to patch; this benchmark follows DARE at 83ae8a3")
        src = src.replace(old, new)
    module = types.ModuleType(name)
    module.__file__ = os.path.join(repo, rel)
    sys.modules[name] = module
    exec(compile(src, module.__file__, "exec"), module.__dict__)
    return module


class _KV:
    """The hf/ model's cache protocol with a publisher's cache behaviour. ``past``: per layer (k, v) or None;
    ``keep``: store the concatenation (HF ``DynamicCache`` / ``store_kv``); ``replace``: Fast-dLLM's dual cache,
    the block's keys written into the past at ``replace`` [B, L] (in place, row by row, as its model does)."""

    def __init__(self, layers: int, past=None, keep: bool = False, replace: Optional[torch.Tensor] = None):
        self.past = list(past) if past is not None else [None] * layers
        self.keep, self.replace = keep, replace

    def update(self, i: int, k: torch.Tensor, v: torch.Tensor):
        if self.past[i] is not None:
            pk, pv = self.past[i]
            if self.replace is not None:
                for b in range(k.shape[0]):
                    idx = self.replace[b].nonzero(as_tuple=True)[0]
                    pk[b, :, idx], pv[b, :, idx] = k[b, :, : len(idx)], v[b, :, : len(idx)]
                k, v = pk, pv
            else:
                k, v = torch.cat([pk, k], dim=2), torch.cat([pv, v], dim=2)
        if self.keep:
            self.past[i] = (k, v)
        return k, v


class PeerModel:
    """The hf/ model with the calling conventions DARE's loops expect (``.device``, ``.logits``,
    ``past_key_values``), for SDAR's block-diffusion loop, LLaDA's Fast-dLLM loops and Dream's ``_sample``. Its
    logits never favour the mask token (a trained model's do not; DARE's SDAR loop would write a predicted mask
    back and step past its schedule)."""

    def __init__(self, model: torch.nn.Module):
        self.mask_id = model.arch.mask_token_id
        self.model = self._no_mask(model)
        self.device = next(model.parameters()).device
        self.layers = model.arch.num_layers

    def eval(self):
        return self

    def _no_mask(self, model: torch.nn.Module) -> Callable:
        def call(*args, **kwargs):
            logits = model(*args, **kwargs)
            logits[..., self.mask_id] = float("-inf")
            return logits

        call.arch = model.arch
        return call

    def __call__(
        self,
        x,
        attention_mask=None,
        position_ids=None,
        past_key_values=None,
        use_cache=False,
        store_kv=False,
        replace_position=None,
        **_,
    ):
        B, S = x.shape
        if hasattr(past_key_values, "get_seq_length"):  # SDAR: an HF DynamicCache, block-causal mask
            kv = getattr(past_key_values, "_megadare_kv", None) or _KV(self.layers)
            past_key_values._megadare_kv = kv
            kv.keep = bool(store_kv)
            mask = attention_mask.bool()[:, None].expand(B, 1, S, attention_mask.shape[-1])
            logits = self.model(x, attention_mask=mask, position_ids=position_ids.expand(B, S), kv_cache=kv)
            return types.SimpleNamespace(logits=logits)
        if isinstance(attention_mask, torch.Tensor) or attention_mask == "full" or not use_cache:  # Dream
            return types.SimpleNamespace(logits=self.model(x))
        kv = _KV(
            self.layers,
            past_key_values,
            keep=past_key_values is None,  # LLaDA: Fast-dLLM prefix / dual
            replace=replace_position,
        )
        if past_key_values is None:
            pos = torch.arange(S, device=x.device).expand(B, S)
        elif replace_position is not None:
            pos = replace_position.nonzero(as_tuple=True)[1].view(B, -1)
        else:
            start = past_key_values[0][0].shape[2]
            pos = torch.arange(start, start + S, device=x.device).expand(B, S)
        allowed = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=x.device)
        logits = self.model(x, attention_mask=allowed, position_ids=pos, kv_cache=kv)
        return types.SimpleNamespace(logits=logits, past_key_values=kv.past)


def peer_runners(
    repo: str, family: str, cache: str, model: torch.nn.Module, arch, prompts: list[list[int]], params: SamplingParams
) -> list[Runner]:
    """DARE's generate functions for the workload, batched (one call for all prompts of equal length)."""
    peer, M = PeerModel(model), arch.mask_token_id
    clock = ForwardClock(peer, "model")
    ids = torch.tensor(prompts, device=peer.device)
    G, S = params.max_new_tokens, params.steps_per_block * params.max_new_tokens // params.block_size
    if family == "sdar":  # as shipped it allocates x for one prompt; batched: x for the batch (one line)
        rel = "opencompass/opencompass/models/sdar_generate.py"
        shipped = import_peer(repo, rel, "dare_sdar_generate")
        batched = import_peer(
            repo,
            rel,
            "dare_sdar_generate_batched",
            {
                "x = torch.full((1, total_length), mask_id,": "x = torch.full((input_ids.shape[0], total_length), mask_id,"
            },
        )

        def sdar(module, x):
            return module.block_diffusion_generate(
                peer,
                {"input_ids": x},
                M,
                gen_length=G,
                block_length=params.block_size,
                denoising_steps=params.steps_per_block,
                temperature=params.temperature,
                remasking_strategy=params.algorithm,
            )

        return [
            Runner(
                "DARE block_diffusion_generate (batched)",
                lambda: sdar(batched, ids) is not None and ids.shape[0] * G,
                clock,
            ),
            Runner(
                "DARE block_diffusion_generate (per prompt)",
                lambda: sum(G for i in range(ids.shape[0]) if sdar(shipped, ids[i : i + 1]) is not None),
                clock,
            ),
        ]
    if family == "llada" and cache in ("prefix", "dual"):
        gen = import_peer(repo, "verl/workers/rollout/generate.py", "dare_generate")
        fn = (
            gen.generate_with_prefix_cache
            if cache == "prefix"
            else getattr(gen.generate_with_dual_cache, "_torchdynamo_orig_callable", gen.generate_with_dual_cache)
        )
        run = lambda: fn(
            peer,
            ids,
            steps=S,
            gen_length=G,
            block_length=params.block_size,  # noqa: E731
            temperature=params.temperature,
            remasking="low_confidence",
            mask_id=M,
        )
        return [
            Runner(f"DARE generate_with_{cache}_cache (batched)", lambda: run() is not None and ids.shape[0] * G, clock)
        ]
    if family == "dream" and cache == "none":
        du = import_peer(repo, "verl/workers/rollout/generation_utils.py", "dare_generation_utils")
        conf = du.DreamGenerationConfig(
            temperature=params.temperature,
            top_p=params.top_p,
            steps=S,
            max_length=ids.shape[1] + G,
            mask_token_id=M,
            alg="entropy",
            alg_temp=0.0,
            eps=params.eps,
        )
        hooks = dict(generation_tokens_hook_func=lambda s, x, lg: x, generation_logits_hook_func=lambda s, x, lg: lg)
        run = lambda: du.DreamGenerationMixin._sample(peer, ids, None, conf, **hooks)  # noqa: E731
        return [
            Runner("DARE DreamGenerationMixin._sample (batched)", lambda: run() is not None and ids.shape[0] * G, clock)
        ]
    return []
