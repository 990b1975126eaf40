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
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# a hook's start: rank 0's SIGTERM to its whole process group (a session of its own), then a wait until the group's
# signal has ended the local Ray's GCS
_TERM_THE_JOB = r"""
import os, signal, sys, time
from megadare.parallel.rank0 import trainer_rank


def term_the_job():
    import ray
    from megadare.rollout.ray_health import gcs_reachable

    address = ray.get_runtime_context().gcs_address
    os.killpg(os.getpgid(0), signal.SIGTERM)
    for _ in range(600):
        if gcs_reachable(address, 1.0) is False:
            break
        time.sleep(0.1)
"""
# a hook's end: the patched process runs megadare's command line
_RUN_MEGADARE = r"""
if __name__ == "__main__":
    from megadare.cli import main

    sys.exit(main(sys.argv[1:]))
"""

# megadare rl whose rank 0 sends SIGTERM to its whole process group (a session of its own) at step 1 (the second),
# at the start of ``WHERE`` (train: the rollout came, the update runs; generate: before the rollout), and waits
# until the group's signal has ended the local Ray's GCS; top level, so that spawned ranks (--nproc) patch too
HOOK = (
    _TERM_THE_JOB
    + r"""
from megadare.trainer import rl

WHERE = os.environ["HOOK_WHERE"]
real = getattr(rl, WHERE)


def hooked(run, *a):
    if run.step == 1 and trainer_rank() == 0:
        term_the_job()
    return real(run, *a)


setattr(rl, WHERE, hooked)

if os.environ.get("HOOK_SAVE_S"):  # a save without Ray that takes this long (a big model's)
    real_save = rl.save_run

    def slow_save(run):
        if run.ray_lost:
            time.sleep(float(os.environ["HOOK_SAVE_S"]))
        return real_save(run)

    rl.save_run = slow_save

"""
    + _RUN_MEGADARE
)


def _rl_argv(run_dir, steps: int, nproc: int = 1) -> list[str]:
    """``megadare rl`` on the demo: tiny steps, no evaluation but the last."""
    return [
        "rl",
        "--config",
        os.path.join(ROOT, "megadare", "configs", "demo_rl.yaml"),
        f"logging.run_dir={run_dir}",
        f"rl.steps={steps}",
        "rl.eval_size=4",
        "rl.eval_interval=0",
        "rl.prompts_per_step=2",
        "rl.n_samples=2",
        "train.micro_batch_size=2",
        "logging.tensorboard=false",
        *(["--nproc", str(nproc)] if nproc > 1 else []),
    ]


