"""Trainer side of the weight transports: how a stage sender's flattened buckets reach the engines.

``distributed``: one group per pipeline stage between its sender (rank 0 of the group) and every engine (gloo on
CPU, NCCL on GPU; groups.py); one broadcast per flat reaches all engines; the senders of all stages send at
the same time. The built-in engine's actor joins these groups itself; an SGLang engine's TP ranks join them through
``init_weights_update_group`` and receive through ``update_weights_from_distributed(load_format=
"flattened_bucket")``.

``colocated``: the same groups carry only a one-element "bucket ready" broadcast and an acknowledging barrier; the
bytes stay in the sender's shared buffer (``/dev/shm`` on CPU, CUDA IPC on GPU), which the engines map and load
from directly.

``object_store``: no group: every stage sender forwards its flats to trainer rank 0 over the trainer's own group
(tensors, point to point); rank 0 puts each bucket into Ray's object store, every engine actor loads it, and the
reference is dropped at once (the store never holds more than one bucket). With in-process engines (a list of
engine objects, e.g. in tests) rank 0 calls their ``update_weights`` directly.

Rank 0 talks to the engines through the rollout manager (``RolloutManager``: ``join_weight_groups``,
``start_receive``, ``load_flats``, ``wait``).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from megadare.parallel.rank0 import trainer_rank
from megadare.rollout.weight_sync.groups import (
    DEFAULT_TIMEOUT,
    GroupSpec,
    SharedBuffer,
    broadcast_from_sender,
    device_sync,
    host_ip,
    host_store,
    join_group,
    leave_group,
)
from megadare.rollout.weight_sync.plan import Bucket, Flat, SyncPlan, flat_layout

_FORWARD_TAG = 1 << 20


def gather_objects(obj: Any) -> list[Any]:
    """Every trainer rank's ``obj`` (small metadata only)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


class GroupTransport:
    """``distributed`` (``how='broadcast'``) and ``colocated`` (``how='shared'``): a group per stage."""

    def __init__(self, plan: SyncPlan, engines: Any, how: str, timeout: timedelta = DEFAULT_TIMEOUT):
        self.plan, self.engines, self.how, self.timeout = plan, engines, how, timeout
        self.stage = plan.stage_of(trainer_rank())
        self.sender = trainer_rank() == self.stage.sender
        self.pg: Any = None
        self.names: list[str] = []
        self.shared: Optional[SharedBuffer] = None
        self.refs: Any = None

    def connect(self, header: dict) -> None:
        """Collective. Rebuild the groups when rank 0 says so (first sync, or an engine was restarted): every
        sender hosts a rendezvous store, rank 0 sends the engines their specs, all join at once."""
        if not header["rebuild"]:
            return
        if self.pg is not None:
            leave_group(self.pg)
            self.pg = None
        store = host_store(self.timeout) if self.sender else None
        addrs = gather_objects((host_ip(), store.port) if self.sender else None)
        world, gen = header["world"], header["generation"]
        self.names = [f"megadare_w{gen}_s{s.stage}" for s in self.plan.stages]
        specs = [
            GroupSpec(n, *addrs[s.sender], world, 0, header["backend"], self.timeout.total_seconds())
            for n, s in zip(self.names, self.plan.stages)
        ]
        refs = self.engines.join_weight_groups(specs, self.how, gen) if trainer_rank() == 0 else None
        if self.sender:
            self.pg = join_group(specs[self.plan.stages.index(self.stage)], self.timeout, store)
        if refs is not None:
            self.engines.wait(refs)

    def alloc(self):
        if self.how != "shared" or not self.sender:
            return None
        return lambda n: self.shared.tensor[:n]

    def begin(self, version: int, device: torch.device) -> None:
        handle = None
        if self.how == "shared" and self.sender:
            size = max((flat_layout(b.flats)[1] for b in self.stage.buckets), default=1)
            self.shared = SharedBuffer(size, device)
            handle = self.shared.handle
        handles = gather_objects(handle) if self.how == "shared" else None
        if trainer_rank() == 0:
            plan = [(n, [b.flats for b in s.buckets]) for n, s in zip(self.names, self.plan.stages)]
            self.refs = self.engines.start_receive(
                self.how, plan, version, [handles[s.sender] for s in self.plan.stages] if handles else None
            )

    def send(self, index: int, bucket: Bucket, flats: list[torch.Tensor]) -> None:
        if self.how == "broadcast":
            for buf in flats:
                broadcast_from_sender(buf, self.pg)
            return
        device_sync(self.shared.tensor.device)  # its bytes are written
        broadcast_from_sender(torch.tensor([index], dtype=torch.int64), self.pg)  # bucket `index` is ready
        dist.barrier(group=self.pg)  # every engine loaded it

    def end(self) -> None:
        if self.shared is not None:
            self.shared.close()
            self.shared = None
        if trainer_rank() == 0:
            self.engines.wait(self.refs)
            self.refs = None

    def close(self) -> None:
        if self.pg is not None:
            leave_group(self.pg)
            self.pg = None


class ObjectStoreTransport:
    """Fallback without a group: stage senders forward flats to rank 0, which hands them to the engines."""

    def __init__(self, plan: SyncPlan, engines: Any):
        self.plan, self.engines = plan, engines
        self.version = 0

    def connect(self, header: dict) -> None:
        pass

    def alloc(self):
        return None

    def begin(self, version: int, device: torch.device) -> None:
        self.version, self.device = version, device
        if trainer_rank() == 0 and isinstance(self.engines, (list, tuple)):
            for e in self.engines:
                getattr(e, "pause", lambda: None)()

    def send(self, index: int, bucket: Bucket, flats: list[torch.Tensor]) -> None:
        if trainer_rank() == 0:
            self._deliver(bucket.flats, flats)
            return
        for buf in flats:
            dist.send(buf, dst=0, tag=_FORWARD_TAG + index)

    def end(self) -> None:
        if trainer_rank() != 0:
            return
        for s in self.plan.stages:
            if s.sender == 0:
                continue
            for i, bucket in enumerate(s.buckets):
                bufs = [torch.empty(f.nbytes, dtype=torch.uint8, device=self.device) for f in bucket.flats]
                for buf in bufs:
                    dist.recv(buf, src=s.sender, tag=_FORWARD_TAG + i)
                self._deliver(bucket.flats, bufs)
        if isinstance(self.engines, (list, tuple)):
            for e in self.engines:
                getattr(e, "resume", lambda: None)()

    def _deliver(self, specs: Sequence[Flat], bufs: list[torch.Tensor]) -> None:
        if isinstance(self.engines, (list, tuple)):
            for e in self.engines:
                for f, buf in zip(specs, bufs):
                    e.update_weights(f.views(buf), self.version)
            return
        self.engines.load_flats(list(specs), bufs, self.version)

    def close(self) -> None:
        pass
