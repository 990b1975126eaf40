"""Helpers of the real-SGLang tests (tests/sglang_cpu/test_*.py, run by run.sh in the SGLang test venv).

* :func:`export_checkpoint`: a tiny checkpoint of a family the way megadare hands one to an engine: written,
  converted to a Megatron checkpoint and exported back (``hf_to_megatron`` -> ``megatron_to_hf``), with sglang's
  hard-coded mask id and a vocabulary that holds it;
* :func:`start_engine` / :func:`native_engine`: a real ``SGLangEngine`` (sglang's CPU engine) and the built-in
  engine on the same checkpoint;
* :func:`assert_same_trajectories`: the equality the tests assert, recorded for the run's closing summary;
* :func:`sync_from_trainer`: ``weight_sync.sync_weights`` run by a sharded Megatron trainer (2 gloo ranks) whose
  rank 0 reaches the engines of this process through a queue (the engines' calls run here, in order).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import threading
from typing import Any, Sequence

import torch

from megadare.models import family_of, load_hf_model, read_hf_config
from megadare.rollout.engine import SamplingParams, Trajectory
from megadare.rollout.native import NativeEngine
from megadare.rollout.sglang_engine import SGLANG_MASK_ID, SGLangEngine, SGLangEngineSpec

# sglang's CPU engine: torch_native attention (no AMX on this CPU), no CUDA graphs, a small KV pool
CPU_ENGINE = {
    "device": "cpu",
    "attention_backend": "torch_native",
    "dtype": "float32",
    "disable_cuda_graph": True,
    "max_total_tokens": 4096,
    "log_level": "error",
}
ARCH = {"sdar": "SDARForCausalLM", "sdar_moe": "SDARMoeForCausalLM", "llada2": "LLaDA2MoeModelLM"}
VOCAB = {"sdar": 151936, "sdar_moe": 151936, "llada2": 157184}  # the publishers' vocabularies
EOS = 151643
# sglang's CPU MoE path (layers/moe/fused_moe_native.py moe_forward_native, taken without AMX) never applies
# routed_scaling_factor, which its CUDA MoE runners do (LLaDA2: 2.5). Measured: with 2.5 the CPU engine's
# trajectories equal megadare's with 1.0, not with 2.5. So the CPU test checkpoints keep the factor at 1.0.
SGLANG_CPU_CONFIG = {"llada2": {"routed_scaling_factor": 1.0}}
RESULTS: list[str] = []  # equality results, printed at the end of the run (conftest.py)


def export_checkpoint(root: str, family: str, seed: int, export: bool = True, **over: Any) -> str:
    """Tiny ``family`` checkpoint (random, seeded) through megadare's export path (``export=False``: as written,
    e.g. a source of other weights); returns its directory."""
    from megadare.convert.hf_megatron import hf_to_megatron, megatron_to_hf
    from tiny import write_tiny_hf

    hf = write_tiny_hf(
        os.path.join(root, "hf"),
        family,
        seed,
        vocab_size=VOCAB[family],
        mask_token_id=SGLANG_MASK_ID[ARCH[family]],
        **{**SGLANG_CPU_CONFIG.get(family, {}), **over},
    )
    if not export:
        return hf
    ck = os.path.join(root, f"megatron_{family}_{seed}")
    out = os.path.join(root, f"export_{family}_{seed}")
    hf_to_megatron(hf, ck, progress=False)
    megatron_to_hf(ck, out, progress=False)
    return out


def engine_kwargs(**extra: Any) -> dict[str, Any]:
    """SGLangEngine keyword arguments for this CPU machine (``extra``: more sglang ServerArgs)."""
    return {
        "max_running_requests": 8,
        "enable_memory_saver": False,
        "mem_fraction_static": 0.1,
        "engine_kwargs": {**CPU_ENGINE, **extra},
    }


def start_engine(path: str, **extra: Any) -> SGLangEngine:
    return SGLangEngine(SGLangEngineSpec(path, EOS, **engine_kwargs(**extra)))


def native_engine(path: str) -> NativeEngine:
    cfg = read_hf_config(path)
    return NativeEngine(load_hf_model(path), family_of(cfg).arch(cfg), eos_token_id=EOS, device="cpu")


def checkpoint_tensors(path: str) -> list[tuple[str, torch.Tensor]]:
    from megadare.models.safetensors_io import SafetensorsReader

    with SafetensorsReader(path) as r:
        return [(k, r.get(k)) for k in sorted(r.keys())]


def assert_same_trajectories(
    label: str, got: Sequence[Trajectory], want: Sequence[Trajectory], logprob_tol: float = 1e-4
) -> None:
    """SGLang's trajectories equal the built-in engine's: tokens, global and block-local commit steps, finish
    reasons, forwards, policy versions exactly; log-probs within ``logprob_tol`` (two float32 attention kernels)."""
    assert len(got) == len(want)
    dlp = 0.0
    for a, b in zip(got, want):
        assert a.response_ids == b.response_ids, (label, a.response_ids, b.response_ids)
        assert (a.commit_step, a.block_step) == (b.commit_step, b.block_step), label
        assert (a.finish_reason, a.num_forwards, a.policy_version) == (
            b.finish_reason,
            b.num_forwards,
            b.policy_version,
        ), label
        dlp = max([dlp] + [abs(x - y) for x, y in zip(a.logprobs, b.logprobs)])
    assert dlp <= logprob_tol, (label, dlp)
    n_tok = sum(len(t.response_ids) for t in got)
    RESULTS.append(
        f"{label}: {len(got)} prompts, {n_tok} tokens: tokens, commit steps, block steps identical; "
        f"max |logp diff| {dlp:.1e}"
    )


def set_weights(engines: Sequence[Any], path: str, version: int) -> None:
    """Load a checkpoint's tensors into engines through the engine protocol (pause, update_weights, resume)."""
    named = checkpoint_tensors(path)
    for e in engines:
        getattr(e, "pause", lambda: None)()
        e.update_weights(named, version)
        getattr(e, "resume", lambda: None)()


