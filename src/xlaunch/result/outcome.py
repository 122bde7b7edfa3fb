"""What a launch left, as data, and the one function that judges it.

Every backend carries out its plan and returns an `Outcome`: the result, and for each rank what
its process left - the record it wrote about its own exception, the status it exited with, the
signals the launcher or its engine sent it, its stack at a timeout. `judge` turns that into the
`LaunchError` or `LaunchTimeout` users read, or nothing when the launch succeeded.

The root cause is decided from those facts alone, never from when a thread happened to look:

- a rank that died by a signal nobody in the launch sent it (the OOM killer's SIGKILL, a SIGSEGV,
  an abort) failed on its own: a process does not die of a peer's Python exception;
- a rank that raised failed on its own, unless its error says it lost a peer ("connection closed
  by peer"): that is the consequence of another rank's failure, never its cause;
- a rank the launcher or the engine stopped (it died of the signal it was sent) is never the cause;
- a rank that ended with status 0 without its function returning (``os._exit(0)``) failed; no
  exit status is xlaunch's own, so ``os._exit(75)`` is the user's too;
- a rank whose function returned but whose process was still alive when a timeout stopped it was
  held by its own threads (a non-daemon thread it started): that is why the launch did not end;
- a rank whose function had neither returned nor raised when the timeout passed timed out,
  whatever it did while it was being stopped (asking for its stack can cut a C call short);
- a rank that died while it sent its value back failed (its value is not taken): the function
  returns only once the value is whole;
- a rank whose function returned and whose process then died of a signal nobody in the launch
  sent is the cause when the others were stopped, or lost a peer, and nothing else failed;
- when nothing failed on its own but peers lost a peer, the ranks whose function had returned
  are the cause: they left while the others still waited on them in a collective (the ranks
  called different collectives, ``if rank == 0: evaluate()``);
- among ranks that raised on their own, the earliest record (the rank's own clock) comes first.

Across machines each node judges its own ranks from these facts, and sends the others the failure
that made it stop its workers (`NodeFacts.elsewhere`, through the rendezvous's store); a node
whose ranks were only stopped, or lost a peer, leads with what another node told it. A node
that failed in its own right leads with its own failure, and lists the others' after it: that
its rank failed before it heard of another machine's failure is a fact (it would have been
stopped otherwise), where comparing two machines' clocks is not. A node silent past the
keep-alive bound is named with its ranks (`Unheard`).
"""

from __future__ import annotations

import dataclasses
import signal
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from xlaunch.names import PathName
from xlaunch.result.errors import (
    Cause,
    LaunchError,
    LaunchTimeout,
    LeftRunning,
    ProcessFailure,
    rank_ranges,
    root_cause,
)
from xlaunch.result.report import LaunchReport, RankReport

SENDING = "while sending its result back to the caller"  # a rank that died then
# How gloo, NCCL and XLA report that a peer went away: the consequence of a failure, never its cause.
PEER_LOSS = ("closed by peer", "reset by peer", "broken pipe", "remote process exited",
             "communicator was aborted", "connection refused", "connection closed",
             "peer closed", "socket closed")


@dataclass(frozen=True)
class RankExit:
    """What one rank's process left when it ended, or when the launch ended it."""

    rank: int
    pid: int | None = None
    exitcode: int | None = None  # None: not seen ending (an engine's process, or unknown); <0: signal
    record: ProcessFailure | None = None  # the rank's own record of an exception it raised
    signals_sent: frozenset[int] = frozenset()  # the owner's signals that reached it alive
    stack: str = ""  # where it stood when it was stopped at the timeout
    stderr_tail: str = ""
    returned: bool = False  # the function returned in this rank (its process may linger after)
    sending: bool = False  # it began to send its value back and had not finished
    running_at_deadline: bool = False  # its function had neither returned nor raised at the timeout
    cancelled: bool = False  # it found the launch already stopped and ran nothing
    terminated: bool = False  # its own record: it received SIGTERM (the owner's, or its engine's)


@dataclass(frozen=True)
class Unheard:
    """Another node that gave no sign of life through the store for ``seconds`` while this
    node's workers ran (it never said it ended); ``store``: the store's address when the store
    itself stopped answering this machine, so that every other node went silent at once."""

    node: int
    host: str
    ranks: tuple[int, ...]
    seconds: float
    store: str = ""


@dataclass(frozen=True)
class NodeFacts:
    """One attempt of a launch across machines, from this node: where it sat, and what the
    others told it through the rendezvous's store (their failures) or did not (`Unheard`)."""

    node: int
    host: str
    elsewhere: tuple[ProcessFailure, ...] = ()  # each node's failure, as that node judged it
    unheard: tuple[Unheard, ...] = ()


