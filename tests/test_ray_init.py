"""Ray for a local run is private: a ``ray start`` elsewhere on the machine (its address file) is not joined."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time

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


UP = r"""
from megadare.rollout.setup import init_ray
init_ray(1)
print("up", flush=True)
import time
time.sleep(300)
"""


def _ray_of(pid: int) -> list:
    """The Ray processes among ``pid``'s descendants (psutil.Process)."""
    import psutil

    from megadare.rollout.ray_guard import is_ray

    out = []
    for p in psutil.Process(pid).children(recursive=True):
        try:
            if is_ray(p):
                out.append(p)
        except psutil.Error:
            continue
    return out


def _alive(p) -> bool:
    import psutil

    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


@pytest.mark.timeout(300)  # Ray starts in seconds, a minute and more on a loaded machine
def test_a_sigkilled_run_leaves_no_ray_process_of_its_own_and_ends_no_other():
    """``megadare rl`` in one process (no --nproc), SIGKILLed: Ray's GCS and raylet died with it, but the raylet's
    children, Ray's dashboard and runtime-env agents, stayed a minute and more, waiting for the dead GCS (under
    --nproc the launcher, a subreaper, ends them). A local Ray now has a guard that ends the run's Ray processes
    once it is gone; a Ray process that is not the run's (another Ray on the node) is left alone."""
    import psutil

    other = subprocess.Popen(["bash", "-c", "exec -a raylet sleep 120"])  # 'raylet', not the run's
    driver = subprocess.Popen([sys.executable, "-c", UP], stdout=subprocess.PIPE, text=True)
    ours: list = []
    try:
        assert driver.stdout.readline().strip() == "up"
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            ours = _ray_of(driver.pid)
            titles = {(p.cmdline() or [""])[0] for p in ours}  # a ray:: title: its first word, padded
            if {"ray::DashboardAgent", "ray::RuntimeEnvAgent"} <= titles:
                break
            time.sleep(0.2)
        assert {"ray::DashboardAgent", "ray::RuntimeEnvAgent"} <= titles, titles
        time.sleep(2.0)  # the guard looks every ray_guard.PROBE_S (0.5 s)
        driver.kill()
        driver.wait()
        left = ours
        deadline = time.monotonic() + 15
        while left and time.monotonic() < deadline:
            time.sleep(0.2)
            left = [p for p in left if _alive(p)]
        assert not left, f"left running after the run was SIGKILLed: {[' '.join(p.cmdline()) for p in left]}"
        assert other.poll() is None, "a Ray process that was not the run's was ended"
    finally:
        for p in [*ours]:
            try:
                p.kill()
            except psutil.Error:
                pass
        driver.kill()
        other.kill()
        other.wait()


@pytest.mark.parametrize("set_s, inside", [(None, "3600"), ("3", "3600"), ("7200", "7200")])
def test_the_driver_outlives_its_gcs_as_long_as_the_run_waits_and_the_setting_is_put_back(monkeypatch, set_s, inside):
    """Around ``ray.init`` Ray's ``gcs_rpc_server_reconnect_timeout_s`` (60 s: then Ray ends the driver) is the
    run's parallel.collective_timeout_s, or a longer one the user set; afterwards the environment is as it was."""
    from megadare.rollout.ray_health import GCS_WAIT_ENV, outliving_the_gcs

    if set_s is None:
        monkeypatch.delenv(GCS_WAIT_ENV, raising=False)
    else:
        monkeypatch.setenv(GCS_WAIT_ENV, set_s)
    with outliving_the_gcs(3600):
        assert os.environ[GCS_WAIT_ENV] == inside
    assert os.environ.get(GCS_WAIT_ENV) == set_s
