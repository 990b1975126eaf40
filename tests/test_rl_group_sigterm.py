"""SIGTERM to every process of an RL job (Slurm's time limit without the scripts' early signal, ``kill -TERM --
-PGID``): it ends the local Ray with the run. The run stopped at its next wait on Ray, exit 2, the step in flight
and everything since the last checkpoint lost (with ``checkpoint.save_interval=0``: the whole run), where SIGINT
finishes the step and saves. The run now stops on the signal as on SIGINT and saves without Ray: the step's update
is kept when it ran (only its weight push is dropped), its rollout lost when Ray went before it came; the run
says 'stopped by signal at step N', exit 0, and no Ray process of its own is left."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# megadare rl whose rank 0 sends SIGTERM to its whole process group (a session of its own) at step 1 (the second),
# at the start of ``WHERE`` (train: the rollout came, the update runs; generate: before the rollout), and waits
# until the group's signal has ended the local Ray's GCS; top level, so that spawned ranks (--nproc) patch too
HOOK = r"""
import os, signal, sys, time
from megadare.parallel.rank0 import trainer_rank
from megadare.trainer import rl

WHERE = os.environ["HOOK_WHERE"]
real = getattr(rl, WHERE)


def hooked(run, *a):
    if run.step == 1 and trainer_rank() == 0:
        import ray
        from megadare.rollout.ray_health import gcs_reachable

        address = ray.get_runtime_context().gcs_address
        os.killpg(os.getpgid(0), signal.SIGTERM)
        for _ in range(600):
            if gcs_reachable(address, 1.0) is False:
                break
            time.sleep(0.1)
    return real(run, *a)


setattr(rl, WHERE, hooked)

if __name__ == "__main__":
    from megadare.cli import main

    sys.exit(main(sys.argv[1:]))
"""


def _ray_pids_of(session_pid: int) -> list[str]:
    """Ray processes still running in the session ``session_pid`` leads (the run's own Ray)."""
    import psutil

    from megadare.rollout.ray_guard import is_ray

    left = []
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == session_pid and is_ray(p) and p.status() != psutil.STATUS_ZOMBIE:
                left.append(f"{p.pid} {' '.join(p.cmdline())[:80]}")
        except (psutil.Error, OSError):
            continue
    return left


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "where, nproc, stopped_at",
    [("train", 1, 2), ("generate", 1, 1), ("train", 2, 2)],
    ids=["mid-update", "before-rollout", "mid-update-nproc2"],
)
def test_a_sigterm_to_the_whole_job_keeps_what_it_can_and_says_so(tmp_path, where, nproc, stopped_at):
    import time

    hook = tmp_path / "hook.py"
    hook.write_text(HOOK)
    run = tmp_path / "rl"
    argv = [
        "rl",
        "--config",
        os.path.join(ROOT, "megadare", "configs", "demo_rl.yaml"),
        f"logging.run_dir={run}",
        "rl.steps=4",
        "rl.eval_size=4",
        "rl.eval_interval=0",
        "rl.prompts_per_step=2",
        "rl.n_samples=2",
        "train.micro_batch_size=2",
        "logging.tensorboard=false",
        *(["--nproc", "2"] if nproc > 1 else []),
    ]
    proc = subprocess.Popen(
        [sys.executable, str(hook), *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, HOOK_WHERE=where),
        start_new_session=True,  # the group it signals is its own
    )
    out, err = proc.communicate(timeout=280)
    assert proc.returncode == 0, err[-3000:]
    assert f"rl stopped by signal at step {stopped_at};" in out, (out, err[-3000:])
    with open(run / "ckpt" / "latest_checkpointed_iteration.txt") as f:
        assert int(f.read()) == stopped_at
    deadline = time.monotonic() + 15
    while _ray_pids_of(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _ray_pids_of(proc.pid) == []
