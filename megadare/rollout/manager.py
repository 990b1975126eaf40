"""Ray-managed rollout engines: N engine actors, requests spread by load, restarts without a model copy.

    manager = RolloutManager(EngineSpec(build_native_engine, hf_dir=...), num_engines=2,
                             resources={"num_cpus": 1})            # {"num_gpus": 1} on a cluster
    trajectories = manager.generate(prompts, SamplingParams(...))  # every prompt exactly once, in order
    WeightSync(trainer_chunks, table, manager).push(version=step)  # weight_sync/ drives the engines' side here

Placement: the actors live in one placement group (one bundle per engine; ``strategy='PACK'`` to colocate them
with the trainer's GPUs, 'SPREAD' to give them their own). Prompts are cut into chunks of ``chunk_size``
(``rollout.chunk_size``), dealt out evenly over the engines that hold the current weights (``PendingRollout.issue``:
each chunk to the engine given the fewest of that call, so chunks re-issued after a death do not count those still
running); prompt j of the rollout samples from the stream ``prompt_seed(params.seed, j)`` (chunk c is sent with
the seed of its first prompt), so the trajectories equal one generate() call on one engine and a re-issued chunk
reproduces its own. If an engine dies mid-rollout (RayActorError), the manager starts a
replacement and re-issues the dead engine's chunks to engines that hold the current weights; the rollout still
returns every trajectory exactly once. No copy of the model is kept anywhere: a replacement serves nothing until
the next weight push reaches it (``fresh``), which rebuilds the weight groups with it; nor does any engine while
a push is under way (one that broke half-way left them all half-pushed); if no engine holds the
current weights any more, the rollout waits for that push (``on_stale``: the RL driver pushes the current
version again) or fails with a message. Before every push ``check_engines`` replaces dead actors, so an engine
that died between steps gets the new version with the others.
"""

from __future__ import annotations

import dataclasses
import re
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from megadare.console import end_open_line
from megadare.errors import RESUME, ConfigError, PeerError
from megadare.models import load_hf_model
from megadare.models.family import family_of, read_hf_config
from megadare.rollout.choices import ENGINE_DEVICES, ENGINE_DTYPES
from megadare.rollout.engine import SamplingParams, Trajectory, prompt_seed
from megadare.rollout.native import NativeEngine, NativeSettings
from megadare.rollout.ray_health import RELEASE_S, GcsWatch, end_local_ray, left_to_ray, ray_died, within
from megadare.rollout.weight_sync.groups import GroupPlan, GroupSpec, WeightReceiver, gpu_uuid, host_ip
from megadare.rollout.weight_sync.plan import Flat


def _ray():
    try:
        import ray  # heavy: Ray
    except ImportError as e:  # pragma: no cover - ray is a dependency, but keep the message clear
        raise ImportError("the rollout manager needs Ray: pip install 'ray>=2.40'") from e
    return ray


@dataclass
class EngineSpec:
    """How an actor builds its engine: ``factory(**kwargs)`` runs inside the actor process."""

    factory: Callable[..., Any]
    kwargs: dict[str, Any] = field(default_factory=dict)