@dataclass(frozen=True)
class Outcome:
    """Everything one launch left; plain data, so `judge` can be tested without processes."""

    path: PathName
    world_size: int
    exits: tuple[RankExit, ...] = ()
    result: Any = None
    timed_out: bool = False
    timeout: float | None = None
    leader_failure: ProcessFailure | None = None  # the launch failed before any worker ran
    earlier_attempts: tuple[tuple[RankExit, ...], ...] = ()  # restarted attempts, oldest first
    nodes: NodeFacts | None = None  # several machines: this attempt's view of the other nodes
    earlier_nodes: tuple[NodeFacts | None, ...] = ()  # the same for each earlier attempt
    exception: BaseException | None = field(default=None, compare=False)  # inline: the original
    rank_reports: tuple[RankReport, ...] = ()  # what each rank that ran measured of itself
    left_running: tuple[LeftRunning, ...] = ()  # what workers started that left the group
    # Several machines, at a timeout: what this node was waiting for (a clause: "it was waiting
    # for the 2 nodes to meet at ...", "no answer from the rendezvous store at ... for 18 s").
    waiting: str = ""
    # In a notebook: the live view of the ranks (`backends.live_view`), for the caller to replace
    # with the report or clear once the launch is judged.
    live_view: Any = field(default=None, compare=False)


def classify(rank_exit: RankExit, timed_out: bool) -> Cause | None:
    """Why this rank belongs in a failure report, or None when it finished (or was never hurt)."""
    if rank_exit.cancelled:
        return None
    if timed_out and rank_exit.running_at_deadline:  # whatever it did while being stopped
        return Cause.TIMED_OUT
    record = rank_exit.record
    if record is not None:
        return Cause.LOST_PEER if lost_a_peer(record) else Cause.RAISED
    stopped = bool(rank_exit.signals_sent)
    if rank_exit.returned:  # its work was done; only a process it kept alive can be a cause
        return Cause.HELD if timed_out and stopped else None
    code = rank_exit.exitcode
    if stopped and (code is None or code >= 0 or -code in rank_exit.signals_sent):
        return Cause.TIMED_OUT if timed_out else Cause.STOPPED
    if rank_exit.terminated:  # the engine ended it (torch_xla's pool, broken by a peer's death)
        return Cause.STOPPED
    return Cause.DIED


def lost_a_peer(record: ProcessFailure) -> bool:
    text = f"{record.exc_type}: {record.message}".lower()
    return any(sign in text for sign in PEER_LOSS)


def failures_of(exits: Sequence[RankExit], timed_out: bool,
                world_size: int | None = None) -> list[ProcessFailure]:
    """The failed ranks of one attempt, root cause first.

    ``world_size``: when the attempt's exits cover fewer ranks (one node of several), a lost peer
    may have been on another machine, so no rank here is blamed for having finished.
    """
    failures = []
    for rank_exit in exits:
        cause = classify(rank_exit, timed_out)
        if cause is not None:
            failures.append(_failure(rank_exit, cause))
    if failures and all(f.secondary for f in failures):
        # Its function returned, then its process died of a signal nobody in the launch sent (the
        # out-of-memory killer as it ended): a death the owner stopped the others for.
        failures += [_failure(e, Cause.DIED) for e in exits if died_after_returning(e)]
    waiting = [f for f in failures if f.cause == Cause.LOST_PEER]
    whole = world_size is None or len(exits) >= world_size
    if waiting and whole and all(f.secondary for f in failures):
        failures += [_finished_early(e, waiting) for e in exits if e.returned]
    return sorted(failures, key=precedence)


def died_after_returning(rank_exit: RankExit) -> bool:
    code = rank_exit.exitcode
    return (rank_exit.returned and rank_exit.record is None and code is not None and code < 0
            and -code not in rank_exit.signals_sent)


def precedence(failure: ProcessFailure) -> tuple[int, int, int]:
    """Where a failure stands among the others: the smallest is the root cause."""
    timed = failure.cause in (Cause.RAISED, Cause.LOST_PEER)  # the rank's own clock says when
    return (failure.cause.precedence, failure.timestamp_ns if timed else 0, failure.rank)


def _failure(rank_exit: RankExit, cause: Cause) -> ProcessFailure:
    base = rank_exit.record or ProcessFailure(rank=rank_exit.rank)
    message = base.message
    if cause == Cause.DIED and not base.exc_type:
        message = _died(rank_exit.exitcode)
        if rank_exit.sending:
            message = f"{SENDING}, it {message}"
        elif rank_exit.returned:
            message = ("its function returned, then its process was ended by a signal nobody "
                       "in the launch sent (the out-of-memory killer does this) before it "
                       "could exit; its peers were stopped for it, or lost it")
    elif cause == Cause.HELD:
        message = ("threads it started (not daemon threads) keep its process alive. Make them "
                   "daemon threads, or stop and join them before the function returns; their "
                   "stacks are below")
    # The status a rank meant to exit with is in its own record (``sys.exit(21)``); a process
    # that several replicas share, or that the pool ended afterwards, exits otherwise.
    exitcode = rank_exit.exitcode if rank_exit.record is None else base.exitcode
    return dataclasses.replace(
        base, rank=rank_exit.rank, pid=rank_exit.pid or base.pid,
        exitcode=exitcode if exitcode is not None else rank_exit.exitcode,
        message=message, stack=rank_exit.stack, stderr_tail=rank_exit.stderr_tail, cause=cause)


