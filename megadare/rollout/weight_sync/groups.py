"""The weight-update groups between trainer senders and engines, and the engine side of receiving.

A trainer process already belongs to the trainer's world (its default process group); an engine actor belongs to
none or to its own (SGLang's TP world). ``torch.distributed.new_group`` can only carve groups out of the default
world, so the group of a stage's sender and the engines is a *second, independent* process group built from its
own TCP rendezvous, exactly what SGLang's ``init_weights_update_group`` does on the engine side
(``sglang/srt/utils/common.py::init_custom_process_group``): a ``TCPStore`` hosted by rank 0 (the sender, on a port
the OS picks) that the others reach through ``rendezvous("tcp://addr:port", rank, world)``, wrapped in a
``PrefixStore`` named after the group, and
``_new_process_group_helper`` to make the gloo / NCCL group without touching the default group. Building ours the
same way is what lets an SGLang engine and the built-in engine join the same kind of group; the store layout
(prefixes) must match for the rendezvous to meet, which a hand-made ``ProcessGroupGloo`` would not. The group is
registered with identity rank mapping, so collectives address it by group rank (``group_src=0`` = the sender).

Engine side (:class:`WeightReceiver`, inside the engine's Ray actor): joins one group per pipeline stage (one
after the other, like SGLang) and receives every stage's buckets concurrently (a thread per group), one
broadcast per flattened buffer, loading each into the engine as it arrives. The colocated variant maps the
sender's shared buffer (``/dev/shm`` on CPU, CUDA IPC on GPU) instead, waits for a one-element "bucket ready"
broadcast, loads from the mapped memory and acknowledges with a barrier: no bytes through sockets.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed import TCPStore
from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous
from torch.multiprocessing.reductions import reduce_tensor

from megadare.files import OWNER, owned_name, sweep_dead
from megadare.rollout.weight_sync.plan import Flat, flat_layout

DEFAULT_TIMEOUT = timedelta(minutes=30)
# (group name, per bucket: its flats in send order): what an engine receives from one stage's sender
GroupPlan = tuple[str, list[list[Flat]]]
Load = Callable[[list[tuple[str, torch.Tensor]]], Any]


@dataclass(frozen=True)
class GroupSpec:
    """How one member joins one weight-update group (the sender is rank 0)."""

    name: str
    addr: str
    port: int
    world_size: int
    rank: int
    backend: str = "gloo"
    timeout_s: float = DEFAULT_TIMEOUT.total_seconds()  # the sender's (rollout.timeout_s): no member waits longer


def host_ip() -> str:
    """This host's address as other nodes reach it: ``MEGADARE_HOST_IP`` if set, else the interface of the default
    route, else the host name's address."""
    if os.environ.get("MEGADARE_HOST_IP"):
        return os.environ["MEGADARE_HOST_IP"]
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))  # no packet is sent: picks the outgoing interface
            return s.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def host_store(timeout: timedelta = DEFAULT_TIMEOUT):
    """A sender's rendezvous store (the group's rank 0 hosts it) on a port the OS picks while binding, so no other
    process can take the port between choosing and binding it; members reach it at ``(host_ip(), store.port)``."""
    return TCPStore(host_ip(), 0, is_master=True, timeout=timeout, wait_for_workers=False)


def join_group(spec: GroupSpec, timeout: Optional[timedelta] = None, store=None):
    """Join the group ``spec`` describes (the sender passes the ``store`` it hosts); blocks until every member
    joined. Its collectives fail after ``timeout`` (default: the spec's, the sender's rollout.timeout_s), so an
    engine whose sender died or hangs mid-push stops waiting then, not after torch's 30 minutes."""
    timeout = timeout or timedelta(seconds=spec.timeout_s)
    if store is None:
        store, _, _ = next(rendezvous(f"tcp://{spec.addr}:{spec.port}", spec.rank, spec.world_size, timeout=timeout))
    store.set_timeout(timeout)
    pg, _ = _new_process_group_helper(
        spec.world_size,
        spec.rank,
        [],
        Backend(spec.backend),
        PrefixStore(spec.name, store),
        group_name=spec.name,
        backend_options=None,
        timeout=timeout,
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(spec.world_size)}
    return pg


def leave_group(pg) -> None:
    dist.destroy_process_group(pg)


def broadcast_from_sender(t: torch.Tensor, pg) -> None:
    dist.broadcast(t, group=pg, group_src=0)


# ---------------------------------------------------------------------------------------------- shared memory
def gpu_uuid(device: Any) -> Optional[str]:
    """The physical identity of a CUDA device: the same GPU has the same UUID in every process, whatever index
    ``CUDA_VISIBLE_DEVICES`` (Ray sets it per actor) gives it there. None for a CPU device."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return str(torch.cuda.get_device_properties(device).uuid)


def cuda_index_of(uuid: str) -> int:
    """This process's index of the GPU ``uuid``."""
    for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
        if str(torch.cuda.get_device_properties(i).uuid) == uuid:
            return i
    raise RuntimeError(
        f"weight sync (colocated): GPU {uuid}, which holds the sender's buffer, is not visible in this "
        f"engine process (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); colocated "
        "needs the engine on the trainer's GPU: set rollout.weight_transport=distributed"
    )