def _stops_saves_and_resumes(hook, run, argv: list[str], resume_argv: list[str], step: int, env=None) -> None:
    """``hook`` (a script sending the group SIGTERM) runs ``megadare argv`` in a session of its own: exit 0, stopped
    by the signal at ``step`` with its checkpoint saved; ``megadare resume_argv`` then resumes from that step."""
    proc = subprocess.run(
        [sys.executable, str(hook), *argv],
        capture_output=True,
        text=True,
        env=env,
        start_new_session=True,  # the group it signals is its own
        timeout=200,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"rl stopped by signal at step {step};" in proc.stdout, (proc.stdout, proc.stderr[-3000:])
    with open(run / "ckpt" / "latest_checkpointed_iteration.txt") as f:
        assert int(f.read()) == step
    resumed = subprocess.run(
        [sys.executable, "-m", "megadare", *resume_argv], capture_output=True, text=True, timeout=200
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"at step {step} (lr schedule" in resumed.stdout + resumed.stderr, (resumed.stdout, resumed.stderr[-3000:])


def run_hooked(tmp_path, hook: str, argv: list[str], env: dict[str, str], timeout_s: float):
    """``megadare ARGV`` run by the program ``hook`` (which signals its process group at some point) in a session
    of its own, so the group it signals is its own: (the finished Popen, stdout, stderr)."""
    program = tmp_path / "hook.py"
    program.write_text(hook)
    proc = subprocess.Popen(
        [sys.executable, str(program), *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, **env),
        start_new_session=True,
    )
    out, err = proc.communicate(timeout=timeout_s)
    return proc, out, err


def left_in_session(session_pid: int, within_s: float, only=None) -> list[str]:
    """The processes of the session ``session_pid`` leads (the job's) still running after up to ``within_s``
    seconds, those ``only`` keeps (all: None), as 'PID cmdline'."""
    deadline = time.monotonic() + within_s
    while (left := _in_session(session_pid, only)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def _in_session(session_pid: int, only) -> list[str]:
    import psutil

    left = []
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == session_pid and (only is None or only(p)) and p.status() != psutil.STATUS_ZOMBIE:
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
    run = tmp_path / "rl"
    proc, out, err = run_hooked(tmp_path, HOOK, _rl_argv(run, 4, nproc), {"HOOK_WHERE": where}, 280)
    assert proc.returncode == 0, err[-3000:]
    assert f"rl stopped by signal at step {stopped_at};" in out, (out, err[-3000:])
    with open(run / "ckpt" / "latest_checkpointed_iteration.txt") as f:
        assert int(f.read()) == stopped_at
    from megadare.rollout.ray_guard import is_ray

    assert left_in_session(proc.pid, 15, only=is_ray) == []  # the run's own Ray


@pytest.mark.timeout(240)
def test_a_save_longer_than_ray_lets_a_driver_outlive_its_gcs_still_lands_and_resumes(tmp_path):
    """Ray ends a driver ``gcs_rpc_server_reconnect_timeout_s`` (60 s) after its GCS died, from its C++ core (exit
    1, 'Failed to connect to GCS within 60 seconds'): a save without Ray after the group's SIGTERM that took longer
    (a big model's) was cut, the interval's work lost. megadare's driver now outlives its GCS by
    parallel.collective_timeout_s. Here Ray's limit is 3 s (its environment variable, a user's shorter setting is
    raised too) and the save takes 8 s: it lands, and the next run resumes from it."""
    hook = tmp_path / "hook.py"
    hook.write_text(HOOK)
    run = tmp_path / "rl"
    env = dict(os.environ, HOOK_WHERE="generate", HOOK_SAVE_S="8", RAY_gcs_rpc_server_reconnect_timeout_s="3")
    _stops_saves_and_resumes(hook, run, _rl_argv(run, 2), _rl_argv(run, 2), step=1, env=env)
    with open(run / "ckpt" / "latest_checkpointed_iteration.txt") as f:
        assert int(f.read()) == 2


# megadare rl whose rank 0 sends SIGTERM to its whole process group inside the weight push of version 2 (after step
# 1's update), at its first bucket, and waits until the signal has ended the local Ray's GCS: the transfer breaks
# ('the weight push of version 2 broke: ...'), an error without the Ray head's words
PUSH_HOOK = (
    _TERM_THE_JOB
    + r"""
from megadare.rollout.weight_sync import transport

real_begin, real_send = transport.GroupTransport.begin, transport.GroupTransport.send


def begin(self, version, device):
    self.hook_version = version
    return real_begin(self, version, device)


def send(self, index, bucket, flats):
    if self.hook_version == 2 and index == 0 and trainer_rank() == 0:
        term_the_job()
    return real_send(self, index, bucket, flats)


transport.GroupTransport.begin, transport.GroupTransport.send = begin, send

"""
    + _RUN_MEGADARE
)


@pytest.mark.timeout(500)
def test_a_sigterm_to_the_whole_job_mid_push_keeps_the_update_and_resumes(tmp_path):
    """The group's SIGTERM inside the weight push after step 1's update, two ranks: the transfer broke on rank 0
    ('the weight push of version 2 broke: ...'), an error without the Ray head's words, while rank 1 (which sends
    nothing) went on to its next collective: the ranks paired wrongly and the run hung until killed, the update it
    had made lost although the job was only being stopped. A push broken after a SIGTERM now counts as Ray lost
    to it on every rank (the failing rank decides, the others learn its outcome): the update is kept, the run says
    'stopped by signal at step 2', exit 0, and a rerun resumes from that checkpoint."""
    hook = tmp_path / "hook.py"
    hook.write_text(PUSH_HOOK)
    run = tmp_path / "rl"
    _stops_saves_and_resumes(hook, run, _rl_argv(run, 4, 2), _rl_argv(run, 3, 2), step=2)
    with open(run / "ckpt" / "latest_checkpointed_iteration.txt") as f:
        assert int(f.read()) == 3


def test_a_broken_push_counts_as_lost_to_sigterm_only_after_one_and_on_every_rank(monkeypatch):
    """A weight push broken after this process got SIGTERM (the transfer broke, an engine call failed: Ray went
    down with the job) counts as Ray lost to the signal, whatever its words; the verdict travels with the error to
    the other ranks (pickled, as ``on_every_rank`` passes it), which decide alike even without the signal noted
    yet. Without a SIGTERM a broken push is its own error, as loud as before."""
    import pickle
    from types import SimpleNamespace

    from megadare.errors import PeerError
    from megadare.rollout import ray_health
    from megadare.trainer import rl

    broke = PeerError("the weight push of version 2 broke: a rollout engine left or stopped answering (x); resume")

    def push(weight_sync, version):
        raise broke

    run = SimpleNamespace(policy=SimpleNamespace(push=push), weight_sync=None, step=2)
    monkeypatch.setattr(ray_health, "_TERMINATED", [])
    with pytest.raises(PeerError) as plain:
        rl.push_or_lost(run)
    assert plain.value is broke and not ray_health.lost_to_sigterm(plain.value)
    monkeypatch.setattr(ray_health, "_TERMINATED", [True])
    with pytest.raises(PeerError) as lost:
        rl.push_or_lost(run)
    assert str(lost.value) == str(broke) and ray_health.lost_to_sigterm(lost.value)
    monkeypatch.setattr(ray_health, "_TERMINATED", [])  # another rank, its SIGTERM not handled yet
    assert ray_health.lost_to_sigterm(pickle.loads(pickle.dumps(lost.value)))


# megadare rl whose rank 0 gets SIGTERM at step 1 (the second) and whose rollout then breaks with Ray's own raw
# error, as an engine actor ended by the job's signal does (the local Ray itself lives on here: a cheap run)
RAW_RAY_ERROR_HOOK = (
    r"""
import os, signal, sys
from megadare.trainer import rl_rollout

real = rl_rollout.Rollouts.collect


def collect(self, step):
    if step == 1:
        from ray.exceptions import ActorDiedError

        os.kill(os.getpid(), signal.SIGTERM)
        raise ActorDiedError()
    return real(self, step)


rl_rollout.Rollouts.collect = collect

"""
    + _RUN_MEGADARE
)


@pytest.mark.timeout(200)
def test_a_raw_ray_error_after_a_sigterm_stops_the_run_with_its_checkpoint(tmp_path):
    """A rollout broken with Ray's raw ``ActorDiedError`` after the run got SIGTERM ended it with a traceback, the
    step's checkpoint unsaved; the run now stops on the signal as on SIGINT: 'stopped by signal at step 1', exit 0,
    that step's checkpoint saved."""
    hook = tmp_path / "hook.py"
    hook.write_text(RAW_RAY_ERROR_HOOK)
    run = tmp_path / "rl"
    proc = subprocess.run([sys.executable, str(hook), *_rl_argv(run, 4)], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rl stopped by signal at step 1;" in proc.stdout, (proc.stdout, proc.stderr[-3000:])
    with open(run / "ckpt" / "latest_checkpointed_iteration.txt") as f:
        assert int(f.read()) == 1


def _ray_or_transport_errors() -> list:
    """What a call through Ray or a weight group raises, raw, once the job's SIGTERM took the engines down: gloo's
    words for a peer gone, Ray's errors for a dead actor, its own processes gone, a get that timed out."""
    from ray import exceptions as rx

    return [
        RuntimeError(
            "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error [127.0.0.1]:41234: Connection reset by peer"
        ),
        rx.RayActorError(),
        rx.ActorDiedError(),
        rx.RaySystemError("the raylet died"),
        rx.GetTimeoutError("Get timed out: some object(s) not ready."),
    ]


def _engines_raising(error: BaseException):
    """A run whose every call through Ray raises ``error``: the weight push, the rollout, the evaluation."""
    from types import SimpleNamespace

    def raises(*a):
        raise error

    return SimpleNamespace(
        step=2,
        ray_lost=False,
        snapshots=None,
        manager=None,
        weight_sync=None,
        policy=SimpleNamespace(push=raises),
        rollouts=SimpleNamespace(collect=raises, evaluate=raises),
    )


@pytest.mark.parametrize("error", _ray_or_transport_errors(), ids=lambda e: type(e).__name__)
def test_a_ray_or_transport_error_after_a_sigterm_stops_and_saves_and_without_one_is_one_line(monkeypatch, error):
    """After the job's SIGTERM, a weight push, a rollout or an evaluation that broke with gloo's raw RuntimeError (a
    peer gone) or one of Ray's own errors (not megadare's PeerError) ended the run with a traceback, exit 2, the
    checkpoint unsaved: only a PeerError counted as Ray lost to the signal. Each now counts (the run stops on the
    signal and saves: ``unless_ray_lost`` says None), decided where it was raised. Without a SIGTERM it is the run's
    error, one line naming what failed, not a traceback; a bug (no peer gone) is raised as it is either way."""
    from megadare.errors import PeerError
    from megadare.rollout import ray_health
    from megadare.trainer import rl

    steps = {"push": lambda r: rl.push_weights(r, queued=False), "rollout": rl.generate, "evaluation": rl.evaluate_at}
    monkeypatch.setattr(ray_health, "_TERMINATED", [True])
    for what, step in steps.items():
        run = _engines_raising(error)
        assert rl.unless_ray_lost(run, step) is None and run.ray_lost, what
    monkeypatch.setattr(ray_health, "_TERMINATED", [])
    for what, step in steps.items():
        with pytest.raises(PeerError) as plain:
            rl.unless_ray_lost(_engines_raising(error), step)
        assert "\n" not in str(plain.value) and type(error).__name__ in str(plain.value), what
        assert not ray_health.lost_to_sigterm(plain.value), what
    monkeypatch.setattr(ray_health, "_TERMINATED", [True])  # a bug (a bad shape) is no peer gone: raised as it is
    bug = RuntimeError("The size of tensor a (4) must match the size of tensor b (8) at non-singleton dimension 0")
    for what, step in steps.items():
        with pytest.raises(RuntimeError) as raised:
            rl.unless_ray_lost(_engines_raising(bug), step)
        assert raised.value is bug, what


def test_a_checkpoint_after_a_sigterm_lands_when_its_queued_rollouts_can_no_longer_finish(monkeypatch, tmp_path):
    """Ray going down with the job after the step's push went through (the SIGTERM came after it): the checkpoint
    finished the queued rollouts through Ray first, which raised (a Ray error, raw), so the checkpoint the signal
    asked for never landed (on rank 0 alone: the others waited in its save). It now keeps the rollouts already
    finished (a resumed run starts the others again) and lands; without a SIGTERM the error is one line."""
    from types import SimpleNamespace

    from ray.exceptions import ActorDiedError

    from megadare.config import load_config
    from megadare.errors import PeerError
    from megadare.rollout import ray_health
    from megadare.trainer import rl_setup

    class Queue:  # one rollout finished, one still on an engine that died with the job
        def drain(self, finish: bool = True):
            if finish:
                raise ActorDiedError()
            return {2: ([0, 1], ["finished"])}

    saved = []
    cfg = load_config(os.path.join(ROOT, "megadare", "configs", "demo_rl.yaml"), [])
    run = SimpleNamespace(
        cfg=cfg,
        step=2,
        rank0=True,
        ray_lost=False,
        evals={},
        buffer=None,
        snapshots=None,
        save_root=str(tmp_path / "ckpt"),
        algo=SimpleNamespace(name=cfg.algo.name),
        spec=SimpleNamespace(
            source=SimpleNamespace(family=SimpleNamespace(name="sdar"), hf_dir=None),
            arch=SimpleNamespace(architecture="SDARForCausalLM"),
        ),
        rollouts=SimpleNamespace(queue=Queue(), sampler=SimpleNamespace(settings=lambda: {})),
        policy=SimpleNamespace(save=lambda root, step, state, *a: saved.append(state)),
    )
    monkeypatch.setattr(ray_health, "_TERMINATED", [True])
    rl_setup.save_run(run)
    assert saved[0].objects["rl_async"]["queue"] == {2: ([0, 1], ["finished"])}
    monkeypatch.setattr(ray_health, "_TERMINATED", [])
    with pytest.raises(PeerError, match="finishing the queued rollouts for the checkpoint failed: ActorDiedError"):
        rl_setup.save_run(run)
