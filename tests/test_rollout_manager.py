"""Ray-managed engines on a local Ray cluster (CPU): every prompt once and in order, recovery from a dead engine,
the engine's device from Ray's assignment and the config. (Weight sync into engine actors: test_weight_sync.py.)"""

from __future__ import annotations

import os

import pytest

ray = pytest.importorskip("ray")

from tiny import write_tiny_hf  # noqa: E402
from megadare.errors import PeerError  # noqa: E402
from megadare.rollout.engine import SamplingParams  # noqa: E402
from megadare.rollout.manager import EngineSpec, RolloutManager, build_native_engine  # noqa: E402

EOS = 253
PARAMS = SamplingParams(max_new_tokens=8, block_size=4, steps_per_block=4, temperature=1.0, seed=11, stop_at_eos=False)
PROMPTS = [[(7 * i + j) % 200 + 1 for j in range(3 + i % 5)] for i in range(10)]


def _hf(path, seed: int, name: str = "sdar") -> str:
    return write_tiny_hf(path, name, seed, block_size=4)


@pytest.fixture(scope="module")
def cluster():
    ray.init(
        address="local",  # a Ray of its own, not a cluster already up on this machine
        num_cpus=4,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={
            "env_vars": {"PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(os.path.abspath(__file__)))])}
        },
    )
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


def _expected(hf_dir: str) -> list:
    """All prompts in one generate() call on one local engine: the manager's chunks (3 prompts each, on two
    engine actors, re-issued after a crash) must give exactly these (sampled, temperature 1)."""
    return [t.response_ids for t in build_native_engine(hf_dir, EOS).generate(PROMPTS, PARAMS)]


def _fail_once(marker: str):
    """Fault injection (test only): an engine factory whose first engine to find no file at ``marker`` creates it
    and kills its own process in generate(), as a crashed engine would. A closure: Ray (cloudpickle) ships it to
    the actor by value, not as a reference to this test module."""

    def build(**kwargs):
        class FailOnce:
            def __init__(self, engine):
                self.engine = engine

            def generate(self, prompts, params):
                if not os.path.exists(marker):
                    open(marker, "w").close()
                    os._exit(1)
                return self.engine.generate(prompts, params)

            def __getattr__(self, name):
                return getattr(self.engine, name)

        return FailOnce(build_native_engine(**kwargs))

    return build


def test_every_prompt_once_in_order_and_recovery_from_a_dead_engine(cluster, tmp_path):
    hf_dir = _hf(tmp_path, 0)
    expected = _expected(hf_dir)
    healthy = RolloutManager(
        EngineSpec(build_native_engine, {"hf_dir": hf_dir, "eos_token_id": EOS}), num_engines=2, chunk_size=3
    )
    got = healthy.generate(PROMPTS, PARAMS)
    assert [t.prompt_ids for t in got] == PROMPTS and [t.response_ids for t in got] == expected
    healthy.shutdown()

    marker = str(tmp_path / "crashed")
    flaky = RolloutManager(
        EngineSpec(_fail_once(marker), {"hf_dir": hf_dir, "eos_token_id": EOS}), num_engines=2, chunk_size=3
    )
    got = flaky.generate(PROMPTS, PARAMS)
    assert os.path.exists(marker) and flaky.restarts == 1  # one engine really died
    assert [t.prompt_ids for t in got] == PROMPTS and [t.response_ids for t in got] == expected
    assert all(h["alive"] for h in flaky.call_all("health"))
    flaky.shutdown()


def _faulty_once(marker: str, fault: str):
    """Fault injection (test only): the first engine to find no file at ``marker`` creates it and, in generate(),
    raises (``fault='raise'``) or never returns (``'hang'``), as a broken or wedged engine would."""

    def build(**kwargs):
        import time

        class Faulty:
            def __init__(self, engine):
                self.engine = engine
                self.faulty = not os.path.exists(marker)
                if self.faulty:
                    open(marker, "w").close()

            def generate(self, prompts, params):
                if self.faulty and fault == "raise":
                    raise MemoryError("CUDA out of memory (injected)")
                while self.faulty:
                    time.sleep(1)
                return self.engine.generate(prompts, params)

            def __getattr__(self, name):
                return getattr(self.engine, name)

        return Faulty(build_native_engine(**kwargs))

    return build


@pytest.mark.parametrize("fault", ["raise", "hang"])
def test_an_engine_that_raises_or_hangs_stops_the_rollout_naming_it(cluster, tmp_path, fault):
    """No wait without end: an engine whose generate() raises, or that returns nothing in rollout.timeout_s, ends
    the rollout in one line naming its slot and host, the cause and the resume (the other engine is not named)."""
    marker = str(tmp_path / "faulty")
    manager = RolloutManager(
        EngineSpec(_faulty_once(marker, fault), {"hf_dir": _hf(tmp_path, 0), "eos_token_id": EOS}),
        num_engines=2,
        chunk_size=3,
    )
    manager.check_engines()  # both engines up (their start is not what is timed here), their hosts known
    manager.timeout_s = 20  # the healthy engine finishes its chunk well within it, even on a loaded machine
    with pytest.raises(PeerError) as err:
        manager.generate(PROMPTS, PARAMS)
    msg = str(err.value)
    assert "\n" not in msg and "resume from its last checkpoint" in msg
    named = [s for s in range(2) if f"rollout engine {s} on {manager.hosts[s]}" in msg]
    assert len(named) == 1, msg
    if fault == "raise":
        assert "raised MemoryError: CUDA out of memory (injected) during generate" in msg
    else:
        assert "gave no answer to a rollout request in 20s (rollout.timeout_s)" in msg
    manager.shutdown(timeout_s=1)


def _marks_shutdown(folder: str):
    """An engine factory whose engine writes ``folder/closed-<pid>`` when shut down (a closure, shipped to the actor
    by value)."""

    def build(**kwargs):
        class Marked:
            def __init__(self, engine):
                self.engine = engine

            def shutdown(self):
                open(os.path.join(folder, f"closed-{os.getpid()}"), "w").close()

            def __getattr__(self, name):
                return getattr(self.engine, name)

        return Marked(build_native_engine(**kwargs))

    return build


def test_shutdown_lets_each_engine_close_itself(cluster, tmp_path):
    """The manager asks every engine to shut down (SGLang's removes its server processes and config folder)
    before it kills the actors; engines without a shutdown (the built-in one) and dead actors do not stop it."""
    hf_dir = _hf(tmp_path, 0)
    folder = tmp_path / "closed"
    folder.mkdir()
    manager = RolloutManager(
        EngineSpec(_marks_shutdown(str(folder)), {"hf_dir": hf_dir, "eos_token_id": EOS}), num_engines=2
    )
    assert not os.listdir(folder)
    manager.shutdown(timeout_s=120)  # the engines' builds, queued before the close, take > 30 s on a loaded machine
    assert len(os.listdir(folder)) == 2  # both engines, each in its own actor process
    plain = RolloutManager(EngineSpec(build_native_engine, {"hf_dir": hf_dir, "eos_token_id": EOS}), num_engines=2)
    ray.kill(plain.actors[0])  # already dead when shut down
    plain.shutdown(timeout_s=10)  # returns: the dead actor's error is not raised


def _hangs_then_closes(folder: str, hang_s: float):
    """An engine factory whose generate() hangs for ``hang_s`` and whose shutdown writes ``folder/closed-<pid>``
    (a closure, shipped to the actor by value)."""

    def build(**kwargs):
        import time

        class Hung:
            def __init__(self, engine):
                self.engine = engine

            def generate(self, prompts, params):
                time.sleep(hang_s)
                return self.engine.generate(prompts, params)

            def shutdown(self):
                open(os.path.join(folder, f"closed-{os.getpid()}"), "w").close()

            def __getattr__(self, name):
                return getattr(self.engine, name)

        return Hung(build_native_engine(**kwargs))

    return build


def test_a_hung_engine_is_killed_at_shutdown_without_waiting_for_its_close(cluster, tmp_path):
    """After an engine gave no answer in rollout.timeout_s the run stops, and its shutdown killed the hung engine
    only after waiting for its close (queued behind the hung call: up to 30 s more before the user saw the error);
    now it is killed at once and never reaches its close."""
    folder = tmp_path / "closed"
    folder.mkdir()
    manager = RolloutManager(
        EngineSpec(_hangs_then_closes(str(folder), 15), {"hf_dir": _hf(tmp_path, 0), "eos_token_id": EOS}),
        num_engines=1,
    )
    manager.check_engines()
    manager.timeout_s = 2
    with pytest.raises(PeerError, match="rollout engine 0 on .* gave no answer to a rollout request in 2s"):
        manager.generate(PROMPTS, PARAMS)
    hung = manager.actors[0]
    manager.shutdown()  # the old code waited here for the close behind the 15 s hang, which then ran
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(hung.info.remote(), timeout=60)
    assert not os.listdir(folder)


def test_engine_device_follows_ray_and_the_config(tmp_path):
    """rollout.device: ``auto`` takes the GPU Ray assigned to the actor; ``cuda`` without a GPU and a Ray-assigned
    GPU without CUDA fail, naming the fix; the config reaches the engine factory. (Inside real actors without a GPU,
    ``auto`` gives CPU: test_weight_sync.py.)"""
    from types import SimpleNamespace

    from megadare.config import load_config
    from megadare.errors import ConfigError
    from megadare.rollout.manager import resolve_engine_device
    from megadare.rollout.setup import engine_spec

    assert resolve_engine_device("auto", gpu_ids=[], cuda_available=True) == "cpu"
    assert resolve_engine_device("auto", gpu_ids=[0], cuda_available=True) == "cuda:0"
    assert resolve_engine_device("cpu", gpu_ids=[0], cuda_available=True) == "cpu"
    with pytest.raises(RuntimeError, match=r"assigned GPU\(s\) \[0\].*no CUDA"):
        resolve_engine_device("auto", gpu_ids=[0], cuda_available=False)
    with pytest.raises(RuntimeError, match="num_gpus: 1"):
        resolve_engine_device("cuda", gpu_ids=[], cuda_available=False)
    with pytest.raises(ConfigError, match="rollout.device"):
        load_config(None, ["rollout.device=gpu"])
    cfg = load_config(None, ["rollout.device=cpu"])
    spec = engine_spec(cfg, SimpleNamespace(hf_dir=_hf(tmp_path, 0)), SimpleNamespace(eos_token_id=EOS))
    assert spec.kwargs["device"] == "cpu" and spec.factory is build_native_engine
    assert (
        engine_spec(load_config(None, []), SimpleNamespace(hf_dir="x"), SimpleNamespace(eos_token_id=EOS)).kwargs[
            "device"
        ]
        == "auto"
    )


def test_engines_no_node_can_hold_fail_at_once(cluster, tmp_path):
    """An infeasible engine bundle (a GPU on a CPU cluster, more CPUs than a node has) is refused before the
    placement group would wait out its timeout (and end in GetTimeoutError, not this error)."""
    from megadare.errors import ConfigError

    spec = EngineSpec(build_native_engine, {"hf_dir": str(tmp_path), "eos_token_id": EOS})
    for resources in ({"num_cpus": 1, "num_gpus": 1}, {"num_cpus": 64}):
        with pytest.raises(ConfigError, match=r"rollout.engine_resources=.*no node of the Ray cluster has"):
            RolloutManager(spec, num_engines=1, resources=resources)


@pytest.mark.timeout(240)  # the old code waited 300 s for the placement group, then raised GetTimeoutError
def test_engines_the_cluster_cannot_hold_together_fail_at_once(cluster, tmp_path):
    """Each engine fits a node but not all of them together (2 x 3 CPUs on a 4-CPU node): one line naming the
    request and what the nodes have, not an opaque GetTimeoutError after 300 s."""
    from megadare.errors import ConfigError

    spec = EngineSpec(build_native_engine, {"hf_dir": str(tmp_path), "eos_token_id": EOS})
    with pytest.raises(ConfigError) as err:
        RolloutManager(spec, num_engines=2, resources={"num_cpus": 3})
    msg = str(err.value)
    assert "\n" not in msg and "rollout.engine_resources={'num_cpus': 3}, rollout.num_engines=2" in msg, msg
    assert "have room for only 1 engines of {'CPU': 3}" in msg and "(its nodes: CPU 4)" in msg, msg


def _fails_to_start(counter: str):
    """Fault injection (test only): an engine factory that raises, as a bad model path or an unsupported dtype
    does; every construction appends a line to ``counter``."""

    def build(**kwargs):
        with open(counter, "a") as f:
            f.write("start\n")
        raise ValueError("model.dtype=fp16 is not supported by this engine (injected)")

    return build


def test_an_engine_that_cannot_start_stops_at_once_naming_its_error(cluster, tmp_path):
    """An engine whose construction raises would raise again in every replacement: the rollout stops at its first
    answer, in one line with the engine's own exception, instead of restarting it max_restarts times."""
    counter = str(tmp_path / "starts")
    manager = RolloutManager(EngineSpec(_fails_to_start(counter), {}), num_engines=1, chunk_size=3)
    with pytest.raises(PeerError) as err:
        manager.generate(PROMPTS[:3], PARAMS)
    msg = str(err.value)
    assert "\n" not in msg, msg
    assert "rollout engine 0 failed to start: raised ValueError: model.dtype=fp16 is not supported" in msg, msg
    assert manager.restarts == 0
    with open(counter) as f:
        assert f.read().count("start") == 1
    manager.shutdown(timeout_s=1)


def _drops_one():
    """An engine factory whose engine answers a chunk with one trajectory too few (a broken engine)."""

    def build():
        class Short:
            def generate(self, prompts, params):
                from types import SimpleNamespace

                return [SimpleNamespace(ids=list(p)) for p in prompts][:-1]

        return Short()

    return build


def test_an_engine_that_answers_fewer_trajectories_than_prompts_stops_the_rollout(cluster):
    """Before, the short chunk was concatenated as it was: every later prompt got another prompt's trajectory."""
    manager = RolloutManager(EngineSpec(_drops_one()), num_engines=1, chunk_size=2)
    try:
        with pytest.raises(PeerError) as err:
            manager.generate([[1], [2], [3], [4]], PARAMS)
    finally:
        manager.shutdown(timeout_s=5)
    msg = str(err.value)
    assert msg.startswith("rollout engine 0 answered a rollout request of 2 prompts (prompts ") and "\n" not in msg
    assert "with 1 trajectories: a broken engine" in msg and "resume from its last checkpoint" in msg, msg


def test_an_engine_killed_by_a_signal_is_said_to_be_so():
    """An engine process SIGKILLed (the OOM killer) mid-rollout: the restart line said only 'died (The actor died
    unexpectedly before finishing this task.)'; it names the process and the likely cause."""
    from ray.exceptions import ActorDiedError

    from megadare.rollout.manager import engine_failure

    class Killed(ActorDiedError):  # Ray's text for an actor whose process was SIGKILLed (ray 2.x)
        def __str__(self):
            return (
                "The actor died unexpectedly before finishing this task.\n\tclass_name: _EngineActor\n\tpid: 11899\n"
                "\tip: 10.0.0.2\nThe actor is dead because its worker process has died. Worker exit type: "
                "SYSTEM_ERROR Worker exit detail: Worker unexpectedly exits with a connection error code 2. End of "
                "file. Some common causes include: (1) the process was killed by the OOM killer ..."
            )

    said = engine_failure(Killed())
    assert (
        said
        == "died (its process, pid 11899, ended without an error: killed by a signal, e.g. the OOM killer, or a crash)"
    )