class _EngineActor:
    """Holds one engine inside a Ray actor process, and its end of the weight transports."""

    def __init__(self, spec: EngineSpec):
        self.engine = spec.factory(**spec.kwargs)
        self.receiver: Optional[WeightReceiver] = None

    def generate(self, prompts, params):
        """The engine's trajectories; the first carries the chunk's generation seconds in ``engine_s``
        (rollout-side busy time for the async health metrics)."""
        t0 = time.perf_counter()
        out = self.engine.generate(prompts, params)
        if out:
            out[0].engine_s = time.perf_counter() - t0
        return out

    def call(self, method: str, *args):
        return getattr(self.engine, method)(*args)

    def close(self) -> None:
        """The engine's own shutdown, where it has one (SGLang: its server processes and its config folder)."""
        if hasattr(self.engine, "shutdown"):
            self.engine.shutdown()

    def info(self) -> dict[str, Any]:
        """Host, device and how many ranks the engine takes in a weight group (SGLang: its TP ranks join)."""
        own = hasattr(self.engine, "join_weight_groups")
        device = getattr(self.engine, "device", "cpu")
        return {
            "ip": host_ip(),
            "device": str(device),
            "gpu": gpu_uuid(device),
            "own_groups": own,
            "group_ranks": int(getattr(self.engine, "tp_size", 1)) if own else 1,
        }

    def join_weight_groups(self, specs: Sequence[GroupSpec], how: str) -> None:
        if how == "broadcast" and hasattr(self.engine, "join_weight_groups"):
            return self.engine.join_weight_groups(specs)
        if self.receiver is None:
            self.receiver = WeightReceiver(getattr(self.engine, "device", "cpu"))
        self.receiver.join(specs)

    def receive_weights(self, how: str, plan: Sequence[GroupPlan], version: int, handles=None) -> dict[str, Any]:
        """One push: every stage's buckets over the groups (``broadcast``) or from the senders' shared buffers
        (``shared``); the engine holds ``version`` afterwards."""
        if how == "broadcast" and hasattr(self.engine, "receive_weights"):
            return self.engine.receive_weights(plan, version)
        if self.receiver is None:
            raise RuntimeError("receive_weights before join_weight_groups")

        def load(named):
            self.engine.update_weights(named, version)

        n = (
            self.receiver.receive(plan, load)
            if how == "broadcast"
            else self.receiver.receive_shared(plan, handles, load)
        )
        return {"bytes": n, "version": version}

    def load_flats(self, flats: Sequence[Flat], version: int, *bufs) -> None:
        """The object-store fallback: one bucket's flats (resolved from Ray's store by the call)."""
        for f, buf in zip(flats, bufs):
            self.engine.update_weights(f.views(buf), version)


@dataclass(frozen=True)
class EngineLimits:
    """How much the manager bears from its engines: deaths per rollout (each one restarted) and seconds of silence
    (``rollout.timeout_s``) before a rollout or a weight push stops with a ``PeerError`` naming the engine; an engine
    Ray cannot place (its bundle lost its node and no node has room) stops it after ``placement_s``, at once when
    Ray finds no node could ever hold it."""

    max_restarts: int = 3
    timeout_s: float = 1800.0
    placement_s: float = 60.0  # the longest an engine may wait for room in the cluster (none at all: no wait)


