"""Nothing lost: checkpoints carry a manifest and resume passes over damaged ones, saying which and why; resume says
where it starts, applies a changed schedule explicitly, refuses another model, rolls metrics back; a finished run
says so; one run per run directory; a full disk leaves no partial checkpoint; megatron's writer processes die
with the trainer (issue 24, items 3, 5, 7, 8).

A tiny SFT run (``megadare sft``, one process, 4 steps, checkpoints at 2 and 4) is trained once per module; each
test works on a copy of its run directory."""

from __future__ import annotations

import json
import math
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import psutil
import pytest

from megadare.trainer.checkpoint import describe_schedule

LOCK_FILE = "megadare.lock"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "examples", "configs", "sft_sdar_tiny.yaml")
TINY = [
    "data.synthetic_size=64",
    "train.global_batch_size=4",
    "train.warmup_steps=1",
    "checkpoint.save_interval=2",
    "checkpoint.keep_last=3",
    "logging.tensorboard=false",
]
# the trainer with megatron's writer processes patched: they block mid-write (BLOCK_WRITERS: each first names
# itself in that directory), or every write of a checkpoint file fails with ENOSPC (FULL_DISK)
RUNNER = r"""
import errno, os, sys, time
import builtins
from megatron.core.dist_checkpointing.strategies import filesystem_async as fa

def blocking_writer(*args, **kwargs):
    open(os.path.join(os.environ["BLOCK_WRITERS"], str(os.getpid())), "w").close()
    time.sleep(300)

def full_disk(path, mode="r", *args, **kwargs):
    if "w" in mode:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
    return builtins.open(path, mode, *args, **kwargs)

if os.environ.get("BLOCK_WRITERS"):
    fa.FileSystemWriterAsync.write_preloaded_data = staticmethod(blocking_writer)
if os.environ.get("FULL_DISK"):
    fa.open = full_disk
from megadare.cli import main
sys.exit(main(sys.argv[1:]))
"""


def megadare(run_dir, *overrides, env=None, timeout=300, file_limit=None) -> subprocess.CompletedProcess:
    """``megadare sft`` on the tiny config in ``run_dir`` (through RUNNER, so env can patch the writers);
    ``file_limit``: the most bytes the process may write to one file (RLIMIT_FSIZE: the kernel refuses the rest)."""

    limit = (lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (file_limit, file_limit))) if file_limit else None
    return subprocess.run(
        [sys.executable, "-c", RUNNER, "sft", "--config", CONFIG, *TINY, f"logging.run_dir={run_dir}", *overrides],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=dict(os.environ, **(env or {})),
        preexec_fn=limit,
    )


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    run = tmp_path_factory.mktemp("trained") / "run"
    r = megadare(run, "train.steps=4")
    assert r.returncode == 0, r.stderr
    return run


