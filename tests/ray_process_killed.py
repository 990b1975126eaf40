"""A rank-0 driver one of whose Ray processes is SIGKILLed while its engine is up (tests/test_rollout_placement.py):
a local Ray as ``megadare rl`` starts it, one engine, then ``raylet`` (its node's raylet: rollouts go on until Ray
finds the node dead) or ``gcs rollout`` / ``gcs busy`` (the head's ``gcs_server``: rollouts go on, the engine still
answering; or the driver works elsewhere, a train step). The run's error is printed as the CLI prints it
(``report_error``). Or ``gcs stopped``: the ``gcs_server`` SIGSTOPped (alive, its port open, answering nothing) and
the run ends, shutting its engines down. The ``gcs`` driver prints the pids of Ray's processes first (the test
checks none is left)."""

from __future__ import annotations

import os
import sys
import time

import psutil
import ray

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from test_rollout_placement import _echo_engine  # noqa: E402
from megadare.cli import report_error  # noqa: E402
from megadare.errors import PeerError  # noqa: E402
from megadare.rollout.engine import SamplingParams  # noqa: E402
from megadare.rollout import manager as manager_module  # noqa: E402
from megadare.rollout.manager import EngineLimits, EngineSpec, RolloutManager  # noqa: E402


def _end_with_a_stopped_gcs(manager) -> None:
    """SIGSTOP the GCS, then end the run as rl_run does (the engines shut down), within a short release deadline."""
    manager_module.RELEASE_S = 3.0
    for p in psutil.Process().children(recursive=True):
        if p.name() == "gcs_server":
            p.suspend()
    manager.shutdown(timeout_s=1)
    sys.exit(0)


if __name__ == "__main__":
    victim, rollouts = sys.argv[1], sys.argv[1] == "raylet" or sys.argv[2] == "rollout"
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)  # a Ray of its own
    manager = RolloutManager(
        EngineSpec(_echo_engine()), num_engines=1, resources={"num_cpus": 1}, limits=EngineLimits(timeout_s=600)
    )
    params = SamplingParams(max_new_tokens=1)
    manager.generate([[1]], params)
    if victim == "gcs":
        print(" ".join(str(p.pid) for p in psutil.Process().children(recursive=True)), flush=True)  # Ray's processes
    if sys.argv[2:] == ["stopped"]:
        _end_with_a_stopped_gcs(manager)
    for p in psutil.Process().children(recursive=True):
        if ("gcs_server" if victim == "gcs" else "raylet") in p.name():
            p.kill()
            if victim == "gcs":
                p.wait(10)
    try:
        for _ in range(600):  # until Ray finds the node dead (raylet), or ends this process 60 s after its GCS died
            if rollouts:
                manager.generate([[1]], params)
            time.sleep(0.5)
    except PeerError as e:
        manager.shutdown(timeout_s=1)  # as the RL loop does, before the CLI reports the error
        report_error(e)
        sys.exit(2)