def _died(exitcode: int | None) -> str:
    """What a death without a Python exception usually means, by the signal that ended it."""
    if exitcode is None:  # an engine's process: its status went to the engine (torch_xla's pool)
        return ("its process ended before its function returned, without raising a Python "
                "exception and without a crash dump, and nobody in the launch stopped it: killed "
                "by SIGKILL (the out-of-memory killer does this) or ended by os._exit() "
                "(os._exit(0) included); its last stderr lines may say which")
    if exitcode == 0:
        return ("ended its process with status 0 before its function returned: os._exit(0), "
                "or a library that exits the process; its peers lost it")
    if exitcode > 0:
        return ("ended without raising a Python exception in the function: os._exit(), or "
                "an error before the function started (its stderr says which)")
    if -exitcode == signal.SIGKILL:
        return ("ended without raising a Python exception: killed by a signal nobody in the "
                "launch sent (the out-of-memory killer does this) or a crash")
    if -exitcode == signal.SIGABRT:
        return ("ended without raising a Python exception: aborted by native code (a failed "
                "check or abort() in a C++ library such as XLA, libtpu or a collective); the "
                "reason is in its last stderr lines")
    if -exitcode in (signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE):
        return ("ended without raising a Python exception: crashed in native code (a C or C++ "
                "extension); its last stderr lines may say where")
    return ("ended without raising a Python exception: killed by a signal nobody in the launch "
            "sent")


def _finished_early(rank_exit: RankExit, waiting: Sequence[ProcessFailure]) -> ProcessFailure:
    """A rank whose function returned while ``waiting`` still waited on it in a collective."""
    ranks = rank_ranges(f.rank for f in waiting)
    where = []
    for failure in waiting:
        if failure.traceback and all(failure.traceback != w.traceback for w in waiting
                                     if w.rank < failure.rank):
            where.append(f"rank {failure.rank} was waiting here:\n{failure.traceback.rstrip()}\n")
    return ProcessFailure(
        rank=rank_exit.rank, pid=rank_exit.pid,
        exitcode=rank_exit.exitcode if rank_exit.exitcode is not None else 0,
        message=f"{ranks} still waited on it in a collective that this rank never called: "
                "the ranks called different collectives, for example a barrier or an "
                "all-reduce under `if rank == 0:`",
        traceback="".join(where), cause=Cause.FINISHED_EARLY)


def judge(outcome: Outcome, report: LaunchReport | None = None) -> LaunchError | None:
    """The error this outcome amounts to (carrying ``report``, which then names the root cause
    too), or None when the launch succeeded."""
    attempts = [*outcome.earlier_attempts, outcome.exits]
    exits = attempts[-1]
    nodes = [*outcome.earlier_nodes, *[None] * len(attempts)]
    earlier = [across_nodes(failures_of(attempt, False, outcome.world_size), nodes[number])
               for number, attempt in enumerate(attempts[:-1])]
    if outcome.leader_failure is not None:
        leader = dataclasses.replace(outcome.leader_failure, cause=Cause.LEADER)
        return LaunchError(f"the {outcome.path} launch failed before any worker ran",
                           [leader], earlier_attempts=earlier, report=_told(report, [leader]),
                           left_running=outcome.left_running)
    failures = failures_of(exits, outcome.timed_out, outcome.world_size)
    if outcome.timed_out:  # the verdict is the timeout, whatever another node said meanwhile
        failures = across_nodes(failures, _only_here(outcome.nodes))
        return LaunchTimeout(_timeout_summary(outcome, failures), failures,
                             earlier_attempts=earlier, report=report,
                             left_running=outcome.left_running)
    failures = across_nodes(failures, outcome.nodes)
    if not failures:
        return None
    return LaunchError(_summary(outcome, failures), failures, earlier_attempts=earlier,
                       report=_told(report, failures), left_running=outcome.left_running)


def across_nodes(failures: list[ProcessFailure], nodes: NodeFacts | None) -> list[ProcessFailure]:
    """This node's failures, each marked with its node, and what the other nodes told it: their
    failures in their own right after this node's own, before its secondary ones. So the root
    cause is this node's own failure when it has one, else the failure another node told. A
    node whose ranks all finished succeeded, whatever another node said of its own."""
    if nodes is None or not failures:
        return failures
    here = [dataclasses.replace(f, node=nodes.node, host=nodes.host) for f in failures]
    there = sorted((f for f in nodes.elsewhere if not f.secondary), key=precedence)
    there += [failure for node in nodes.unheard for failure in _unheard(node)]
    return [*(f for f in here if not f.secondary), *there, *(f for f in here if f.secondary)]


