"""parallel/launch.py: a master port taken between ``free_port`` and rank 0's bind starts the launch again."""

from __future__ import annotations

import socket

import pytest

from megadare.parallel import launch


def _sum_ranks(rank: int, world: int) -> float:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    dist.destroy_process_group()
    return float(t)


@pytest.fixture
def taken_port():
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    yield held.getsockname()[1]
    held.close()


def test_a_taken_master_port_is_retried_on_a_new_one(monkeypatch, taken_port):
    real, handed = launch.free_port, []

    def first_one_taken() -> int:
        handed.append(taken_port if not handed else real())
        return handed[-1]

    monkeypatch.setattr(launch, "free_port", first_one_taken)
    assert launch.spawn(_sum_ranks, 2, timeout_s=120) == [3.0, 3.0]
    assert handed[0] == taken_port and len(handed) == 2


def test_a_port_taken_every_time_is_an_error(monkeypatch, taken_port):
    monkeypatch.setattr(launch, "free_port", lambda: taken_port)
    with pytest.raises(launch.WorkerError, match="EADDRINUSE"):
        launch.spawn(_sum_ranks, 2, timeout_s=120)
