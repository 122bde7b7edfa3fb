"""The one stop order at a timeout, every path's (backends/supervise.py, `Attempt.expire`): the
ranks that had settled are read first, then the launch is marked cancelled, then each live
worker is asked for its stack, then everything is stopped (SIGTERM, the grace, SIGKILL).

Real processes under a real owner; the starter is the smallest one a path could be."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from xlaunch.backends.exits import AttemptFiles, dist_exits
from xlaunch.backends.processes import ProcessEnd, ProcessSet
from xlaunch.backends.supervise import Attempt, supervise
from xlaunch.plan.specs import InlineSpec, LaunchPlan
from xlaunch.result.outcome import Outcome, RankExit
from xlaunch.worker.launch_dir import CANCELLED, LaunchDir, Mark, note, write_pid

pytestmark = pytest.mark.skipif(not os.path.exists("/proc"), reason="Linux's /proc")


def worker(folder: str, cancel_marker: str, rank: int) -> None:
    """Rank 0 returns at once (settled before the deadline); rank 1 waits, and writes down what
    it saw at each signal: whether the launch was marked cancelled when its stack was asked,
    and whether its stack had been asked when SIGTERM came."""
    attempt = Path(folder)
    seen = attempt / f"seen-{rank}"

    def on_stack(number: int, frame: object) -> None:
        with open(seen, "a") as out:
            out.write(f"stack cancelled={os.path.exists(cancel_marker)}\n")
        (attempt / f"stack-{rank}").write_text(f'  File "train.py", line 1, in rank{rank}\n')

    def on_term(number: int, frame: object) -> None:
        with open(seen, "a") as out:
            out.write("term\n")
        os._exit(0)

    signal.signal(signal.SIGUSR1, on_stack)
    signal.signal(signal.SIGTERM, on_term)
    write_pid(attempt, rank, rank)
    if rank == 0:
        note(attempt, Mark.RETURNED, 0)
        time.sleep(60)  # returned, and still alive at the deadline
    while True:
        time.sleep(0.05)


class Starter:
    def prepare(self, attempt: Attempt) -> None:
        pass

    def start(self, attempt: Attempt, owner: ProcessSet) -> None:
        processes = [owner.start("fork", worker, (str(attempt.folder),
                                                  str(attempt.folder / CANCELLED), rank),
                                 f"rank-{rank}") for rank in range(2)]
        pending = list(processes)
        while pending:
            for process in owner.wait(pending, None):
                pending.remove(process)

    def must_stop(self, attempt: Attempt) -> bool:
        return False

    def exits(self, attempt: Attempt, ends: Sequence[ProcessEnd],
              files: AttemptFiles) -> tuple[RankExit, ...]:
        return dist_exits(ends, files, 0)

    def outcome(self, attempt: Attempt, outcome: Outcome) -> Outcome:
        return outcome


def test_at_the_deadline_settled_then_cancelled_then_stacks_then_the_stop(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))  # this test's own launch folder
    launch_dir = LaunchDir.create()
    plan = LaunchPlan("cpu", 2, 2, InlineSpec(), timeout=2.0, stop_grace=5.0)
    attempt = Attempt(plan, launch_dir, 0, Starter())
    try:
        timed_out = supervise(attempt, plan.timeout)
        outcome = attempt.outcome(timed_out)
    finally:
        attempt.end()
    assert timed_out
    assert attempt.settled_at_deadline == frozenset({0})  # read before anything was stopped
    seen = (attempt.folder / "seen-1").read_text().splitlines()
    assert seen == ["stack cancelled=True", "term"]  # cancelled, then asked, then stopped
    by_rank = {rank_exit.rank: rank_exit for rank_exit in outcome.exits}
    assert by_rank[0].returned and not by_rank[0].running_at_deadline
    assert by_rank[1].running_at_deadline and "in rank1" in by_rank[1].stack
    assert signal.SIGTERM in by_rank[1].signals_sent
    launch_dir.remove()
