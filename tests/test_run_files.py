"""Nothing lost, nobody in: the files a run keeps beside its checkpoints (set-aside value checkpoints, metrics
rolled back on resume), the names rotation and resume count as checkpoints, the fp8 engines' export and the run
lock. Focused tests on the functions involved (no training run)."""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys

import pytest

from megadare.convert.manifest import write_manifest
from megadare.errors import RunStateError


def _fake_checkpoint(d, step: int) -> None:
    """An intact-looking checkpoint directory (train state, meta, manifest), no tensors."""
    d.mkdir(parents=True)
    (d / "train_state.json").write_text(json.dumps({"step": step}))
    (d / "megadare.json").write_text(json.dumps({"written_by": "megadare rl"}))
    write_manifest(str(d))


def test_resume_and_rotation_count_the_same_checkpoint_names(tmp_path):
    """Rotation counted only ``iter_%07d`` names, resume any ``iter_<str.isdigit()>``: a stray ``iter_6`` was a
    checkpoint to resume but never rotated, and a name of non-ASCII digits (``iter_²``) made every resume and
    rotation die in int()'s ValueError traceback. One rule now (``iteration_step``): the names the trainer writes."""
    from megadare.convert.mcore_ckpt import MegatronCheckpointError, iteration_dirs, iteration_step, read_tracker
    from megadare.trainer import checkpoint_rotation

    for step in (2, 4, 6):
        _fake_checkpoint(tmp_path / f"iter_{step:07d}", step)
    for stray in ("iter_8", "iter_00000009", "iter_²", "iter_0000010.tmp"):
        (tmp_path / stray).mkdir()
    assert [os.path.basename(d) for d in iteration_dirs(str(tmp_path))] == [
        "iter_0000006",
        "iter_0000004",
        "iter_0000002",
    ]
    assert iteration_step("iter_12345678") == 12345678 and iteration_step("iter_0000006.rolled-back") is None
    checkpoint_rotation.prune_checkpoints(str(tmp_path), 2, 6)
    assert sorted(os.listdir(tmp_path)) == [
        "iter_00000009",
        "iter_0000004",
        "iter_0000006",
        "iter_0000010.tmp",
        "iter_8",
        "iter_²",
    ]
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("²")
    with pytest.raises(MegatronCheckpointError, match="holds '²', not a step number"):
        read_tracker(str(tmp_path))


def test_set_aside_value_checkpoints_go_once_the_run_saves_their_step_again(tmp_path, monkeypatch):
    """TraceRL: each kill between the value model's save and the policy's left ``<root>_value/iter_N.rolled-back``
    (a full checkpoint) that nothing deleted; the README told users to remove them. The save of step N (both
    models in place) now removes the ones of steps <= N; a later step's, a ``.damaged`` one and any other name
    are kept."""
    from megadare.trainer import policy as policy_mod

    root = tmp_path / "ckpt"
    value = tmp_path / "ckpt_value"
    _fake_checkpoint(root / "iter_0000006", 6)
    _fake_checkpoint(value / "iter_0000006", 6)
    for name in (
        "iter_0000008.rolled-back",
        "iter_0000008.rolled-back-2",
        "iter_0000007.rolled-back",
        "iter_0000009.rolled-back",
        "iter_0000006.damaged",
        "iter_0000008.rolled-back.mine",
        "notes",
    ):
        (value / name).mkdir()
        (value / name / "f").write_text("x")

    def fake_save(r, step, trained, state, about, keep_last):
        d = os.path.join(r, f"iter_{step:07d}")
        os.makedirs(d)
        return d

    monkeypatch.setattr(policy_mod, "save_train_checkpoint", fake_save)
    vm = policy_mod.ValueModel([], None, None)
    p = policy_mod.Policy([], None, None, value=vm)
    p.save(str(root), 8, policy_mod.CheckpointState(), policy_mod.Provenance(), keep_last=2)
    assert sorted(os.listdir(value)) == [
        "iter_0000006",
        "iter_0000006.damaged",
        "iter_0000008",
        "iter_0000008.rolled-back.mine",
        "iter_0000009.rolled-back",
        "notes",
    ]
    assert sorted(os.listdir(root)) == ["iter_0000006", "iter_0000008"]