def _check_feasible(ray, bundle: dict[str, float], resources: dict, num_engines: int = 1) -> None:
    """Fail at once when the live nodes of the Ray cluster cannot hold one engine, or all ``num_engines`` together
    (each node holds as many as fit in its totals): an infeasible placement group would wait out its placement
    timeout and end in an error that cannot name the config (e.g. the config's num_cpus on small nodes)."""
    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    fits = [min((int(node.get(k, 0) // v) for k, v in bundle.items() if v > 0), default=num_engines) for node in nodes]
    if sum(fits) >= num_engines:
        return
    have = "; ".join(", ".join(f"{k} {node.get(k, 0):g}" for k in bundle) for node in nodes) or "no live node"
    what = (
        f"rollout.engine_resources={resources}: no node of the Ray cluster has {bundle} for one engine"
        if not any(fits)
        else f"rollout.engine_resources={resources}, rollout.num_engines={num_engines}: the nodes of the Ray "
        f"cluster have room for only {sum(fits)} engines of {bundle}"
    )
    raise ConfigError(
        f"{what} (its nodes: {have}); lower the request (Slurm scripts: ENGINE_GPUS / ENGINE_CPUS / NUM_ENGINES) "
        "or give the nodes more"
    )


class RolloutManager:
    def __init__(
        self,
        spec: EngineSpec,
        num_engines: int = 1,
        resources: Optional[dict[str, float]] = None,
        strategy: str = "PACK",
        chunk_size: int = 8,
        limits: Optional["EngineLimits"] = None,
    ):
        ray = _ray()
        from ray.util.placement_group import placement_group  # heavy: Ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy  # heavy: Ray

        if not ray.is_initialized():
            raise RuntimeError("RolloutManager needs a running Ray (ray.init(...) or the Slurm launcher)")
        limits = limits or EngineLimits()
        self.gcs = GcsWatch(ray.get_runtime_context().gcs_address)  # the head's GCS: its death stops the run
        self.spec, self.chunk_size, self.max_restarts = spec, chunk_size, limits.max_restarts
        self.timeout_s = limits.timeout_s  # rollout.timeout_s: the longest an engine may stay silent
        self.placement_s = limits.placement_s
        self._unplaced_since: Optional[float] = None
        self.unanswered: set[int] = set()  # slots that hung, raised or died: shutdown kills them without a word
        self.hosts: list[Optional[str]] = [None] * num_engines  # each slot's host, once it answered engine_info
        self.resources = dict(resources or {"num_cpus": 1})
        bundle = {("GPU" if k == "num_gpus" else "CPU" if k == "num_cpus" else k): v for k, v in self.resources.items()}
        _check_feasible(ray, bundle, self.resources, num_engines)
        self.pg = placement_group([dict(bundle) for _ in range(num_engines)], strategy=strategy)
        self.bundle = bundle
        ready, _ = self.wait_placed([self.pg.ready()], 1, max(self.placement_s, 300.0))
        if not ready:
            raise self.unplaceable(list(range(num_engines)))
        self._strategy = PlacementGroupSchedulingStrategy
        self._actor_cls = ray.remote(_EngineActor)
        self.actors = [self._start(i) for i in range(num_engines)]
        self.restarts = 0
        self.version: Optional[int] = None  # the version of the latest push (None: none yet)
        self.fresh = [True] * num_engines  # slot holds the latest version (a replacement does not)
        self.weight_groups: Optional[str] = None  # generation of the weight groups every engine has joined
        self.on_stale: Optional[Callable[[], None]] = None  # pushes the current version again (RL driver)
        self._group_ranks = [1] * num_engines

    def _start(self, slot: int):
        return self._actor_cls.options(
            **self.resources,
            max_concurrency=1,
            scheduling_strategy=self._strategy(placement_group=self.pg, placement_group_bundle_index=slot),
        ).remote(self.spec)

    # ------------------------------------------------------------------ weights (weight_sync/ drives these)
    def engine_info(self) -> list[dict[str, Any]]:
        """Every engine's info; a dead actor is replaced first and the replacement answers for its slot."""
        ray = _ray()
        from ray.exceptions import RayActorError  # heavy: Ray

        infos = []
        for slot, ref in enumerate([a.info.remote() for a in self.actors]):
            try:
                infos.append(self._get_one(ray, slot, ref, "its check before a weight push (info)"))
            except PeerError as e:
                if not isinstance(e.__cause__, RayActorError) or e.__cause__.actor_init_failed:
                    raise
                self._restart(slot)
                infos.append(
                    self._get_one(ray, slot, self.actors[slot].info.remote(), "its check after a restart (info)")
                )
            self.hosts[slot] = infos[-1]["ip"]
        return infos

    def peer(self, slot: int) -> str:
        """How a message names engine ``slot``: its slot and host (once known)."""
        host = self.hosts[slot] if slot < len(self.hosts) else None
        return f"rollout engine {slot}" + (f" on {host}" if host else "")

    def silent(self, slots: Sequence[int], what: str) -> PeerError:
        """The error for engines that gave no answer to ``what`` within ``timeout_s``."""
        names = ", ".join(self.peer(s) for s in sorted(set(slots)))
        self.unanswered.update(slots)
        return PeerError(
            f"{names} gave no answer to {what} in {self.timeout_s:g}s (rollout.timeout_s): hung, or slower than "
            f"that; {RESUME} (raise rollout.timeout_s if the engine is only slow)"
        )

    def failed(self, slot: int, what: str, e: BaseException) -> PeerError:
        """The error for engine ``slot`` dying or raising during ``what`` (the Ray error ``e`` as the cause)."""
        self.unanswered.add(slot)
        return PeerError(f"{self.peer(slot)} {engine_failure(e)} during {what}; {RESUME}")

    def wait_placed(self, refs: list, num_returns: int, timeout_s: float) -> tuple[list, list]:
        """``ray.wait`` for ``timeout_s``, checking every few seconds that every engine has a place in the cluster
        (``check_placed``): an engine Ray cannot place fails then, not as silence after ``timeout_s``."""
        ray = _ray()
        end = time.monotonic() + timeout_s
        while True:
            self.gcs.check()  # the head's GCS gone: the engines still answer, a wait would not end
            left = end - time.monotonic()
            ready, late = ray.wait(refs, num_returns=num_returns, timeout=max(0.0, min(left, 2.0)))
            if len(ready) >= num_returns or left <= 2.0:
                return ready, late
            self.check_placed()

    def check_placed(self) -> None:
        """Raise when an engine's bundle has had no node for ``placement_s`` (its node left and no other has
        room), or at once when Ray finds that no node can hold it."""
        from ray.util.placement_group import placement_group_table  # heavy: Ray

        table = placement_group_table(self.pg)
        nodes = {int(i): node for i, node in (table.get("bundles_to_node_id") or {}).items()}
        unplaced = [i for i in range(len(table.get("bundles") or {})) if not nodes.get(i)]
        if table.get("state") == "CREATED" or not unplaced:
            self._unplaced_since = None
            return
        now = time.monotonic()
        self._unplaced_since = self._unplaced_since or now
        infeasible = (table.get("stats") or {}).get("scheduling_state") == "INFEASIBLE"
        if infeasible or now - self._unplaced_since >= self.placement_s:
            raise self.unplaceable(unplaced)

    def unplaceable(self, slots: Sequence[int]) -> PeerError:
        """The error for engines Ray cannot place: what each asks for and what the cluster's live nodes have."""
        ray = _ray()
        self.unanswered.update(slots)
        names = ", ".join(f"rollout engine {s}" for s in sorted(slots))
        every = ray.nodes()
        nodes = [n for n in every if n.get("Alive")]
        have = "; ".join(
            f"{n.get('NodeManagerAddress', '?')}: "
            + ", ".join(f"{k} {n['Resources'].get(k, 0):g}" for k in self.bundle)
            for n in nodes
        )
        free = ray.available_resources()
        dead = sorted({n.get("NodeManagerAddress", "?") for n in every if not n.get("Alive")})
        why = (
            ray_died(f"Ray node {', '.join(dead)}", "its raylet killed or its host lost")
            if dead
            else "the request is larger than the free room"
        )
        return PeerError(
            f"{names} cannot be placed: Ray has no node with {self.bundle} free for it (rollout.engine_resources="
            f"{self.resources}; the live nodes have {have or 'none'}, free now: "
            f"{', '.join(f'{k} {free.get(k, 0):g}' for k in self.bundle)}): {why}; {RESUME} once the cluster has "
            "the room, or lower rollout.engine_resources / rollout.num_engines"
        )

    def _get_one(self, ray, slot: int, ref, what: str):
        from ray.exceptions import RayError  # heavy: Ray

        ready, _ = self.wait_placed([ref], 1, self.timeout_s)
        if not ready:
            raise self.silent([slot], what)
        try:
            return ray.get(ref)
        except RayError as e:
            raise self.failed(slot, what, e) from e

    def dead_slots(self, refs: Optional[list], wait_s: float = 5.0) -> list[int]:
        """The slots whose call in ``refs`` (one per engine) failed because the engine died, within ``wait_s``."""
        if not refs:
            return []
        ray = _ray()
        from ray.exceptions import RayActorError, RayError  # heavy: Ray

        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=wait_s)
        dead = []
        for slot, ref in enumerate(refs):
            try:
                if ref in ready:
                    ray.get(ref, timeout=0)
            except RayActorError:
                dead.append(slot)
            except RayError:  # an engine that raised is not dead: the push's own error says what broke
                pass
        return dead

    def gather(self, refs: list, what: str) -> list:
        """The answers of one call per engine (``refs[i]`` from slot i), waiting at most ``timeout_s``: an engine
        that died, raised or stays silent is a ``PeerError`` naming it."""
        ray = _ray()
        _, late = self.wait_placed(refs, len(refs), self.timeout_s)
        if late:
            raise self.silent([refs.index(r) for r in late], what)
        return [self._get_one(ray, slot, ref, what) for slot, ref in enumerate(refs)]

    def check_engines(self) -> None:
        """Replace every dead actor now (before a push, so the push reaches the replacement); raise the
        ``PeerError`` of a dead Ray head first (``GcsWatch.check``: after a SIGTERM the run drops the push)."""
        self.gcs.check()
        self.engine_info()

    def weight_group_setup(self, how: str, trainer_device) -> tuple[int, str]:
        """Size of each weight group (the sender plus every engine's ranks) and its backend: NCCL when the
        trainer and every engine run on GPUs (an SGLang engine does) and the bytes travel over it, else gloo."""
        infos = self.engine_info()
        self._group_ranks = [i["group_ranks"] if how == "broadcast" else 1 for i in infos]
        gpus = str(trainer_device).startswith("cuda") and all(
            i["own_groups"] or i["device"].startswith("cuda") for i in infos
        )
        return 1 + sum(self._group_ranks), "nccl" if how == "broadcast" and gpus else "gloo"

    def join_weight_groups(self, specs: Sequence[GroupSpec], how: str, generation: str) -> list:
        """Start every engine joining the groups (engine i after the sender and engines < i); returns refs."""
        refs, offset = [], 1
        for a, n in zip(self.actors, self._group_ranks):
            refs.append(a.join_weight_groups.remote([dataclasses.replace(s, rank=offset) for s in specs], how))
            offset += n
        self.weight_groups = generation
        return refs

    def start_receive(self, how: str, plan: Sequence[GroupPlan], version: int, handles=None) -> list:
        self._weights_in_flight()
        return [a.receive_weights.remote(how, plan, version, handles) for a in self.actors]

    def _weights_in_flight(self) -> None:
        """A push has started to overwrite the engines' weights: none holds a whole version until ``synced``. A
        push that breaks half-way leaves every engine stale, so no rollout is served from half-pushed weights
        (stamped with either version): the next one waits for a whole push (``fresh_slots``)."""
        self.fresh = [False] * len(self.actors)

    def wait(self, refs: list) -> list:
        return self.gather(refs, "the weight push")

    def load_flats(self, flats: Sequence[Flat], bufs: list, version: int) -> None:
        """Object-store fallback: one bucket into every engine; its objects are released right after."""
        ray = _ray()
        self._weights_in_flight()
        refs = [ray.put(b) for b in bufs]
        self.gather([a.load_flats.remote(list(flats), version, *refs) for a in self.actors], "the weight push")
        del refs

    def synced(self, version: int) -> None:
        self.version = version
        self.fresh = [True] * len(self.actors)

    # ------------------------------------------------------------------ generation
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Trajectory]:
        """Every prompt's trajectory, in order (blocks until done)."""
        return self.submit(prompts, params).result()

    def submit(self, prompts: list[list[int]], params: SamplingParams) -> "PendingRollout":
        """Start a rollout and return at once (one-step-off training overlaps it with a train step); the engines
        serve it before any weight update sent after this call, so it uses the weights they hold now."""
        chunks = [prompts[i : i + self.chunk_size] for i in range(0, len(prompts), self.chunk_size)]
        pending = PendingRollout(self, chunks, params)
        pending.issue(list(range(len(chunks))))
        return pending

    def _restart(self, slot: int) -> None:
        """A replacement actor (the model as loaded by its factory): fresh only while nothing was pushed yet."""
        self.restarts += 1
        self.actors[slot] = self._start(slot)
        self.unanswered.discard(slot)
        self.fresh[slot] = self.version is None
        self.weight_groups = None

    def fresh_slots(self) -> list[int]:
        """Slots holding the current weights; when none is left, the current version is pushed again first."""
        slots = [s for s, f in enumerate(self.fresh) if f]
        if slots:
            return slots
        if self.on_stale is None:
            raise RuntimeError(
                f"no rollout engine holds weight version {self.version} any more (every one was "
                "restarted) and nothing can push it again here; restarted engines receive the "
                "current weights at the next weight sync"
            )
        self.on_stale()
        return [s for s, f in enumerate(self.fresh) if f]

    def call_all(self, method: str, *args) -> list[Any]:
        """Call an engine method on every actor (sleep, wake, health, logits, ...)."""
        return self.gather([a.call.remote(method, *args) for a in self.actors], f"{method}()")

    def shutdown(self, timeout_s: float = 30.0, ray_stopped: bool = False) -> None:
        """Each engine shuts itself down (at most ``timeout_s`` for all), then the actors are killed and their
        placement group removed. An engine that hung, raised or died (``unanswered``) is killed first, without
        being asked: its close would wait behind the call it hangs in, delaying the run's error by ``timeout_s``.
        With the head's GCS dead, the engines are only asked to close: killing actors and removing the group go
        through the GCS and would wait for Ray to end this driver (the actors end with their raylet); the local Ray
        is ended. ``ray_stopped``: the job's SIGTERM reached Ray's processes too (an eval stopped by it): nothing is
        asked through Ray, the local Ray is ended. A GCS alive but not answering: ``_release``."""
        gcs_dead = ray_stopped or self.gcs.found_dead()  # after a SIGTERM to the job (set-up stopped by it): at once
        if not ray_stopped:
            self._close_engines(timeout_s, kill_first=not gcs_dead)
        self.gcs.stop()
        if gcs_dead or self.gcs.error is not None:
            end_local_ray()
            return
        self._release()

    def _close_engines(self, timeout_s: float, kill_first: bool) -> None:
        ray = _ray()
        from ray.exceptions import RayError  # heavy: Ray

        for slot in sorted(self.unanswered) if kill_first else []:
            ray.kill(self.actors[slot])
        closing = [a.close.remote() for s, a in enumerate(self.actors) if s not in self.unanswered]
        try:
            ray.get(closing, timeout=timeout_s)
        except RayError:  # a dead actor, an engine whose shutdown failed or hangs: killed below all the same
            pass

    def _release(self) -> None:
        """Kill the actors and remove their placement group, within ``RELEASE_S``: a GCS that takes the call and
        never answers (stopped, swamped) held the run's end in ``remove_placement_group`` forever. Past it, the
        local Ray this run started is ended (never one it joined), and one line says so or what is left."""
        ray = _ray()
        from ray.util.placement_group import remove_placement_group  # heavy: Ray

        def release() -> None:
            for a in self.actors:
                ray.kill(a)
            remove_placement_group(self.pg)

        if within(RELEASE_S, release):
            return
        n = len(self.actors)
        what = f"the rollout engines ({n} actor{'s' * (n != 1)}, placement group {self.pg.id.hex()})"
        end_open_line(sys.stderr)
        print(f"megadare: {left_to_ray(what, RELEASE_S, end_local_ray())}", file=sys.stderr, flush=True)


class PendingRollout:
    """A rollout in flight: chunk c goes to the fresh engine given the fewest chunks by the same ``issue`` call,
    with seed ``prompt_seed(params.seed, index of its first prompt)``, so prompt j of the rollout draws the stream
    ``prompt_seed(params.seed, j)`` whatever the chunking and the engine (the seeds are linear in the index): the
    trajectories equal one ``generate`` call on one engine. ``result()`` collects them, restarting dead engines and
    re-issuing their chunks to fresh ones."""

    def __init__(self, manager: RolloutManager, chunks: list[list[list[int]]], params: SamplingParams):
        self.manager, self.chunks, self.params = manager, chunks, params
        self.first = [sum(len(c) for c in chunks[:i]) for i in range(len(chunks))]  # index of each chunk's prompt 0
        self.inflight: dict[Any, tuple[int, int]] = {}
        self.results: dict[int, list[Trajectory]] = {}
        self.restarts_left = manager.max_restarts

    def issue(self, todo: list[int]) -> None:
        m = self.manager
        load = [0] * len(m.actors)
        slots = m.fresh_slots() if todo else []
        for c in todo:
            slot = min(slots, key=lambda s: load[s])
            load[slot] += 1
            p = dataclasses.replace(self.params, seed=prompt_seed(self.params.seed, self.first[c]))
            self.inflight[m.actors[slot].generate.remote(self.chunks[c], p)] = (c, slot)

    def result(self) -> list[Trajectory]:
        """Every chunk's trajectories, in order. An engine that dies has its chunks re-issued (after a restart,
        within ``max_restarts``); one that raises, or that finishes no chunk in ``rollout.timeout_s`` while holding
        some, stops the rollout with a ``PeerError`` naming it."""
        ray = _ray()
        m = self.manager
        while self.inflight:
            ready, _ = m.wait_placed(list(self.inflight), 1, m.timeout_s)
            if not ready:
                raise m.silent([slot for _, slot in self.inflight.values()], "a rollout request")
            ready, _ = ray.wait(list(self.inflight), num_returns=len(self.inflight), timeout=0)
            todo, dead = self._collect(ready)
            for ref, (c, slot) in list(self.inflight.items()):  # a dead engine's other chunks: re-issued too
                if slot in dead:
                    del self.inflight[ref]
                    todo.append(c)
            for slot, e in sorted(dead.items()):
                self._replace(slot, e)
            self.issue(sorted(todo))
        return [t for c in range(len(self.chunks)) for t in self.results[c]]

    def _collect(self, ready: list) -> tuple[list[int], dict[int, BaseException]]:
        """The finished chunks' trajectories into ``results`` -> (chunks to re-issue, dead slots and their errors)."""
        ray = _ray()
        from ray.exceptions import RayActorError, RayError  # heavy: Ray

        todo, dead = [], {}
        for ref in ready:
            c, slot = self.inflight.pop(ref)
            try:
                self.results[c] = self._checked(slot, c, ray.get(ref))
            except RayActorError as e:
                dead[slot] = e
                todo.append(c)
            except RayError as e:
                raise self.manager.failed(slot, "generate", e) from e
        return todo, dead

    def _checked(self, slot: int, c: int, out) -> list[Trajectory]:
        """An engine's answer to chunk ``c``: one trajectory per prompt, else every later prompt of the rollout would
        get another's trajectory (and its reward) without a word."""
        want = len(self.chunks[c])
        if not isinstance(out, list) or len(out) != want:
            m = self.manager
            m.unanswered.add(slot)
            got = f"{len(out)} trajectories" if isinstance(out, list) else f"a {type(out).__name__}"
            raise PeerError(
                f"{m.peer(slot)} answered a rollout request of {want} prompts (prompts {self.first[c]}.."
                f"{self.first[c] + want - 1}) with {got}: a broken engine; {RESUME}"
            )
        return out

    def _replace(self, slot: int, e: BaseException) -> None:
        """A replacement for the dead engine in ``slot``, within the restart budget; says so on stderr. An engine
        whose construction raised is not replaced: its replacement would raise the same."""
        m = self.manager
        if getattr(e, "actor_init_failed", False):
            m.unanswered.add(slot)
            raise PeerError(
                f"{m.peer(slot)} {engine_failure(e)} (a replacement would too: fix that first); {RESUME}"
            ) from e
        if self.restarts_left <= 0:
            raise PeerError(
                f"{m.peer(slot)} {engine_failure(e)} and the restart budget of this rollout ({m.max_restarts}) is "
                f"used up; {RESUME}"
            )
        self.restarts_left -= 1
        print(
            f"rollout: {m.peer(slot)} {engine_failure(e)}; restarting it ({m.max_restarts - self.restarts_left} of "
            f"{m.max_restarts} restarts), its requests go to the other engines",
            file=sys.stderr,
        )
        m._restart(slot)


_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # the colour codes in Ray's error texts


def engine_failure(e: BaseException) -> str:
    """What happened to an engine, from Ray's error: 'raised X: msg' (the engine's own exception) or 'died (...)'
    (the actor process is gone: killed, OOM, its node lost), in one line."""
    from ray.exceptions import RayActorError, RayTaskError  # heavy: Ray

    if isinstance(e, RayTaskError) and not isinstance(e, RayActorError):
        cause = e.cause if getattr(e, "cause", None) is not None else e
        lines = str(cause).strip().splitlines() or [""]
        return f"raised {type(cause).__name__}: {lines[-1][:300]}"
    lines = [ln.strip() for ln in _ANSI.sub("", str(e)).strip().splitlines() if ln.strip()]
    if getattr(e, "actor_init_failed", False):  # its constructor raised: the last line is the exception
        return f"failed to start: raised {lines[-1][:300]}" if lines else "failed to start"
    killed = "worker process has died" in str(e) and "unexpectedly exits" in str(e)
    if killed:  # Ray's words for a process gone without an error: SIGKILL, the OOM killer, a segfault
        pid = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("pid:")), "?")
        return f"died (its process, pid {pid}, ended without an error: killed by a signal, e.g. the OOM killer, or a crash)"
    return f"died ({lines[0][:300]})" if lines else "died"


