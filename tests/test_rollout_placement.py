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
