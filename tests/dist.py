"""Multi-process test runs (gloo): a thin name for megadare.parallel.launch.spawn, and a trainer that has taken a
step (what the weight-sync tests push into engines)."""

from __future__ import annotations

from typing import Optional

from megadare.parallel.launch import spawn as run_distributed  # noqa: F401


def tiny_trainer(layout: dict, hf_dir: str, lr: float = 1e-2):
    """(chunks, DDP model, optimizer, scheduler, arch, HF config) of the checkpoint ``hf_dir`` sharded under
    ``layout`` (distributed already initialised with it), before any step."""
    from megadare.convert.hf_megatron import load_hf_into_model
    from megadare.models.family import family_of, read_hf_config
    from megadare.models.gpt import build_model_chunks, transformer_config
    from megadare.trainer.optim import OptimSettings, build_optimizer, wrap_ddp

    cfg = read_hf_config(hf_dir)
    arch = family_of(cfg).arch(cfg)
    chunks = build_model_chunks(
        arch, transformer_config(arch, sequence_parallel=layout.get("sp", False)), attention_backend="sdpa"
    )
    load_hf_into_model(chunks, hf_dir)
    model = wrap_ddp(chunks, True)
    opt, sched = build_optimizer(model, OptimSettings(lr=lr, total_steps=2))
    return chunks, model, opt, sched, arch, cfg


def random_step(model, opt, sched, arch, n_rows: int = 4) -> dict:
    """One optimizer step on random rows (the same rows on every call); returns train_step's report."""
    import torch
    from megatron.core import parallel_state as ps

    from megadare.data.rows import Row, pack_rows, split_for_data_parallel
    from megadare.trainer.policy import Policy
    from megadare.trainer.step import RowFormat, train_step

    g = torch.Generator().manual_seed(0)
    rows = [
        Row(
            tokens=torch.randint(0, 250, (10,), generator=g),
            labels=torch.randint(0, 250, (10,), generator=g),
            weight=torch.ones(10),
            position_ids=torch.arange(10),
            denom=10.0,
        )
        for _ in range(n_rows)
    ]
    mbs = split_for_data_parallel(pack_rows(rows, 20), ps.get_data_parallel_world_size(), ps.get_data_parallel_rank())
    return train_step(Policy(model, opt, sched), mbs, 10.0 * n_rows, RowFormat("bidirectional", 4, arch.vocab_size))


def stepped_trainer(layout: dict, hf_dir: str, n_rows: int = 4, lr: float = 1e-2):
    """(chunks, DDP model, arch, HF config) of the checkpoint ``hf_dir`` sharded under ``layout`` (distributed
    already initialised with it), after one optimizer step on random rows, so its weights differ from the
    checkpoint's."""
    chunks, model, opt, sched, arch, cfg = tiny_trainer(layout, hf_dir, lr)
    random_step(model, opt, sched, arch, n_rows)
    return chunks, model, arch, cfg


def fresh_update(cfg, src, algo, samples, block: int, kind: str) -> dict:
    """One RL update (``trainer.rl_update.update``, off-policy objective) of a freshly built model (and reference,
    when the algorithm needs one) on ``samples``: the update's metrics plus ``moved``, the largest weight change."""
    from megadare.algos.sft import example_generator
    from megadare.trainer.model_setup import build_training_chunks
    from megadare.trainer.optim import OptimSettings, build_optimizer, wrap_ddp
    from megadare.trainer.policy import Policy
    from megadare.trainer.rl_update import StepUpdate, TrainShape, update

    model = wrap_ddp(build_training_chunks(cfg, src), True)
    opt, sched = build_optimizer(model, OptimSettings(lr=1e-3, total_steps=2))
    ref = None
    if algo.needs_ref:
        ref = build_training_chunks(cfg, src)
        for c in ref:
            c.eval().requires_grad_(False)
    before = [p.detach().clone() for p in model[0].parameters()]
    m = update(
        StepUpdate(cfg, algo, 0, TrainShape(src.arch, block, kind, 0, 1, model, example_generator)),
        samples,
        Policy(model, opt, sched, ref_chunks=ref),
        algo.objective(on_policy=False),
    )
    return {**m, "moved": max(float((p.detach() - b).abs().max()) for p, b in zip(model[0].parameters(), before))}


def reward_error_on_every_rank(rank: int, world: int) -> str:
    """Rank 0 fails to score (RewardError) inside ``run_on_rank0``: what each rank then raises."""
    from megadare.rewards import RewardError
    from megadare.parallel.rank0 import run_on_rank0

    def failing():
        raise RewardError("reward 'auto' failed at data.parquet:row 5")

    raised = _raised_in_a_group(rank, world, lambda: run_on_rank0(failing), RewardError)
    return f"rank {rank}: {raised if raised is not None else 'no error'}"


def _raised_in_a_group(rank: int, world: int, call, caught: type, timeout_s: Optional[float] = None):
    """What ``call()`` raised of type ``caught`` on this rank of a fresh gloo group (None: it returned); any other
    error propagates. ``timeout_s``: the group's collective timeout (gloo's default where None)."""
    from datetime import timedelta

    import torch.distributed as dist

    timeout = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
    dist.init_process_group("gloo", rank=rank, world_size=world, **timeout)
    try:
        call()
    except caught as e:
        return e
    finally:
        dist.destroy_process_group()
    return None


