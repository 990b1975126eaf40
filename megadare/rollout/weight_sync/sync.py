"""Weight sync: the trainer's TP/PP/EP/VPP shards -> HF-named flattened buckets -> every engine, every RL step.

    sync = WeightSync(chunks, table, manager if rank == 0 else None, SyncSettings(transport="auto"))
    stats = sync.push(version=step)          # collective over the trainer's ranks

One push: rank 0 checks the engines (a dead actor is restarted now and joins the rebuilt groups) and tells every
rank which transport to use and whether to rebuild the groups; the engines start receiving; every pipeline stage
gathers its own buckets with tensor collectives and its sender hands each one to the transport, all stages at
once (gather.py); rank 0 waits for the engines and records the version. The plan (plan.py: who
sends what, buckets, flats) is built once from megatron's own sharding metadata, so every layout takes the same
code path. Transports (transport.py): ``distributed`` (a torch.distributed group per stage sender and all
engines), ``colocated`` (shared memory / CUDA IPC), ``object_store`` (no group: through rank 0 and Ray, one bucket
at a time); ``auto`` takes ``colocated`` when the trainer runs on CPU and every sender and engine share one host,
else ``distributed``; with the trainer on GPUs, ``colocated`` (CUDA IPC) when every engine runs on the GPU of the
trainer's sender, ``distributed`` (NCCL) when no engine shares a GPU with a member of its group (NCCL refuses two
ranks of one group on one GPU), ``object_store`` otherwise (``_gpu_transport``). Nothing keeps a copy of the
model: a restarted engine gets the current version at the next push (the rollout manager waits for it, see
manager.py).

``fp8_block=(128, 128)`` sends the family's linear weights as float8_e4m3fn with one ``weight_scale_inv`` per block
(megadare/convert/fp8.py), for SGLang engines started from a ``quantize_export(..., fmt="fp8-block")`` checkpoint.
Returns bytes, seconds, GB/s and the number of buckets per push.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from megadare.convert.fp8 import fp8_rollout_weights, linear_hf_names
from megadare.errors import RESUME, ConfigError, PeerError
from megadare.models.mapping import ParamMap
from megadare.parallel.rank0 import picklable, trainer_rank
from megadare.rollout.choices import WEIGHT_TRANSPORTS
from megadare.rollout.ray_health import peer_lost
from megadare.rollout.weight_sync.gather import stage_buckets
from megadare.rollout.weight_sync.groups import DEFAULT_TIMEOUT, gpu_uuid, host_ip
from megadare.rollout.weight_sync.plan import SyncPlan, Transform, build_plan, plain_hf
from megadare.rollout.weight_sync.transport import GroupTransport, ObjectStoreTransport, gather_objects


_HOW = {"distributed": "broadcast", "colocated": "shared"}  # what the engines do with a group transport


def fp8_transform(table: Sequence[ParamMap], block: tuple[int, int]) -> Transform:
    """Megatron -> HF, then every linear weight as its block-fp8 pair (convert/fp8.py)."""
    linear = linear_hf_names(table)
    return lambda row, full: list(fp8_rollout_weights(plain_hf(row, full), linear, block=block))


@dataclass(frozen=True)
class SyncSettings:
    """How weights travel to the engines (``SyncSettings.of(cfg.rollout)``): ``transport`` (auto | distributed |
    colocated | object_store, rollout.weight_transport), ``bucket_bytes`` per flattened bucket (rollout.bucket_mb),
    ``fp8_block`` (block-fp8 linear weights for engines serving an fp8 export; None: as trained) and the weight
    groups' ``timeout``."""

    transport: str = "auto"
    bucket_bytes: int = 512 << 20
    fp8_block: Optional[tuple[int, int]] = None
    timeout: timedelta = DEFAULT_TIMEOUT

    def __post_init__(self) -> None:
        if self.transport not in WEIGHT_TRANSPORTS:
            raise ValueError(f"weight transport {self.transport!r}: choose one of {WEIGHT_TRANSPORTS}")

    @classmethod
    def of(cls, rollout) -> "SyncSettings":
        """The settings of config section ``rollout`` (weight_transport, bucket_mb, fp8_weights; timeout_s: a push
        that an engine stops answering fails after it, like a rollout, not after the groups' default 30 minutes)."""
        return cls(
            transport=rollout.weight_transport,
            bucket_bytes=rollout.bucket_mb << 20,
            fp8_block=(128, 128) if rollout.fp8_weights else None,
            timeout=timedelta(seconds=rollout.timeout_s),
        )


