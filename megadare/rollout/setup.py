"""The rollout side of a run, from its config: the sampling parameters (train and evaluation) and the engine
actors (built-in or SGLang) behind a Ray rollout manager. The RL trainer and ``megadare eval`` both start here.

``cfg`` is the run's ``megadare.config.Config`` (read, never changed); this layer sits below megadare.config, so it takes
the object without importing its type.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from contextlib import contextmanager
from typing import Iterator, Optional

from megadare.convert.outputs import EXPORT_MARK, read_export_mark
from megadare.errors import ConfigError, OutputError, PeerError
from megadare.models.family import ModelArch
from megadare.rollout import ray_guard
from megadare.rollout.engine import SamplingParams
from megadare.rollout.ray_health import outliving_the_gcs


def resolve_canvas(cfg, arch: Optional[ModelArch]) -> str:
    """rl.canvas with the family default: ``full`` for full-attention families (LLaDA, Dream: their samplers
    decode a fixed canvas bidirectionally, so every position -- the EOS/pad tokens after the answer included --
    conditions every step, and the trainer sees the sampler's states only on the same canvas; LLaDA's SFT trains
    that EOS padding; DARE keeps it), ``eos`` for block-diffusion families (decoding stops after the block with
    the first EOS, and later blocks never influence earlier ones under the block-causal mask; DARE cuts there)."""
    if cfg.rl.canvas is not None:
        return cfg.rl.canvas
    if arch is None:
        return "eos"
    return "eos" if arch.is_block_diffusion else "full"


def rollout_block(cfg, arch: Optional[ModelArch]) -> int:
    """The rollout's denoising block: ``rollout.block_size``, else a block-diffusion model's own, else 32."""
    if cfg.rollout.block_size:
        return cfg.rollout.block_size
    return arch.block_size if arch is not None and arch.is_block_diffusion else 32


def sampling_params(cfg, arch, seed: int, evaluation: bool = False, record_steps: bool = False):
    """The rollout's SamplingParams (block size checked against the model's). Training rollouts decode the
    response canvas of ``rl.canvas`` (full: every max_new_tokens position; eos: stop after the EOS block);
    evaluation stops at EOS (blocks are committed left to right, so the answer is the same)."""
    r = cfg.rollout
    block = rollout_block(cfg, arch)
    if arch.is_block_diffusion and block != arch.block_size:
        raise ConfigError(
            f"rollout.block_size={block} differs from the model's block size {arch.block_size}: the "
            "sampler, the trainer and the model must agree (set model.block_size to change it)"
        )
    return SamplingParams(
        max_new_tokens=r.max_new_tokens,
        block_size=block,
        steps_per_block=(r.eval_steps_per_block if evaluation else 0) or r.steps_per_block or block,
        algorithm=r.algorithm,
        threshold=r.threshold,
        temperature=r.eval_temperature if evaluation else r.temperature,
        top_k=r.top_k,
        top_p=r.top_p,
        seed=seed,
        record_steps=record_steps and not evaluation,
        confidence=r.confidence,
        schedule=r.schedule,
        eps=r.eps,
        alg_temp=r.alg_temp,
        editing_threshold=r.editing_threshold,
        max_post_steps=r.max_post_steps,
        num_to_transfer=r.num_to_transfer,
        stop_at_eos=evaluation or resolve_canvas(cfg, arch) == "eos",
    )


def engine_spec(cfg, src, tok):
    """How each engine actor builds its engine: the built-in torch engine, or SGLang (``rollout.engine_tp`` GPUs
    of tensor parallelism per engine; with ``rollout.fp8_weights`` started from a block-fp8 export of the model
    under ``<run_dir>/engine_fp8``, which the weight sync then updates in the same format)."""
    from megadare.rollout.manager import (
        EngineSpec,
        build_native_engine,
    )  # heavy: megadare.config imports this module; the engines pull torch.distributed and sympy
    from megadare.rollout.native import NativeSettings  # heavy too: the hf/ model

    r = cfg.rollout
    gpus = r.engine_resources.get("num_gpus")
    if r.engine != "sglang":
        if r.engine_tp != 1:
            raise ConfigError(
                f"rollout.engine_tp={r.engine_tp}: the built-in engine runs on one device; tensor-"
                "parallel engines need rollout.engine=sglang"
            )
        return EngineSpec(
            build_native_engine,
            {
                "hf_dir": src.hf_dir,
                "eos_token_id": tok.eos_token_id,
                "device": r.device,
                "dtype": r.dtype,
                "settings": NativeSettings(
                    max_batch=r.max_batch, compile=r.compile, full_attention_cache=r.full_attention_cache
                ),
            },
        )
    if gpus is not None and gpus < r.engine_tp:
        raise ConfigError(
            f"rollout.engine_tp={r.engine_tp} needs rollout.engine_resources num_gpus >= "
            f"{r.engine_tp} per engine actor (got {gpus})"
        )
    # fail here, not inside an actor, when sglang or the plugin is missing
    from megadare.rollout.sglang_engine import (
        _import_sglang,
        build_sglang_engine,
    )  # heavy: megadare.config imports this module; the engines pull torch.distributed and sympy

    _import_sglang()
    # the engines serve block fp8, so they start from the fp8-block export of the model
    model_path = fp8_engine_model(cfg.logging.run_dir, src.hf_dir) if r.fp8_weights else src.hf_dir
    return EngineSpec(
        build_sglang_engine,
        {
            "model_path": model_path,
            "eos_token_id": tok.eos_token_id,
            "block_size": r.block_size,
            "steps_per_block": r.steps_per_block,
            "algorithm": r.algorithm,
            "threshold": r.threshold,
            "max_running_requests": max(1, r.chunk_size),
            "chunk_bytes": r.bucket_mb << 20,
            "tp_size": r.engine_tp,
        },
    )


class _DropRayTokenNotice(logging.Filter):
    """Ray >= 2.5x logs at every local ``ray.init()`` that it enabled token authentication (its default, which we
    keep); that one notice, and nothing else of Ray's authentication logger (its warning that authentication is
    disabled stays), is dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Token authentication is enabled for this Ray cluster")


