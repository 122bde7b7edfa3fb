"""Failures as data, formatted in one place.

A launch that fails usually fails in one rank first; its peers then fail too ("connection closed
by peer", a barrier stopped by the launcher). Users need the first one. `outcome.judge` decides
which failure is which from facts each process left (its own record, the signal it died of, the
signals the launcher sent it); this module holds the record and turns a judged list into the
message users read in a notebook cell or a terminal.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import signal
import time
import traceback
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from xlaunch.result.report import LaunchReport

class Cause(str, enum.Enum):
    """Why a rank appears in a failure report: the judgement `outcome.judge` makes from the facts.

    Each cause carries its precedence (the root cause is the first failure in its own right, in
    this order), the label the report shows, and whether it is secondary (a consequence of
    another rank's failure, never a cause). A str, so ``failure.cause == "raised"`` reads.
    """

    precedence: int
    label: str
    secondary: bool

    def __new__(cls, code: str, precedence: int, label: str, secondary: bool) -> Cause:
        member = str.__new__(cls, code)
        member._value_ = code
        member.precedence, member.label, member.secondary = precedence, label, secondary
        return member

    LEADER = "leader", 0, "failed", False  # the launch (or its leader) failed before a worker ran
    DIED = "died", 1, "failed", False  # a signal nobody in the launch sent, or an exit unexplained
    RAISED = "raised", 2, "failed", False  # raised an exception of its own
    FINISHED_EARLY = "finished-early", 3, "failed", False  # returned while peers waited on it
    HELD = "held-by-threads", 4, "finished, held by its own threads", False  # returned, lived on
    LOST_PEER = "lost-peer", 5, "secondary: lost a peer", True  # its error says a peer went away
    STOPPED = "stopped", 6, "secondary: stopped by the launcher", True  # after another failed
    TIMED_OUT = "timed-out", 6, "stopped at the timeout", True  # its stack says where it stood
    # Several machines: another node's ranks, silent through the store past the keep-alive
    # bound (that node cut off, or down), or the store itself silent (this machine cut off).
    UNREACHABLE = "unreachable", 1, "not heard from", False


_CAUSES = {cause.value: cause for cause in Cause}
MESSAGE_LIMIT = 4000  # characters of a rank's message kept in the error; the rest in a file
TRACEBACK_LIMIT = 24000  # characters of its traceback, likewise
# What a node sends the others through the store about a failure (`ProcessFailure.to_share`):
# the traceback's last lines and the stderr's, within these.
SHARED_TRACEBACK_LIMIT = 6000
SHARED_TAIL_LIMIT = 2000


@dataclass(frozen=True)
class ProcessFailure:
    """What one rank left behind when it failed (or, at a timeout, where it stood)."""

    rank: int
    pid: int | None = None
    exitcode: int | None = None  # None: still running or unknown; negative: killed by that signal
    exc_type: str | None = None
    message: str = ""
    traceback: str = ""
    timestamp_ns: int = 0  # time.time_ns() in the rank itself when it recorded the exception
    stack: str = ""  # the Python stack at a timeout
    stderr_tail: str = ""  # last lines written to stderr, for processes that died without a word
    error_file: str | None = None
    cause: Cause = Cause.RAISED
    full_text: str | None = None  # a file with the whole message and traceback, when cut here
    # Several machines: the node the rank ran on and that machine's host name (None: one machine)
    node: int | None = None
    host: str = ""
    told: bool = False  # another node's launch told this one, through the store

    @property
    def secondary(self) -> bool:
        """A consequence of another rank's failure, not a failure in its own right."""
        return self.cause.secondary

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
        where = "the launch" if self.cause == Cause.LEADER else f"rank {self.rank}"
        where += (f" (pid {self.pid})" if self.pid else "") + self.place()
        return f"{where}: {self.what()}" if self.what() else where

    def place(self) -> str:
        """`` on node 1 (host xlhost2)`` for a launch across machines; empty on one machine."""
        if self.node is None:
            return ""
        return f" on node {self.node}" + (f" (host {self.host})" if self.host else "")

    def what(self) -> str:
        if self.cause == Cause.FINISHED_EARLY:
            return "returned early"
        if self.cause == Cause.HELD:
            return "its function returned, but its process did not end"
        if self.exc_type:
            return f"{self.exc_type}: {self.message}".rstrip().rstrip(":")
        if self.exitcode is None:
            return ""
        return self.exit_cause

    # --- the record file a rank writes about itself ------------------------------------------

    @classmethod
    def from_exception(cls, error: BaseException, *, rank: int, exitcode: int = 1,
                       skip_frames: int = 0) -> ProcessFailure:
        """This process's record of ``error``, stamped now; ``skip_frames`` drops launcher frames."""
        tb = error.__traceback__
        for _ in range(skip_frames):
            tb = tb.tb_next if tb is not None and tb.tb_next is not None else tb
        return cls(rank=rank, pid=os.getpid(), exitcode=exitcode, exc_type=type(error).__qualname__,
                   message=exception_text(error), timestamp_ns=time.time_ns(),
                   traceback="".join(traceback.format_exception(type(error), error, tb)))

    def bounded(self) -> tuple[ProcessFailure, str | None]:
        """This record with its message and traceback cut to a size a notebook shows at once,
        and the whole text when something was cut (None when nothing was)."""
        if len(self.message) <= MESSAGE_LIMIT and len(self.traceback) <= TRACEBACK_LIMIT:
            return self, None
        # A traceback ends with the exception's own line: the message once, not twice.
        whole = self.traceback if self.message in self.traceback else (
            f"{self.exc_type}: {self.message}\n\n{self.traceback}")
        return dataclasses.replace(self, message=_cut(self.message, MESSAGE_LIMIT),
                                   traceback=_cut(self.traceback, TRACEBACK_LIMIT)), whole

    def to_share(self) -> ProcessFailure:
        """This record as a node sends it to the others through the store: bounded, plain, and
        without what only this machine can read (its files, its stack at a timeout)."""
        return dataclasses.replace(
            self, message=_cut(self.message, MESSAGE_LIMIT),
            traceback=_last(self.traceback, SHARED_TRACEBACK_LIMIT),
            stderr_tail=_last(self.stderr_tail, SHARED_TAIL_LIMIT), stack="", error_file=None,
            full_text=None)

    def to_json(self) -> str:
        return json.dumps({**dataclasses.asdict(self), "cause": self.cause.value})

    @classmethod
    def from_json(cls, text: str, error_file: str | None = None) -> ProcessFailure:
        """Read a record; fields a newer or older writer added or dropped are ignored."""
        data: dict[str, Any] = json.loads(text)
        known = {f.name for f in dataclasses.fields(cls)}
        record = cls(**{key: value for key, value in data.items() if key in known})
        record = dataclasses.replace(record, cause=_CAUSES[str(record.cause)])
        return dataclasses.replace(record, error_file=error_file) if error_file else record


def _cut(text: str, limit: int) -> str:
    """The start and the end of ``text`` (where a message and a traceback say the most)."""
    if len(text) <= limit:
        return text
    head, tail = limit * 2 // 3, limit // 3
    return f"{text[:head]}\n... ({len(text) - head - tail} characters cut: the whole text is in " \
           f"the file the error names) ...\n{text[-tail:]}"


def _last(text: str, limit: int) -> str:
    """The last whole lines of ``text`` within ``limit`` characters (a traceback's end)."""
    if len(text) <= limit:
        return text
    kept = text[-limit:]
    kept = kept[kept.find("\n") + 1:] if "\n" in kept else kept
    return f"... ({len(text) - len(kept)} characters before these lines cut)\n{kept}"


def root_cause(failures: Sequence[ProcessFailure]) -> ProcessFailure | None:
    """The one choice of root cause, for the headline, the report and ``.root_cause`` alike:
    the first failure in its own right (``failures`` are in precedence order); with none, the
    first rank that lost a peer (the peer that failed was elsewhere); else nothing."""
    own = [failure for failure in failures if not failure.secondary]
    if own:
        return own[0]
    lost = [failure for failure in failures if failure.cause == Cause.LOST_PEER]
    return lost[0] if lost else None


def exception_text(error: BaseException) -> str:
    """``str(error)``, or what went wrong with it: a broken ``__str__`` must not hide the error."""
    try:
        return str(error)
    except Exception as broken:  # the user's __str__ may raise anything
        try:
            why = f"{type(broken).__qualname__}: {broken}"
        except Exception:
            why = type(broken).__qualname__
        return f"<its __str__ raised {why}>"


def rank_ranges(ranks: Iterable[int]) -> str:
    """``[0, 1, 2, 3, 5]`` -> ``"ranks 0-3, 5"``; one rank -> ``"rank 5"``."""
    ordered = sorted(set(ranks))
    spans: list[str] = []
    start = previous = ordered[0]
    for rank in [*ordered[1:], None]:
        if rank is not None and rank == previous + 1:
            previous = rank
            continue
        spans.append(str(start) if start == previous else f"{start}-{previous}")
        if rank is not None:
            start = previous = rank
    return ("rank " if len(ordered) == 1 else "ranks ") + ", ".join(spans)


def group_failures(failures: Sequence[ProcessFailure]) -> list[list[ProcessFailure]]:
    """Ranks that failed the same way form one group, placed where its first member stands.

    Eight TPU cores hitting one bug are one entry with one traceback, not eight.
    """
    groups: dict[tuple[Any, ...], list[ProcessFailure]] = {}
    for failure in failures:
        same = (failure.cause, failure.exc_type, failure.message, failure.node,
                failure.exitcode if not failure.exc_type else None, bool(failure.stack))
        key = same if not failure.stack else (*same, failure.rank)  # stacks differ per rank
        groups.setdefault(key, []).append(failure)
    return list(groups.values())


@dataclass(frozen=True)
class LeftRunning:
    """A process a worker started that left the launch's process group and still ran when the
    launch ended: not killed (it left on purpose), named with its pid."""

    pid: int
    command: str


def left_running_text(left: Sequence[LeftRunning]) -> str:
    """What a launch says of the processes it left running (empty when there are none)."""
    if not left:
        return ""
    many = len(left) > 1
    which = "; ".join(f"pid {process.pid} ({process.command})" for process in left)
    pids = " ".join(str(process.pid) for process in left)
    return (f"{'processes' if many else 'a process'} a worker started left the launch's process "
            f"group (os.setsid(), start_new_session=True or process_group=0) and "
            f"{'are' if many else 'is'} left running: {which}; `kill {pids}` ends "
            f"{'them' if many else 'it'}")


def format_failures(failures: Sequence[ProcessFailure], summary: str) -> str:
    """The one formatter: the message users read in a notebook cell or a terminal."""
    lines = [summary]
    root = root_cause(failures)
    for group in group_failures(failures):
        first = group[0]
        label = "root cause" if root is not None and root in group else first.cause.label
        pids = [f.pid for f in group if f.pid]
        where = "the launch" if first.cause == Cause.LEADER else rank_ranges(f.rank for f in group)
        if len(pids) == 1:
            where += f" (pid {pids[0]})"
        where += first.place()
        lines += ["", f"[{label}] {where}" + (f": {first.what()}" if first.what() else "")]
        if label == "root cause" and first.secondary:
            lines.append("  (it lost a peer; the peer that failed left no record here: "
                         "look at the other machine's output)")
        elif first.told:
            lines.append(f"  (told by node {first.node}'s launch through the rendezvous store; "
                         "its whole output is on that machine)")
        lines += _details(first)
    return "\n".join(lines)


def _details(failure: ProcessFailure) -> list[str]:
    lines = []
    if failure.message and not failure.exc_type:
        lines.append(f"  {failure.message}")
    if failure.traceback and not failure.secondary:
        lines.append(failure.traceback.rstrip())
    if failure.full_text:
        lines.append(f"(cut above; the whole message and traceback of rank {failure.rank}: "
                     f"{failure.full_text})")
    if failure.stack:
        lines.append(f"Python stack of rank {failure.rank} when it was stopped "
                     "(most recent call first):")
        lines.append(failure.stack.rstrip())
    if failure.stderr_tail:
        lines.append(f"last lines rank {failure.rank} wrote to stderr:")
        lines.append(failure.stderr_tail.rstrip())
    return lines


class LaunchError(RuntimeError):
    """A worker failed. ``failures`` lists each failed rank, root cause first.

    ``earlier_attempts`` holds the failures of attempts that were restarted (``max_restarts``);
    ``report`` is the `LaunchReport` of the workers that ran, when there is one.
    """

    def __init__(self, summary: str, failures: Iterable[ProcessFailure] = (), *,
                 earlier_attempts: Sequence[Sequence[ProcessFailure]] = (),
                 report: LaunchReport | None = None,
                 left_running: Sequence[LeftRunning] = ()) -> None:
        self.summary = summary
        self.failures: list[ProcessFailure] = list(failures)
        self.earlier_attempts = [list(attempt) for attempt in earlier_attempts]
        self.report = report
        self.left_running = list(left_running)  # what a worker started and detached, still running
        super().__init__(self._text())

    def _text(self) -> str:
        text = format_failures(self.failures, self.summary)
        warnings = self.report.warnings if self.report is not None else ()
        if warnings:
            text += "\n\nthe launch report (error.report) warned:" + "".join(
                f"\n  - {warning}" for warning in warnings)
        for number, attempt in enumerate(self.earlier_attempts, start=1):
            first = root_cause(attempt) or (attempt[0] if attempt else None)
            if first is not None:
                text += (f"\n\nattempt {number} (restarted) failed first with "
                         f"{first.headline()}")
                if first.traceback:
                    text += "\n" + first.traceback.rstrip()
        if self.left_running:
            text += "\n\n" + left_running_text(self.left_running)
        return text

    @property
    def root_cause(self) -> ProcessFailure | None:
        """The first rank to fail in its own right; a peer's error when nothing else is known."""
        return root_cause(self.failures)

    @property
    def exitcode(self) -> int:
        """The exit status a command line should end with: the root-cause rank's, or 1."""
        root = self.root_cause
        if root is None or root.exitcode is None or root.exitcode <= 0:
            return 1
        return root.exitcode

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (_rebuild, (type(self), self.summary, self.failures, self.earlier_attempts,
                           self.left_running))


class LaunchTimeout(LaunchError):
    """The launch's ``timeout`` expired; ``failures`` holds each live rank's Python stack."""


def _rebuild(kind: type[LaunchError], summary: str, failures: list[ProcessFailure],
             earlier: list[list[ProcessFailure]],
             left_running: Sequence[LeftRunning] = ()) -> LaunchError:
    return kind(summary, failures, earlier_attempts=earlier, left_running=left_running)