def _records(path) -> list[str]:
    return open(path).read().splitlines() if os.path.exists(path) else []


@pytest.mark.parametrize("killed_at", ["replace", "fsync"])
def test_a_kill_during_the_metrics_roll_back_loses_and_doubles_nothing(tmp_path, monkeypatch, killed_at):
    """Resume moves the rolled-back steps' records from metrics.jsonl to metrics.rolled_back.jsonl: it appended
    them, then replaced metrics.jsonl, so a kill between the two left them in both files and the rerun appended
    them again (each twice). A kill at every step of the move (each rename, each temp file's write) and then the
    rerun now leave each record exactly once."""
    from megadare.trainer import monitor

    rows = [json.dumps({"step": s, "loss": s / 10}) for s in range(1, 7)]
    old_rolled = [json.dumps({"step": 5, "loss": 9.0})]  # an earlier roll-back's
    real = getattr(monitor.os, killed_at)
    kills = 0
    while True:
        metrics, rolled = tmp_path / "metrics.jsonl", tmp_path / "metrics.rolled_back.jsonl"
        metrics.write_text("\n".join(rows) + "\n")
        rolled.write_text(old_rolled[0] + "\n")
        calls = []

        def kill_at_the_nth(*a, n=kills, **k):
            calls.append(a)
            if len(calls) == n + 1:
                raise KeyboardInterrupt  # the kill, before this call's effect
            return real(*a, **k)

        monkeypatch.setattr(monitor.os, killed_at, kill_at_the_nth)
        try:
            monitor.roll_back_jsonl(str(metrics), 4)
            finished = True
        except KeyboardInterrupt:
            finished = False
        monkeypatch.setattr(monitor.os, killed_at, real)
        monitor.roll_back_jsonl(str(metrics), 4)  # the rerun
        assert _records(metrics) == rows[:4], kills
        assert _records(rolled) == old_rolled + rows[4:], kills
        assert sorted(os.listdir(tmp_path)) == ["metrics.jsonl", "metrics.rolled_back.jsonl"], kills
        if finished:
            break
        kills += 1
    assert kills >= 2  # the kill fell at each of the move's steps


def test_a_second_run_on_a_live_runs_checkpoint_root_is_refused(tmp_path):
    """A run locked its run directory, and its checkpoint root only when that lay outside it: a second run with
    checkpoint.save=<first run_dir>/ckpt (or logging.run_dir there) took its lock and trained into the live run's
    checkpoints. The checkpoint root is now locked wherever it lies; the second run is refused in one line."""
    from megadare.errors import RunStateError
    from megadare.trainer.run_lock import run_dir_lock

    a = tmp_path / "a"
    with run_dir_lock(str(a), str(a / "ckpt")):
        for second in ((tmp_path / "b", a / "ckpt"), (a / "ckpt", a / "ckpt" / "ckpt")):
            with pytest.raises(RunStateError) as e:
                with run_dir_lock(str(second[0]), str(second[1])):
                    pass
            line = str(e.value)
            assert f"{a / 'ckpt'} is in use by pid {os.getpid()}" in line and "\n" not in line, line
        assert not (tmp_path / "b").exists()  # what the refused run took is given back, its directory too
    assert sorted(os.listdir(a)) == ["ckpt"] and os.listdir(a / "ckpt") == []  # released at the end
    with run_dir_lock(str(tmp_path / "b"), str(a / "ckpt")):  # the first run is over: the second may go on
        pass


