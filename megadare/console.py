"""Whether a progress bar left stderr's line open, so that a one-line error starts a line of its own.

A tqdm bar redraws its line as ``\\r<bar>`` and ends it only when it closes. A rank killed mid-run (``--nproc``: its
stderr is the launcher's) never closes its bar, and the launcher's ``megadare: error: ...`` was glued onto the bar's
line (``...eval/accuracy=0]megadare: error: ...``). Bars write through ``progress_stream()``, which records whether
the last write ended a line; ``spawn`` shares that record between the launcher and its ranks (``share``), and
``cli.report_error`` ends an open line first (``end_open_line``).

Where stderr is no terminal (a Slurm log, a pipe), ``\\r`` redraws made one 'line' that grew with every frame,
unreadable with ``less``/``grep``: ``progress_bar`` draws a bar there as whole lines instead (``_LineBar``), at
most one each ``LINE_INTERVAL_S`` seconds, plus the first, the last and any explicit refresh.

On a terminal that reports no size (a pty opened without one: ``script``, some CI runners) tqdm's
``dynamic_ncols`` read the width and height as -1 and drew nothing; ``_TerminalBar`` takes the size
``shutil.get_terminal_size`` falls back to there (``$COLUMNS``/``$LINES``, else 80 x 24).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import sys
from typing import Any, Optional, TextIO

from tqdm import tqdm

# 1 while a bar's line is open; a launch replaces it by a byte in shared memory (multiprocessing RawValue)
_line = {"open": ctypes.c_byte(0)}


def share(flag: Any) -> None:
    """Record the open line in ``flag`` (anything with an int ``value``: the launch's shared byte) from now on."""
    _line["open"] = flag


def line_open() -> bool:
    return bool(_line["open"].value)


def end_open_line(stream: TextIO) -> None:
    """Write the newline that a bar left out, if one did, to ``stream``."""
    if line_open():
        stream.write("\n")
        _line["open"].value = 0


class _Tracked:
    """A text stream whose writes record whether they ended a line; everything else is the stream's."""

    def __init__(self, stream: TextIO):
        self._stream = stream

    def write(self, text: str) -> int:
        n = self._stream.write(text)
        if text:
            _line["open"].value = 0 if text.endswith("\n") else 1
        return n

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def progress_stream() -> TextIO:
    """stderr (as it is now, for a progress bar's ``file=``), its writes recorded (module doc)."""
    return _Tracked(sys.stderr)  # type: ignore[return-value]


# the least seconds between two progress lines in a log (a bar on a terminal redraws as tqdm does)
LINE_INTERVAL_S = 30.0


class _LineBar(tqdm):
    """A tqdm bar that prints each frame as a line of its own, ended by a newline, never ``\\r``-redrawn; the
    frame is the bar's text less its bar glyphs (desc, percent, n/total, elapsed<ETA, rate, postfix)."""

    def __init__(self, **kwargs: Any):
        self._shown: Any = None  # (n, postfix) of the last line printed
        # ncols=0: no bar glyphs; miniters=1: no tqdm monitor thread forcing a refresh between two intervals
        kwargs.update(ncols=0, dynamic_ncols=False, mininterval=LINE_INTERVAL_S, miniters=1)
        super().__init__(**kwargs)

    @staticmethod
    def status_printer(file: TextIO):
        def print_line(text: str) -> None:
            if text:  # '' clears a terminal's line: a log has none to clear
                file.write(text + "\n")
                getattr(file, "flush", lambda: None)()

        return print_line

    def display(self, msg: Any = None, pos: Any = None) -> bool:
        if msg is None:
            self._shown = (self.n, self.postfix)
        super().display(msg, pos)
        return False  # no line is left to clear (tqdm's close writes a CR after a clearing display that drew)

    def update(self, n: float = 1) -> Any:
        drawn = super().update(n)
        if not drawn and not self.disable and self.total and self.n >= self.total:
            self.refresh()  # the last step has its line at once, not only at close
            drawn = True
        return drawn

    def close(self) -> None:
        if not self.disable and self._shown != (self.n, self.postfix):
            self.refresh()  # the last state, unless its line is out already
        self.leave = False  # tqdm's close would end the (already ended) line with another newline
        super().close()


def _terminal_shape(fp: Any) -> tuple[Optional[int], Optional[int]]:
    """The (columns, lines) a bar on terminal ``fp`` may take, one less each as tqdm's own reading of them: the
    terminal's size, ``shutil.get_terminal_size``'s where the terminal reports none (0), or (None, None) where it
    cannot be asked (as tqdm: a bar of its default width)."""
    try:
        columns, lines = os.get_terminal_size(fp.fileno())
    except (AttributeError, ValueError, OSError):  # no fileno, a closed stream, no terminal behind it
        return None, None
    if columns <= 0 or lines <= 0:
        fallback = shutil.get_terminal_size()
        columns, lines = columns if columns > 0 else fallback.columns, lines if lines > 0 else fallback.lines
    return columns - 1, lines - 1


class _TerminalBar(tqdm):
    """A tqdm bar redrawn in place whose ``dynamic_ncols`` follows the terminal's size through ``_terminal_shape``
    (tqdm's own reads a terminal without a size as -1 x -1 and draws nothing)."""

    def __init__(self, **kwargs: Any):
        follow = kwargs.get("dynamic_ncols", False)
        if follow:  # the first frame is drawn inside tqdm's __init__: its size is given, then followed
            columns, lines = _terminal_shape(kwargs["file"])
            kwargs.update(dynamic_ncols=False, ncols=columns, nrows=lines)
        super().__init__(**kwargs)
        if follow:
            self.dynamic_ncols = _terminal_shape


def progress_bar(**kwargs: Any) -> tqdm:
    """A tqdm bar (``kwargs`` are tqdm's, less ``file``) on ``progress_stream()``: redrawn in place on a terminal,
    printed as lines (``_LineBar``) where stderr is a file or a pipe."""
    try:
        terminal = sys.stderr.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream: no terminal
        terminal = False
    bar_class = _TerminalBar if terminal else _LineBar
    return bar_class(file=progress_stream(), **kwargs)
