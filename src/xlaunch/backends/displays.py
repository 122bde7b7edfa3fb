"""The caller's side of workers' displays: read what each rank sent, publish it in the cell.

Made only when the caller is a Jupyter kernel and the workers are forked (`worker.displays` is
the workers' side). One thread reads every rank's socket and publishes on the kernel's iopub
channel under the launching cell's request, as if the function had displayed it there. Each
rank's display ids get the rank (two ranks' bars never update each other's). Bursts are folded:
an update of a display or a widget's state waits in a queue where a later one replaces (or, for a
widget, merges into) it, and the queue is published at most every `FLUSH_S` seconds, so a bar
updated 10,000 times a second costs the cell a few messages a second; its last state is always
published. The workers' text comes the same way (`lines.TextFolder`: lines several ranks print
alike shown once). `close` returns once everything the workers sent is published.

The thread must outlive anything a worker sends: workers write to their socket with a blocking
send, so a relay that stopped reading would hold every worker at its next print. Whatever fails
in the work on one message (a frame that does not unpickle, text that is not text, a display
the kernel refuses, the live view) is caught there; nothing is dropped silently: text that could
not be folded or published is written to the caller's own stream as it came, and anything else
is named in a warning (each kind once).
"""

from __future__ import annotations

import contextlib
import pickle
import selectors
import socket
import sys
import threading
import time
import warnings
from typing import Any

from xlaunch import _compat
from xlaunch.backends.lines import TextFolder
from xlaunch.backends.live_view import LiveView
from xlaunch.worker.displays import LENGTH_BYTES, TEXT

FLUSH_S = 0.2
DRAIN_LIMIT_S = 10.0  # at the end: a stray process still writing cannot hold the launch