def test_the_fp8_engines_folder_is_served_or_replaced_only_with_a_sound_mark(tmp_path):
    """rollout.fp8_weights: <run_dir>/engine_fp8 with a config.json and no export mark was served as it was (any
    folder, of any model), and a damaged mark died in json's traceback, while the export check read the same mark
    as 'no mark'. One reader now: a folder without the mark is refused (megadare cannot tell it made it, so it
    neither serves nor deletes it), a damaged mark is one line naming the file, wherever it is read."""
    from megadare.convert.outputs import EXPORT_MARK, check_export_target
    from megadare.errors import OutputError
    from megadare.rollout.setup import fp8_engine_model

    run = tmp_path / "run"
    folder = run / "engine_fp8"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")  # not an export: no mark
    with pytest.raises(OutputError) as e:
        fp8_engine_model(str(run), str(tmp_path / "model"))
    line = str(e.value)
    assert line.startswith(f"{folder} has no {EXPORT_MARK}: megadare cannot tell that it exported") and "\n" not in line
    assert os.listdir(folder) == ["config.json"]
    (folder / EXPORT_MARK).write_text('{"kind": "hf-fp8-bl')  # torn
    for call in (
        lambda: fp8_engine_model(str(run), str(tmp_path / "model")),
        lambda: check_export_target(str(folder), "hf-fp8-block", [str(tmp_path / "model")]),
    ):
        with pytest.raises(OutputError) as e:
            call()
        line = str(e.value)
        assert line.startswith(f"{folder / EXPORT_MARK} is damaged (JSONDecodeError: ") and "\n" not in line, line
        assert "remove the directory" in line
    assert sorted(os.listdir(folder)) == [EXPORT_MARK, "config.json"]


def test_a_kill_while_writing_the_run_config_leaves_the_previous_one(tmp_path, monkeypatch):
    """config.yaml was truncated, then written: a kill (or a full disk) in between left it empty or torn, and an
    empty config.yaml reads as the user's own, so every later start of the run was refused. It is now replaced
    in one rename: the previous one stays until the new one is whole."""
    from types import SimpleNamespace

    from megadare.trainer import monitor

    cfg = SimpleNamespace(logging=SimpleNamespace(run_dir=str(tmp_path)))
    monkeypatch.setattr(monitor, "to_yaml", lambda c: "train:\n  steps: 4\n")
    monitor.write_run_config(cfg)
    before = (tmp_path / "config.yaml").read_text()

    def killed(c):
        raise KeyboardInterrupt  # the kill, while the new config is being written

    monkeypatch.setattr(monitor, "to_yaml", killed)
    with pytest.raises(KeyboardInterrupt):
        monitor.write_run_config(cfg)
    assert (tmp_path / "config.yaml").read_text() == before
    assert monitor.foreign_run_config(str(tmp_path)) is None and os.listdir(tmp_path) == ["config.yaml"]


def test_an_export_removes_what_a_killed_export_of_the_same_out_left(tmp_path, capsys):
    """A SIGKILLed export (an OOM kill mid-write) left its hidden staging folder beside --out, a whole model's
    size, and each retry left another: nothing removed them. The staging names now carry pid@host; an export
    removes those of its --out whose process on this host is gone, and keeps a live one's, another host's and
    names it did not give."""
    import socket
    import subprocess
    import sys

    from megadare.convert.outputs import staging_dir

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    host = socket.gethostname()
    out = tmp_path / "export"
    names = {
        "dead": f".export.tmp.{gone.pid}@{host}-abcd1234",
        "old": f".export.old.{gone.pid}@{host}-efgh5678",
        "live": f".export.tmp.{os.getpid()}@{host}-ijkl9012",
        "elsewhere": f".export.tmp.{gone.pid}@not-{host}-mnop3456",
        "other out": f".export2.tmp.{gone.pid}@{host}-qrst7890",
        "unnamed": ".export.tmp-uvwx1234",
    }
    for name in names.values():
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_text("x")
    staging = staging_dir(str(out))
    left = set(os.listdir(tmp_path))
    assert left == {os.path.basename(staging)} | {names[k] for k in ("live", "elsewhere", "other out", "unnamed")}
    assert os.path.basename(staging).startswith(f".export.tmp.{os.getpid()}@{host}-")
    assert f"export: removed {tmp_path / names['dead']}, left by a killed export of {out}" in capsys.readouterr().err