@pytest.fixture
def run(trained, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(trained, dst)
    return dst


def steps_logged(run) -> list[int]:
    return [json.loads(line)["step"] for line in open(run / "metrics.jsonl")]


def one_error_line(stderr: str) -> str:
    """The one ``megadare: error:`` line of a refused command (and no traceback)."""
    assert "Traceback" not in stderr, stderr
    lines = [ln for ln in stderr.splitlines() if ln.startswith("megadare: error:")]
    assert len(lines) == 1, stderr
    return lines[0]


def test_every_checkpoint_has_a_manifest_that_finds_damage(run):
    from megadare.convert.manifest import check_checkpoint
    from megadare.convert.mcore_ckpt import MegatronCheckpointError, intact_checkpoint_dir, newest_intact

    ckpt = run / "ckpt"
    for it in ("iter_0000002", "iter_0000004"):
        assert json.load(open(ckpt / it / "manifest.json"))["files"]["train_state.json"]["sha256"]
        assert check_checkpoint(str(ckpt / it)).intact
    shard = ckpt / "iter_0000004" / "__0_0.distcp"
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(100)
    v = check_checkpoint(str(ckpt / "iter_0000004"))
    assert not v.intact and v.problem == f"{shard} has 100 bytes, the manifest says {size}"
    pick = newest_intact(str(ckpt))
    assert pick.path == str(ckpt / "iter_0000002") and pick.skipped == [(str(ckpt / "iter_0000004"), v.problem)]
    with pytest.raises(
        MegatronCheckpointError,
        match=f"{ckpt}/iter_0000004 is damaged: .*; {ckpt}/iter_0000002 is intact: pass it explicitly",
    ):
        intact_checkpoint_dir(str(ckpt))
    # a flipped byte in a small file, a missing file
    state = ckpt / "iter_0000002" / "train_state.json"
    state.write_text(state.read_text().replace('"step": 2', '"step": 3'))
    assert "does not match its checksum" in check_checkpoint(str(ckpt / "iter_0000002")).problem
    os.remove(ckpt / "iter_0000002" / "rng" / "rank_00000.pt")
    assert check_checkpoint(str(ckpt / "iter_0000002")).problem.endswith("rank_00000.pt is missing")


def test_a_checkpoint_without_manifest_is_checked_against_its_metadata(run):
    """Checkpoints of older megadare versions still load (said once), and a truncated shard is still found."""
    from megadare.convert.manifest import check_checkpoint

    it = run / "ckpt" / "iter_0000004"
    os.remove(it / "manifest.json")
    v = check_checkpoint(str(it))
    assert v.intact and v.legacy
    with open(it / "__0_1.distcp", "r+b") as f:
        f.truncate(1000)
    v = check_checkpoint(str(it))
    assert not v.intact and v.legacy and "__0_1.distcp has 1000 bytes, .metadata needs at least" in v.problem


def test_tracker_and_state_files_are_read_with_errors_naming_them(run):
    from megadare.convert.mcore_ckpt import MegatronCheckpointError, newest_intact, resolve_checkpoint_dir

    ckpt = run / "ckpt"
    (ckpt / "latest_checkpointed_iteration.txt").write_text("garbage\n")
    with pytest.raises(MegatronCheckpointError, match="latest_checkpointed_iteration.txt holds 'garbage', not a step"):
        resolve_checkpoint_dir(str(ckpt))
    pick = newest_intact(str(ckpt), required=("train_state.json",))
    assert pick.path == str(ckpt / "iter_0000004") and "holds 'garbage'" in pick.tracker_problem
    os.remove(ckpt / "iter_0000004" / "train_state.json")
    pick = newest_intact(str(ckpt), required=("train_state.json",))
    assert pick.path == str(ckpt / "iter_0000002")
    assert pick.skipped == [(str(ckpt / "iter_0000004"), f"{ckpt}/iter_0000004/train_state.json is missing")]


def test_resume_passes_over_a_damaged_checkpoint_and_rolls_metrics_back(run):
    """The newest checkpoint truncated: the run resumes from the one before (saying which and why), applies its
    own (longer) schedule explicitly, and metrics.jsonl holds each step once; the rolled-back records are kept
    aside."""
    with open(run / "ckpt" / "iter_0000004" / "__0_0.distcp", "r+b") as f:
        f.truncate(100)
    r = megadare(run, "train.steps=6")
    assert r.returncode == 0, r.stderr
    ckpt = run / "ckpt"
    assert (
        f"checkpoint: passing over {ckpt}/iter_0000004: {ckpt}/iter_0000004/__0_0.distcp has 100 bytes, the "
        "manifest says"
    ) in r.stderr
    assert (
        f"resumed from {ckpt}/iter_0000002 at step 2 (lr schedule: cosine, lr 0.003 -> 0, warmup 1, over 6 steps;"
        in r.stderr
    )
    assert "this run's settings replace the checkpoint's: decay steps 4 -> 6)" in r.stderr
    assert "FutureWarning" not in r.stderr  # megatron's deprecation note, filtered precisely
    assert steps_logged(run) == [1, 2, 3, 4, 5, 6]
    assert [json.loads(line)["step"] for line in open(run / "metrics.rolled_back.jsonl")] == [3, 4]
    assert sorted(os.listdir(ckpt)) == [
        "iter_0000002",
        "iter_0000004",
        "iter_0000004.damaged",  # moved aside when the run resumed before it, kept
        "iter_0000006",
        "latest_checkpointed_iteration.txt",
    ]


def test_rerunning_a_finished_run_says_so(run):
    r = megadare(run, "train.steps=4")
    assert r.returncode == 0, r.stderr
    assert f"resumed from {run}/ckpt/iter_0000004 at step 4" in r.stderr
    assert "sft: nothing to train: this run already finished at step 4" in r.stdout and "nan" not in r.stdout
    assert steps_logged(run) == [1, 2, 3, 4]


def test_a_changed_model_is_refused(run):
    r = megadare(run, "train.steps=6", "model.tiny_config={hidden_size: 32}")
    assert r.returncode == 2
    assert "init_hf holds the tiny model an earlier run in this directory trained" in one_error_line(r.stderr)
    assert "hidden_size 64 vs 32" in r.stderr
    assert steps_logged(run) == [1, 2, 3, 4]
    # (checkpoint.load of another family: tests/test_preflight.py; the same check runs when the run loads it)


def test_resume_refuses_another_commands_or_another_source_checkpoint(run):
    from megadare.errors import RunStateError
    from megadare.trainer.checkpoint import resume_run

    ckpt = str(run / "ckpt")
    with pytest.raises(
        RunStateError,
        match=f"was written by megadare sft, this is megadare rl: start from it with checkpoint.load={ckpt}",
    ):
        resume_run(ckpt, None, None, "megadare rl")
    with pytest.raises(RunStateError, match="was trained from .*init_hf, this config names model.hf_path=/elsewhere"):
        resume_run(ckpt, None, None, "megadare sft", source="/elsewhere")


def test_resume_refuses_another_rl_algorithm(run, tmp_path):
    """An RL run resumed under another algo.name would go on from the old objective's optimiser state and replay
    (and overwrite the run's config.yaml): refused before anything is loaded or written."""
    from megadare.errors import RunStateError
    from megadare.convert.manifest import write_manifest
    from megadare.trainer.checkpoint import MEGADARE_META, resume_run

    ckpt = tmp_path / "ckpt"
    shutil.copytree(run / "ckpt", ckpt)
    for meta_file in ckpt.glob(f"iter_*/{MEGADARE_META}"):  # as an RL run of tracerl wrote it
        meta = json.loads(meta_file.read_text())
        meta.update(written_by="megadare rl", algo="tracerl")
        meta_file.write_text(json.dumps(meta))
        write_manifest(str(meta_file.parent))
    with pytest.raises(
        RunStateError, match=r"trains tracerl, this config names algo.name=d1: .* set algo.name=tracerl"
    ):
        resume_run(str(ckpt), None, None, "megadare rl", algo="d1")


def test_one_run_per_run_directory(run):
    from megadare.trainer.run_lock import LOCK, acquire, holder_alive, release

    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lock = {
            "pid": holder.pid,
            "host": socket.gethostname(),
            "started": psutil.Process(holder.pid).create_time(),
            "slurm_job": None,
            "time": "earlier",
        }
        (run / LOCK).write_text(json.dumps(lock))
        r = megadare(run, "train.steps=6")
        assert r.returncode == 2
        assert (
            f"{run} is in use by pid {holder.pid} on {socket.gethostname()} (since earlier; {run}/{LOCK})"
            in one_error_line(r.stderr)
        )
        assert steps_logged(run) == [1, 2, 3, 4] and "iter_0000006" not in os.listdir(run / "ckpt")
        assert holder_alive(str(run))
    finally:
        holder.kill()
        holder.wait()
    assert holder_alive(str(run)) is None  # a dead pid on this host: stale
    assert (
        acquire(str(run)) == f"{run}/{LOCK}: took over the lock of pid {holder.pid} on {socket.gethostname()}: "
        f"pid {holder.pid} is no longer running"
    )
    assert json.loads((run / LOCK).read_text())["pid"] == os.getpid()
    release(str(run))
    assert not (run / LOCK).exists()
    # another host cannot be checked: refused; the same Slurm job (a requeue) takes it over
    (run / LOCK).write_text(json.dumps(dict(lock, host="elsewhere", slurm_job="77")))
    assert "is in use by pid" in holder_alive(str(run))
    os.environ["SLURM_JOB_ID"] = "77"
    try:
        assert "it belongs to this Slurm job 77 (requeued)" in acquire(str(run))
    finally:
        del os.environ["SLURM_JOB_ID"]
        release(str(run))


def test_a_full_disk_leaves_no_partial_checkpoint(run):
    """Every write of the step-6 checkpoint fails with ENOSPC: one line naming the error and the intact checkpoint,
    no iter_0000006.tmp; a rerun resumes from step 4 (a real full tmpfs gives the same line: see the issue note)."""
    r = megadare(run, "train.steps=6", env={"FULL_DISK": "1"})
    assert r.returncode == 2
    line = one_error_line(r.stderr)
    assert f"saving {run}/ckpt/iter_0000006 failed: No space left on device ({run}/ckpt/iter_0000006.tmp/" in line
    assert f"the partial iter_0000006.tmp was removed and {run}/ckpt/iter_0000004 is intact" in line
    assert sorted(os.listdir(run / "ckpt")) == ["iter_0000002", "iter_0000004", "latest_checkpointed_iteration.txt"]
    from megadare.convert.mcore_ckpt import newest_intact

    assert newest_intact(str(run / "ckpt")).path == str(run / "ckpt" / "iter_0000004")  # what a rerun resumes


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait(pred, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.1)
    return pred()


def test_checkpoint_writers_die_with_the_trainer(tmp_path):
    """SIGKILL of the trainer during a save: megatron's writer processes (and anything else it started: on the old
    code a multiprocessing Manager and the resource tracker) are gone within seconds; SIGTERM ends a writer."""
    writers = tmp_path / "writers"
    writers.mkdir()
    log = open(tmp_path / "trainer.log", "w")
    trainer = subprocess.Popen(
        [
            sys.executable,
            "-c",
            RUNNER,
            "sft",
            "--config",
            CONFIG,
            *TINY,
            "train.steps=2",
            f"logging.run_dir={tmp_path / 'run'}",
        ],
        cwd=ROOT,
        stdout=log,
        stderr=log,
        env=dict(os.environ, BLOCK_WRITERS=str(writers)),
    )
    family: list[int] = []
    try:
        assert _wait(lambda: len(os.listdir(writers)) >= 2 or trainer.poll() is not None, 240), "no save started"
        assert trainer.poll() is None, open(tmp_path / "trainer.log").read()
        family += [p.pid for p in psutil.Process(trainer.pid).children(recursive=True)]
        forked = sorted(int(w) for w in os.listdir(writers))
        assert set(forked) <= set(family)
        os.kill(forked[0], signal.SIGTERM)
        assert _wait(lambda: _gone(forked[0]), 5), "SIGTERM did not end the writer"
        trainer.kill()
        trainer.wait()
        assert _wait(lambda: all(_gone(p) for p in family), 10), [
            psutil.Process(p).cmdline() for p in family if not _gone(p)
        ]
    finally:  # never leave a process behind, even when the test fails
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
        for pid in family:
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)
        log.close()


