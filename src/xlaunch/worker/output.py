"""Each rank's output, prefixed ``[rank N]`` line by line, in time linear in its size."""

from __future__ import annotations

import codecs
import contextlib
import fcntl
import io
import os
import re
import threading
from collections.abc import Callable, Iterator
from typing import Any

# (text, live line number or None for a new one) -> that line's number; None: not shown
LiveLine = Callable[[str, "int | None"], "int | None"]
# [(prefix or "", text)]: pieces of this stream's output, whole lines but for the last -> whether
# they were sent
Lines = Callable[[list[tuple[str, str]]], bool]

LINE_ENDS = ("\n", "\r")
# The lock file is the launch's, made with its folder (`launch_dir.LaunchDir.create`): a worker
# opens it, never creates it, never through a symlink.
_OPEN_LOCK = os.O_RDWR | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
_AFTER_LINE_END = re.compile(r"(?<=[\r\n])")


class PrefixedStream(io.TextIOBase):
    """Prefixes each line, and writes whole lines, so ranks' output does not interleave mid-line.

    A carriage return also ends a piece, so a progress bar still redraws in place. Text without
    a line end waits in a list of pieces (never re-scanned), so a rank printing a million dots
    without a newline costs a million appends, not a million copies of a growing string.

    A pipe keeps a write whole only up to 4 KiB (PIPE_BUF): a longer line from one rank could be
    cut by another's. With ``lock_path`` (a file every rank of the launch shares, which the caller
    made) each write holds an advisory lock on it, so lines of any length arrive whole. It is a
    full text stream: ``buffer`` (bytes, decoded and prefixed alike), ``reconfigure``, ``name``,
    ``line_buffering``… come from the stream it wraps.

    With ``live`` (a worker of a Jupyter kernel) a line redrawn with carriage returns (a text
    progress bar) does not go to the stream, where another rank's redraws would overwrite it:
    each state goes to ``live``, this rank's own line in the cell, updated in place; its last
    state stays there once the line ends. With ``lines`` too, the rest goes to ``lines``, not to
    the stream: the caller folds what several ranks print alike and shows it. A process the
    rank forks (a DataLoader worker) has no way to the caller of its own: there, and wherever
    ``live`` or ``lines`` could not take a piece, every line goes to the stream, prefixed (the
    kernel's stream carries a forked process's text to the cell itself).
    """

    def __init__(self, stream: Any, prefix: str, lock_path: str | None = None,
                 live: LiveLine | None = None, lines: Lines | None = None) -> None:
        self._stream = stream
        self._prefix = prefix
        self._pending: list[str] = []
        self._line_started = False  # part of the current line already went out (by a flush)
        self._lock_path = lock_path
        self._lock_fd: int | None = None
        self._lock_pid = 0
        self._threads = threading.Lock()
        self._buffer: PrefixedBuffer | None = None
        self._live = live
        self._live_line: int | None = None  # the live line this stream is redrawing
        self._redrawing = False  # the current line began after a carriage return
        self._live_text = ""  # the current line's text so far, when redrawing
        self._lines = lines if live is not None else None
        self._pid = os.getpid()  # the process whose way to the caller ``live`` and ``lines`` are

    def write(self, text: str) -> int:
        if self._live is not None and self._routed():
            return self._write_live(text)
        last_end = max(text.rfind("\n"), text.rfind("\r"))
        if last_end < 0:
            self._pending.append(text)
            return len(text)
        head, self._pending = "".join([*self._pending, text[:last_end + 1]]), [text[last_end + 1:]]
        with self._held():
            self._stream.write("".join(self._start(piece) + piece for piece in _pieces(head)))
            self._stream.flush()
        return len(text)

    def flush(self) -> None:
        if self._live is not None:
            self._routed()
        pending = "".join(self._pending)
        self._pending = []
        if pending and self._live is not None and self._redrawing:
            self._live_text += pending
            self._show(self._live_text)
            pending = ""
        start = self._start(pending) if pending else ""
        if pending and self._lines is not None:
            if self._lines([(start, pending)]):
                self._line_started = True
                pending = ""
            else:
                self._plain()
        with self._held():
            if pending:
                self._stream.write(start + pending)
                self._line_started = True
            self._stream.flush()

    def _routed(self) -> bool:
        """Whether this is the process ``live`` and ``lines`` lead from; in a process it forked,
        from now on every line goes to the stream (`_plain`)."""
        if os.getpid() == self._pid:
            return True
        self._plain()
        return False

    def _plain(self) -> None:
        """In this process from now on: lines to the stream, prefixed, as in a terminal."""
        if self._live_text:  # a redrawn line's start, not shown yet
            self._pending.insert(0, self._live_text)
        self._live = self._lines = None
        self._live_line, self._redrawing, self._live_text = None, False, ""

    def _write_live(self, text: str) -> int:
        """Lines as `write`, but a redrawn line's states go to the live line."""
        last_end = max(text.rfind("\n"), text.rfind("\r"))
        if last_end < 0:
            self._pending.append(text)
            return len(text)
        head, self._pending = "".join([*self._pending, text[:last_end + 1]]), [text[last_end + 1:]]
        out: list[tuple[str, str]] = []
        for piece in _pieces(head):
            if self._line_started and not self._redrawing:  # the line's start went out already
                out.append(("", piece))
                self._line_started = piece[-1] not in LINE_ENDS
                continue
            line = self._live_text + piece[:-1]
            self._live_text = ""
            if piece[-1] == "\r":
                if line:
                    self._show(line)
                self._redrawing = True
            elif self._redrawing or self._live_line is not None:
                if line:
                    self._show(line)
                self._redrawing, self._live_line = False, None
            else:
                out.append((self._start(piece), piece))
        if out and self._lines is not None and self._lines(out):
            return len(text)
        if out:
            if self._lines is not None:  # they could not be sent: the stream takes them
                self._plain()
            with self._held():
                self._stream.write("".join(prefix + piece for prefix, piece in out))
                self._stream.flush()
        return len(text)

    def _show(self, line: str) -> None:
        if self._live is not None:
            shown = self._live(self._prefix + line, self._live_line)
            if shown is not None:
                self._live_line = shown
                return
            self._plain()
        with self._held():  # a redraw, as in a terminal
            self._stream.write(self._prefix + line + "\r")
            self._stream.flush()

    def _start(self, piece: str) -> str:
        """The prefix this piece needs: none mid-line, none for a bare line end (a progress
        bar's leading carriage return, an empty print)."""
        prefix = "" if self._line_started or piece in LINE_ENDS else self._prefix
        self._line_started = False
        return prefix

    @contextlib.contextmanager
    def _held(self) -> Iterator[None]:
        """The launch's output lock, across processes (flock) and threads, while writing."""
        with self._threads:
            fd = self._lock_file()
            if fd is None:
                yield
                return
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError:
                yield
                return
            try:
                yield
            finally:
                with contextlib.suppress(OSError):
                    fcntl.flock(fd, fcntl.LOCK_UN)

    def _lock_file(self) -> int | None:
        if self._lock_path is None:
            return None
        if self._lock_pid != os.getpid():  # each process its own open file: flock is per open
            self._lock_pid = os.getpid()
            try:
                self._lock_fd = os.open(self._lock_path, _OPEN_LOCK)
            except OSError:  # the launch's folder is gone: write without it
                self._lock_fd = None
        return self._lock_fd

    # --- the rest of a text stream, from the stream underneath --------------------------------

    @property
    def buffer(self) -> PrefixedBuffer:
        """Bytes written here are decoded and prefixed like text (``sys.stdout.buffer.write``)."""
        if self._buffer is None:
            self._buffer = PrefixedBuffer(self)
        return self._buffer

    def reconfigure(self, **options: Any) -> None:
        reconfigure = getattr(self._stream, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(**options)

    def isatty(self) -> bool:
        return bool(getattr(self._stream, "isatty", lambda: False)())

    def fileno(self) -> int:
        return int(self._stream.fileno())

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return str(getattr(self._stream, "encoding", None) or "utf-8")

    @property
    def errors(self) -> str:  # type: ignore[override]
        return str(getattr(self._stream, "errors", None) or "strict")

    @property
    def name(self) -> str:
        return str(getattr(self._stream, "name", "<stdout>"))

    @property
    def mode(self) -> str:
        return "w"

    @property
    def line_buffering(self) -> bool:
        return bool(getattr(self._stream, "line_buffering", False))

    @property
    def write_through(self) -> bool:
        return bool(getattr(self._stream, "write_through", False))

    def writable(self) -> bool:
        return True


class PrefixedBuffer(io.BufferedIOBase):
    """The binary side of a `PrefixedStream`: bytes in, prefixed text out."""

    def __init__(self, text: PrefixedStream) -> None:
        self._text = text
        self._decoder = codecs.getincrementaldecoder(text.encoding)("replace")

    def write(self, data: Any) -> int:
        raw = bytes(data)
        self._text.write(self._decoder.decode(raw))
        return len(raw)

    def flush(self) -> None:
        self._text.flush()

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return self._text.isatty()

    def fileno(self) -> int:
        return self._text.fileno()

    @property
    def name(self) -> str:
        return self._text.name


class ThreadPrefixedStream(PrefixedStream):
    """The streams of a process whose replicas are threads (TPU v2/v3, XLA's CPU device with
    several devices): each replica's thread writes through a `PrefixedStream` of its own, with
    its rank's prefix and its own line state (`prefix_thread`); a line from any other thread of
    the process goes out whole, without a prefix, as it did before."""

    def __init__(self, stream: Any, lock_path: str | None = None) -> None:
        super().__init__(stream, "", lock_path)
        self.pid = os.getpid()
        self._by_thread: dict[int, PrefixedStream] = {}

    def prefix_thread(self, prefix: str) -> None:
        """The calling thread's lines get ``prefix`` from now on."""
        self._by_thread[threading.get_ident()] = PrefixedStream(self._stream, prefix,
                                                                self._lock_path)

    def write(self, text: str) -> int:
        own = self._by_thread.get(threading.get_ident())
        return own.write(text) if own is not None else super().write(text)

    def flush(self) -> None:
        own = self._by_thread.get(threading.get_ident())
        if own is not None:
            own.flush()
        else:
            super().flush()


_THREAD_STREAMS = threading.Lock()


def prefix_replica_thread(prefix: str, lock_path: str | None) -> bool:
    """In a replica that is a thread of its process: this thread's lines on the process's
    ``sys.stdout`` and ``sys.stderr`` get ``prefix``. The first replica of the process puts the
    per-thread streams in place (True: the caller's streams were replaced, for the log handlers
    to follow); the others add their thread."""
    import sys

    with _THREAD_STREAMS:
        made = not (isinstance(sys.stdout, ThreadPrefixedStream) and sys.stdout.pid == os.getpid())
        if made:
            sys.stdout = ThreadPrefixedStream(sys.stdout, lock_path)
            sys.stderr = ThreadPrefixedStream(sys.stderr, lock_path)
        for stream in (sys.stdout, sys.stderr):
            if isinstance(stream, ThreadPrefixedStream):
                stream.prefix_thread(prefix)
    return made


def _pieces(text: str) -> list[str]:
    """Split after every line end, in one pass; ``text`` ends with a line end."""
    return [piece for piece in _AFTER_LINE_END.split(text) if piece]


def rebind_log_handlers(streams: dict[int, Any]) -> None:
    """Logging handlers made before the launch that write to the caller's stdout or stderr
    (``logging.basicConfig`` in the notebook) write to this worker's prefixed streams instead.

    ``streams``: ``id`` of the stream a handler may hold -> the stream it writes to now. Only
    in the worker: the caller's handlers are untouched.
    """
    import sys

    logging = sys.modules.get("logging")
    if logging is None:  # never imported: no handler exists yet
        return
    loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
    for logger in loggers:
        for handler in getattr(logger, "handlers", ()):
            if not isinstance(handler, logging.StreamHandler) or isinstance(
                    handler, logging.FileHandler):
                continue
            target = streams.get(id(handler.stream))
            if target is not None:
                handler.setStream(target)
