"""Error types shared by every layer (the ground floor of the import layers: it imports nothing of megadare)."""

from __future__ import annotations


class ConfigError(ValueError):
    """A bad config: the message names the dotted key and how to fix it."""


class ModelConfigError(ValueError):
    """A checkpoint's config.json is missing a key, has a bad value, or is of no known family (models/family.py)."""


class CheckpointError(ValueError):
    """A checkpoint directory is missing files, or names a tensor it does not hold (models/safetensors_io.py)."""


class MegatronCheckpointError(ValueError):
    """A directory is not a megadare/megatron distributed checkpoint, or lacks a tensor (convert/mcore_ckpt.py)."""


class OutputError(ValueError):
    """An output path a command refuses to write: it holds what the command did not write, or a source."""


class RunStateError(ValueError):
    """A run directory's state refuses the command: held by another run, or trained from another model."""


class PeerError(RuntimeError):
    """A peer of the run (a rollout engine, a trainer rank) died, raised or stopped answering: the run stops, and
    the message names the peer, the cause and the fix (``RESUME``: the last checkpoint is intact)."""


class JobStopping(PeerError):
    """A peer lost because the whole job is stopping (its SIGTERM reached Ray too): the run saves and stops. Where
    ranks' outcomes of one call differ, this one prevails (parallel/rank0.py ``on_every_rank``), so every rank
    decides alike."""


class StoppedBeforeTheLoop(BaseException):
    """SIGTERM (Slurm's preemption, scancel) while a run set up, before its first step (trainer/signals.py): the
    set-up unwinds (Ray, the checkpoint writers and the run lock end with it) and the command says so in one line,
    exit 0 as a run stopped in its loop. A BaseException, as KeyboardInterrupt: no ``except Exception`` on its way
    swallows it."""


RESUME = "the run stops; run the same command again to resume from its last checkpoint"
