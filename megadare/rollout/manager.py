"""Ray-managed rollout engines: N engine actors, requests spread by load, restarts with replay on failure.

    manager = RolloutManager(EngineSpec(build_native_engine, hf_dir=...), num_engines=2,
                             resources={"num_cpus": 1})            # {"num_gpus": 1} on a cluster
    trajectories = manager.generate(prompts, SamplingParams(...))  # every prompt exactly once, in order
    sync_weights(trainer_chunks, table, [manager], version=step)   # manager.update_weights fans out

Placement: the actors live in one placement group (one bundle per engine; ``strategy='PACK'`` to colocate them
with the trainer's GPUs, 'SPREAD' to give them their own). Prompts are cut into chunks of ``chunk_size``; each
chunk goes to the engine with the fewest outstanding chunks; chunk c samples with seed ``params.seed + c`` so a
re-issued chunk reproduces its trajectories. If an engine dies mid-rollout (RayActorError), the manager starts a
replacement, replays the latest weights into it (kept as object refs) and re-issues the dead engine's chunks; the
rollout still returns every trajectory exactly once.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from megadare.errors import ConfigError
from megadare.rollout.engine import SamplingParams, Trajectory


def _ray():
    try:
        import ray
    except ImportError as e:  # pragma: no cover - ray is a dependency, but keep the message clear
        raise ImportError("the rollout manager needs Ray: pip install 'ray>=2.40'") from e
    return ray


@dataclass
class EngineSpec:
    """How an actor builds its engine: ``factory(**kwargs)`` runs inside the actor process."""

    factory: Callable[..., Any]
    kwargs: dict[str, Any] = field(default_factory=dict)


class _EngineActor:
    """Holds one engine inside a Ray actor process."""

    def __init__(self, spec: EngineSpec):
        self.engine = spec.factory(**spec.kwargs)

    def generate(self, prompts, params):
        """The engine's trajectories; the first carries the chunk's generation seconds in ``extra['engine_s']``
        (rollout-side busy time for the async health metrics)."""
        t0 = time.perf_counter()
        out = self.engine.generate(prompts, params)
        if out:
            out[0].extra["engine_s"] = time.perf_counter() - t0
        return out

    def update_weights(self, named, version):
        return self.engine.update_weights(named, version)

    def call(self, method: str, *args):
        return getattr(self.engine, method)(*args)


def _check_feasible(ray, bundle: dict[str, float], resources: dict) -> None:
    """Fail at once when no live node of the Ray cluster can hold one engine: an infeasible placement group would
    wait for the 300 s timeout and end in an opaque GetTimeoutError (e.g. the config's num_cpus on small nodes)."""
    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    if any(all(node.get(k, 0) >= v for k, v in bundle.items()) for node in nodes):
        return
    have = "; ".join(", ".join(f"{k} {node.get(k, 0):g}" for k in bundle) for node in nodes) or "no live node"
    raise ConfigError(f"rollout.engine_resources={resources}: no node of the Ray cluster has {bundle} for one engine "
                      f"(its nodes: {have}); lower the request (Slurm scripts: ENGINE_GPUS / ENGINE_CPUS) or give "
                      "the nodes more")


class RolloutManager:
    def __init__(self, spec: EngineSpec, num_engines: int = 1, resources: Optional[dict[str, float]] = None,
                 strategy: str = "PACK", chunk_size: int = 8, max_restarts: int = 3):
        ray = _ray()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if not ray.is_initialized():
            raise RuntimeError("RolloutManager needs a running Ray (ray.init(...) or the Slurm launcher)")
        self.spec, self.chunk_size, self.max_restarts = spec, chunk_size, max_restarts
        self.resources = dict(resources or {"num_cpus": 1})
        bundle = {("GPU" if k == "num_gpus" else "CPU" if k == "num_cpus" else k): v
                  for k, v in self.resources.items()}
        _check_feasible(ray, bundle, self.resources)
        self.pg = placement_group([dict(bundle) for _ in range(num_engines)], strategy=strategy)
        ray.get(self.pg.ready(), timeout=300)
        self._strategy = PlacementGroupSchedulingStrategy
        self._actor_cls = ray.remote(_EngineActor)
        self.actors = [self._start(i) for i in range(num_engines)]
        self.weights: Optional[tuple[list, int]] = None   # (bucket refs, version) of the latest sync
        self._pending_buckets: list = []
        self.restarts = 0

    def _start(self, slot: int):
        return self._actor_cls.options(
            **self.resources, max_concurrency=1,
            scheduling_strategy=self._strategy(placement_group=self.pg, placement_group_bundle_index=slot),
        ).remote(self.spec)

    # ------------------------------------------------------------------ weights
    def pause(self) -> None:
        self._pending_buckets = []

    def update_weights(self, named: list, version: int) -> None:
        """One bucket to every engine (one object in Ray's store, shared by all actors)."""
        ray = _ray()
        ref = ray.put(named)
        self._pending_buckets.append(ref)
        ray.get([a.update_weights.remote(ref, version) for a in self.actors])
        self.weights = (list(self._pending_buckets), version)

    def resume(self) -> None:
        pass

    def _replay_weights(self, actor) -> None:
        if self.weights is not None:
            ray = _ray()
            refs, version = self.weights
            ray.get([actor.update_weights.remote(r, version) for r in refs])

    # ------------------------------------------------------------------ generation
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Trajectory]:
        """Every prompt's trajectory, in order (blocks until done)."""
        return self.submit(prompts, params).result()

    def submit(self, prompts: list[list[int]], params: SamplingParams) -> "PendingRollout":
        """Start a rollout and return at once (one-step-off training overlaps it with a train step); the engines
        serve it before any weight update sent after this call, so it uses the weights they hold now."""
        chunks = [prompts[i:i + self.chunk_size] for i in range(0, len(prompts), self.chunk_size)]
        pending = PendingRollout(self, chunks, params)
        pending.issue(list(range(len(chunks))))
        return pending

    def _restart(self, slot: int) -> None:
        self.restarts += 1
        self.actors[slot] = self._start(slot)
        self._replay_weights(self.actors[slot])

    def call_all(self, method: str, *args) -> list[Any]:
        """Call an engine method on every actor (sleep, wake, health, logits, ...)."""
        ray = _ray()
        return ray.get([a.call.remote(method, *args) for a in self.actors])

    def shutdown(self) -> None:
        ray = _ray()
        from ray.util.placement_group import remove_placement_group

        for a in self.actors:
            ray.kill(a)
        remove_placement_group(self.pg)