# ---------------------------------------------------------------- second red team (holes the first round missed)
def test_two_runs_sharing_one_checkpoint_root_are_refused(run, tmp_path):
    """The lock covers checkpoint.save too: a second run with its own logging.run_dir but the first run's
    checkpoint root would prune and replace the first run's checkpoints."""
    from megadare.trainer.run_lock import LOCK

    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lock = {"pid": holder.pid, "host": socket.gethostname(), "started": psutil.Process(holder.pid).create_time()}
        (run / "ckpt" / LOCK).write_text(json.dumps(dict(lock, time="earlier")))
        other = tmp_path / "other"
        r = megadare(other, "train.steps=6", f"checkpoint.save={run / 'ckpt'}")
        assert r.returncode == 2, r.stderr
        assert f"{run / 'ckpt'} is in use by pid {holder.pid}" in one_error_line(r.stderr)
        assert "iter_0000006" not in os.listdir(run / "ckpt")
    finally:
        holder.kill()
        holder.wait()


def test_rotation_never_deletes_the_intact_checkpoint_behind_a_damaged_newer_one(run):
    """iter_4 is damaged, the run resumes from iter_2 and saves iter_3 with keep_last=2: rotation used to keep
    iter_3 and the damaged iter_4 and delete iter_2, leaving one intact checkpoint; the damaged one of the
    rolled-back steps is now moved aside (never deleted) when the run resumes before it."""
    ckpt = run / "ckpt"
    shard = next(p for p in (ckpt / "iter_0000004").iterdir() if p.suffix == ".distcp")
    shard.write_bytes(shard.read_bytes()[:-8])
    r = megadare(run, "train.steps=3", "checkpoint.save_interval=1", "checkpoint.keep_last=2")
    assert r.returncode == 0, r.stderr
    names = sorted(os.listdir(ckpt))
    assert "iter_0000002" in names and "iter_0000003" in names, names
    assert "iter_0000004" not in names and any(n.startswith("iter_0000004.damaged") for n in names), names
    assert "moved it aside" in r.stderr
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "3"


