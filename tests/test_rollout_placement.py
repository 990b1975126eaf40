"""An engine Ray cannot place again (its node left and no other has room) stops the rollout at once, naming the
engine, what it asks for and what the cluster has; before, it was reported as silence after rollout.timeout_s.
(A two-node local Ray cluster of its own: the worker node is removed mid-run, as a lost host or a killed raylet.)"""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")

from megadare.errors import PeerError  # noqa: E402
from megadare.rollout.engine import SamplingParams  # noqa: E402
from megadare.rollout.manager import EngineLimits, EngineSpec, RolloutManager  # noqa: E402


def _echo_engine():
    """An engine factory (a closure, shipped to the actor by value: this module is not on the workers' path) whose
    engine gives the prompts back."""

    def build():
        class Echo:
            def generate(self, prompts, params):
                from types import SimpleNamespace

                return [SimpleNamespace(ids=list(p)) for p in prompts]

        return Echo()

    return build


@pytest.fixture(scope="module")
def two_nodes():
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    worker = cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, log_to_driver=False)
    yield cluster, worker
    ray.shutdown()
    cluster.shutdown()


@pytest.mark.timeout(240)  # the old code waited rollout.timeout_s (600 s here) for the engine
def test_an_engine_that_cannot_be_placed_again_stops_the_rollout_naming_it(two_nodes):
    cluster, worker = two_nodes
    manager = RolloutManager(
        EngineSpec(_echo_engine()), num_engines=1, resources={"num_cpus": 1}, limits=EngineLimits(timeout_s=600)
    )
    params = SamplingParams(max_new_tokens=1)
    assert [t.ids for t in manager.generate([[1, 2], [3]], params)] == [[1, 2], [3]]
    cluster.remove_node(worker)  # the engine's node is gone: its actor dies, the head node has no CPU for it
    with pytest.raises(PeerError) as err:
        manager.generate([[1, 2], [3]], params)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("rollout engine 0 cannot be placed: Ray has no node with {'CPU': 1}")
    assert "rollout.engine_resources={'num_cpus': 1}" in msg and ": CPU 0" in msg and "free now: CPU 0" in msg, msg
    assert f"Ray node {worker.node_ip_address} died (its raylet killed or its host lost; Ray's logs: " in msg, msg
    assert "resume from its last checkpoint" in msg
    manager.shutdown(timeout_s=1)


@pytest.mark.timeout(300)  # the old code waited rollout.timeout_s (600 s) for the engine it could not restart
def test_a_killed_raylet_ends_the_run_naming_the_dead_node_and_ray_logs(tmp_path):
    """This host's raylet SIGKILLed under the run (its only node): Ray prints its log tail, its engine dies with
    the node, and no node is left to restart it on. The run's last line names the dead node, Ray's logs and the
    resume, instead of 'gave no answer' after rollout.timeout_s; it comes after Ray's log tail."""
    import os
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(__file__), "ray_process_killed.py")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own local Ray, not this module's
    out = subprocess.run(  # one pipe for both, as a terminal or a Slurm log shows them
        [sys.executable, script, "raylet"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=280,
        env=env,
    )
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("megadare: error: ")]
    assert out.returncode == 2 and len(lines) == 1, (out.returncode, out.stdout[-3000:])
    # Ray's dump of the dead raylet's log (on stdout, block-buffered in a pipe) came after the run's line
    assert out.stdout.strip().splitlines()[-1] == lines[0], out.stdout[-3000:]
    assert lines[0].startswith("megadare: error: rollout engine 0 cannot be placed: "), lines[0]
    assert " died (its raylet killed or its host lost; Ray's logs: " in lines[0], lines[0]
    assert "resume from its last checkpoint" in lines[0]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("driver", ["rollout", "busy"])
def test_a_killed_gcs_ends_the_run_in_one_line_naming_it_and_leaves_no_ray_process(driver):
    """The head's gcs_server SIGKILLed under the run (a local Ray, as ``megadare rl`` starts it), while the driver
    runs rollouts (the engine still answers) or works elsewhere (a train step). Before, Ray ended the driver 60 s
    later with its own line ('Failed to connect to GCS within 60 seconds ...'), exit 1. Now the run's last line
    names the dead GCS and Ray's logs, exit 2, and no process of its Ray is left behind."""
    import os
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(__file__), "ray_process_killed.py")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own local Ray, not this module's
    out = subprocess.run([sys.executable, script, "gcs", driver], capture_output=True, text=True, timeout=380, env=env)
    last = (out.stderr.strip().splitlines() or [""])[-1]
    assert out.returncode == 2, (out.returncode, out.stderr[-3000:])
    assert last.startswith("megadare: error: the Ray head (its GCS, gcs_server at "), out.stderr[-3000:]
    assert " died (killed, or its host lost; Ray's logs: " in last and "resume from its last checkpoint" in last
    assert out.stderr.count("megadare: error: ") == 1, out.stderr[-3000:]
    pids = [int(p) for p in out.stdout.split()]
    assert pids, out.stdout
    left = _ray_left(pids)  # killed ones may take a moment to go
    assert not left, [(p.pid, p.status(), p.name()) for p in left]