class DisplayRelay:
    def __init__(self, publish: Any, local_ranks: int, fold: bool = True,
                 live_folder: str | None = None, live_ranks: int = 0) -> None:
        self._publish = publish
        # The live view of the ranks (`live_view`), read from the launch's folder ``live_folder``;
        # ``live_ranks``: the ranks 0.. it shows before their workers start (this node's, on one
        # machine; with several, a rank shows once its worker started).
        self.live = LiveView(publish, live_folder, live_ranks) if live_folder else None
        self._text = TextFolder(fold)
        self._pairs = [socket.socketpair() for _ in range(local_ranks)]
        self.fds = tuple(writer.fileno() for _, writer in self._pairs)
        self._wake, self._waker = socket.socketpair()
        self._queue: list[list[Any]] = []  # [key, msg_type, content, metadata, buffers]
        self._pending: dict[Any, list[Any]] = {}  # key -> its entry in the queue
        self._inbox = [bytearray() for _ in self._pairs]
        self._warned: set[str] = set()
        self._thread = threading.Thread(target=self._loop, name="xlaunch-displays", daemon=True)
        self._thread.start()

    @classmethod
    def for_kernel(cls, local_ranks: int, fold: bool,
                   live_folder: str | None = None, live_ranks: int = 0) -> DisplayRelay | None:
        publish = _compat.kernel_publisher()
        if publish is None:
            return None
        return cls(publish, local_ranks, fold, live_folder, live_ranks)

    def close(self) -> None:
        """Every worker has ended: publish what they sent, then free the sockets."""
        with contextlib.suppress(OSError):
            self._waker.send(b"x")
        self._thread.join()
        for pair in (*self._pairs, (self._wake, self._waker)):
            for end in pair:
                end.close()

    # --- in the relay's thread ----------------------------------------------------------------

    def _loop(self) -> None:
        selector = selectors.DefaultSelector()
        for index, (reader, _) in enumerate(self._pairs):
            reader.setblocking(False)
            selector.register(reader, selectors.EVENT_READ, index)
        selector.register(self._wake, selectors.EVENT_READ, None)
        next_flush = time.monotonic() + FLUSH_S
        live = self.live
        try:
            while True:
                deadlines = [t for t in (next_flush if self._queue else None,
                                         self._text.next_due(),
                                         live.next_due() if live is not None else None)
                             if t is not None]
                wait = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
                for key, _ in selector.select(wait):
                    if key.data is None:
                        self._drain()
                        self._show_text(everything=True)
                        self._flush()
                        self._tick(force=True)  # its last state: every rank's end, last line
                        return
                    self._read(key.data)
                self._tick()
                self._show_text()
                if self._queue and time.monotonic() >= next_flush:
                    self._flush()
                    next_flush = time.monotonic() + FLUSH_S
        finally:
            selector.close()

    def _drain(self) -> None:
        deadline = time.monotonic() + DRAIN_LIMIT_S
        for index in range(len(self._pairs)):
            while self._read(index) and time.monotonic() < deadline:
                pass

    def _read(self, index: int) -> bool:
        """What rank ``index`` sent so far, queued; False once nothing more is waiting."""
        try:
            data = self._pairs[index][0].recv(1 << 20)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            return False
        if not data:
            return False
        inbox = self._inbox[index]
        inbox += data
        while len(inbox) >= LENGTH_BYTES:
            size = int.from_bytes(inbox[:LENGTH_BYTES], "big")
            if len(inbox) < LENGTH_BYTES + size:
                break
            frame = bytes(inbox[LENGTH_BYTES:LENGTH_BYTES + size])
            del inbox[:LENGTH_BYTES + size]
            message: Any = None
            try:  # one bad frame never stops the others
                message = pickle.loads(frame)
                self._queue_message(*message)
            except Exception as error:
                self._lost(message, error)
        return True

    def _lost(self, message: Any, error: Exception) -> None:
        """A message the relay could not take: its text to the caller's stream as it came, or
        a warning naming what was not shown."""
        if isinstance(message, tuple) and len(message) == 5 and message[1] == TEXT:
            content = message[2] if isinstance(message[2], dict) else {}
            _to_caller(str(content.get("name")), _as_text(content.get("pieces")))
            return
        kind = message[1] if isinstance(message, tuple) and len(message) == 5 else "message"
        self._warn(str(kind), f"a worker's {kind} could not be shown: "
                              f"{type(error).__name__}: {error}")

    def _warn(self, kind: str, text: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            with contextlib.suppress(Exception):
                warnings.warn(f"xlaunch: {text}", RuntimeWarning, stacklevel=1)

    def _tick(self, force: bool = False) -> None:
        live = self.live
        if live is None:
            return
        try:
            live.tick(force=force)
        except Exception as error:  # the view stops; the launch and its text go on
            self.live = None
            self._warn("live view", f"the live view of the ranks stopped: "
                                    f"{type(error).__name__}: {error}")

    def _show_text(self, everything: bool = False) -> None:
        try:
            due = self._text.due(everything=everything)
        except Exception:  # text that is not text: shown as it came, unfolded
            try:
                due = self._text.take_all()
            except Exception as error:
                due = []
                self._warn("text", f"workers' text could not be shown: {error!r}")
        if not due:
            return
        for stream in (sys.stdout, sys.stderr):  # what the caller printed first shows first
            with contextlib.suppress(Exception):
                stream.flush()
        for name, text in due:
            if not self._send("stream", {"name": name, "text": text}, {}, []):
                _to_caller(name, text)

    def _queue_message(self, rank: int, msg_type: str, content: dict[str, Any],
                       metadata: dict[str, Any] | None, buffers: list[bytes]) -> None:
        if msg_type == TEXT:
            self._text.add(rank, content["name"], content["pieces"])
            if self.live is not None:
                self.live.saw_text(rank, content["pieces"])
            return
        if self.live is not None:
            self.live.saw_display(rank, msg_type, content)
        content = own_display_id(content, rank)
        key = update_key(msg_type, content, buffers)
        entry = self._pending.get(key) if key is not None else None
        if entry is None:
            entry = [key, msg_type, content, metadata, buffers]
            self._queue.append(entry)
            if key is not None:
                self._pending[key] = entry
        elif msg_type == "comm_msg":  # a widget's state: later values win, key by key
            state = {**entry[2]["data"].get("state", {}), **content["data"].get("state", {})}
            entry[2] = {**content, "data": {**content["data"], "state": state}}
        else:
            entry[2], entry[3] = content, metadata

    def _flush(self) -> None:
        queue, self._queue, self._pending = self._queue, [], {}
        for _, msg_type, content, metadata, buffers in queue:
            self._send(msg_type, content, metadata, buffers)

    def _send(self, msg_type: str, content: dict[str, Any], metadata: dict[str, Any] | None,
              buffers: list[bytes]) -> bool:
        try:
            self._publish(msg_type, content, metadata, buffers)
        except Exception as error:  # the cell must still get the rest
            self._warn(msg_type, f"a worker's {msg_type} could not be shown: {error}")
            return False
        return True


def _as_text(pieces: Any) -> str:
    try:
        return "".join(f"{prefix}{piece}" for prefix, piece in pieces)
    except Exception:
        return f"{pieces!r}\n"


def _to_caller(name: str, text: str) -> None:
    """Workers' text the relay could not show its way: written to the caller's own stream."""
    stream = sys.stderr if name == "stderr" else sys.stdout
    with contextlib.suppress(Exception):
        stream.write(text)
        stream.flush()


def own_display_id(content: dict[str, Any], rank: int) -> dict[str, Any]:
    """The rank's own display id: two ranks' ``display_id`` never name the same output."""
    transient = content.get("transient")
    if not isinstance(transient, dict) or "display_id" not in transient:
        return content
    return {**content, "transient": {**transient,
                                     "display_id": f"{transient['display_id']}-rank{rank}"}}


def update_key(msg_type: str, content: dict[str, Any], buffers: list[bytes]) -> Any:
    """What a message updates in place (a later one may replace it); None: it must go as is."""
    if msg_type == "update_display_data":
        return ("display", content.get("transient", {}).get("display_id"))
    data = content.get("data")
    if (msg_type == "comm_msg" and not buffers and isinstance(data, dict)
            and data.get("method") == "update" and not data.get("buffer_paths")
            and isinstance(data.get("state"), dict)):
        return ("comm", content.get("comm_id"))
    return None