def test_a_full_disk_while_logging_metrics_is_one_line(run):
    """metrics.jsonl cannot grow (RLIMIT_FSIZE: the kernel refuses the write, EFBIG, as a full disk refuses it with
    ENOSPC): a raw OSError traceback from the middle of a step; now one line naming the file and what to do, and a
    rerun resumes from the intact checkpoint."""
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("\n".join(lines + lines[:1] * 16) + "\n")  # longer than config.yaml
    limit = os.path.getsize(run / "metrics.jsonl") + 5
    assert limit > os.path.getsize(run / "config.yaml")
    r = megadare(run, "train.steps=6", file_limit=limit)
    assert r.returncode == 2, r.stderr
    line = one_error_line(r.stderr)
    assert f"writing the metrics of step 5 to {run}/metrics.jsonl failed: File too large;" in line, line
    assert not (run / LOCK_FILE).exists()
    assert sorted(os.listdir(run / "ckpt"))[-2:] == ["iter_0000004", "latest_checkpointed_iteration.txt"]


def test_a_changed_data_order_is_refused_on_resume(run):
    """A resumed run takes the batch of step s from (seed, s, global batch size, number of examples): changing any
    of them moved the run to another place in another order, skipping and repeating examples, without a word."""
    for change, said in [
        ("train.global_batch_size=8", "train.global_batch_size 4 -> 8"),
        ("seed=7", "seed 1234 -> 7"),
        ("data.synthetic_size=80", "the number of examples (data files) 64 -> 80"),
    ]:
        r = megadare(run, "train.steps=6", change)
        assert r.returncode == 2, (change, r.stderr)
        line = one_error_line(r.stderr)
        assert f"{run}/ckpt/iter_0000004 was trained 4 steps in another data order ({said})" in line, line
    assert steps_logged(run) == [1, 2, 3, 4]
    # a checkpoint written before the order was saved: its consumed count still tells a changed batch size
    state_file = run / "ckpt" / "iter_0000004" / "train_state.json"
    state = json.loads(state_file.read_text())
    del state["data_order"]
    state_file.write_text(json.dumps(state))
    os.remove(run / "ckpt" / "iter_0000004" / "manifest.json")  # as an older megadare wrote it
    r = megadare(run, "train.steps=6", "train.global_batch_size=8")
    assert "(train.global_batch_size 4 -> 8)" in one_error_line(r.stderr)


