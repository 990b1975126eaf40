"""A full disk (ENOSPC) or a run directory written by others, where a run saves, logs and rotates: one line naming
the file, nothing deleted that the run did not write. Focused tests on the functions involved (no training run)."""

from __future__ import annotations

import errno
import json
import os
import threading
from types import SimpleNamespace

import pytest
from safetensors import SafetensorError
from tensorboard.compat.tensorflow_stub.io import gfile

from megadare.convert.manifest import write_manifest
from megadare.errors import RunStateError
from megadare.trainer import checkpoint_rotation
from megadare.trainer.checkpoint_rotation import ROOT_ID
from megadare.trainer.monitor import Monitor

CONFIG = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples/configs/sft_sdar_tiny.yaml"
)


def _logging(run_dir) -> SimpleNamespace:
    return SimpleNamespace(run_dir=str(run_dir), jsonl=True, tensorboard=True, log_interval=1)


def _disk_full_after(monkeypatch, writes: int) -> None:
    """tensorboard's event-file writes fail with ENOSPC after ``writes`` of them (a full disk)."""
    real, done = gfile.LocalFileSystem._write, [0]

    def write(self, filename, file_content, mode):
        done[0] += 1
        if done[0] > writes:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(self, filename, file_content, mode)

    monkeypatch.setattr(gfile.LocalFileSystem, "_write", write)


@pytest.fixture
def thread_tracebacks(monkeypatch) -> list:
    """The thread errors that would be printed as tracebacks (threading.excepthook's calls)."""
    seen: list = []
    monkeypatch.setattr(threading, "excepthook", lambda args: seen.append(args.exc_type))
    return seen


def test_a_full_disk_when_tensorboard_opens_is_one_line(tmp_path, monkeypatch, thread_tracebacks):
    """tensorboard writes its first event as it opens: on a full disk a raw OSError traceback came out of the
    Monitor (and another one from tensorboard's writer thread). Now one line naming the directory."""
    _disk_full_after(monkeypatch, 0)
    with pytest.raises(RunStateError) as e:
        Monitor(_logging(tmp_path), total_steps=4, start_step=2)
    assert str(e.value).startswith(f"writing the tensorboard events to {tmp_path}/tensorboard failed: No space left")
    assert "\n" not in str(e.value) and thread_tracebacks == []


def test_a_full_disk_while_logging_tensorboard_is_one_line(tmp_path, monkeypatch, thread_tracebacks):
    """The event file fills up mid-run: Monitor.log's one-line error was lost, its close() raised the writer
    thread's OSError again from inside the handler (a traceback, no line). Now the line names the tensorboard
    directory, and closing after it raises nothing."""
    monitor = Monitor(_logging(tmp_path), total_steps=4)
    monitor.log(1, {"loss": 1.0})
    _disk_full_after(monkeypatch, 0)
    with pytest.raises(RunStateError) as e:
        monitor.log(2, {"loss": 0.5})
    assert str(e.value).startswith(
        f"writing the metrics of step 2 to {tmp_path}/tensorboard failed: No space left on device; the steps since"
    ), e.value
    monitor.close()
    assert thread_tracebacks == []


def _checkpoint(d, step: int, root_id=None) -> None:
    """An intact-looking checkpoint directory (train state, meta with ``root_id``, manifest), no tensors."""
    d.mkdir(parents=True)
    (d / "train_state.json").write_text(json.dumps({"step": step}))
    (d / "megadare.json").write_text(
        json.dumps({"written_by": "megadare sft", **({ROOT_ID: root_id} if root_id else {})})
    )
    write_manifest(str(d))


