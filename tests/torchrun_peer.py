"""A two-rank gloo job for torchrun (tests/test_launch_peers.py): rank 1 is SIGKILLed mid-step while rank 0 waits
for it in a collective; rank 0 runs as ``megadare sft|rl`` runs under torchrun (``cli._launch``) and prints its error
as the CLI does."""

from __future__ import annotations

import os
import signal
import sys
from datetime import timedelta

import torch.distributed as dist

from megadare.cli import _launch
from megadare.errors import PeerError


def work(cfg) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=cfg["timeout_s"]))  # parallel.collective_timeout_s
    dist.barrier()
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


if __name__ == "__main__":
    try:
        _launch(None, work, {"timeout_s": float(sys.argv[1])}, 1)
    except PeerError as e:
        print(f"megadare: error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