def device_sync(device: Any) -> None:
    """Wait for the device's queued work (a GPU copy into or out of a shared buffer is asynchronous: the other
    process must not read or overwrite the buffer before it finished). Nothing to wait for on the CPU."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


_IPC_DEVICE_ARG = 6  # rebuild_cuda_tensor(..., storage_device, ...): the sender's device index (sglang patch_torch.py)


SHM_DIR, SHM_PREFIX = "/dev/shm", "megadare_w_"


class SharedBuffer:
    """A byte buffer other processes on this host map without a copy: a file in ``/dev/shm`` (CPU) or a CUDA IPC
    handle (GPU). ``handle`` is what :func:`open_shared` takes; a CUDA handle names its GPU by UUID, since the
    sender's device index means another GPU (or none) in an engine process with its own CUDA_VISIBLE_DEVICES.
    The file is ``megadare_w_<pid>@<host>-<hex>``: a new buffer first removes those of pushes killed mid-way
    (SIGKILL: no ``close``), never a live process's."""

    def __init__(self, nbytes: int, device: torch.device):
        self.path: Optional[str] = None
        if device.type == "cuda":
            self.tensor = torch.empty(nbytes, dtype=torch.uint8, device=device)
            self.handle: Any = ("cuda", gpu_uuid(device), reduce_tensor(self.tensor))
            return
        for left in sweep_dead(SHM_DIR, SHM_PREFIX + OWNER + "-[0-9a-f]{32}"):
            print(f"weight sync (colocated): removed {left}, left by a killed push", file=sys.stderr, flush=True)
        free = os.statvfs(SHM_DIR)  # after the sweep: what killed pushes left no longer counts
        if free.f_bavail * free.f_frsize < nbytes:
            raise RuntimeError(
                f"weight sync (colocated): /dev/shm has {free.f_bavail * free.f_frsize >> 20} MiB free, "
                f"a bucket needs {nbytes >> 20} MiB; enlarge /dev/shm, lower rollout.bucket_mb or set "
                "rollout.weight_transport=distributed"
            )
        self.path = os.path.join(SHM_DIR, owned_name(SHM_PREFIX, uuid.uuid4().hex))
        self.tensor = torch.from_file(self.path, shared=True, size=max(nbytes, 1), dtype=torch.uint8)
        self.handle = ("shm", self.path, nbytes)

    def close(self) -> None:
        if self.path is not None and os.path.exists(self.path):
            os.unlink(self.path)  # the mappings stay valid until every process drops them


def open_shared(handle) -> torch.Tensor:
    if handle[0] == "cuda":
        _, uuid, (fn, args) = handle
        args = list(args)
        args[_IPC_DEVICE_ARG] = cuda_index_of(uuid)
        return fn(*args)
    _, path, nbytes = handle
    return torch.from_file(path, shared=True, size=max(nbytes, 1), dtype=torch.uint8)


# ---------------------------------------------------------------------------------------------- engine side
def _in_threads(fns: Sequence[Callable[[], Any]]) -> list[Any]:
    """Run each function in its own thread; re-raise the first error."""
    out: list[Any] = [None] * len(fns)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            out[i] = fns[i]()
        except BaseException as e:  # noqa: BLE001 - re-raised below in the caller's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


class WeightReceiver:
    """The engine's membership in the weight-update groups (one per pipeline stage) and the receive loops."""

    def __init__(self, device: Any = "cpu"):
        self.device = torch.device(device)
        self.groups: dict[str, Any] = {}

    def join(self, specs: Sequence[GroupSpec]) -> None:
        """Leave the previous groups (a restart rebuilds them all) and join ``specs`` in order (every engine joins
        in the same order; each stage's sender waits in its own rendezvous meanwhile)."""
        self.close()
        self.groups = {s.name: join_group(s) for s in specs}  # each with its sender's timeout

    def close(self) -> None:
        for pg in self.groups.values():
            leave_group(pg)
        self.groups = {}

    def receive(self, plan: Sequence[GroupPlan], load: Load) -> int:
        """Every stage's buckets, stages concurrently: per flat one broadcast from the sender into a buffer reused
        flat after flat, then ``load`` (which copies the tensors into the model)."""

        def stage(name: str, buckets: list[list[Flat]]) -> int:
            n, area = (
                0,
                torch.empty(
                    max((f.nbytes for fs in buckets for f in fs), default=0), dtype=torch.uint8, device=self.device
                ),
            )  # reused flat after flat
            for flats in buckets:
                for f in flats:
                    broadcast_from_sender(area[: f.nbytes], self.groups[name])
                    load(f.views(area[: f.nbytes]))
                    n += f.nbytes
            return n

        return sum(_in_threads([lambda g=g: stage(*g) for g in plan]))

    def receive_shared(self, plan: Sequence[GroupPlan], handles: Sequence[Any], load: Load) -> int:
        """Colocated: per bucket wait for the sender's "ready" broadcast, load from its shared buffer, then
        acknowledge (barrier) so the sender may overwrite it."""

        def stage(name: str, buckets: list[list[Flat]], handle) -> int:
            mem, pg, n = open_shared(handle), self.groups[name], 0
            for i, flats in enumerate(buckets):
                ready = torch.zeros(1, dtype=torch.int64)
                broadcast_from_sender(ready, pg)
                if int(ready) != i:
                    raise RuntimeError(f"weight sync (colocated): group {name} expected bucket {i}, got {int(ready)}")
                for f, at in zip(flats, flat_layout(flats)[0]):
                    load(f.views(mem[at : at + f.nbytes].to(self.device)))
                    n += f.nbytes
                device_sync(self.device)  # the loads out of the buffer finished: the sender may refill it
                dist.barrier(group=pg)
            return n

        return sum(_in_threads([lambda g=g, h=h: stage(g[0], g[1], h) for g, h in zip(plan, handles)]))
