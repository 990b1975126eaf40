"""parallel/launch.py: a rank that dies without a word (SIGKILL, the OOM killer) ends the launch at once, naming it,
whether the other ranks wait for it in a collective or work on."""

from __future__ import annotations

import os
import signal
import time

import pytest

from megadare.errors import PeerError
from megadare.parallel import launch


def _rank1_killed(rank: int, world: int, survivor: str) -> int:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    dist.barrier()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    if survivor == "collective":
        dist.barrier()  # gloo: 'Connection reset by peer' here, which names the survivor
    else:
        time.sleep(600)  # a long rollout on rank 0: nothing tells it its peer is gone
    return rank


@pytest.mark.parametrize("survivor", ["collective", "busy"])
def test_a_killed_rank_ends_the_launch_naming_it(survivor):
    with pytest.raises(PeerError) as err:
        launch.spawn(_rank1_killed, 2, survivor, timeout_s=120)
    msg = str(err.value)
    assert msg.startswith("trainer rank 1 (pid ") and "\n" not in msg, msg
    assert "was killed by SIGKILL" in msg and "resume from its last checkpoint" in msg


def _rank0_slow(rank: int, world: int) -> int:
    from datetime import timedelta

    import torch.distributed as dist

    from megadare.parallel.rank0 import run_on_rank0

    dist.init_process_group("gloo", timeout=timedelta(seconds=2))  # parallel.collective_timeout_s=2
    return run_on_rank0(lambda: time.sleep(8) or 1)  # a rollout slower than the timeout


def test_a_rank_waiting_past_the_collective_timeout_says_what_it_waited_for():
    """The other ranks wait in a collective for rank 0's rollout: past parallel.collective_timeout_s that is one
    line naming the waiting rank, rank 0 and the key (not gloo's 'Timed out waiting 2000ms for recv')."""
    with pytest.raises(PeerError) as err:
        launch.spawn(_rank0_slow, 2, timeout_s=120)
    msg = str(err.value)
    assert msg.startswith("trainer rank 1 waited for rank 0 (its rollout or scoring) longer than ") and "\n" not in msg
    assert "parallel.collective_timeout_s" in msg and "resume from its last checkpoint" in msg
