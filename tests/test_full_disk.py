"""A full disk (ENOSPC) or a run directory written by others, where a run saves, logs and rotates: one line naming
the file, nothing deleted that the run did not write. Focused tests on the functions involved (no training run)."""

from __future__ import annotations

import errno
import os
import threading
from types import SimpleNamespace

import pytest
from tensorboard.compat.tensorflow_stub.io import gfile

from megadare.errors import RunStateError
from megadare.trainer.monitor import Monitor


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