def test_a_kill_while_an_export_replaces_the_previous_one_leaves_one_in_place(tmp_path, monkeypatch):
    """publish moved the previous export aside, then renamed the new one into place: a kill between the two left
    no --out at all (and a training checkpoint re-saved under its own name, no iter_N). The two are now swapped
    in one step where the filesystem can; the previous export goes afterwards."""
    from megadare.convert import outputs

    out, staging = tmp_path / "out", tmp_path / "staging"
    for d, text in ((out, "previous"), (staging, "new")):
        d.mkdir()
        (d / "model.safetensors").write_text(text)
    if not outputs._exchange(str(staging), str(out)):
        pytest.skip("this filesystem cannot swap two paths in one step")
    outputs._exchange(str(staging), str(out))  # back as they were
    real, calls = os.replace, []

    def killed_after_the_first(*a, **k):
        calls.append(a)
        if len(calls) == 2:
            raise KeyboardInterrupt  # the kill, between moving the previous export aside and the new one in
        return real(*a, **k)

    monkeypatch.setattr(outputs.os, "replace", killed_after_the_first)
    try:
        outputs.publish(str(staging), str(out))
    except KeyboardInterrupt:
        pass
    monkeypatch.setattr(outputs.os, "replace", real)
    assert (out / "model.safetensors").read_text() == "new"
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_a_tracerl_runs_value_checkpoints_are_locked_with_its_checkpoints(tmp_path):
    """TraceRL with a value model saves it under <root>_value, which no lock covered: a second run with
    checkpoint.save=<root>_value trained into it and its rotation deleted the live run's value checkpoints.
    The RL run now locks it beside its checkpoint root."""
    from types import SimpleNamespace

    from megadare.algos import build_algorithm
    from megadare.errors import RunStateError
    from megadare.trainer.rl import checkpoint_roots
    from megadare.trainer.run_lock import run_dir_lock

    cfg = SimpleNamespace(checkpoint=SimpleNamespace(save=None), logging=SimpleNamespace(run_dir=str(tmp_path / "a")))
    with_value = SimpleNamespace(cfg=cfg, algo=build_algorithm("tracerl", {"value_model": True}))
    without = SimpleNamespace(cfg=cfg, algo=build_algorithm("tracerl", {}))
    root = str(tmp_path / "a" / "ckpt")
    assert checkpoint_roots(with_value) == (root, root + "_value") and checkpoint_roots(without) == (root,)
    with run_dir_lock(cfg.logging.run_dir, *checkpoint_roots(with_value)):
        with pytest.raises(RunStateError, match=f"{root}_value is in use by pid {os.getpid()}"):
            with run_dir_lock(str(tmp_path / "b"), root + "_value"):
                pass


def test_saving_checkpoint_x_leaves_a_users_x_tmp_alone(tmp_path, monkeypatch):
    """save_checkpoint(chunks, X) removed and reused ``X.tmp`` whatever it held: a user's own folder of that name
    beside X was deleted. It now stages in a fresh pid@host sibling of its own, so ``X.tmp`` is kept as it was."""
    from megatron.core import dist_checkpointing

    from megadare.convert import mcore_ckpt

    mine = tmp_path / "ckpt.tmp"
    mine.mkdir()
    (mine / "notes.txt").write_text("the user's")
    monkeypatch.setattr(mcore_ckpt, "model_sharded_state_dict", lambda chunks: {})
    monkeypatch.setattr(dist_checkpointing, "save", lambda sd, path: (tmp_path / path / "common.pt").write_text("x"))
    mcore_ckpt.save_checkpoint([], str(tmp_path / "ckpt"))
    assert (mine / "notes.txt").read_text() == "the user's"
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "ckpt.tmp"] and (tmp_path / "ckpt" / "common.pt").exists()


