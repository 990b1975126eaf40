"""parallel/launch.py: a rank that dies without a word (SIGKILL, the OOM killer) ends the launch at once, naming it,
whether the other ranks wait for it in a collective or work on."""

from __future__ import annotations

import os
import signal
import time

import pytest

from megadare.errors import PeerError
from megadare.parallel import launch


def _rank1_killed(rank: int, world: int, survivor: str) -> int:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    dist.barrier()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    if survivor == "collective":
        dist.barrier()  # gloo: 'Connection reset by peer' here, which names the survivor
    else:
        time.sleep(600)  # a long rollout on rank 0: nothing tells it its peer is gone
    return rank


@pytest.mark.parametrize("survivor", ["collective", "busy"])
def test_a_killed_rank_ends_the_launch_naming_it(survivor):
    with pytest.raises(PeerError) as err:
        launch.spawn(_rank1_killed, 2, survivor, timeout_s=120)
    msg = str(err.value)
    assert msg.startswith("trainer rank 1 (pid ") and "\n" not in msg, msg
    assert "was killed by SIGKILL" in msg and "resume from its last checkpoint" in msg


def _rank0_slow(rank: int, world: int) -> int:
    from datetime import timedelta

    import torch.distributed as dist

    from megadare.parallel.rank0 import run_on_rank0

    dist.init_process_group("gloo", timeout=timedelta(seconds=2))  # parallel.collective_timeout_s=2
    return run_on_rank0(lambda: time.sleep(8) or 1)  # a rollout slower than the timeout


def test_a_rank_waiting_past_the_collective_timeout_says_what_it_waited_for():
    """The other ranks wait in a collective for rank 0's rollout: past parallel.collective_timeout_s that is one
    line naming the waiting rank, rank 0 and the key (not gloo's 'Timed out waiting 2000ms for recv')."""
    with pytest.raises(PeerError) as err:
        launch.spawn(_rank0_slow, 2, timeout_s=120)
    msg = str(err.value)
    assert msg.startswith("trainer rank 1 waited for rank 0 (its rollout or scoring) longer than ") and "\n" not in msg
    assert "parallel.collective_timeout_s" in msg and "resume from its last checkpoint" in msg


def test_under_torchrun_a_killed_rank_ends_the_run_and_the_survivor_says_so_in_one_line(tmp_path):
    """torchrun (the Slurm path): rank 1 SIGKILLed while rank 0 waits in a collective. The run ends (torchrun ends
    the survivors), its report names rank 1 and SIGKILL, and rank 0 says what happened in one line instead of
    gloo's traceback ('Connection reset by peer ... Check the logs of the ...')."""
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(__file__), "torchrun_peer.py")
    env = dict(os.environ, TMPDIR=str(tmp_path))  # torchrun's own /tmp/torchelastic_* log folders go here
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--monitor-interval",
            "0.5",
            script,
            "5",
        ],
        capture_output=True,
        text=True,
        timeout=300,  # a hang fails here, the collective timeout is 5 s
        env=env,
    )
    assert out.returncode != 0
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("megadare: error: ")]
    assert len(lines) == 1, out.stderr[-3000:]
    assert lines[0].startswith("megadare: error: trainer rank 1 died (SIGKILL, "), lines[0]  # the dead one, not 0
    assert ": trainer rank 0 (pid " in lines[0] and " lost it in a collective (" in lines[0], lines[0]
    assert "by peer" in lines[0], lines[0]
    assert "torchrun's report ('Root Cause') says why" in lines[0] and "resume from its last checkpoint" in lines[0]
    assert "[rank0]: Traceback" not in out.stderr
    root = out.stderr[out.stderr.index("Root Cause") :]
    assert "rank      : 1 (local_rank: 1)" in root and "SIGKILL" in root, root


