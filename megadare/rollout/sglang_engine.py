"""The SGLang rollout engine: the engine protocol (generate / update_weights / sleep / wake / health) on sglang's
offline ``Engine``, decoding with megadare's own dLLM algorithm (``sglang_plugin.MegadareBlockDiffusion``).

    engine = SGLangEngine(SGLangEngineSpec("/ckpt/SDAR-1.7B-Chat", eos_token_id=151643, max_running_requests=128))
    trajs = engine.generate(prompts, SamplingParams(max_new_tokens=256, block_size=4, steps_per_block=4,
                                                    temperature=1.0, seed=step))
    # in a Ray engine actor, driven by rollout.weight_sync.sync.WeightSync: join_weight_groups + receive_weights
    # (distributed: flattened buckets broadcast by every pipeline stage's sender), or update_weights (colocated)

Install: ``pip install "megadare[sglang]"`` (pins ``sglang>=0.5.20,<0.5.24``), and install megadare itself into the
same environment (``pip install -e .``): sglang finds the algorithm through megadare's entry point in the group
``sglang.srt.plugins``, which it loads in every sglang process.

Followed (sglang 0.5.20 / 0.5.21 / 0.5.22 / 0.5.23 wheels): ``sglang/srt/entrypoints/engine.py``
(``Engine(**server_args)``, ``generate(input_ids=..., sampling_params=[...])`` -> one dict per prompt with
``output_ids`` and ``meta_info`` (``finish_reason = {"type": "stop" | "length" | "abort", ...}``,
``weight_version``, customized per-token info), ``update_weights_from_tensor(named_tensors, load_format,
flush_cache)`` (``load_format="flattened_bucket"``: the caller passes one serialized ``{"flattened_tensor",
"metadata"}`` payload per TP rank, built with ``sglang/srt/weight_sync/tensor_bucket.py::FlattenedTensorBucket`` and
``sglang.srt.utils.MultiprocessingSerializer``), ``init_weights_update_group(master_address, master_port,
rank_offset, world_size, group_name, backend)``, ``update_weights_from_distributed(names, dtypes, shapes,
group_name, flush_cache, load_format)`` (the receiver allocates every listed tensor, then receives one
``broadcast(src=0)`` per tensor in list order: so the sender chunks), ``begin_weight_update`` /
``end_weight_update`` (0.5.21+: weight updates must run inside such a session,
``managers/scheduler_components/weight_updater.py``), ``flush_cache`` (-> ``.success``; fails while requests are in
flight, so it is retried), ``release_memory_occupation`` / ``resume_memory_occupation`` (need
``enable_memory_saver``), ``get_model_info`` (``weight_version``), ``get_server_info``, ``shutdown``);
``sglang/srt/dllm/config.py`` (``DLLM_PARAMS``: SDAR / SDAR-MoE block 4 and mask id 151669, LLaDA2 block 32 and mask
id 156895, hard-coded by architecture: config.json's ``mask_token_id`` is ignored, so a checkpoint with another mask
id is refused here before the engine starts; ``max_running_requests`` defaults to 1 in dLLM mode, so it is always
passed); ``sglang/srt/sampling/sampling_params.py`` (``temperature``, ``top_p``, ``top_k`` (-1 = off),
``max_new_tokens``, ``ignore_eos``, ``stop_token_ids``, ``sampling_seed``, ``custom_params``);
``sglang/srt/utils/common.py::init_custom_process_group`` (what the sender's group must match).

Gaps (documented, not hidden): sglang's ``Engine.update_weights_from_tensor`` / ``..._from_distributed`` take no
weight version (the request structs have one, the Engine methods do not pass it), so the policy version is kept
here and stamped on every trajectory; ``health()`` also reports sglang's own ``weight_version``.

Tested: against a fake of the sglang boundary (tests/test_sglang_engine.py) and against a real sglang 0.5.21 Engine
on CPU (tests/sglang_cpu/, run by tests/sglang_cpu/run.sh in CI): trajectories equal the built-in engine's for
SDAR, SDAR-MoE and LLaDA2; weight pushes from sharded Megatron trainers, in process (``update_weights_from_tensor``,
TP2+SP) and as a Ray engine actor over gloo groups (``join_weight_groups`` / ``receive_weights``, EP2); an engine
restarted through the Ray manager. Unverified without a GPU: CUDA IPC, NCCL, ``release_memory_occupation``
(``enable_memory_saver`` needs the CUDA-only torch_memory_saver), TP > 1.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
import weakref
from dataclasses import dataclass
import importlib.metadata
from typing import Any, Iterable, Mapping, Optional, Sequence

import torch
import yaml

from megadare.files import owned_tempdir
from megadare.models.family import family_of
from megadare.rollout.engine import SamplingParams, Superseded, Trajectory, answer_ids, check_generate_call, prompt_seed
from megadare.rollout.sglang_plugin import (
    ALGORITHM_NAME,
    CUSTOM_PARAMS_KEY,
    DECODER_KEYS,
    SGLANG_REQUIREMENT,
    SUPPORTED_ARCHITECTURES,
    TRACE_KEY,
)

INSTALL_HINT = f'pip install "megadare[sglang]" (i.e. "{SGLANG_REQUIREMENT}")'
# sglang/srt/dllm/config.py DLLM_PARAMS (0.5.20-0.5.23; tests/sglang_cpu checks them against the installed sglang)
DEFAULT_BLOCK_SIZE = {"SDARForCausalLM": 4, "SDARMoeForCausalLM": 4, "LLaDA2MoeModelLM": 32}
SGLANG_MASK_ID = {"SDARForCausalLM": 151669, "SDARMoeForCausalLM": 151669, "LLaDA2MoeModelLM": 156895}
PLUGIN_ENTRY_POINT = "megadare.rollout.sglang_plugin:register"
PLUGIN_GROUP = "sglang.srt.plugins"


def _import_sglang():
    try:
        import sglang  # optional: sglang
    except ImportError as e:
        raise ImportError(
            f"the SGLang rollout engine needs sglang: {INSTALL_HINT}; the built-in engine "
            "(rollout.engine=native) needs nothing extra"
        ) from e
    return sglang


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (sglang resolves names with ``getattr(torch, name)``)."""
    return str(dtype).removeprefix("torch.")


