"""The suite launches ranks in-process (megadare.parallel.launch.spawn) a few hundred times: they fork from one
server that imported torch, megatron and the trainer once (``preload_ranks``) instead of each importing them again
(~10 s of CPU per rank). CLI runs in subprocesses keep the start method users get, 'spawn'."""

from __future__ import annotations

from megadare.parallel.launch import preload_ranks

preload_ranks(["megadare.trainer.sft_loop", "megadare.trainer.rl"])
