"""One attempt's view of the other nodes, through the rendezvous's store, kept by a daemon thread.

What each node writes, under xlaunch's own keys (per attempt, so a restart starts clean):

- ``FAILURE_KEY``/<node>/<n>: that node's n-th failure told (a `ProcessFailure` record as JSON,
  bounded: `ProcessFailure.to_share`), then ``FAILED_KEY`` counts it: a node that sees the count
  grow reads the records it has not read yet, and stops its own workers. A node tells its first
  failed rank, then any later one that ranks before all it told (its ranks' ends are seen in no
  fixed order: a rank that lost its peer can end before the peer that raised), each under a key
  of its own, so none is overwritten before every node read it;
- ``ALIVE_KEY``/<node>: a counter it adds to every ``keep_alive_interval`` while its attempt runs,
  and adds ``ENDED`` to when its attempt has ended (its workers all gone): a node not heard from
  for ``keep_alive_interval x keep_alive_max_attempt`` that never said it ended is lost (torch
  elastic's c10d rendezvous drops a node by the same rule and the same settings).

The store is on another machine: a call can block for minutes when that machine is cut off (no
reset arrives). Only this thread calls it; the launch thread reads what it found, and the time
of the last call that came back: when that grows past the bound, the store stopped answering
this machine. A call that fails at once means the store's host ended its launch (or its
launcher died): there is nothing more to hear, and nothing to hold against anyone.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from xlaunch.result.errors import ProcessFailure

FAILED_KEY = "xlaunch/failed/attempt_{attempt}"  # how many nodes told a failure
FAILURE_KEY = "xlaunch/failure/attempt_{attempt}/{node}/{told}"  # its told-th failure, as JSON
ALIVE_KEY = "xlaunch/alive/attempt_{attempt}/{node}"  # that node's heartbeats; + ENDED at its end
ENDED = 1 << 40
FAILED_AT_ONCE_S = 1.0  # a store call that fails sooner was refused: the store's host has gone


class StoreWatch:
    def __init__(self, store: Any, attempt: int, node: int, others: list[int],
                 interval: float, beat: float, current: Callable[[], bool]) -> None:
        self.store, self.attempt, self.node, self.others = store, attempt, node, others
        self.interval, self.beat, self.current = interval, beat, current
        now = time.monotonic()
        self.answered_at = now  # the last store call that came back
        self.heard_at = dict.fromkeys(others, now)  # each node's last heartbeat seen
        self.ended: set[int] = set()
        self.records: dict[tuple[int, int], ProcessFailure] = {}  # (node, n) -> its n-th told
        self.gone = False  # the store refused a call: its host ended; nothing more to hear
        self.stopped = False  # this thread has ended (superseded, closed, or the store lost)
        self._beats: dict[int, int] = {}
        self.changed = threading.Condition()
        threading.Thread(target=self._run, daemon=True, name="xlaunch-store-watch").start()

    def key(self, template: str, node: int | None = None, told: int = 0) -> str:
        return template.format(attempt=self.attempt, node=self.node if node is None else node,
                               told=told)

    # --- in its own thread ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._watch()
        finally:
            with self.changed:
                self.stopped = True
                self.changed.notify_all()

    def _watch(self) -> None:
        told = 0
        next_beat = 0.0
        while self.current():
            calling = time.monotonic()
            try:
                count = self._call(self.store.add, self.key(FAILED_KEY), 0)
                if count > told:
                    told = count
                    self._read_records()
                if time.monotonic() >= next_beat:
                    next_beat = time.monotonic() + self.beat
                    self._call(self.store.add, self.key(ALIVE_KEY), 1)
                    self._hear()
            except Exception:  # refused at once: its host ended; else cut off (answered_at stays)
                self.gone = time.monotonic() - calling < FAILED_AT_ONCE_S
                return
            finally:
                with self.changed:
                    self.changed.notify_all()
            time.sleep(self.interval)

    def _call(self, method: Callable[..., Any], *arguments: Any) -> Any:
        answer = method(*arguments)
        self.answered_at = time.monotonic()
        return answer

    def _read_records(self) -> None:
        """Each node's told failures not read yet, in its order (a record is set before it is
        counted: one a slower telling thread has not set yet is read at its own count)."""
        for node in self.others:
            told = sum(1 for other, _ in self.records if other == node)
            while self._call(self.store.check, [key := self.key(FAILURE_KEY, node, told)]):
                record = ProcessFailure.from_json(self._call(self.store.get, key).decode())
                self.records[(node, told)] = record
                told += 1

    def _hear(self) -> None:
        for node in self.others:
            beats = self._call(self.store.add, self.key(ALIVE_KEY, node), 0)
            if beats != self._beats.get(node):
                self._beats[node] = beats
                self.heard_at[node] = time.monotonic()
            if beats >= ENDED:
                self.ended.add(node)

    # --- in the launch thread or the caller's: what was found, never a store call -----------

    def silent(self) -> tuple[float, dict[int, float]]:
        """How long the store has not answered, and each node not heard from (those that said
        they ended left out); nothing while the store's host has gone."""
        now = time.monotonic()
        if self.gone:
            return 0.0, {}
        return now - self.answered_at, {node: now - self.heard_at[node] for node in self.others
                                        if node not in self.ended}

    def wait_for_cause(self, seconds: float) -> None:
        """Until another node told a failure in its own right, or ``seconds`` passed."""
        deadline = time.monotonic() + seconds
        with self.changed:
            while not any(not r.secondary for r in self.records.values()) and not self.stopped:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self.changed.wait(left)