def test_a_save_stopped_by_a_file_size_limit_says_so(run):
    """torch's zip writer reports a write the kernel refused (RLIMIT_FSIZE here, a full disk alike) as 'unexpected
    pos 704 vs 598', naming no cause; the line now names the limit (and a nearly full disk)."""
    limit = os.path.getsize(run / "config.yaml") + 200  # config.yaml and the metrics fit, a checkpoint does not
    r = megadare(run, "train.steps=6", file_limit=limit)
    line = one_error_line(r.stderr)
    assert f"saving {run}/ckpt/iter_0000006 failed: " in line, line
    assert f"(this process may write files of at most {limit} bytes (ulimit -f))" in line, line
    assert f"{run}/ckpt/iter_0000004 is intact" in line


def test_a_kill_between_the_policy_and_value_model_saves_resumes_from_a_step_with_both(run, tmp_path):
    """TraceRL's value model is saved under <root>_value after the policy's checkpoint: a SIGKILL between the two
    left a newest policy checkpoint without its value model, and every rerun picked it and died loading the value
    model ('does not exist: ... train one first'). A checkpoint now counts only with an intact value model beside
    it (and rotation waits for both saves, so an older step with both is still there)."""
    from megadare.convert.mcore_ckpt import newest_intact

    policy, value = run / "ckpt", tmp_path / "ckpt_value"
    shutil.copytree(policy, value)
    shutil.rmtree(value / "iter_0000004")  # the kill came before the value model's rename
    pick = newest_intact(str(policy), required=("train_state.json",), companions=(str(value),))
    assert pick.path == str(policy / "iter_0000002")
    assert pick.skipped == [
        (str(policy / "iter_0000004"), f"its companion checkpoint is not intact: {value}/iter_0000004 is missing")
    ]