def test_the_foundation_demo_leaves_no_temp_dir_behind(tmp_path, monkeypatch, capsys):
    """`megadare demo --foundation` without --workdir worked in a temp dir it never removed: every run left its
    checkpoints in /tmp (1.6 MB for sdar, 13 MB for every family). The temp dir now goes at the end, however the
    demo ends (here: an error in the first family); --workdir keeps its outputs."""
    import tempfile

    from megadare import demo_foundation

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    roots = []

    def first_family_fails(name, root, seed):
        roots.append(root)
        os.makedirs(os.path.join(root, "hf", name))
        raise RuntimeError("the first family failed")

    monkeypatch.setattr(demo_foundation, "_make_checkpoint", first_family_fails)
    for argv in (["--families", "sdar"], ["--families", "sdar", "--workdir", str(tmp_path / "kept")]):
        with pytest.raises(RuntimeError, match="the first family failed"):
            demo_foundation.main(argv)
    assert roots[0].startswith(str(tmp_path / "tmp")) and os.listdir(tmp_path / "tmp") == []
    assert roots[1] == str(tmp_path / "kept") and os.path.isdir(tmp_path / "kept" / "hf" / "sdar")
    assert "(removed at the end; --workdir keeps it)" in capsys.readouterr().out


def test_a_lock_that_cannot_be_written_leaves_no_empty_lock(tmp_path, monkeypatch):
    """ENOSPC (or a SIGKILL) between creating the lock and writing its holder left an empty megadare.lock that
    refused every later run as 'in use by pid ? on ?'. The lock is now written aside and linked into place; an
    empty or garbled lock (left by an older megadare) names no live holder and is taken over."""
    from megadare.trainer import run_lock

    real_dump = json.dump

    def full_disk(obj, f, *a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(run_lock.json, "dump", full_disk)
    with pytest.raises(RunStateError, match="cannot take the run lock: No space left on device;"):
        run_lock.acquire(str(tmp_path))
    monkeypatch.setattr(run_lock.json, "dump", real_dump)
    assert os.listdir(tmp_path) == []
    (tmp_path / run_lock.LOCK).write_text("")  # what the old code left
    assert run_lock.holder_alive(str(tmp_path)) is None
    assert "names no holder" in run_lock.acquire(str(tmp_path))
    run_lock.release(str(tmp_path))
    assert os.listdir(tmp_path) == []


def test_the_lock_is_written_through_a_file_named_by_pid_and_host(tmp_path, monkeypatch):
    """The lock was written to ``megadare.lock.<pid>.tmp`` first: two hosts' runs on a shared filesystem with the
    same pid wrote, linked and removed one file; one SIGKILLed in between left it for good. The name now carries
    ``<pid>@<host>`` (megadare/files.py's owned name) and a dead writer's file of this host goes at the next run;
    another host's stays."""
    from megadare.trainer import run_lock

    host, linked, real_link = socket.gethostname(), [], os.link
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    left = tmp_path / f"{run_lock.LOCK}.{dead.pid}@{host}-tmp"
    other = tmp_path / f"{run_lock.LOCK}.{os.getpid()}@another-node-tmp"
    left.write_text("{}")
    other.write_text("{}")
    monkeypatch.setattr(run_lock.os, "link", lambda src, dst: (linked.append(src), real_link(src, dst)))
    assert run_lock.acquire(str(tmp_path)) == ""
    assert [os.path.basename(p) for p in linked] == [f"{run_lock.LOCK}.{os.getpid()}@{host}-tmp"]
    assert sorted(os.listdir(tmp_path)) == sorted([run_lock.LOCK, other.name])
    run_lock.release(str(tmp_path))
