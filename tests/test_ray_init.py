"""Ray for a local run is private: a ``ray start`` elsewhere on the machine (its address file) is not joined."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

import pytest

JOIN = r"""
import ray
from megadare.rollout.setup import init_ray
init_ray(1)
print("cpus", ray.cluster_resources().get("CPU"))
ray.shutdown()
"""


@pytest.mark.timeout(300)
def test_a_local_run_starts_its_own_ray_beside_another_clusters_address_file():
    """``<tmp>/ray/ray_current_cluster`` names the cluster of the last ``ray start`` on the machine (here one long
    gone): Ray's ``init(address=None)`` joined it, and with num_cpus given every local ``megadare rl`` / ``eval``
    died in a traceback ('When connecting to an existing cluster, num_cpus and num_gpus must not be provided').
    A run without RAY_ADDRESS now starts its own Ray."""
    tmp = tempfile.mkdtemp(prefix="rayinit", dir="/tmp")  # Ray's socket paths must stay short (107 bytes)
    try:
        os.makedirs(os.path.join(tmp, "ray"))
        with open(os.path.join(tmp, "ray", "ray_current_cluster"), "w") as f:
            f.write("127.0.0.1:9\n")
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        r = subprocess.run([sys.executable, "-c", JOIN], capture_output=True, text=True, env=dict(env, RAY_TMPDIR=tmp))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    assert r.returncode == 0, r.stderr
    assert "cpus 2.0" in r.stdout, r.stdout


@pytest.mark.parametrize("joined", [None, "10.0.0.7:6379"])
def test_a_ray_that_does_not_start_is_one_line_naming_the_fix(monkeypatch, joined):
    """Under load a local Ray's raylet / GCS came up late and ``megadare eval`` ended in Ray's 25-line traceback
    (``Exception: The current node timed out during startup ...``); it is one PeerError line naming the fix."""
    import ray

    from megadare.errors import PeerError
    from megadare.rollout.setup import init_ray

    def fail(**kwargs):
        raise Exception(
            "The current node timed out during startup. This could happen because some of the raylet\n"
            "failed to startup or the GCS has become overloaded."
        )

    monkeypatch.setattr(ray, "init", fail)
    if joined:
        monkeypatch.setenv("RAY_ADDRESS", joined)
    else:
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(PeerError) as e:
        init_ray(1)
    msg = str(e.value)
    assert "\n" not in msg and "timed out during startup" in msg
    assert (f"RAY_ADDRESS={joined}" in msg) if joined else ("ray start --head" in msg and "did not come up" in msg)