class WeightSync:
    """Pushes the trainer's weights into the engines; one per run on every trainer rank. ``engines`` (rank 0): a
    ``RolloutManager``, or a list of in-process engine objects (``update_weights(named, version)``, optional
    ``pause()`` / ``resume()``), which take the ``object_store`` path."""

    def __init__(
        self,
        chunks: Sequence[torch.nn.Module],
        table: Sequence[ParamMap],
        engines: Any = None,
        settings: SyncSettings = SyncSettings(),
    ):
        transport = settings.transport
        if trainer_rank() == 0 and transport in ("distributed", "colocated") and isinstance(engines, (list, tuple)):
            raise ValueError(
                f"weight transport {transport!r} needs engine actors (a RolloutManager); in-process "
                "engines take transport='object_store'"
            )
        self.chunks, self.table, self.engines, self.requested = list(chunks), list(table), engines, transport
        self.settings = settings
        self.bucket_bytes, self.timeout = int(settings.bucket_bytes), settings.timeout
        self.transform = fp8_transform(table, settings.fp8_block) if settings.fp8_block else plain_hf
        self.plan: Optional[SyncPlan] = None
        self.transport: Any = None
        self.transport_name = ""
        self.generation = ""  # rank 0: name of the weight groups this sync built (engines joined)
        self.device = next((p.device for c in self.chunks for p in c.parameters()), torch.device("cpu"))

    def push(self, version: int) -> dict[str, float]:
        """Collective over the trainer's ranks: every engine holds ``version`` when this returns on rank 0."""
        t0 = time.perf_counter()
        if self.plan is None:
            self.plan = build_plan(self.chunks, self.table, self.bucket_bytes, self.transform)
        header = self._header()
        if self.transport is None:
            self.transport = self._make_transport(header)
        try:
            self._send_all(header, version)
        except RuntimeError as e:
            if isinstance(e, PeerError) or not peer_lost(e):
                raise
            raise self._broken(version, e) from e
        if trainer_rank() == 0 and hasattr(self.engines, "synced"):
            self.engines.synced(version)
        dt = time.perf_counter() - t0
        nbytes = float(self.plan.total_bytes())
        return {
            "sync_bytes": nbytes,
            "sync_seconds": dt,
            "sync_gbps": nbytes / max(dt, 1e-9) / 1e9,
            "sync_buckets": float(sum(len(s.buckets) for s in self.plan.stages)),
        }

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def _send_all(self, header: dict, version: int) -> None:
        self.transport.connect(header)
        self.transport.begin(version, self.device)
        for i, bucket, flats in stage_buckets(
            self.chunks, self.plan, self.transform, self.transport.alloc(), self.device
        ):
            self.transport.send(i, bucket, flats)
        self.transport.end()

    def _broken(self, version: int, e: RuntimeError) -> PeerError:
        """A push whose group lost a member (an engine killed mid-push) or waited past rollout.timeout_s: one line,
        naming the engines already seen dead (rank 0)."""
        dead = (
            self.engines.dead_slots(getattr(self.transport, "refs", None))
            if hasattr(self.engines, "dead_slots")
            else []
        )
        who = ", ".join(self.engines.peer(s) for s in dead) or "a rollout engine (or a trainer rank)"
        first = (str(e).strip().splitlines() or [""])[0][:300]
        return PeerError(
            f"the weight push of version {version} broke: {who} left or stopped answering ({first}); {RESUME}"
        )

    # ------------------------------------------------------------------ rank 0 decides, everyone follows
    def _header(self) -> dict:
        """Rank 0's decision for this push, broadcast to every rank: transport, whether to (re)build the groups
        (first push, an engine restarted since, or the engines joined another sync's groups), the group size and
        the groups' name. Where rank 0 cannot decide (the Ray head gone after a SIGTERM: ``check_engines``), the
        header carries its error and every rank raises it: none waits on a push that never comes."""
        ranks = (
            gather_objects((host_ip(), gpu_uuid(self.device)))
            if self.requested != "object_store" and not self.transport_name
            else None
        )
        header: list[Any] = [None]
        failed: Optional[Exception] = None
        if trainer_rank() == 0:
            try:
                header[0] = self._decide(ranks)
            except Exception as e:  # noqa: BLE001 - any failure here: every rank raises it, none waits for a push
                failed, header[0] = e, {"error": picklable(e)}
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(header, src=0)
        if failed is not None:
            raise failed
        if "error" in header[0]:
            raise header[0]["error"]
        self.transport_name = header[0]["transport"]
        return header[0]

    def _decide(self, ranks: Optional[list[tuple[str, Optional[str]]]]) -> dict:
        """Rank 0: the header of this push (``_header``), the engines checked (a dead actor replaced)."""
        name = self.transport_name or self._resolve(ranks)
        if not self.transport_name:
            print(f"weight sync transport: {name} (rollout.weight_transport={self.requested})", flush=True)
        if hasattr(self.engines, "check_engines"):
            self.engines.check_engines()  # replace dead actors before the push reaches them
        rebuild, world, backend = False, 0, "gloo"
        rebuild = name in ("distributed", "colocated") and self.engines.weight_groups != self.generation
        if rebuild:  # group size and backend matter only to a (re)build
            world, backend = self.engines.weight_group_setup(_HOW[name], self.device)
            self.generation = uuid.uuid4().hex[:12]
        return {
            "transport": name,
            "rebuild": rebuild,
            "world": world,
            "backend": backend,
            "generation": self.generation,
        }

    def _resolve(self, ranks: Optional[list[tuple[str, Optional[str]]]]) -> str:
        """The transport ``auto`` stands for here, and a requested one checked to be possible. ``ranks``: every
        trainer rank's (host, GPU UUID or None). On GPUs the choice follows who shares a GPU: NCCL refuses two
        members of one group on the same GPU, and CUDA IPC reaches only a GPU the engine itself uses."""
        if self.requested == "object_store" or isinstance(self.engines, (list, tuple)) or self.engines is None:
            return "object_store"
        ranks = ranks or []
        infos = self.engines.engine_info()
        engine_ips = sorted({i["ip"] for i in infos})
        same_host = len({ip for ip, _ in ranks} | set(engine_ips)) == 1
        if self.requested == "colocated" and not same_host:
            raise ConfigError(
                f"rollout.weight_transport=colocated needs the engines on the trainer's host: trainer "
                f"ranks on {sorted({ip for ip, _ in ranks})}, engines on {engine_ips}; set "
                "rollout.weight_transport=distributed (or auto)"
            )
        if self.device.type != "cuda":  # shared memory reaches any engine process of the host
            return self.requested if self.requested != "auto" else ("colocated" if same_host else "distributed")
        return _gpu_transport(self.requested, same_host, self._sender_gpus(ranks), [i.get("gpu") for i in infos])

    def _sender_gpus(self, ranks: list[tuple[str, Optional[str]]]) -> list[Optional[str]]:
        senders = [s.sender for s in self.plan.stages] if self.plan is not None else [0]
        return [ranks[r][1] if r < len(ranks) else None for r in senders]

    def _make_transport(self, header: dict):
        if header["transport"] == "object_store":
            return ObjectStoreTransport(self.plan, self.engines)
        return GroupTransport(self.plan, self.engines, _HOW[header["transport"]], self.timeout)