def _unheard(node: Unheard) -> list[ProcessFailure]:
    """The ranks of a node that went silent, each a failure in its own right."""
    if node.store:
        why = (f"no sign of life for {node.seconds:.0f} s: the rendezvous store at {node.store} "
               "stopped answering this machine, so every other node went silent at once (this "
               "machine cut off from the others, or the store's host down)")
    else:
        why = (f"no sign of life through the rendezvous store for {node.seconds:.0f} s, and it "
               "never said it ended (its network cut off, or its machine or launcher gone)")
    return [ProcessFailure(rank=rank, message=why, cause=Cause.UNREACHABLE, node=node.node,
                           host=node.host) for rank in node.ranks]


def _only_here(nodes: NodeFacts | None) -> NodeFacts | None:
    return None if nodes is None else NodeFacts(nodes.node, nodes.host)


def node_failure(rank_exit: RankExit) -> ProcessFailure | None:
    """What a node tells the others about one of its ranks that ended in failure before any
    stop: the rank judged from its own facts, as `failures_of` would."""
    cause = classify(rank_exit, False)
    return None if cause is None else _failure(rank_exit, cause)


def cause_elsewhere(exits: Sequence[RankExit], world_size: int) -> bool:
    """Whether this node's ranks failed only as a consequence (stopped, or lost a peer): the
    cause is on another node, and its word is worth a short wait."""
    failures = failures_of(exits, False, world_size)
    return bool(failures) and all(failure.secondary for failure in failures)


def lead_line(failure: ProcessFailure, ranks: Sequence[int] = ()) -> str:
    """``rank 3 on node 1 (host h2) raised RuntimeError: its message's first line``."""
    text = f"{rank_ranges(ranks or [failure.rank])}{failure.place()} {_verb(failure)}"
    first = failure.message.strip().splitlines()[0] if failure.message.strip() else ""
    if failure.exc_type and first:
        text += f": {first[:200]}{'...' if len(first) > 200 else ''}"
    return text


def restarting(error: LaunchError, number: int, attempts: int) -> str:
    """The line every node says when it restarts: the attempt, and the failure that ended the
    last one, wherever it happened."""
    lead = error.root_cause
    why = lead_line(lead) if lead is not None else error.summary
    return f"restarting (attempt {number} of {attempts}) after {why}"


def _told(report: LaunchReport | None, failures: list[ProcessFailure]) -> LaunchReport | None:
    lead = root_cause(failures) or (failures[0] if failures else None)
    if report is None or lead is None:
        return report
    return dataclasses.replace(report, root_cause=lead_line(lead))


def _summary(outcome: Outcome, failures: list[ProcessFailure]) -> str:
    lead = root_cause(failures) or failures[0]
    ranks = [lead.rank]
    if lead.cause == Cause.UNREACHABLE:  # a node: all its ranks
        ranks = [f.rank for f in failures if f.cause == lead.cause and f.node == lead.node]
    text = f"the launch failed: {rank_ranges(ranks)}{lead.place()} {_verb(lead)}"
    others = len({(f.node, f.rank) for f in failures}) - len(ranks)
    if others:
        text += f"; {others} other rank{'s' if others > 1 else ''} of {outcome.world_size} failed"
    return text


def _verb(failure: ProcessFailure) -> str:
    if failure.cause == Cause.UNREACHABLE:
        return "gave no sign of life through the rendezvous store"
    if failure.cause == Cause.DIED and failure.message.startswith(SENDING):
        return f"{failure.exit_cause} {SENDING}"
    if failure.cause == Cause.DIED:
        how = f" ({failure.exit_cause})" if failure.exitcode is not None else ""
        return f"ended without an exception{how}"
    if failure.cause == Cause.FINISHED_EARLY:
        return "finished (its function returned) while its peers still waited on it"
    if failure.exc_type:
        return f"raised {failure.exc_type}"
    return failure.exit_cause


def _timeout_summary(outcome: Outcome, failures: list[ProcessFailure]) -> str:
    held = [f.rank for f in failures if f.cause == Cause.HELD]
    running = [f for f in failures if f.cause == Cause.TIMED_OUT]
    where = "" if running or held else " (no worker had started yet)"
    if held:
        where = f" ({rank_ranges(held)} had finished, held by its own threads)"
    waiting = f"; {outcome.waiting}" if outcome.waiting else ""
    return (f"the launch did not finish within timeout={outcome.timeout} s and was "
            f"stopped{where}{waiting}")

