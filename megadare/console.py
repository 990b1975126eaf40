"""Whether a progress bar left stderr's line open, so that a one-line error starts a line of its own.

A tqdm bar redraws its line as ``\\r<bar>`` and ends it only when it closes. A rank killed mid-run (``--nproc``: its
stderr is the launcher's) never closes its bar, and the launcher's ``megadare: error: ...`` was glued onto the bar's
line (``...eval/accuracy=0]megadare: error: ...``). Bars write through ``progress_stream()``, which records whether
the last write ended a line; ``spawn`` shares that record between the launcher and its ranks (``share``), and
``cli.report_error`` ends an open line first (``end_open_line``).
"""

from __future__ import annotations

import ctypes
import sys
from typing import Any, TextIO

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
