"""The CPU runtime: layout checks, the compatibility layer's guard, and the local launcher's error path."""

from __future__ import annotations

import pytest
import torch

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
