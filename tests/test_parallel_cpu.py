"""The CPU runtime: layout checks, the compatibility layer's guard, and the local launcher's error path."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from env_at_import import seen_at_import
from megadare.parallel import Layout
from megadare.parallel.cpu import install_cpu_compat
from megadare.parallel.launch import WorkerError, spawn


@pytest.mark.parametrize(
    "world,kw,msg",
    [
        (3, dict(tp=2), "not divisible by tp\\*pp\\*cp"),
        (2, dict(ep=4), "etp\\*ep\\*pp"),
        (2, dict(tp=1, sp=True), "sp=true needs"),
        (2, dict(vpp=2), "vpp=2 needs"),
        (2, dict(tp=0), "positive integer"),
    ],
)
def test_check_sizes(world, kw, msg):
    args = dict(tp=1, pp=1, ep=1, etp=1, cp=1, vpp=None, sp=False)
    args.update(kw)
    with pytest.raises(ValueError, match=msg):
        Layout(world, **args)


def test_check_sizes_dp():
    assert Layout(8, tp=2, pp=2, ep=2, etp=1, cp=1, vpp=2, sp=True).dp == 2


def test_compat_layer_is_inert_when_cuda_is_in_use(monkeypatch):
    import megadare.parallel.cpu as cpu

    monkeypatch.setattr(cpu, "_INSTALLED", False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    before = torch.cuda.current_device
    assert install_cpu_compat() is False
    assert torch.cuda.current_device is before and not cpu.is_installed()


def _boom(rank, world):
    if rank == 1:
        raise RuntimeError("rank one exploded")
    return rank


def _ranks(rank, world):
    import os

    return (rank, world, int(os.environ["RANK"]), torch.ones(3) * rank)


def test_spawn_returns_per_rank_results_and_reports_failures():
    res = spawn(_ranks, 2)
    assert [r[:3] for r in res] == [(0, 2, 0), (1, 2, 1)] and torch.equal(res[1][3], torch.ones(3))
    with pytest.raises(WorkerError, match="rank 1 failed(.|\\n)*rank one exploded"):
        spawn(_boom, 2)


def _rank_env(rank, world, key):
    import os

    return os.getppid(), os.environ.get(key)


def test_preloaded_ranks_fork_from_the_server_with_the_launchers_environment_of_now(monkeypatch):
    """The suite's launches (tests/conftest.py: preload_ranks) fork ranks from a server that imported torch and
    megatron, started before this test: a variable set since is still in every rank's environment, as under
    'spawn'."""
    spawn(_rank_env, 1, "MEGADARE_TEST_LATE")  # the server runs (it may have before this test)
    monkeypatch.setenv("MEGADARE_TEST_LATE", "set after the server started")
    got = spawn(_rank_env, 2, "MEGADARE_TEST_LATE")
    assert [g[1] for g in got] == ["set after the server started"] * 2
    # also when the rank imports the function's module (Ray caches RAY_AUTH_MODE, set by a local ray.init, there)
    assert spawn(seen_at_import, 1) == ["set after the server started"]
    assert {g[0] for g in got} != {os.getpid()}  # forked by the server, not started by this process


def test_no_cuda_advice_on_cpu():
    """megatron's sequence-parallel linear advises CUDA_DEVICE_MAX_CONNECTIONS=1 (a CUDA stream setting): on CPU,
    with the layer installed, the README's `--nproc 2 parallel.tp=2 parallel.sp=true` run shows no such warning."""
    code = """
import warnings
import torch
import torch.distributed as dist
from megadare.parallel import init_distributed
from megatron.core.tensor_parallel.layers import linear_with_grad_accumulation_and_async_allreduce as linear

init_distributed()  # one gloo process, the compatibility layer installed
out = linear(torch.ones(2, 1, 4), torch.ones(3, 4), None, False, False, True, tp_group=dist.group.WORLD)
assert out.shape == (2, 1, 3), out.shape
print("ok")
"""
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_DEVICE_MAX_CONNECTIONS", "PYTHONWARNINGS")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in r.stderr, r.stderr