def test_rotation_deletes_only_the_checkpoints_this_root_saved(tmp_path, capsys):
    """Rotation deleted the oldest iter_* whoever wrote it: a checkpoint of another run copied in by hand, a
    directory without megadare.json, and it renamed a symbolic link (to a checkpoint kept elsewhere) to
    iter_N.pruning for good. Now only those with this root's id (or none: an older megadare's) go; the others
    are kept, each said once."""
    root, elsewhere = tmp_path / "ckpt", tmp_path / "elsewhere"
    _checkpoint(root / "iter_0000001", 1)  # an older megadare's: no root id, rotated as before
    for step in (4, 6, 8):
        _checkpoint(root / f"iter_{step:07d}", step, "ours")
    _checkpoint(root / "iter_0000002", 2, "theirs")  # another run's, copied in
    (root / "iter_0000003").mkdir()  # the user's own
    (root / "iter_0000003" / "notes.txt").write_text("mine")
    _checkpoint(elsewhere / "iter_0000005", 5, "ours")
    os.symlink(elsewhere / "iter_0000005", root / "iter_0000005")
    checkpoint_rotation.prune_checkpoints(str(root), 2, 8)
    assert sorted(os.listdir(root)) == ["iter_0000002", "iter_0000003", "iter_0000005", "iter_0000006", "iter_0000008"]
    assert os.path.islink(root / "iter_0000005") and (elsewhere / "iter_0000005" / "manifest.json").is_file()
    err = capsys.readouterr().err
    assert f"checkpoint: rotation leaves {root}/iter_0000002 alone: another checkpoint root saved it" in err, err
    assert f"{root}/iter_0000003 alone: it has no readable megadare.json" in err
    assert f"{root}/iter_0000005 alone: it is a symbolic link (to {elsewhere}/iter_0000005)" in err
    checkpoint_rotation.prune_checkpoints(str(root), 2, 8)
    assert "rotation leaves" not in capsys.readouterr().err  # said once


def test_a_save_inherits_the_root_id_through_the_tracker(tmp_path):
    """The id a save records is that of the checkpoint the tracker names (the run's last save or the step it
    resumed), never that of a directory copied in."""
    root = tmp_path / "ckpt"
    _checkpoint(root / "iter_0000004", 4, "ours")
    _checkpoint(root / "iter_0000006", 6, "theirs")  # copied in, newer
    (root / "latest_checkpointed_iteration.txt").write_text("4")
    assert checkpoint_rotation.root_id(str(root)) == "ours"
    fresh = checkpoint_rotation.root_id(str(tmp_path / "new"))
    assert len(fresh) == 32 and fresh != checkpoint_rotation.root_id(str(tmp_path / "new"))


def test_a_full_disk_writing_the_run_config_is_one_line_and_keeps_the_previous(tmp_path, monkeypatch):
    """config.yaml is written at each start: on a full disk (here its fsync refused, as a full disk refuses a
    write-back) a raw OSError traceback came out; now one line naming the file, the previous config.yaml
    intact and no temp file left."""
    from megadare import files
    from megadare.config import load_config
    from megadare.trainer.monitor import write_run_config

    cfg = load_config(CONFIG, [f"logging.run_dir={tmp_path}"])
    write_run_config(cfg)
    before = (tmp_path / "config.yaml").read_text()

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(files.os, "fsync", full)
    with pytest.raises(RunStateError) as e:
        write_run_config(load_config(CONFIG, [f"logging.run_dir={tmp_path}", "train.steps=7"]))
    assert str(e.value).startswith(
        f"writing the run's resolved config to {tmp_path}/config.yaml failed: No space left on device; nothing"
    ), e.value
    assert (tmp_path / "config.yaml").read_text() == before and sorted(os.listdir(tmp_path)) == ["config.yaml"]


def test_a_full_disk_writing_the_tiny_model_is_one_line(tmp_path, monkeypatch):
    """A tiny model's run writes it to <run_dir>/init_hf first: on a full disk safetensors' own error (not even an
    OSError) came out as a traceback; now one line naming the directory, and nothing left there."""
    from megadare.config import load_config
    from megadare.models import safetensors_io
    from megadare.trainer import model_setup
    from megadare.trainer.spec import model_source

    cfg = load_config(CONFIG, [f"logging.run_dir={tmp_path}"])

    def full(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors_io, "save_file", full)
    with pytest.raises(RunStateError) as e:
        model_setup.materialise(model_source(cfg), cfg)
    assert str(e.value).startswith(f"writing the tiny model to {tmp_path}/init_hf failed: No space left on device;")
    assert os.listdir(tmp_path) == []
