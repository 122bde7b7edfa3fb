"""Each rank's output, prefixed ``[rank N]`` line by line, in time linear in its size."""

from __future__ import annotations

import io
import re
from typing import Any

LINE_ENDS = ("\n", "\r")
_AFTER_LINE_END = re.compile(r"(?<=[\r\n])")


class PrefixedStream(io.TextIOBase):
    """Prefixes each line, and writes whole lines, so ranks' output does not interleave mid-line.

    A carriage return also ends a piece, so a progress bar still redraws in place. Text without
    a line end waits in a list of pieces (never re-scanned), so a rank printing a million dots
    without a newline costs a million appends, not a million copies of a growing string.
    """

    def __init__(self, stream: Any, prefix: str) -> None:
        self._stream = stream
        self._prefix = prefix
        self._pending: list[str] = []
        self._line_started = False  # part of the current line already went out (by a flush)

    def write(self, text: str) -> int:
        last_end = max(text.rfind("\n"), text.rfind("\r"))
        if last_end < 0:
            self._pending.append(text)
            return len(text)
        head, self._pending = "".join([*self._pending, text[:last_end + 1]]), [text[last_end + 1:]]
        self._stream.write("".join(self._start(piece) + piece for piece in _pieces(head)))
        self._stream.flush()
        return len(text)

    def flush(self) -> None:
        pending = "".join(self._pending)
        self._pending = []
        if pending:
            self._stream.write(self._start(pending) + pending)
            self._line_started = True
        self._stream.flush()

    def _start(self, piece: str) -> str:
        """The prefix this piece needs: none mid-line, none for a bare line end (a progress
        bar's leading carriage return, an empty print)."""
        prefix = "" if self._line_started or piece in LINE_ENDS else self._prefix
        self._line_started = False
        return prefix

    def isatty(self) -> bool:
        return bool(getattr(self._stream, "isatty", lambda: False)())

    def fileno(self) -> int:
        return int(self._stream.fileno())

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return str(getattr(self._stream, "encoding", "utf-8"))

    def writable(self) -> bool:
        return True


def _pieces(text: str) -> list[str]:
    """Split after every line end, in one pass; ``text`` ends with a line end."""
    return [piece for piece in _AFTER_LINE_END.split(text) if piece]
