"""parallel/launch.py: the ranks die with their launcher. A launcher SIGKILLed (the OOM killer, ``kill -9``, a
harness timeout) left its ranks running as orphans (one spun at 97% of a core for 40 minutes beside CI); under
'forkserver' the server lived on too (every rank holds its "alive" pipe)."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest

# the launcher: a process of its own (the test SIGKILLs it), launching 2 ranks of _sleep_forever
LAUNCHER = """
import sys
from megadare.parallel import launch
import test_launch_orphans
if sys.argv[1] == "forkserver":
    launch.preload_ranks(["megadare.parallel.launch"])
launch.spawn(test_launch_orphans._sleep_forever, 2, sys.argv[2], timeout_s=600)
"""


def _sleep_forever(rank: int, world: int, where: str) -> None:
    Path(where, f".rank{rank}").write_text(str(os.getpid()))
    Path(where, f".rank{rank}").rename(Path(where, f"rank{rank}.pid"))  # whole: the test reads it once it exists
    time.sleep(600)


def _gone(p: psutil.Process) -> bool:
    try:
        return p.status() == psutil.STATUS_ZOMBIE  # dead, waiting for whoever adopted it to reap it
    except psutil.NoSuchProcess:
        return True


def _ranks_up(launcher: subprocess.Popen, where: Path, timeout_s: float) -> list[psutil.Process]:
    """The launcher's descendants (ranks, forkserver, resource tracker) once both ranks wrote their pid."""
    deadline = time.monotonic() + timeout_s
    while not all((where / f"rank{r}.pid").exists() for r in range(2)):
        assert launcher.poll() is None, f"the launcher exited with {launcher.returncode} before its ranks started"
        assert time.monotonic() < deadline, "the ranks did not start"
        time.sleep(0.2)
    return psutil.Process(launcher.pid).children(recursive=True)


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_ranks_die_with_a_sigkilled_launcher(method, tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, method, str(tmp_path)], env=env)
    left: list[psutil.Process] = []
    try:
        left = _ranks_up(launcher, tmp_path, timeout_s=120)
        ranks = {int((tmp_path / f"rank{r}.pid").read_text()) for r in range(2)}
        assert ranks <= {p.pid for p in left}, "the ranks are not the launcher's descendants"
        _kill_and_expect_gone(launcher, left)
    finally:
        _end(launcher, left)


def _kill_and_expect_gone(launcher: subprocess.Popen, left: list[psutil.Process]) -> None:
    """SIGKILL the launcher; every process of ``left`` must be gone within 10 s."""
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not all(_gone(p) for p in left):
        time.sleep(0.2)
    alive = [f"{p.pid} ({p.cmdline()[-1][:60]})" for p in left if not _gone(p)]
    assert not alive, f"processes outlived their SIGKILLed launcher by 10 s: {alive}"


def _end(launcher: subprocess.Popen, left: list[psutil.Process]) -> None:
    """Never leave a process behind, even when the test fails (what the old code left: beside the rest of the suite)."""
    if launcher.poll() is None:
        launcher.kill()
        launcher.wait()
    for p in left:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def test_sft_ranks_die_with_a_sigkilled_megadare_nproc_2(tmp_path):
    """The command as users run it: ``megadare sft --nproc 2`` (start method 'spawn') killed once training started."""
    config = Path(__file__).parents[1] / "examples" / "configs" / "sft_sdar_tiny.yaml"
    command = ["sft", "--config", str(config), "--nproc", "2"]
    overrides = ["data.synthetic_size=64", "train.global_batch_size=4", "train.steps=100000"]
    with _megadare_after_a_step(tmp_path, [*command, *overrides], "training step") as (launcher, left):
        assert len([p for p in left if "--multiprocessing-fork" in p.cmdline()]) == 2, "not 2 ranks"
        _kill_and_expect_gone(launcher, left)


@contextmanager
def _megadare_after_a_step(tmp_path, argv: list[str], step: str):
    """``python -m megadare ARGV`` (run directory and log under ``tmp_path``) once its first ``step`` is done (a
    line in metrics.jsonl; 240 s at most): (the launcher, its descendants then); nothing left after it (``_end``)."""
    run, log_path = tmp_path / "run", tmp_path / "megadare.log"
    with open(log_path, "w") as log:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "megadare", *argv, f"logging.run_dir={run}", "logging.tensorboard=false"],
            stdout=log,
            stderr=log,
        )
        left: list[psutil.Process] = []
        try:
            deadline = time.monotonic() + 240
            while not ((run / "metrics.jsonl").exists() and (run / "metrics.jsonl").stat().st_size):
                assert launcher.poll() is None, log_path.read_text()[-3000:]
                assert time.monotonic() < deadline, f"no {step} within 240 s"
                time.sleep(0.5)
            left = psutil.Process(launcher.pid).children(recursive=True)
            yield launcher, left
        finally:
            _end(launcher, left)


def _mark(rank: int, world: int, where: str) -> None:
    Path(where, "ran").write_text("")


def test_a_rank_whose_launcher_died_before_the_death_signal_was_armed_exits_at_once(tmp_path):
    """The race: a launcher that died before its rank's prctl sends no signal; the rank sees another parent (it was
    adopted) and exits, without running its function."""
    from megadare.parallel import launch

    child = os.fork()
    if child == 0:
        try:  # not this child's parent: as if its launcher had died and it had been adopted
            launcher = launch._Launcher(dict(os.environ), os.getppid() + 1)
            launch._entry(0, 1, (_mark, (str(tmp_path),)), queue.Queue(), launcher, None)
        finally:
            os._exit(0)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 1 and not (tmp_path / "ran").exists()


def test_the_ray_of_a_sigkilled_megadare_rl_nproc_2_goes_with_it(tmp_path):
    """``megadare rl --nproc 2`` killed (SIGKILL) once its engines generate: the ranks die with the launcher
    (PR_SET_PDEATHSIG), and the Ray rank 0 started (GCS, raylet, dashboard and agents, the engines' workers) must
    go too: Ray fate-shares its GCS and raylet with the driver, the workers follow the raylet, the guard
    (rollout/ray_guard.py) SIGKILLs the agents. Each is seen alive before the kill."""
    from megadare.rollout.ray_guard import is_ray

    config = Path(__file__).parents[1] / "megadare" / "configs" / "demo_rl.yaml"
    overrides = ["rl.steps=100000", "rl.eval_size=4", "rl.eval_interval=0", "rl.prompts_per_step=2", "rl.n_samples=2"]
    argv = ["rl", "--config", str(config), "--nproc", "2", *overrides, "train.micro_batch_size=2"]
    with _megadare_after_a_step(tmp_path, argv, "RL step") as (launcher, left):
        ray = [os.path.basename(p.cmdline()[0]) for p in left if _alive_ray(p, is_ray)]
        assert "gcs_server" in ray and "raylet" in ray, ray
        assert any(c.startswith("ray::") for c in ray), ray  # a worker: an engine's or an agent
        _kill_and_expect_gone(launcher, left)


def _alive_ray(p: psutil.Process, is_ray) -> bool:
    try:
        return is_ray(p) and not _gone(p)
    except psutil.Error:
        return False