def _gpu_transport(requested: str, same_host: bool, senders: list[Optional[str]], engines: list[Optional[str]]) -> str:
    """The transport for a trainer on GPUs (``senders``: each stage sender's GPU UUID; ``engines``: each engine's,
    None for an engine off the GPU). colocated (CUDA IPC) works when every engine runs on the one sender's GPU;
    distributed (NCCL) when no two members of a group share a GPU; otherwise only object_store works."""
    ipc_ok = same_host and len(set(senders)) == 1 and all(g is not None and g in senders for g in engines)
    on_gpus = [g for g in engines if g is not None]
    clash = any(g in senders for g in on_gpus) or len(set(on_gpus)) < len(on_gpus)
    if requested == "colocated" and not ipc_ok:
        raise ConfigError(
            "rollout.weight_transport=colocated on GPUs needs every engine on the GPU of the trainer's "
            f"sender (CUDA IPC): sender GPUs {senders}, engine GPUs {engines}; set "
            "rollout.weight_transport=auto"
        )
    if requested == "distributed" and clash:
        raise ConfigError(
            "rollout.weight_transport=distributed: an engine shares a GPU with the trainer's sender or "
            f"another engine, and NCCL refuses two ranks of one group on one GPU (sender GPUs {senders}, "
            f"engine GPUs {engines}); set rollout.weight_transport=auto (colocated: CUDA IPC)"
        )
    if requested != "auto":
        return requested
    if ipc_ok:
        return "colocated"
    if not clash:
        return "distributed"
    print(
        f"weight sync: engines share GPUs with the trainer but not one sender's GPU (sender GPUs {senders}, engine "
        f"GPUs {engines}): neither NCCL nor CUDA IPC can reach them all; weights travel through the object store",
        flush=True,
    )
    return "object_store"


def sync_weights(
    chunks: Sequence[torch.nn.Module],
    table: Sequence[ParamMap],
    engines: Any,
    version: int,
    settings: SyncSettings = SyncSettings(transport="object_store"),
) -> dict[str, float]:
    """One push without keeping the plan (collective): ``WeightSync(...).push(version)``."""
    sync = WeightSync(chunks, table, engines, settings)
    try:
        return sync.push(version)
    finally:
        sync.close()