def resolve_engine_device(
    device: str, gpu_ids: Optional[Sequence] = None, cuda_available: Optional[bool] = None
) -> str:
    """The built-in engine's device from ``rollout.device`` and the GPUs Ray assigned to its actor (``gpu_ids``,
    default ``ray.get_gpu_ids()`` inside an actor): ``auto`` = the assigned GPU (Ray sets CUDA_VISIBLE_DEVICES, so
    it is ``cuda:0`` in the actor), CPU when none was assigned; ``cuda`` needs one."""
    if device not in ENGINE_DEVICES:
        raise ValueError(f"rollout.device={device!r}: choose one of {ENGINE_DEVICES}")
    if gpu_ids is None:
        gpu_ids = _assigned_gpus()
    cuda = torch_cuda_available() if cuda_available is None else cuda_available
    if device == "cpu" or (device == "auto" and not gpu_ids):
        return "cpu"
    if gpu_ids and not cuda:
        raise RuntimeError(
            f"Ray assigned GPU(s) {list(gpu_ids)} to the engine actor, but torch sees no CUDA device "
            "(a CPU-only torch build?); install a CUDA build of torch or set rollout.device=cpu"
        )
    if not cuda:
        raise RuntimeError(
            "rollout.device=cuda but the engine actor has no GPU: give it one with "
            "rollout.engine_resources={num_gpus: 1}, or set rollout.device=cpu / auto"
        )
    return "cuda:0" if gpu_ids else "cuda"