class PendingRollout:
    """A rollout in flight: chunk c goes to the least-loaded engine with seed ``params.seed + c``; ``result()``
    collects them, restarting dead engines (weights replayed) and re-issuing their chunks."""

    def __init__(self, manager: RolloutManager, chunks: list[list[list[int]]], params: SamplingParams):
        self.manager, self.chunks, self.params = manager, chunks, params
        self.inflight: dict[Any, tuple[int, int]] = {}
        self.results: dict[int, list[Trajectory]] = {}
        self.restarts_left = manager.max_restarts

    def issue(self, todo: list[int]) -> None:
        m = self.manager
        load = [0] * len(m.actors)
        for c in todo:
            slot = min(range(len(m.actors)), key=lambda s: load[s])
            load[slot] += 1
            p = dataclasses.replace(self.params, seed=self.params.seed + c)
            self.inflight[m.actors[slot].generate.remote(self.chunks[c], p)] = (c, slot)

    def result(self) -> list[Trajectory]:
        ray = _ray()
        from ray.exceptions import RayActorError

        while self.inflight:
            inflight, self.inflight = self.inflight, {}
            todo, dead = [], set()
            for ref, (c, slot) in inflight.items():
                try:
                    self.results[c] = ray.get(ref)
                except RayActorError:
                    dead.add(slot)
                    todo.append(c)
            for slot in sorted(dead):
                if self.restarts_left <= 0:
                    raise RuntimeError(f"rollout engine {slot} died and the restart budget "
                                       f"({self.manager.max_restarts}) is used up")
                self.restarts_left -= 1
                self.manager._restart(slot)
            self.issue(todo)
        return [t for c in range(len(self.chunks)) for t in self.results[c]]


def build_native_engine(hf_dir: str, eos_token_id: int, device: Optional[str] = None,
                        fail_once_marker: Optional[str] = None):
    """Engine factory for actors: the built-in engine on the family's hf/ model loaded from ``hf_dir``.

    ``fail_once_marker`` (fault-injection for tests): the first engine whose generate() finds no file at that
    path creates it and kills its process, as a crashed engine would.
    """
    from megadare.models import load_hf_model
    from megadare.models.family import family_of, read_hf_config
    from megadare.rollout.native import NativeEngine

    cfg = read_hf_config(hf_dir)
    engine = NativeEngine(load_hf_model(hf_dir), family_of(cfg).arch(cfg), eos_token_id=eos_token_id,
                          device=device or "cpu")
    if fail_once_marker:
        engine = _FailOnce(engine, fail_once_marker)
    return engine


class _FailOnce:
    def __init__(self, engine, marker: str):
        self.engine, self.marker = engine, marker

    def generate(self, prompts, params):
        import os

        if not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os._exit(1)
        return self.engine.generate(prompts, params)

    def __getattr__(self, name):
        return getattr(self.engine, name)