def test_a_lone_process_keeps_its_rendezvous_port_to_itself():
    """A single process picks a free port for its process group without putting it in os.environ: a process it
    starts afterwards (a subprocess test, a demo's next stage) must not inherit MASTER_PORT and find it taken."""
    code = """
import os, subprocess, sys
import torch.distributed as dist
from megadare.parallel import init_distributed

init_distributed()  # one gloo process; its group stays up while the child starts its own
assert dist.is_initialized() and "MASTER_PORT" not in os.environ, os.environ.get("MASTER_PORT")
child = "from megadare.parallel import init_distributed; init_distributed(); print('child ok')"
r = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=300)
assert r.returncode == 0, r.stderr[-1500:]
print(r.stdout.strip())
"""
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR", "RANK", "WORLD_SIZE")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("child ok"), r.stderr[-2000:]


def _steps_with_and_without_the_mode(rank, world, layout: dict, hf_dirs: dict) -> dict:
    """Per family: the parameters after one optimizer step (and the torch calls the CUDA-to-CPU mode saw) with
    the mode on everywhere (``SCOPED`` False) and off in the hot sections (forwards, optimizer copies and step)."""
    from dist import tiny_trainer, random_step
    from megadare.parallel import cpu, init_distributed

    init_distributed(Layout(**layout))
    seen = [0]
    mode_call = cpu._CudaToCpuMode.__torch_function__

    def counted(self, *args, **kwargs):
        seen[0] += 1
        return mode_call(self, *args, **kwargs)

    cpu._CudaToCpuMode.__torch_function__ = counted
    out = {}
    for name, hf_dir in hf_dirs.items():
        for scoped in (False, True):
            cpu.SCOPED = scoped
            _, model, opt, sched, arch, _ = tiny_trainer(layout, hf_dir)
            seen[0] = 0
            random_step(model, opt, sched, arch)
            params = [p.detach().clone() for chunk in model for p in chunk.parameters()]
            out[(name, scoped)] = (params, seen[0])
    cpu.SCOPED = True
    return out


@pytest.mark.parametrize(
    "layout,families",
    [
        (dict(tp=2, sp=True), ["sdar", "sdar_moe", "llada2", "llada", "dream"]),
        (dict(pp=2), ["sdar", "sdar_moe", "llada2", "llada", "dream"]),
        (dict(ep=2), ["sdar_moe", "llada2"]),
    ],
)
def test_hot_sections_run_without_the_cuda_mode_and_step_identically(tmp_path, layout, families):
    """Forward + backward + optimizer step of every family at TP2 / PP2 / EP2 (gloo) with the CUDA-to-CPU mode
    scoped out of the hot sections equal the step with the mode everywhere, bitwise, and the mode sees far fewer
    calls (the hot sections really ran without it: no CUDA device hard-coded there)."""
    from tiny import write_tiny_hf

    hf_dirs = {name: write_tiny_hf(tmp_path, name, seed=i) for i, name in enumerate(families)}
    for rank_out in spawn(_steps_with_and_without_the_mode, 2, layout, hf_dirs):
        for name in families:
            (everywhere, calls_all), (scoped, calls_scoped) = rank_out[(name, False)], rank_out[(name, True)]
            assert len(everywhere) == len(scoped) > 0, name
            assert all(torch.equal(a, b) for a, b in zip(everywhere, scoped)), f"{name} {layout}: params differ"
            assert calls_scoped < calls_all / 2, f"{name} {layout}: the mode saw {calls_scoped} of {calls_all} calls"


def _put_rank(rank, world, queue):
    queue.put(rank)
    return rank


def test_a_multiprocessing_queue_reaches_the_ranks():
    """A launch whose arguments hold a multiprocessing Queue (the real-SGLang weight-sync test's trainer talks to
    the engines through two) raised 'Queue objects should only be shared between processes through inheritance'
    once the suite's forkserver launches pickled the arguments up front."""
    import multiprocessing as mp

    queue = mp.get_context("spawn").Queue()
    assert spawn(_put_rank, 2, queue) == [0, 1]
    assert sorted(queue.get(timeout=30) for _ in range(2)) == [0, 1]