def relayout(layout: dict) -> None:
    """Megatron's parallel groups for ``layout`` in an already running process group (one launch serves several
    layouts: the process group stays, the model-parallel groups are rebuilt)."""
    from megatron.core import parallel_state as ps

    from megadare.parallel import Layout, init_distributed

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    init_distributed(Layout(**layout))


def push_refused_on_every_rank(rank: int, world: int) -> str:
    """Rank 0 cannot decide a push (its engines' check finds the Ray head gone, as after a SIGTERM to the job):
    what each rank then raises."""
    from datetime import timedelta

    import torch.distributed as dist

    from megadare.errors import PeerError
    from megadare.rollout.weight_sync.sync import SyncSettings, WeightSync

    class HeadGone:  # a RolloutManager whose GcsWatch found the GCS dead
        def check_engines(self) -> None:
            raise PeerError("the Ray head is gone (gcs_server at 127.0.0.1:6379)")

    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=30))
    try:
        engines = HeadGone() if rank == 0 else None
        WeightSync([], [], engines, SyncSettings(transport="object_store")).push(1)
    except PeerError as e:
        return f"rank {rank}: {e}"
    finally:
        dist.destroy_process_group()
    return f"rank {rank}: pushed"


def stale_push_failing(rank: int, world: int, failing: str, swallow: bool = False) -> tuple[str, str]:
    """Inside ``run_on_rank0``, rank 0's rollout finds every engine restarted and calls for a push
    (``manager.on_stale``) that raises on ``failing`` ranks ('every', 'rank0', 'others'); ``swallow``: the rollout
    catches that error, asks again, catches it again and returns. (What this rank raised, what it got from rank 0's
    next broadcast: a later collective that nothing stray may pair with.)"""
    from datetime import timedelta
    from types import SimpleNamespace

    import torch.distributed as dist

    from megadare.errors import PeerError
    from megadare.parallel.rank0 import run_on_rank0

    def push():
        if failing == "every" or (rank == 0) == (failing == "rank0"):
            raise PeerError(f"the weight push of version 3 broke on trainer rank {rank}")

    manager = SimpleNamespace(on_stale=None)

    def rollout():
        for _ in range(2 if swallow else 1):
            try:
                manager.on_stale()  # every engine restarted: push the current weights again
            except PeerError:
                if not swallow:
                    raise
        return "trajectories"

    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=10))
    try:
        try:
            raised = f"returned {run_on_rank0(rollout, push, manager if rank == 0 else None)}"
        except PeerError as e:
            raised = str(e)
        return raised, _next_word(rank)
    finally:
        dist.destroy_process_group()


def stale_push_interrupted(rank: int, world: int) -> tuple[str, str]:
    """Inside ``run_on_rank0``, rank 0's rollout calls for a repeat push (``manager.on_stale``) whose part on rank 0
    is interrupted (a ``BaseException``: KeyboardInterrupt) while the other ranks' parts return. (The type of what
    this rank raised, what it got from rank 0's next broadcast: a later collective nothing stray may pair with.)"""
    from datetime import timedelta
    from types import SimpleNamespace

    import torch.distributed as dist

    from megadare.parallel.rank0 import run_on_rank0

    def push():
        if rank == 0:
            raise KeyboardInterrupt

    manager = SimpleNamespace(on_stale=None)

    def rollout():
        manager.on_stale()  # every engine restarted: push the current weights again
        return "trajectories"

    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=10))
    try:
        try:
            raised = f"returned {run_on_rank0(rollout, push, manager if rank == 0 else None)}"
        except BaseException as e:  # noqa: BLE001 - what each rank raised is the test's answer
            raised = type(e).__name__
        return raised, _next_word(rank)
    finally:
        dist.destroy_process_group()


def outcomes_differ_on_a_job_stop(rank: int, world: int) -> str:
    """One push, broken on both ranks: rank 0 saw the job's SIGTERM (a ``LostToSigterm``), rank 1 did not yet (its
    part broke first: a plain ``PeerError``). What each rank raises."""
    from megadare.errors import PeerError
    from megadare.parallel.rank0 import on_every_rank
    from megadare.rollout.ray_health import LostToSigterm

    def push() -> None:
        if rank == 0:
            raise LostToSigterm("the engines went down with the job")
        raise PeerError("the weight push broke on trainer rank 1")

    raised = _raised_in_a_group(rank, world, lambda: on_every_rank(push), PeerError, timeout_s=30)
    return f"rank {rank}: {'no error' if raised is None else f'{type(raised).__name__}: {raised}'}"


def _next_word(rank: int) -> str:
    """What this rank gets from rank 0's next broadcast (a later collective nothing stray may pair with), or gloo's
    timeout where the broadcast was left unpaired."""
    import torch.distributed as dist

    box = ["the next step's word" if rank == 0 else None]
    try:
        dist.broadcast_object_list(box, src=0)
    except RuntimeError as e:  # a broadcast left unpaired: gloo's timeout
        box = [f"{type(e).__name__}: {str(e)[:40]}"]
    return str(box[0])