@pytest.mark.timeout(200)
def test_a_run_ends_in_bounded_time_when_its_gcs_takes_calls_but_answers_none():
    """The head's gcs_server alive but answering nothing (SIGSTOPped here; swamped, or waiting for a lost node):
    its port still accepts, so the GCS watch sees it alive, and the engines' shutdown at the run's end waited in
    ``remove_placement_group`` forever (the old code: the run never ended). Now the release gets RELEASE_S, then
    the local Ray the run started is ended and one line says so."""
    import os
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(__file__), "ray_process_killed.py")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own local Ray, not this module's
    proc = subprocess.Popen(
        [sys.executable, script, "gcs", "stopped"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        out, err = proc.communicate(timeout=150)  # set-up ~20 s on a loaded 2-core machine, the release 3 s
    finally:
        if proc.poll() is None:  # the old code: hung in remove_placement_group
            proc.kill()
            out, err = proc.communicate()
        left = _ray_left([int(p) for p in out.split()])
        for p in left:  # its Ray's processes, stopped GCS included, end with this test either way
            p.kill()
    assert proc.returncode == 0, (proc.returncode, err[-3000:])
    lines = [ln for ln in err.splitlines() if ln.startswith("megadare: ")]
    assert len(lines) == 1, err[-3000:]
    assert lines[0].startswith("megadare: Ray's GCS did not release the rollout engines (1 actor, placement group ")
    assert "within 3 s (" in lines[0] and "Ray's logs: " in lines[0], lines[0]
    assert lines[0].endswith(" processes)") and "ended the local Ray this run started (" in lines[0], lines[0]
    assert out.split() and not left, (out, [(p.pid, p.name()) for p in left])


def _ray_left(pids: list[int]) -> list:
    """Those of ``pids`` still running after 10 s (psutil.Process; zombies and the gone left out)."""
    import psutil

    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=10)
    return [p for p in alive if p.status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)]


def test_the_gcs_watch_rides_out_a_blip_and_names_a_lost_host(monkeypatch):
    """A GCS port that timed out three probes in a row (~9 s: a congested network Ray itself rides out for 60 s)
    ended the run; now it takes GCS_MISSES (~30 s) in a row, and a refused port (nothing listens) at once."""
    import threading

    from megadare.rollout import ray_health

    def watch(answers):
        answers, done = iter(answers), threading.Event()
        monkeypatch.setattr(ray_health, "gcs_reachable", lambda address: next(answers, True))
        monkeypatch.setattr(ray_health, "_still_joined", lambda address: True)
        monkeypatch.setattr(ray_health, "ray_logs", lambda: "/logs")
        w = ray_health.GcsWatch("h:1", grace_s=60.0, probe_s=0.001, on_exit=lambda rc: done.set())
        w._thread.join(timeout=0.5)  # dead: the thread waits out grace_s; alive: it probes on
        w.stop()
        w._thread.join()
        return w.error

    blips = ([None] * 9 + [True]) * 3  # 9 probes without an answer: ~27 s
    assert watch(blips) is None
    assert "the Ray head (its GCS, gcs_server at h:1) died" in str(watch([None] * ray_health.GCS_MISSES))
    assert "gcs_server at h:1" in str(watch([True, False]))


def test_after_a_sigterm_the_gcs_watch_leaves_the_stop_to_the_run(monkeypatch):
    """A GCS gone after the run got SIGTERM (the group's signal ended Ray too): the watch ended the process after
    ``grace_s`` (exit 2, the step in flight lost) while the step trained. It now only records the error, which the
    RL loop takes for a stop on the signal (``lost_to_sigterm``) and saves without Ray."""
    import threading

    from megadare.rollout import ray_health

    monkeypatch.setattr(ray_health, "_TERMINATED", [True], raising=False)
    monkeypatch.setattr(ray_health, "gcs_reachable", lambda address: False)
    monkeypatch.setattr(ray_health, "_still_joined", lambda address: True)
    monkeypatch.setattr(ray_health, "ray_logs", lambda: "/logs")
    exited = threading.Event()
    w = ray_health.GcsWatch("h:1", grace_s=0.01, probe_s=0.001, on_exit=lambda rc: exited.set())
    w._thread.join(timeout=30)
    assert not w._thread.is_alive() and not exited.is_set()
    assert ray_health.lost_to_sigterm(w.error), w.error
    monkeypatch.setattr(ray_health, "_TERMINATED", [])
    assert not ray_health.lost_to_sigterm(w.error)  # without the signal: an error of its own


def test_a_gcs_gone_after_this_run_got_sigterm_is_said_to_have_got_it_too(monkeypatch):
    """SIGTERM to every process of the job (Slurm's time limit, `kill -TERM -- -PGID`) during a rollout: the
    local Ray's GCS stopped with it and the run stopped with 'the Ray head ... died (killed, or its host lost ...)',
    as if something else had killed it. The line now says the SIGTERM did, and how to stop with a checkpoint."""
    import signal
    import threading

    from megadare.rollout import ray_health
    from megadare.trainer.signals import StopSignal

    monkeypatch.setattr(ray_health, "_TERMINATED", [], raising=False)
    stop = StopSignal((signal.SIGTERM,))
    try:
        stop._handle(signal.SIGTERM, None)  # what the handler does on the signal
    finally:
        stop.restore()
    monkeypatch.setattr(ray_health, "gcs_reachable", lambda address: False)  # refused: nothing listens
    monkeypatch.setattr(ray_health, "_still_joined", lambda address: True)
    monkeypatch.setattr(ray_health, "ray_logs", lambda: "/logs")
    done = threading.Event()
    w = ray_health.GcsWatch("h:1", grace_s=60.0, probe_s=0.001, on_exit=lambda rc: done.set())
    w._thread.join(timeout=0.5)
    w.stop()
    w._thread.join()
    msg = str(w.error)
    assert msg.startswith("the Ray head (its GCS, gcs_server at h:1) died (ended by the SIGTERM this run got too"), msg
    assert "the step in flight is lost" in msg and "resume from its last checkpoint" in msg, msg