def test_a_lost_rank_in_a_larger_world_is_named_as_a_peer_of_the_survivor(monkeypatch):
    """Gloo's error names no rank: with more than two ranks the line cannot say which died, and says so."""

    def lost():
        raise RuntimeError("[gloo/transport/tcp/pair.cc:534] Read error [10.0.0.2]:4021: Connection reset by peer")

    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(PeerError) as err:
        launch.run_here(lost)
    msg = str(err.value)
    assert msg.startswith("a peer of trainer rank 2 (pid ") and " died (SIGKILL, " in msg, msg
    assert "that rank was lost in a collective (Read error [10.0.0.2]:4021: Connection reset by peer)" in msg, msg


def test_a_peer_whose_socket_closed_before_it_showed_dead_is_still_named(monkeypatch):
    """World 3 under torchrun on a loaded host: rank 2 SIGKILLed, and rank 0 said 'a peer of trainer rank 0 died'.
    The kernel closes a killed process's sockets before it shows as dead (a zombie): the survivor read 'Connection
    reset by peer' and looked in between, finding every peer running (the world-of-three test above
    named no one 2 runs in 8 with four busy loops on two cores). Here the peer still runs when the survivor
    looks and dies 0.2 s later: it is named."""
    import socket
    import subprocess
    import sys
    import threading

    from megadare.parallel import peers

    peer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    threading.Timer(0.2, peer.kill).start()  # Popen's wait (below) reaps it meanwhile: gone, then
    threading.Timer(0.25, peer.wait).start()
    host = socket.gethostname()
    monkeypatch.setattr(peers, "_PEERS", {0: (os.getpid(), host), 1: (1, "another-host"), 2: (peer.pid, host)})
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    try:
        msg = launch.lost_rank("Connection reset by peer")
    finally:
        peer.kill()
        peer.wait()
    assert msg.startswith("trainer rank 2 died (SIGKILL, ") and ": trainer rank 0 (pid " in msg, msg


def test_a_peer_in_its_exit_counts_as_dead_though_it_shows_running(tmp_path):
    """The killed peer of the world of three, looked at between its sockets' close and its zombie state, shows
    'running' (4 kills in 60 with two busy loops on two cores, each time with PF_EXITING set): its /proc flags say
    it is in its exit. Read past a name holding ') ' (a process may call itself anything)."""
    from megadare.parallel import peers

    fields = "R 1 2 3 0 -1 {flags} 0 0 0 0 1 2 0 0 20 0 1 0 5 6 7"
    for pid, flags in ((11, 0x404044), (12, 0x404040)):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_text(f"{pid} (a) b) R (c) " + fields.format(flags=flags))
    assert peers.exiting(11, proc=str(tmp_path)) and not peers.exiting(12, proc=str(tmp_path))
    assert not peers.exiting(os.getpid()) and not peers.exiting(13, proc=str(tmp_path))


def test_an_engine_lost_mid_push_is_not_taken_for_a_lost_trainer_rank(monkeypatch):
    """A weight push whose engine died says so itself (a PeerError whose cause is gloo's 'Connection reset by
    peer'); before, run_here took it for a lost trainer rank and replaced the line."""
    push = PeerError("the weight push of version 3 broke: rollout engine 1 on h left (Connection reset by peer); x")

    def broke():
        raise push

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(PeerError) as err:
        launch.run_here(broke)
    assert err.value is push


def test_under_torchrun_a_killed_rank_in_a_world_of_three_is_named(tmp_path):
    """World 3, rank 2 SIGKILLed while ranks 0 and 1 wait for it in a collective: gloo's 'Connection reset by peer'
    names no rank, and each survivor said only 'a peer of trainer rank 0 (...) died'. The ranks' pids are gathered
    at start-up, so a survivor names the dead rank on its host."""
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(__file__), "torchrun_peer.py")
    env = dict(os.environ, TMPDIR=str(tmp_path))
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", "--monitor-interval", "0.5"]
    out = subprocess.run([*argv, script, "5", "2"], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode != 0
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("megadare: error: ")]
    assert lines, out.stderr[-3000:]
    for line in lines:  # each survivor that had its say before torchrun ended it
        assert line.startswith("megadare: error: trainer rank 2 died (SIGKILL, "), line
        assert " lost it in a collective (" in line and "resume from its last checkpoint" in line, line


