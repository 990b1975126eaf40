"""A gloo job for torchrun (tests/test_launch_peers.py): rank 1 (or the rank given after the timeout) is SIGKILLed
mid-step while the others wait for it in a collective; they run as ``megadare sft|rl`` runs under torchrun
(``cli._launch``, ``init_distributed`` gathering the ranks' pids) and print their error as the CLI does."""

from __future__ import annotations

import os
import signal
import sys
from datetime import timedelta

import torch.distributed as dist

from megadare.cli import _launch
from megadare.errors import PeerError
from megadare.parallel import peers
from megadare.trainer.signals import StopSignal


def work(cfg) -> None:
    """One step of the loop: SIGTERM is the loop's (``StopSignal``: finish the step, save), as in a run. torchrun
    ends the survivors by SIGTERM once it sees the killed rank: without the loop's handler they died of it, racing
    their own line (gloo's reset seen, the dead rank looked for, the line printed), and a loaded machine saw none."""
    StopSignal()
    dist.init_process_group("gloo", timeout=timedelta(seconds=cfg["timeout_s"]))  # parallel.collective_timeout_s
    peers.record()  # as init_distributed does
    dist.barrier()
    if dist.get_rank() == cfg["victim"]:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


if __name__ == "__main__":
    try:
        _launch(None, work, {"timeout_s": float(sys.argv[1]), "victim": int((sys.argv[2:] or ["1"])[0])}, 1)
    except PeerError as e:
        print(f"megadare: error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
