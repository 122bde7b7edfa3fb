"""Failures as data, formatted in one place.

A launch that fails usually fails in one rank first; its peers then fail too ("connection closed
by peer", a killed barrier). Users need the first one. So every backend reports what it saw as
`ProcessFailure` records with a precise timestamp, and `LaunchError` orders them: the earliest
failure that carries an exception is the root cause, everything else is marked secondary.
"""

from __future__ import annotations

import signal
from collections.abc import Iterable
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class ProcessFailure:
    """What one rank left behind when it failed (or, for a timeout, where it stood)."""

    rank: int
    pid: int | None = None
    exitcode: int | None = None
    exc_type: str | None = None
    message: str = ""
    traceback: str = ""
    timestamp_ns: int = 0  # time.time_ns() when the failure was recorded; 0 when unknown
    stack: str = ""  # the Python stack at a timeout
    stderr_tail: str = ""  # last lines written to stderr, for processes that died without a word
    error_file: str | None = None
    secondary: bool = False

    @property
    def exit_cause(self) -> str:
        if self.exitcode is None:
            return "still running"
        if self.exitcode < 0:
            try:
                name = signal.Signals(-self.exitcode).name
            except ValueError:
                name = f"signal {-self.exitcode}"
            return f"killed by {name}"
        return f"exit code {self.exitcode}"

    def headline(self) -> str:
        where = f"rank {self.rank}" + (f" (pid {self.pid})" if self.pid else "")
        if self.exc_type:
            return f"{where}: {self.exc_type}: {self.message}".rstrip()
        if self.exitcode is None:
            return where
        return f"{where}: {self.exit_cause}"


def order_failures(failures: Iterable[ProcessFailure]) -> list[ProcessFailure]:
    """Root cause first (the earliest; at a tie, one that raised, then one whose exit is known)."""
    def when(f: ProcessFailure) -> tuple[int, int, int, int]:
        known_end = 0 if f.exc_type else 1 if f.exitcode is not None else 2
        return (0 if f.timestamp_ns else 1, f.timestamp_ns, known_end, f.rank)

    ordered = sorted(failures, key=when)
    return [replace(f, secondary=i > 0) for i, f in enumerate(ordered)]


def format_failures(failures: list[ProcessFailure], summary: str) -> str:
    """The one formatter: the message users read in a notebook cell or a terminal."""
    lines = [summary]
    for failure in failures:
        if failure.stack and not failure.exc_type:
            label = "stopped at the timeout"
        elif failure.secondary:
            label = "secondary failure (after the root cause)"
        else:
            label = "root cause"
        lines.append("")
        lines.append(f"[{label}] {failure.headline()}")
        if failure.traceback and not failure.secondary:
            lines.append(failure.traceback.rstrip())
        elif failure.message and not failure.exc_type:
            lines.append(f"  {failure.message}")
        if failure.stack:
            lines.append(f"Python stack of rank {failure.rank} when it was stopped "
                         "(most recent call first):")
            lines.append(failure.stack.rstrip())
        if failure.stderr_tail:
            lines.append(f"last lines rank {failure.rank} wrote to stderr:")
            lines.append(failure.stderr_tail.rstrip())
    return "\n".join(lines)


class LaunchError(RuntimeError):
    """A worker failed. ``failures`` lists what each failed rank left, root cause first."""

    def __init__(self, summary: str, failures: Iterable[ProcessFailure] = ()) -> None:
        ordered = order_failures(failures)
        self.summary = summary
        self.failures: list[ProcessFailure] = ordered
        super().__init__(format_failures(ordered, summary))

    @property
    def root_cause(self) -> ProcessFailure | None:
        return self.failures[0] if self.failures else None

    @property
    def exitcode(self) -> int:
        """The exit status a command line should end with: the root-cause rank's, or 1."""
        root = self.root_cause
        if root is None or root.exitcode is None or root.exitcode <= 0:
            return 1
        return root.exitcode

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (type(self), (self.summary, self.failures))


class LaunchTimeout(LaunchError):
    """The launch's ``timeout`` expired; ``failures`` holds each live rank's Python stack."""

    def __init__(self, summary: str, failures: Iterable[ProcessFailure] = ()) -> None:
        self.summary = summary
        self.failures = sorted(failures, key=lambda f: f.rank)
        RuntimeError.__init__(self, format_failures(self.failures, summary))