@contextmanager
def _own_sigterm_handler() -> Iterator[None]:
    """Around ``ray.init``: megadare's SIGTERM handler (a run's set-up stopping, trainer/signals.py) is put back
    after it, where Ray put its own (``sys.exit(15)``, noting nothing: the set-up's cleanup then went through the
    GCS the same SIGTERM had ended). Ray's stays where megadare had none (evaluation)."""
    before = signal.getsignal(signal.SIGTERM) if threading.current_thread() is threading.main_thread() else None
    try:
        yield
    finally:
        if callable(before) and getattr(before, "__module__", "").startswith("megadare."):
            signal.signal(signal.SIGTERM, before)


def _quiet_ray_token_notice() -> None:
    log = logging.getLogger("ray._private.authentication.authentication_token_setup")
    if not any(isinstance(f, _DropRayTokenNotice) for f in log.filters):
        log.addFilter(_DropRayTokenNotice())


def fp8_engine_model(run_dir: str, hf_dir: str) -> str:
    """``<run_dir>/engine_fp8``: the fp8-block export of ``hf_dir`` the fp8 engines start from, exported when it
    is missing or was exported from another model (its mark names the source; the run directory of an earlier
    run with another model.hf_path kept it, and the engines served that model). A non-empty folder without the
    mark (or with a damaged one, ``read_export_mark``) is refused in one line: megadare cannot tell that it
    wrote it, nor from which model, so it neither serves nor deletes it."""
    from megadare.convert.quantize import quantize_export  # heavy: only for fp8 engines; pulls safetensors

    path = os.path.join(run_dir, "engine_fp8")
    if os.path.isdir(path) and os.listdir(path):
        mark = read_export_mark(path)
        if mark is None:
            raise OutputError(
                f"{path} has no {EXPORT_MARK}: megadare cannot tell that it exported this folder, nor from which "
                "model, so it neither serves nor replaces it (an older megadare's export had no mark): remove or "
                "move it (the next start exports model.hf_path there again), or use another logging.run_dir"
            )
        same = mark["kind"] == "hf-fp8-block" and mark.get("sources") == [os.path.abspath(hf_dir)]
        if same and os.path.exists(os.path.join(path, "config.json")):
            return path
    quantize_export(hf_dir, path, fmt="fp8-block", progress=False)  # replaces a previous export only
    return path


def init_ray(num_engines: int, gcs_wait_s: float = 3600.0) -> None:
    """Join the Ray cluster of ``RAY_ADDRESS`` (the Slurm launcher's), else start a private local one. Not
    ``address=None``: Ray then joins the cluster named in ``<tmp>/ray/ray_current_cluster`` (any ``ray start`` on
    the machine, another user's or one long dead), and with ``num_cpus`` given the run died in a traceback. A Ray
    that does not come up (its raylet or GCS late on a loaded machine, a cluster that does not answer) is one
    ``PeerError`` line, not Ray's traceback. A local Ray gets a guard that ends it once this process is gone,
    SIGKILLed too (rollout/ray_guard.py). Ray lets this driver live ``gcs_wait_s`` without its head's GCS, not
    60 s: a checkpoint saved without Ray after a SIGTERM to the whole job is not cut (``outliving_the_gcs``)."""
    import ray  # heavy: Ray

    _quiet_ray_token_notice()
    joined = os.environ.get("RAY_ADDRESS")
    if not joined:  # ours to end should this process be SIGKILLed, or Ray come up half
        ray_guard.start()
    try:
        with outliving_the_gcs(gcs_wait_s), _own_sigterm_handler():
            ray.init(
                address=joined or "local",
                include_dashboard=False,
                log_to_driver=False,
                num_cpus=None if joined else max(2, num_engines + 1),
            )
    except Exception as e:  # noqa: BLE001 - Ray raises a bare Exception when its node does not start
        why = " ".join(str(e).split()) or type(e).__name__
        if joined:
            raise PeerError(
                f"could not join the Ray cluster at RAY_ADDRESS={joined}: {why}; check that `ray status` answers "
                "there, or unset RAY_ADDRESS to start a local Ray"
            ) from None
        raise PeerError(
            f"the local Ray this run starts did not come up: {why}; on a loaded machine run the same command "
            "again, or start Ray yourself (`ray start --head`) and set RAY_ADDRESS to its address"
        ) from None


def start_engines(cfg, src, tok):
    """Rank 0: Ray (``init_ray``) and the engine actors with the model."""
    import ray  # heavy: Ray

    from megadare.rollout.manager import (
        EngineLimits,
        RolloutManager,
    )  # heavy: megadare.config imports this module; the engines pull torch.distributed and sympy

    spec = engine_spec(cfg, src, tok)
    if not ray.is_initialized():
        init_ray(cfg.rollout.num_engines, gcs_wait_s=cfg.parallel.collective_timeout_s)
    return RolloutManager(
        spec,
        num_engines=cfg.rollout.num_engines,
        resources=dict(cfg.rollout.engine_resources),
        chunk_size=cfg.rollout.chunk_size,
        limits=EngineLimits(timeout_s=cfg.rollout.timeout_s),
    )