def chunk_named(
    named: Sequence[tuple[str, torch.Tensor]], chunk_bytes: int, by_dtype: bool = False
) -> list[list[tuple[str, torch.Tensor]]]:
    """Consecutive chunks of at most ``chunk_bytes`` (a larger tensor gets its own chunk); with ``by_dtype`` each
    chunk holds one dtype (a flattened bucket is sliced back with ``.view(dtype)``, which needs aligned offsets)."""
    groups: dict[Any, list[tuple[str, torch.Tensor]]] = {}
    for name, t in named:
        groups.setdefault(t.dtype if by_dtype else None, []).append((name, t))
    out: list[list[tuple[str, torch.Tensor]]] = []
    for items in groups.values():
        cur: list[tuple[str, torch.Tensor]] = []
        size = 0
        for name, t in items:
            n = t.numel() * t.element_size()
            if cur and size + n > chunk_bytes:
                out.append(cur)
                cur, size = [], 0
            cur.append((name, t))
            size += n
        if cur:
            out.append(cur)
    return out


def _ok(result: Any, what: str) -> None:
    """sglang control calls answer (success, message) or an object with ``.success``; raise on failure."""
    if result is None:
        return
    if isinstance(result, tuple) and result and isinstance(result[0], bool):
        success, message = result[0], (result[1] if len(result) > 1 else "")
    elif hasattr(result, "success"):
        success, message = bool(result.success), getattr(result, "message", "")
    else:
        return
    if not success:
        raise RuntimeError(f"sglang {what} failed: {message}")