def test_a_changed_layout_says_the_random_states_start_fresh(run):
    """A checkpoint of another layout loads resharded (model, optimiser), but each rank's random states belong to
    its place in the saved layout: they were left behind without a word. The resume line now says so."""
    state_file = run / "ckpt" / "iter_0000004" / "train_state.json"
    state = json.loads(state_file.read_text())
    state["world_size"], state["layout"] = 2, dict(state.get("layout", {}), tp=2)
    state_file.write_text(json.dumps(state))
    os.remove(run / "ckpt" / "iter_0000004" / "manifest.json")  # checked against .metadata, as an older one
    r = megadare(run, "train.steps=6")
    assert r.returncode == 0, r.stderr
    assert "random states not restored, the layout changed: world size 2 -> 1, tp 2 -> 1)" in r.stderr, r.stderr


def test_a_tracker_that_cannot_be_written_is_one_line_naming_the_saved_checkpoint(tmp_path):
    """The tracker is written after the checkpoint's rename: a failure there (a full disk on a 1-byte file, a
    path in the way) gave a raw OSError traceback though the checkpoint was in place. Now one line naming both."""
    from megadare.convert.mcore_ckpt import MegatronCheckpointError
    from megadare.trainer import checkpoint

    (tmp_path / (checkpoint.TRACKER + ".tmp")).mkdir()  # the temp file's path is taken: open() cannot write it
    with pytest.raises(MegatronCheckpointError) as e:
        checkpoint._write_tracker(str(tmp_path), 6)
    line = str(e.value)
    assert line.startswith(f"{tmp_path}/{checkpoint.TRACKER}: writing the tracker failed: Is a directory"), line
    assert f"{tmp_path}/iter_0000006 is saved and intact" in line and "\n" not in line


def _fake_checkpoint(d, step: int) -> None:
    """An intact-looking checkpoint directory (train state, meta, manifest), no tensors."""
    from megadare.convert.manifest import write_manifest

    d.mkdir(parents=True)
    (d / "train_state.json").write_text(json.dumps({"step": step}))
    (d / "megadare.json").write_text(json.dumps({"written_by": "megadare rl"}))
    write_manifest(str(d))


def test_a_value_checkpoint_of_rolled_back_steps_is_moved_aside(tmp_path, monkeypatch):
    """The policy's iter_8 was damaged (or moved aside, as the load error says to): the run resumed from step 6
    and left the value model's iter_8 in place. Rotation then counted it among the newest and deleted the value
    model's iter_6, and a kill between the policy's and the value model's saves of step 8 paired the new policy
    with the old timeline's value model. It is now moved aside when the run resumes before it."""
    from megadare.trainer import checkpoint
    from megadare.trainer import checkpoint_rotation

    policy, value = tmp_path / "ckpt", tmp_path / "ckpt_value"
    for step in (6, 8):
        _fake_checkpoint(value / f"iter_{step:07d}", step)
    _fake_checkpoint(policy / "iter_0000006", 6)
    monkeypatch.setattr(checkpoint, "load_train_checkpoint", lambda *a, **k: {"step": 6})

    class Trained:
        model, optimizer, scheduler = [], None, None

        def companion_roots(self, root):
            return (str(value),)

    state = checkpoint.resume_run(str(policy), Trained(), None, "megadare rl")
    assert state["step"] == 6
    assert sorted(os.listdir(value)) == ["iter_0000006", "iter_0000008.rolled-back"]
    checkpoint_rotation.prune_checkpoints(str(value), 2, 7)  # the step-7 save's rotation keeps both real ones
    assert (value / "iter_0000006").is_dir()
    # a fresh start (no policy checkpoint) sets aside every value checkpoint it finds
    shutil.rmtree(policy)
    assert checkpoint.resume_run(str(policy), Trained(), None, "megadare rl") == {}
    assert sorted(os.listdir(value)) == ["iter_0000006.rolled-back", "iter_0000008.rolled-back"]