# ---------------------------------------------------------------------------------------------- trainer -> engines
class QueueEngine:
    """What rank 0 of the trainer holds in place of the engines: each protocol call goes through a queue to the
    test process, which runs it on the real engines and answers (None, or the error's text)."""

    def __init__(self, calls: Any, answers: Any):
        self.calls, self.answers = calls, answers

    def _call(self, *msg: Any) -> None:
        self.calls.put(pickle.dumps(msg))
        err = self.answers.get(timeout=600)
        if err is not None:
            raise RuntimeError(f"engine side: {err}")

    def pause(self) -> None:
        self._call("pause")

    def update_weights(self, named, version: int) -> None:
        self._call("update_weights", [(n, t.clone()) for n, t in named], version)

    def resume(self) -> None:
        self._call("resume")


def _trainer(
    rank: int, world: int, layout: dict, hf_dir: str, calls: Any, answers: Any, version: int, bucket_bytes: int
) -> dict:
    from dist import stepped_trainer
    from megadare.convert.hf_megatron import mapping_for
    from megadare.parallel import Layout, destroy_distributed, init_distributed
    from megadare.rollout.weight_sync.sync import SyncSettings, sync_weights

    init_distributed(Layout(**layout))
    try:
        _, model, _, cfg = stepped_trainer(layout, hf_dir)
        _, _, table = mapping_for(cfg)
        engines = [QueueEngine(calls, answers)] if rank == 0 else []
        return sync_weights(
            model,
            table,
            engines,
            version=version,
            settings=SyncSettings(transport="object_store", bucket_bytes=bucket_bytes),
        )
    finally:
        destroy_distributed()


def sync_from_trainer(
    layout: dict, hf_dir: str, engines: Sequence[Any], version: int, bucket_bytes: int = 64 << 10
) -> dict:
    """A 2-rank gloo Megatron trainer under ``layout`` loads ``hf_dir``, takes an optimizer step and runs
    ``sync_weights`` into ``engines`` (served here, in this thread, as rank 0 calls them). Returns rank 0's sync
    statistics and the number of buckets the engines received."""
    from dist import run_distributed

    ctx = mp.get_context("spawn")
    calls, answers = ctx.Queue(), ctx.Queue()
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["stats"] = run_distributed(
                _trainer, 2, layout, hf_dir, calls, answers, version, bucket_bytes, timeout_s=600
            )[0]
        except BaseException as e:  # noqa: BLE001 - re-raised below in the test thread
            out["error"] = e

    trainer = threading.Thread(target=run, daemon=True)
    trainer.start()
    buckets = 0
    while True:
        try:
            msg = pickle.loads(calls.get(timeout=5))
        except Exception:  # queue.Empty: is the trainer still there?
            if not trainer.is_alive():
                break
            continue
        try:
            for e in engines:
                method = getattr(e, msg[0], None)
                if method is not None:
                    method(*msg[1:])
            buckets += msg[0] == "update_weights"
            answers.put(None)
        except Exception as e:  # noqa: BLE001 - reported to the trainer, which raises it
            answers.put(f"{type(e).__name__}: {e}")
            raise
        if msg[0] == "resume":
            break
    trainer.join(timeout=600)
    if "error" in out:
        raise out["error"]
    return {**out["stats"], "buckets_received": buckets}


def greedy_and_sampled(block: int, steps: int) -> list[tuple[str, SamplingParams]]:
    """The decoding settings the equality tests run: blocks of ``block`` tokens in ``steps`` steps (sampled: half
    as many), two or three blocks per prompt."""
    half = max(1, steps // 2)
    return [
        (
            "greedy",
            SamplingParams(max_new_tokens=block + 3, block_size=block, steps_per_block=steps, stop_at_eos=False),
        ),
        (
            "sampled",
            SamplingParams(
                max_new_tokens=block + 4,
                block_size=block,
                steps_per_block=half,
                temperature=1.0,
                top_k=50,
                top_p=0.95,
                seed=7,
                stop_at_eos=False,
            ),
        ),
        (
            "sampled-random-remasking",
            SamplingParams(
                max_new_tokens=block + 2,
                block_size=block,
                steps_per_block=half,
                algorithm="random",
                temperature=0.8,
                seed=11,
                stop_at_eos=False,
            ),
        ),
        (
            "greedy-dynamic",
            SamplingParams(
                max_new_tokens=2 * block,
                block_size=block,
                steps_per_block=steps,
                algorithm="low_confidence_dynamic",
                threshold=0.02,
                stop_at_eos=False,
            ),
        ),
    ]