def read_architecture(model_path: str) -> tuple[str, dict[str, Any]]:
    """(architectures[0], config) of a HF checkpoint directory."""
    path = os.path.join(model_path, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"SGLangEngine: no config.json in {model_path!r}")
    with open(path) as f:
        cfg = json.load(f)
    archs = cfg.get("architectures") or []
    if not archs:
        raise ValueError(f"SGLangEngine: {path} declares no architectures")
    return archs[0], cfg


def check_mask_id(model_path: str, arch: str, cfg: dict[str, Any]) -> None:
    """Refuse a checkpoint sglang would decode with the wrong mask token: sglang takes the mask id from the
    architecture (``SGLANG_MASK_ID``) and ignores config.json, so the checkpoint's own mask id (the family's
    reading of config.json) must be that one, and inside the vocabulary."""
    facts = family_of(cfg).arch(cfg)
    want = SGLANG_MASK_ID[arch]
    where = os.path.join(model_path, "config.json")
    if facts.mask_token_id != want:
        raise ValueError(
            f"SGLangEngine: {where} has mask token id {facts.mask_token_id}, but sglang hard-codes mask "
            f"id {want} for {arch} (sglang/srt/dllm/config.py, DLLM_PARAMS) and ignores config.json: it "
            f"would decode with the wrong mask. Serve this checkpoint with the built-in engine "
            f"(rollout.engine=native), or use one whose mask token id is {want}"
        )
    if want >= facts.vocab_size:
        raise ValueError(
            f"SGLangEngine: {where} has vocab_size={facts.vocab_size}, which does not hold sglang's "
            f"mask id {want} for {arch}; use a checkpoint whose vocabulary holds it"
        )


def plugin_registered() -> bool:
    """Whether sglang will load megadare's algorithm: the entry point is installed (``pip install -e .``) and not
    filtered out by ``SGLANG_PLUGINS``."""
    eps = [
        ep
        for ep in importlib.metadata.entry_points(group=PLUGIN_GROUP)
        if ep.value.replace(" ", "") == PLUGIN_ENTRY_POINT
    ]
    if not eps:
        return False
    allowed = os.environ.get("SGLANG_PLUGINS", "")
    if allowed.strip():
        names = {x.strip() for x in allowed.split(",") if x.strip()}
        return any(ep.name in names for ep in eps)
    return True


def trajectory_from_output(
    prompt: list[int], out: dict[str, Any], params: SamplingParams, eos_token_id: int, policy_version: int
) -> Trajectory:
    """One sglang generate() output (``output_ids`` + ``meta_info`` with the plugin's per-token trace) as a
    validated Trajectory."""
    ids = [int(t) for t in out.get("output_ids") or []]
    meta = out.get("meta_info") or {}
    fr = meta.get("finish_reason")
    kind = fr.get("type") if isinstance(fr, dict) else fr
    if kind == "abort":
        raise RuntimeError(f"sglang aborted a request: {fr}")
    trace = meta.get(TRACE_KEY)
    if trace is None:
        raise RuntimeError(
            f"sglang returned no {TRACE_KEY!r}: megadare's dLLM algorithm did not run (is megadare "
            f"installed in sglang's environment, its entry point in {PLUGIN_GROUP!r}, and "
            "SGLANG_PLUGINS unset or naming 'megadare'?)"
        )
    if (
        kind == "stop"
        and params.stop_at_eos
        and isinstance(fr, dict)
        and fr.get("matched") == eos_token_id
        and (not ids or ids[-1] != eos_token_id)
        and len(trace) > len(ids)
    ):
        ids.append(eos_token_id)  # a trimmed stop token: its trace entry is still there
    ids = ids[: params.max_new_tokens]
    if len(trace) < len(ids):
        raise RuntimeError(f"sglang returned {len(trace)} trace entries for {len(ids)} output tokens")
    trace = trace[: len(ids)]
    if any(e is None for e in trace):
        raise RuntimeError("sglang returned output tokens without a trace entry (a retracted request?)")
    finish = "eos" if eos_token_id in ids else "length"  # the answer ended (a full canvas keeps what follows)
    if params.stop_at_eos and finish == "eos":
        ids = answer_ids(ids, eos_token_id)
        trace = trace[: len(ids)]
    num_forwards = max((int(e[3]) for e in trace), default=0)
    superseded = [
        Superseded(k, int(tok), int(g), int(s), float(lp))
        for k, e in enumerate(trace)
        for g, s, lp, tok in (e[4] if len(e) > 4 else [])
    ]
    return Trajectory(
        prompt_ids=list(prompt),
        response_ids=ids,
        commit_step=[int(e[0]) for e in trace],
        block_step=[int(e[1]) for e in trace],
        logprobs=[float(e[2]) for e in trace],
        finish_reason=finish,
        num_forwards=num_forwards,
        params=params,
        policy_version=policy_version,
        superseded=superseded if params.algorithm == "editing" else (superseded or None),
        extra={"sglang_weight_version": meta.get("weight_version")},
    ).validate()