def test_a_config_yaml_of_the_users_in_the_run_dir_is_not_replaced(run, tmp_path):
    """logging.run_dir holding the user's own config.yaml (the experiment's config kept beside its run): the run
    replaced it with its resolved config, comments and all gone. It is now refused in one line before training;
    a config.yaml a run wrote (with or without the header older runs lacked) is rewritten as before."""
    fresh = tmp_path / "mine"
    fresh.mkdir()
    (fresh / "config.yaml").write_text("# my experiment\ntrain:\n  steps: 2\n")
    r = megadare(fresh, "train.steps=2")
    assert r.returncode == 2, r.stderr
    line = one_error_line(r.stderr)
    assert f"{fresh}/config.yaml was not written by a megadare run;" in line, line
    assert (fresh / "config.yaml").read_text() == "# my experiment\ntrain:\n  steps: 2\n"
    assert sorted(os.listdir(fresh)) == ["config.yaml"]
    written = (run / "config.yaml").read_text()
    assert written.startswith("# the resolved config of this megadare run")
    (run / "config.yaml").write_text(written.split("\n", 1)[1])  # as a run of an older megadare wrote it
    r = megadare(run, "train.steps=5")
    assert r.returncode == 0, r.stderr
    assert (run / "config.yaml").read_text().startswith("# the resolved config of this megadare run")


def test_resume_with_other_lora_settings_is_refused_naming_them(run, tmp_path):
    """A full fine-tuning run resumed with lora.rank=4 died in megatron's load with a KeyError listing every key
    of the checkpoint, and said to move the checkpoint aside (every older one fails alike: moving them all aside
    restarts the run from step 0); a LoRA run resumed with another lora.alpha rescaled its adapters without a
    word. Both are now refused in one line naming the settings; the same settings resume."""
    r = megadare(run, "train.steps=6", "lora.rank=4")
    assert r.returncode == 2, r.stderr
    line = one_error_line(r.stderr)
    assert f"{run}/ckpt/iter_0000004 was trained with full fine-tuning (lora.rank=0), this config has LoRA " in line
    # a checkpoint of an older megadare, without the settings in its train state: told by its keys
    state_file = run / "ckpt" / "iter_0000004" / "train_state.json"
    state = json.loads(state_file.read_text())
    del state["lora"]
    state_file.write_text(json.dumps(state))
    os.remove(run / "ckpt" / "iter_0000004" / "manifest.json")
    r = megadare(run, "train.steps=6", "lora.rank=4")
    assert "was trained with full fine-tuning (lora.rank=0)" in one_error_line(r.stderr)
    assert steps_logged(run) == [1, 2, 3, 4]
    lora = tmp_path / "lora"
    assert megadare(lora, "train.steps=2", "lora.rank=4").returncode == 0
    r = megadare(lora, "train.steps=3", "lora.rank=4", "lora.alpha=8")
    assert "this config has LoRA (lora.rank=4, lora.alpha=8.0," in one_error_line(r.stderr)
    r = megadare(lora, "train.steps=3", "lora.rank=4")
    assert r.returncode == 0 and "resumed from" in r.stderr, r.stderr


def test_a_save_directory_that_cannot_be_written_is_refused_before_training(run, tmp_path):
    """checkpoint.save on a read-only filesystem (or under a file, as here, or without permission): the run lock's
    write raised an OSError traceback. Now one line naming the directory, before any step is trained."""
    (tmp_path / "a_file").write_text("mine")
    r = megadare(run, "train.steps=6", f"checkpoint.save={tmp_path}/a_file/ckpt")
    assert r.returncode == 2, r.stderr
    line = one_error_line(r.stderr)
    assert f"{tmp_path}/a_file/ckpt/megadare.lock: cannot take the run lock: Not a directory" in line, line
    assert (tmp_path / "a_file").read_text() == "mine" and not (run / LOCK_FILE).exists()
    assert steps_logged(run) == [1, 2, 3, 4]


