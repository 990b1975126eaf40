"""Progress bars where stderr is a log (a Slurm job's file, a pipe): ended lines at a sane rate, not ``\\r`` frames
that grow one 'line' for the whole run; on a terminal the bar redraws as before."""

import fcntl
import io
import os
import pty
import shutil
import struct
import sys
import termios
from types import SimpleNamespace

import pytest

from megadare.console import LINE_INTERVAL_S, line_open
from megadare.trainer.monitor import Monitor


class _Clock:
    """tqdm's clock, moved by hand."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def clock(monkeypatch):
    fake = _Clock()
    monkeypatch.setattr("tqdm.std.time", fake)  # a bar's _time is read from tqdm.std at its start
    return fake


def _train(tmp_path, clock, steps: int, seconds_per_step: float) -> list[bool]:
    """A Monitor's bar over ``steps`` steps; whether stderr's line was left open after each."""
    logging = SimpleNamespace(run_dir=str(tmp_path / "run"), jsonl=False, tensorboard=False, log_interval=1)
    monitor = Monitor(logging, total_steps=steps, desc="sft", enabled=True)
    opened = []
    for step in range(1, steps + 1):
        clock.now += seconds_per_step
        monitor.log(step, {"loss": 1.0 / step, "lr": 1e-5})
        opened.append(line_open())
    monitor.close()
    return opened


def _log_lines(tmp_path, monkeypatch, clock, steps: int, seconds_per_step: float) -> list[str]:
    log = tmp_path / "slurm.err"
    with open(log, "w") as stderr:
        monkeypatch.setattr(sys, "stderr", stderr)
        opened = _train(tmp_path, clock, steps, seconds_per_step)
    assert not any(opened)  # an error line after the bar starts a line of its own without help
    text = log.read_text()
    assert "\r" not in text and text.endswith("\n"), repr(text)
    return text.splitlines()


def test_a_bar_in_a_log_prints_ended_lines_at_most_one_per_interval(tmp_path, monkeypatch, clock):
    lines = _log_lines(tmp_path, monkeypatch, clock, steps=100, seconds_per_step=1.0)
    # the first (step 0), one each LINE_INTERVAL_S seconds of steps, the last (step 100)
    assert 3 <= len(lines) <= 2 + 100 // LINE_INTERVAL_S, lines
    assert lines[0].startswith("sft:   0% 0/100 [00:00<?"), lines
    assert lines[-1].startswith("sft: 100% 100/100 [01:40<00:00,"), lines
    assert lines[-1].endswith("loss=0.01, lr=1e-05]"), lines  # the last step's metrics, once
    for line in lines[1:]:
        assert "/100 [" in line and "step/s, loss=" in line and "<" in line, line


def test_fast_steps_in_a_log_print_the_first_and_the_last_line(tmp_path, monkeypatch, clock):
    lines = _log_lines(tmp_path, monkeypatch, clock, steps=500, seconds_per_step=0.01)
    assert len(lines) == 2, lines
    assert " 0/500 " in lines[0] and " 500/500 " in lines[1] and "loss=0.002," in lines[1], lines


def test_a_bar_on_a_terminal_redraws_its_line(tmp_path, monkeypatch, clock):
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    opened = _train(tmp_path, clock, steps=3, seconds_per_step=1.0)
    assert all(opened)  # the frame is redrawn in place: its line stays open until the bar closes
    text = terminal.getvalue()
    frames = text.split("\r")
    assert text.count("\n") == 1 and text.endswith("\n") and len(frames) >= 4, repr(text)
    assert "| 3/3 [" in frames[-1] and "loss=0.3333, lr=1e-05]" in frames[-1], repr(text)


def test_a_bar_on_a_terminal_without_a_size_draws(tmp_path, monkeypatch, clock):
    """A pty opened without a size (``script``, some CI runners) reads 0 x 0: tqdm's ``dynamic_ncols`` (the
    Monitor's bar) took it as -1 columns and -1 lines and drew nothing; the bar takes the fallback size there."""
    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.delenv("LINES", raising=False)
    controller, terminal_fd = pty.openpty()
    fcntl.ioctl(terminal_fd, termios.TIOCSWINSZ, struct.pack("HHHH", 0, 0, 0, 0))
    assert os.get_terminal_size(terminal_fd) == (0, 0)
    with open(terminal_fd, "w", buffering=1, closefd=True) as terminal:
        monkeypatch.setattr(sys, "stderr", terminal)
        _train(tmp_path, clock, steps=3, seconds_per_step=1.0)
        terminal.flush()
    os.set_blocking(controller, False)
    text = b""
    try:
        while chunk := os.read(controller, 65536):
            text += chunk
    except (BlockingIOError, OSError):  # nothing more to read (EIO: the terminal's side is closed)
        pass
    finally:
        os.close(controller)
    frames = text.decode().split("\r")
    drawn = [f for f in frames if "/3 [" in f]
    assert drawn and "| 3/3 [" in drawn[-1] and "loss=0.3333" in drawn[-1], repr(text)
    assert all(len(f) < shutil.get_terminal_size().columns for f in drawn), repr(text)
