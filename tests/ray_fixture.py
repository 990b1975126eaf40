"""One local Ray cluster per test module; code under test joins it through RAY_ADDRESS, as on Slurm."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    # a Ray of its own (address="local"): a bare ray.init() joins any cluster already up on this machine
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    old = os.environ.get("RAY_ADDRESS")
    os.environ["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address
    yield
    if old is None:
        os.environ.pop("RAY_ADDRESS", None)
    else:
        os.environ["RAY_ADDRESS"] = old
    ray.shutdown()