def test_a_kill_during_rotation_leaves_no_half_deleted_checkpoint(tmp_path, monkeypatch):
    """Rotation deleted an old iter_* in place: a kill midway (here right after its manifest went)
    left a checkpoint under its iter_* name that, without a manifest, passed the older-checkpoint check (shards
    against .metadata) and would resume without its random states. It is now renamed out of the iter_* names
    before the delete; a rerun's rotation removes what a killed one left."""
    from megadare.trainer import checkpoint_rotation

    for step in (2, 4, 6):
        _fake_checkpoint(tmp_path / f"iter_{step:07d}", step)
    real = shutil.rmtree

    def killed_midway(path, ignore_errors=False):
        if os.path.exists(os.path.join(path, "manifest.json")):
            os.remove(os.path.join(path, "manifest.json"))
            raise KeyboardInterrupt  # the kill
        return real(path, ignore_errors=ignore_errors)

    monkeypatch.setattr(checkpoint_rotation.shutil, "rmtree", killed_midway)
    with pytest.raises(KeyboardInterrupt):
        checkpoint_rotation.prune_checkpoints(str(tmp_path), 2, 6)
    monkeypatch.setattr(checkpoint_rotation.shutil, "rmtree", real)
    assert sorted(os.listdir(tmp_path)) == ["iter_0000002.pruning", "iter_0000004", "iter_0000006"]
    _fake_checkpoint(tmp_path / "iter_0000008", 8)
    checkpoint_rotation.prune_checkpoints(str(tmp_path), 2, 8)
    assert sorted(os.listdir(tmp_path)) == ["iter_0000006", "iter_0000008"]


def test_rotation_leaves_a_checkpoint_copied_in_from_another_run_alone(run, tmp_path):
    """Every save records its root's id (inherited through the tracker, so a resumed run keeps it); rotation
    deleted whatever iter_* was oldest, here another run's checkpoint copied in by hand. It is kept, and said."""
    ckpt = run / "ckpt"
    ids = {json.loads((ckpt / d / "megadare.json").read_text())["root_id"] for d in ("iter_0000002", "iter_0000004")}
    assert len(ids) == 1
    other = tmp_path / "other"
    r = megadare(other, "train.steps=1", "checkpoint.save_interval=1")
    assert r.returncode == 0, r.stderr
    shutil.copytree(other / "ckpt" / "iter_0000001", ckpt / "iter_0000001")
    r = megadare(run, "train.steps=6", "checkpoint.keep_last=2")
    assert r.returncode == 0, r.stderr
    assert f"checkpoint: rotation leaves {ckpt}/iter_0000001 alone: another checkpoint root saved it" in r.stderr
    assert sorted(d for d in os.listdir(ckpt) if d.startswith("iter_")) == [
        "iter_0000001",
        "iter_0000004",
        "iter_0000006",
    ]
    assert json.loads((ckpt / "iter_0000006" / "megadare.json").read_text())["root_id"] in ids


def test_a_changed_lr_on_resume_is_the_lr_trained_with(run):
    """The resumed line said 'lr 0.003 -> 0.001' while the run trained on with 0.003: the optimiser's param groups
    came back from the checkpoint with its max_lr, which the scheduler computes the lr from. The run's settings
    (lr, Adam's betas) now apply, and the changed betas are named too."""
    r = megadare(run, "train.steps=6", "optim.lr=1e-3", "optim.adam_beta2=0.95")
    assert r.returncode == 0, r.stderr
    assert "this run's settings replace the checkpoint's: lr 0.003 -> 0.001, decay steps 4 -> 6, adam betas" in r.stderr
    assert "(0.9, 0.999) -> (0.9, 0.95)" in r.stderr
    lr5 = [json.loads(line)["lr"] for line in open(run / "metrics.jsonl")][4]
    assert lr5 == pytest.approx(1e-3 * 0.5 * (1 + math.cos(math.pi * 3 / 5)))  # cosine, warmup 1, 6 steps, at 4


def test_a_constant_schedule_is_not_said_to_decay():
    """A resumed demo RL run (constant lr) said 'lr schedule: constant, lr 0.0005 -> 0', as if it decayed to 0."""
    shape = dict(max_lr=5e-4, min_lr=0.0, lr_warmup_steps=0, lr_decay_steps=12)
    constant = SimpleNamespace(lr_decay_style="constant", **shape)
    assert describe_schedule(constant, None) == "constant, lr 0.0005, warmup 0, over 12 steps; lr now 0.0005"
    cosine = SimpleNamespace(lr_decay_style="cosine", **shape)
    assert describe_schedule(cosine, None).startswith("cosine, lr 0.0005 -> 0, warmup 0")