def _assigned_gpus() -> list:
    ray = _ray()
    return list(ray.get_gpu_ids()) if ray.is_initialized() else []


def torch_cuda_available() -> bool:
    return torch.cuda.is_available()


def build_native_engine(
    hf_dir: str, eos_token_id: int, device: str = "auto", dtype: str = "auto", settings: Optional[NativeSettings] = None
):
    """Engine factory for actors: the built-in engine on the family's hf/ model loaded from ``hf_dir`` in the
    engine's dtype (``auto``: bfloat16 on CUDA, float32 on CPU), on the device :func:`resolve_engine_device` picks
    (the GPU Ray assigned to the actor under ``auto``), decoding as ``settings`` say (``NativeSettings``:
    rollout.max_batch / compile / full_attention_cache).
    """
    cfg = read_hf_config(hf_dir)
    dev = resolve_engine_device(device)
    if dtype not in ENGINE_DTYPES:
        raise ValueError(f"rollout.dtype={dtype!r}: choose one of {ENGINE_DTYPES}")
    if dtype == "auto":
        dtype = "bfloat16" if dev.startswith("cuda") else "float32"
    dt = getattr(torch, dtype)
    return NativeEngine(
        load_hf_model(hf_dir, dtype=dt),
        family_of(cfg).arch(cfg),
        eos_token_id=eos_token_id,
        device=dev,
        dtype=dt,
        settings=settings or NativeSettings(),
    )