def _checked_model(model_path: str, max_running_requests: int, check_plugin: bool) -> tuple[str, dict]:
    """The checkpoint's architecture and config, refused in one line when SGLangEngine cannot serve it."""
    arch, cfg = read_architecture(model_path)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"SGLangEngine supports {list(SUPPORTED_ARCHITECTURES)} (SDAR, SDAR-MoE / TraDo, "
            f"LLaDA2); {model_path!r} is {arch!r}: use the built-in engine (rollout.engine=native)"
        )
    if not isinstance(max_running_requests, int) or max_running_requests < 1:
        raise ValueError(f"max_running_requests must be a positive int, got {max_running_requests!r}")
    check_mask_id(model_path, arch, cfg)
    if check_plugin and not plugin_registered():
        raise RuntimeError(
            f"megadare's sglang plugin is not registered: install megadare into this environment "
            f"(pip install -e .) so that the entry point {PLUGIN_GROUP!r} -> {PLUGIN_ENTRY_POINT} "
            "exists, and leave SGLANG_PLUGINS unset or include 'megadare' in it"
        )
    return arch, cfg


@dataclass(frozen=True)
class SGLangEngineSpec:
    """What an SGLang engine serves and how (built once from ``rollout.*`` by ``rollout.setup.engine_spec`` and
    shipped to the engine actor): the HF checkpoint ``model_path`` and its ``eos_token_id``; the engine's default
    block decoding (``block_size`` / ``steps_per_block`` / ``algorithm`` / ``threshold``, None: the checkpoint's
    block size, one step per token); its sizes (``max_running_requests``, ``tp_size``, ``mem_fraction_static``,
    ``enable_memory_saver``, ``random_seed``); the weight push (``chunk_bytes`` per bucket, ``flush_retries`` x
    ``flush_interval_s`` for sglang's cache flush); ``engine_kwargs``: more ``sglang.Engine`` (``ServerArgs``)
    fields, passed unchanged."""

    model_path: str
    eos_token_id: int
    block_size: Optional[int] = None
    steps_per_block: Optional[int] = None
    algorithm: str = "low_confidence_static"
    threshold: float = 0.9
    max_running_requests: int = 128
    tp_size: int = 1
    mem_fraction_static: float = 0.7
    enable_memory_saver: bool = True
    random_seed: int = 0
    chunk_bytes: int = 512 << 20
    flush_retries: int = 60
    flush_interval_s: float = 1.0
    engine_kwargs: Optional[Mapping[str, Any]] = None


