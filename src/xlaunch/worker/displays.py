"""A forked worker's displays, sent to the caller (a Jupyter kernel), which publishes them.

The caller makes one socket pair per local rank before any worker starts (`backends.displays`)
and hands each worker its end's descriptor. In the worker, the kernel's session sends what it
would have sent (and dropped: a forked process may not use the kernel's sockets) down that socket
instead: display_data, update_display_data, clear_output, comm_open/comm_msg/comm_close (hence
ipywidgets and ``tqdm.auto`` bars); and the rank's prefixed stdout/stderr pieces
(`output.PrefixedStream`), which the caller folds and shows. Each message is one frame: 4 bytes
of length, then a pickle of ``(rank, msg_type, content, metadata, buffers)``.
"""

from __future__ import annotations

import os
import pickle
import socket
import threading
from typing import Any

from xlaunch import _compat

LENGTH_BYTES = 4
TEXT = "xlaunch_text"  # a rank's stream output, for the caller to fold and show
LIVE_LINE = "xlaunch-line"  # the display id of a rank's live text line (the caller adds the rank)


class DisplaySink:
    """This rank's end of the caller's socket; a process it forks sends nothing through it
    (each call says False there: its text goes to the kernel's stream instead, `PrefixedStream`;
    its displays are dropped, as the kernel drops a fork's)."""

    def __init__(self, fd: int, rank: int) -> None:
        self._socket = socket.socket(fileno=fd)
        self._socket.setblocking(True)
        self._pid = os.getpid()
        self._rank = rank
        self._lock = threading.Lock()
        self._lines = 0  # live lines this rank started

    def __call__(self, msg_type: str, content: dict[str, Any], metadata: dict[str, Any] | None,
                 buffers: Any = None) -> bool:
        if os.getpid() != self._pid:
            return False
        try:
            frame = pickle.dumps((self._rank, msg_type, content, metadata,
                                  [bytes(buffer) for buffer in buffers or ()]), protocol=5)
        except Exception:
            return False
        with self._lock:
            try:
                self._socket.sendall(len(frame).to_bytes(LENGTH_BYTES, "big") + frame)
            except OSError:  # the caller is gone: nothing can show it any more
                pass
        return True

    def live_line(self, text: str, line: int | None) -> int | None:
        """Show ``text`` as live line ``line`` of this rank (a display updated in place); None
        starts a new one (the previous keeps its last state). Returns the line's number; None
        when it could not be sent (a process the rank forked)."""
        first = line is None
        number = self._lines + 1 if line is None else line
        display_id = f"{LIVE_LINE}-{number}"
        if not self("display_data" if first else "update_display_data",
                    {"data": {"text/plain": text}, "metadata": {},
                     "transient": {"display_id": display_id}}, {}):
            return None
        self._lines = max(self._lines, number)
        return number

    def lines(self, name: str) -> Any:
        """What stream ``name`` of this rank writes, sent to the caller (`PrefixedStream`):
        whether it was."""
        def send(pieces: list[tuple[str, str]]) -> bool:
            return self(TEXT, {"name": name, "pieces": pieces}, None)
        return send


def route_displays(fds: tuple[int, ...] | None, local_rank: int, rank: int) -> DisplaySink | None:
    """In a forked worker of a kernel: what it displays goes to the caller. None elsewhere."""
    if fds is None or local_rank >= len(fds):
        return None
    for index, fd in enumerate(fds):  # the other ranks' ends are not this worker's
        if index != local_rank:
            try:
                os.close(fd)
            except OSError:
                pass
    sink = DisplaySink(fds[local_rank], rank)
    if not _compat.route_kernel_messages(sink):
        return None
    return sink
