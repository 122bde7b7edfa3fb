"""The launch's stderr, copied to the caller's and its last lines kept for failure reports.

A replica that dies without a Python exception (a segfault, an abort inside XLA) says why only on
stderr. Everything the replicas write there passes through a pipe the caller copies to its own
stderr, keeping the last bytes so the report can show what the dead replica wrote last.
"""

from __future__ import annotations

import codecs
import contextlib
import os
import re
import select
import sys
import threading

from xlaunch.names import CHECK_S

TAIL_BYTES = 32768
TAIL_LINES = 30
STACK_FRAMES = 8  # innermost frames kept from each crash dump in the tail
_CLAIMED = re.compile(r"\[rank (\d+)\] ")


class Tail:
    """Pumps a pipe into ``sys.stderr`` in a thread of its own, keeping the last bytes."""

    def __init__(self) -> None:
        self.data = bytearray()
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def open_pipe(self) -> int:
        """A pipe the replicas write their stderr to, copied from here on; its write end."""
        read_end, write_end = os.pipe()
        self.start(read_end)
        return write_end

    def start(self, fd: int) -> None:
        self._thread = threading.Thread(target=self._pump, args=(fd,), name="xlaunch-stderr",
                                        daemon=True)
        self._thread.start()

    def _pump(self, fd: int) -> None:
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        try:
            while True:
                if not poller.poll(CHECK_S * 1000):
                    if self._done.is_set():
                        break  # something outside the launch still holds the pipe
                    continue
                chunk = os.read(fd, 65536)
                if not chunk:
                    break
                self.data += chunk
                del self.data[:-TAIL_BYTES]
                with contextlib.suppress(Exception):
                    sys.stderr.write(decoder.decode(chunk))
                    sys.stderr.flush()
        finally:
            os.close(fd)

    def stop(self) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def lines(self, rank: int | None = None) -> str:
        return tail_lines(self.data.decode("utf-8", "replace"), rank)


def tail_lines(text: str, rank: int | None = None) -> str:
    """The last lines of ``text``, less those another rank's ``[rank N]`` prefix claims.

    A crash dump lists the innermost frames first: only those are kept, so that the outer ones
    (the launcher's, or all of a notebook kernel's) do not push the message out.
    """
    kept: list[str] = []
    frames = 0
    for line in text.splitlines():
        claimed = _CLAIMED.match(line)
        if not line.strip() or line.startswith("Extension modules:") or (
                rank is not None and claimed and int(claimed[1]) != rank):
            continue
        frames = frames + 1 if line.startswith("  File ") else 0
        if frames <= STACK_FRAMES:
            kept.append(line)
        elif frames == STACK_FRAMES + 1:
            kept.append("  ...")
    return "\n".join(kept[-TAIL_LINES:])