class SGLangEngine:
    """Rollout engine protocol on ``sglang.Engine`` with ``dllm_algorithm="MegadareBlockDiffusion"``.

    Architectures: SDAR, SDAR-MoE (and TraDo, which is SDAR), LLaDA2. ``block_size`` defaults to the checkpoint's
    ``block_size`` or sglang's default for the architecture and is written, with the default ``steps_per_block`` /
    ``algorithm`` / ``threshold``, to the YAML passed as ``dllm_algorithm_config``; per-request sampling parameters
    travel in each request (``custom_params``), so one engine serves any ``SamplingParams`` with its block size.
    ``max_running_requests`` is always passed (sglang's dLLM mode would otherwise decode one request at a time).
    ``engine_kwargs`` go to ``sglang.Engine`` unchanged (any ``ServerArgs`` field, e.g. ``dllm_fdfo``).
    """

    def __init__(self, spec: SGLangEngineSpec, check_plugin: bool = True):
        sglang = _import_sglang()
        arch, cfg = _checked_model(spec.model_path, spec.max_running_requests, check_plugin)
        self.block_size = int(spec.block_size or cfg.get("block_size") or DEFAULT_BLOCK_SIZE[arch])
        steps = int(spec.steps_per_block or self.block_size)
        SamplingParams(block_size=self.block_size, steps_per_block=steps, algorithm=spec.algorithm)  # validates
        self.architecture = arch
        self.spec = spec
        self.eos = int(spec.eos_token_id)
        self.tp_size = int(spec.tp_size)
        self.max_running_requests = spec.max_running_requests
        self.enable_memory_saver = spec.enable_memory_saver
        self.chunk_bytes = int(spec.chunk_bytes)
        self.flush_retries, self.flush_interval_s = int(spec.flush_retries), float(spec.flush_interval_s)
        self.version = 0
        self.asleep = False
        self._session_open = False
        self._paused = False
        self._tmpdir = owned_tempdir("megadare_sglang_")  # what SIGKILLed engines (ray.kill) left goes
        self._cleanup = weakref.finalize(self, shutil.rmtree, self._tmpdir, True)
        self.algorithm_config = {
            "block_size": self.block_size,
            "steps_per_block": steps,
            "algorithm": spec.algorithm,
            "threshold": float(spec.threshold),
        }
        self.algorithm_config_path = os.path.join(self._tmpdir, "dllm_algorithm.yaml")
        with open(self.algorithm_config_path, "w") as f:
            yaml.safe_dump(self.algorithm_config, f)
        extra = dict(spec.engine_kwargs or {})
        fixed = {"dllm_algorithm", "dllm_algorithm_config", "model_path"}
        if fixed & set(extra):
            raise ValueError(f"engine_kwargs may not set {sorted(fixed & set(extra))}: SGLangEngine owns them")
        self.engine_kwargs: dict[str, Any] = {
            "model_path": spec.model_path,
            "dllm_algorithm": ALGORITHM_NAME,
            "dllm_algorithm_config": self.algorithm_config_path,
            "max_running_requests": spec.max_running_requests,
            "tp_size": self.tp_size,
            "mem_fraction_static": spec.mem_fraction_static,
            "enable_memory_saver": spec.enable_memory_saver,
            "random_seed": spec.random_seed,
            "skip_tokenizer_init": True,
            "trust_remote_code": True,
            **extra,
        }
        self._engine = sglang.Engine(**self.engine_kwargs)

    # ------------------------------------------------------------------ generation
    def sampling_params(self, params: SamplingParams, index: int) -> dict[str, Any]:
        """sglang sampling parameters of the ``index``-th prompt."""
        seed = prompt_seed(params.seed, index)
        sp: dict[str, Any] = {
            "max_new_tokens": params.max_new_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k if params.top_k > 0 else -1,
            "sampling_seed": seed,
            "ignore_eos": not params.stop_at_eos,
            "skip_special_tokens": False,
            "custom_params": {
                CUSTOM_PARAMS_KEY: {
                    "algorithm": params.algorithm,
                    "steps_per_block": params.steps_per_block,
                    "threshold": params.threshold,
                    "seed": seed,
                    **{k: getattr(params, k) for k in DECODER_KEYS},
                }
            },
        }
        if params.stop_at_eos:
            sp["stop_token_ids"] = [self.eos]
        return sp

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Trajectory]:
        check_generate_call(self.asleep, prompts)
        if params.block_size != self.block_size:
            raise ValueError(
                f"sampling block_size={params.block_size} differs from the engine's block size "
                f"{self.block_size} ({self.architecture}); they must agree"
            )
        if params.record_steps:
            raise ValueError(
                "record_steps (per-step predictions, MDPO) is not supported by the SGLang engine; "
                "use the built-in engine"
            )
        outs = self._engine.generate(
            input_ids=[list(map(int, p)) for p in prompts],
            sampling_params=[self.sampling_params(params, i) for i in range(len(prompts))],
        )
        if isinstance(outs, dict):
            outs = [outs]
        if len(outs) != len(prompts):
            raise RuntimeError(f"sglang returned {len(outs)} outputs for {len(prompts)} prompts")
        return [trajectory_from_output(p, o, params, self.eos, self.version) for p, o in zip(prompts, outs)]

    # ------------------------------------------------------------------ weights
    def _begin(self) -> bool:
        """Open sglang's weight-update session (0.5.21+) if none is open; True if this call opened it."""
        if self._session_open or not hasattr(self._engine, "begin_weight_update"):
            return False
        _ok(self._engine.begin_weight_update(), "begin_weight_update")
        self._session_open = True
        return True

    def _end(self) -> None:
        if self._session_open:
            _ok(self._engine.end_weight_update(), "end_weight_update")
            self._session_open = False

    def flush_cache(self) -> None:
        """sglang's flush_cache fails while requests are in flight: retry (slime: 60 x 1 s)."""
        for attempt in range(self.flush_retries):
            res = self._engine.flush_cache()
            ok = res.success if hasattr(res, "success") else (res[0] if isinstance(res, tuple) else res is not False)
            if ok:
                return
            if attempt + 1 < self.flush_retries:
                time.sleep(self.flush_interval_s)
        raise RuntimeError(f"sglang flush_cache still failing after {self.flush_retries} attempts")

    def pause(self) -> None:
        """Start a weight sync (``sync_weights`` calls it before the first bucket): one sglang update session
        and one cache flush for all buckets."""
        self._begin()
        self._paused = True

    def resume(self) -> None:
        if self._paused:
            self._paused = False
            self._end()
            self.flush_cache()

    def _flattened_payload(self, chunk: list[tuple[str, torch.Tensor]]) -> Any:
        from sglang.srt.utils import MultiprocessingSerializer  # optional: sglang
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket  # optional: sglang

        device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cuda":
            try:  # device indices by UUID across processes (what sglang's own weight_sync helper does)
                from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions  # optional: sglang

                monkey_patch_torch_reductions()
            except ImportError:
                pass
        bucket = FlattenedTensorBucket(named_tensors=[(n, t.detach().to(device).contiguous()) for n, t in chunk])
        data = {"flattened_tensor": bucket.get_flattened_tensor(), "metadata": bucket.get_metadata()}
        return MultiprocessingSerializer.serialize(data, output_str=True)

    @contextlib.contextmanager
    def _weight_update(self, version: int):
        """Around one weight load: open sglang's update session unless pause() holds one, close it whatever
        happens; on success flush the cache (pause/resume flush once at the end instead) and take ``version``."""
        opened = self._begin()
        try:
            yield
        finally:
            if opened and not self._paused:
                self._end()
        if not self._paused:
            self.flush_cache()
        self.version = version

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> dict[str, Any]:
        """Load HF-named tensors (one bucket or the whole model) with ``update_weights_from_tensor`` (colocated:
        CUDA IPC of a flattened bucket per dtype and chunk, the same payload for every TP rank), then flush the
        cache (unless inside pause()/resume(), which flush once at the end)."""
        named = list(named_tensors)
        t0 = time.perf_counter()
        nbytes, chunks = 0, 0
        with self._weight_update(version):
            for chunk in chunk_named(named, self.chunk_bytes, by_dtype=True):
                payload = self._flattened_payload(chunk)
                _ok(
                    self._engine.update_weights_from_tensor(
                        named_tensors=[payload] * self.tp_size, load_format="flattened_bucket", flush_cache=False
                    ),
                    "update_weights_from_tensor",
                )
                if torch.cuda.is_available():
                    torch.cuda.ipc_collect()
                nbytes += sum(t.numel() * t.element_size() for _, t in chunk)
                chunks += 1
        return {
            "tensors": len(named),
            "bytes": nbytes,
            "chunks": chunks,
            "version": version,
            "seconds": time.perf_counter() - t0,
        }

    def join_weight_groups(self, groups: Sequence[Any]) -> None:
        """Join the weight-update groups of a ``distributed`` weight sync (one per trainer pipeline stage; its
        sender is rank 0): this engine's TP ranks become ranks ``g.rank .. g.rank + tp_size - 1`` of each. Blocks
        until every member joined, so the trainer joins concurrently (the call comes through Ray ``.remote``)."""
        for g in groups:
            _ok(
                self._engine.init_weights_update_group(
                    master_address=g.addr,
                    master_port=int(g.port),
                    rank_offset=int(g.rank),
                    world_size=int(g.world_size),
                    group_name=g.name,
                    backend=g.backend,
                ),
                "init_weights_update_group",
            )

    def receive_weights(self, plan: Sequence[tuple[str, list]], version: int) -> dict[str, Any]:
        """One weight push over the groups: per group, per bucket, per flattened buffer (``weight_sync.plan.Flat``: one
        dtype, tensors packed in order = sglang's ``flattened_bucket`` layout) one
        ``update_weights_from_distributed(load_format="flattened_bucket")``, which receives one broadcast."""
        n = 0
        with self._weight_update(version):
            for group_name, buckets in plan:
                for flats in buckets:
                    for f in flats:
                        _ok(
                            self._engine.update_weights_from_distributed(
                                names=list(f.names),
                                dtypes=[dtype_name(f.dtype)] * len(f.names),
                                shapes=[list(s) for s in f.shapes],
                                group_name=group_name,
                                flush_cache=False,
                                load_format="flattened_bucket",
                            ),
                            "update_weights_from_distributed",
                        )
                        n += f.nbytes
        return {"bytes": n, "version": version}

    # ------------------------------------------------------------------ memory, health
    def sleep(self) -> None:
        """Release weights, KV cache and CUDA graphs (``release_memory_occupation``) while the trainer runs."""
        if not self.enable_memory_saver:
            raise RuntimeError("sleep() needs the engine started with enable_memory_saver=True")
        self._engine.release_memory_occupation()
        self.asleep = True

    def wake(self) -> None:
        if self.asleep:
            self._engine.resume_memory_occupation()
        self.asleep = False

    def health(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "alive": True,
            "engine": "sglang",
            "version": self.version,
            "asleep": self.asleep,
            "architecture": self.architecture,
            "block_size": self.block_size,
            "max_running_requests": self.max_running_requests,
        }
        try:
            info = self._engine.get_model_info() if hasattr(self._engine, "get_model_info") else {}
            out["weight_version"] = info.get("weight_version")
            server = self._engine.get_server_info()
            out["sglang_version"] = server.get("version")
            out["dllm_algorithm"] = server.get("dllm_algorithm")
            out["server_max_running_requests"] = server.get("max_running_requests")
        except Exception as e:  # a dead engine: report, don't raise
            out["alive"] = False
            out["error"] = f"{type(e).__name__}: {e}"
        return out

    def shutdown(self) -> None:
        try:
            self._engine.shutdown()
        finally:
            self._cleanup()


def build_sglang_engine(**spec: Any) -> SGLangEngine:  # manager.EngineSpec calls factory(**kwargs)
    """Engine factory for ``manager.EngineSpec`` (runs inside the Ray actor that owns the GPU): the engine of the
    ``SGLangEngineSpec`` with these fields."""
    return SGLangEngine(SGLangEngineSpec(**spec))