def _rank_stopped(rank: int, world: int) -> int:
    """Rank 1 stops (SIGSTOP: Ctrl-Z, a debugger) in a train step while the others wait for it in a collective of
    one of megatron's groups (its data-parallel group: the gradients' all-reduce)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megadare.parallel import init_distributed

    init_distributed(timeout_s=3)  # parallel.collective_timeout_s=3
    dist.barrier()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    dist.all_reduce(torch.ones(1), group=parallel_state.get_data_parallel_group())
    return rank


def test_a_stopped_rank_ends_the_launch_after_the_collective_timeout_naming_it():
    """A rank stopped (SIGSTOP) in a world of three: megatron's groups waited their own 30 minutes whatever
    parallel.collective_timeout_s said, then gloo's traceback ('Timed out waiting ...ms for recv'). Now the run ends
    after parallel.collective_timeout_s in one line naming the stopped rank (and the stopped process is killed)."""
    with pytest.raises(PeerError) as err:
        launch.spawn(_rank_stopped, 3, timeout_s=120)  # the launch's own timeout: 'timed out ... waiting for ranks'
    msg = str(err.value)
    assert msg.startswith("trainer rank 1 (pid ") and " is stopped (SIGSTOP, " in msg and "\n" not in msg, msg
    assert "waited for it in a collective longer than parallel.collective_timeout_s" in msg, msg
    assert "resume from its last checkpoint" in msg, msg


# a rank's child as Ray's raylet is: it dies with the rank (PR_SET_PDEATHSIG), its own child (an agent) lives on
RAYLET_LIKE = r"""
import ctypes, signal, subprocess, sys, time
ctypes.CDLL(None).prctl(1, int(signal.SIGKILL), 0, 0, 0)
agent = subprocess.Popen(["sleep", "600"])
open(sys.argv[1], "w").write(str(agent.pid))
time.sleep(600)
"""


def _rank_killed_with_a_raylet(rank: int, world: int, pid_file: str) -> int:
    import subprocess
    import sys

    subprocess.Popen([sys.executable, "-c", RAYLET_LIKE, pid_file])
    while not os.path.exists(pid_file) or not open(pid_file).read():
        time.sleep(0.1)
    os.kill(os.getpid(), signal.SIGKILL)
    return rank


def test_what_a_killed_rank_leaves_behind_is_ended(tmp_path):
    """Rank 0 of `megadare rl --nproc 2` SIGKILLed (the OOM killer): its local Ray's raylet and GCS died with it,
    but Ray's dashboard and runtime-env agents (the raylet's children) lived on under init, waiting for the GCS
    forever. The launch adopts such orphans and ends them."""
    import psutil

    pid_file = str(tmp_path / "agent.pid")
    with pytest.raises(PeerError):
        launch.spawn(_rank_killed_with_a_raylet, 1, pid_file, timeout_s=120)
    agent = int(open(pid_file).read())
    try:
        with open(f"/proc/{agent}/stat") as f:  # raises when it is gone (reaped)
            pytest.fail(f"the agent is left: {f.read()}")
    except FileNotFoundError:
        pass
    finally:
        if psutil.pid_exists(agent):
            psutil.Process(agent).kill()


def _rank_killed_holding_a_semaphore(rank: int, world: int) -> int:
    import multiprocessing

    lock = multiprocessing.get_context("spawn").Lock()  # registered with the launcher's resource tracker
    os.kill(os.getpid(), signal.SIGKILL)
    return rank if lock else rank


class _AsTerminal:
    """A stream that says it is a terminal (``isatty``); everything else is the stream's."""

    def __init__(self, stream):
        self._stream = stream

    def isatty(self) -> bool:
        return True

    def __getattr__(self, name):
        return getattr(self._stream, name)


def _rank_killed_mid_bar(rank: int, world: int) -> int:
    """Rank 0 killed while its progress bar's line is open (a ``\\r``-redrawn line, never ended: a terminal's bar;
    in a pipe the bar prints ended lines)."""
    import sys
    import tempfile
    from types import SimpleNamespace

    from megadare.trainer.monitor import Monitor

    sys.stderr = _AsTerminal(sys.stderr)
    logging = SimpleNamespace(run_dir=tempfile.mkdtemp(), jsonl=False, tensorboard=False, log_interval=1)
    monitor = Monitor(logging, total_steps=2)
    monitor.log(1, {"loss": 1.0, "eval/accuracy": 0.0})
    monitor.bar.refresh()
    os.kill(os.getpid(), signal.SIGKILL)
    return rank


KILLED_RANK_CLI = r"""
import sys
sys.path.insert(0, sys.argv[1])
import test_launch_peers
from megadare.cli import report_error
from megadare.errors import PeerError
from megadare.parallel import launch
try:
    launch.spawn(getattr(test_launch_peers, sys.argv[2]), 1, timeout_s=120)
except PeerError as e:
    report_error(e)
    sys.exit(2)
"""


def test_the_error_line_of_a_killed_rank_is_the_runs_last_word():
    """A rank SIGKILLed holding a semaphore (a multiprocessing lock of Ray's or torch's): after the run's one-line
    error, multiprocessing's resource tracker said 'UserWarning: resource_tracker: There appear to be 1 leaked
    semaphore objects to clean up at shutdown' (and its source line) as the process ended. It cleans them up
    all the same; the warning is left out, so the error stays the last line."""
    import subprocess
    import sys

    tests = os.path.dirname(os.path.abspath(__file__))
    run = [sys.executable, "-c", KILLED_RANK_CLI, tests, "_rank_killed_holding_a_semaphore"]
    out = subprocess.run(run, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("megadare: error: trainer rank 0 (pid ") and "was killed by SIGKILL" in last, out.stderr


def test_the_error_of_a_rank_killed_mid_progress_bar_starts_its_own_line():
    """``--nproc``: rank 0 killed with its progress bar's line open (``\\r``-redrawn, not ended). The launcher's
    error was glued onto it (``...eval/accuracy=0]megadare: error: ...``); now it starts a line of its own, and
    the bar's line is kept above it."""
    import subprocess
    import sys

    tests = os.path.dirname(os.path.abspath(__file__))
    run = [sys.executable, "-c", KILLED_RANK_CLI, tests, "_rank_killed_mid_bar"]
    out = subprocess.run(run, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.rstrip("\n").split("\n")  # lines as a terminal or a log ends them (a bar's \r does not)
    assert lines[-1].startswith("megadare: error: trainer rank 0 (pid "), out.stderr
    assert "was killed by SIGKILL" in lines[-1], out.stderr
    assert lines[-2].endswith("eval/accuracy=0]"), out.stderr


def _rank_with_a_double_forked_helper(rank: int, world: int) -> str:
    """A helper process started by double fork (its parent gone at once) that ends a moment later: the launch,
    which adopts orphans, must reap it while the ranks run on, not keep it as a zombie till the end."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", "import subprocess; print(subprocess.Popen(['sleep', '0.5']).pid)"],
        capture_output=True,
        text=True,
    )
    helper = int(out.stdout)
    time.sleep(4)  # the helper ended 3.5 s ago; the launch reaps each second
    try:
        with open(f"/proc/{helper}/stat") as f:
            return f.read().split(")")[-1].split()[0]  # 'Z': a zombie
    except FileNotFoundError:
        return "gone"


def test_an_adopted_process_that_ends_is_reaped_during_the_launch():
    assert launch.spawn(_rank_with_a_double_forked_helper, 1, timeout_s=120) == ["gone"]
