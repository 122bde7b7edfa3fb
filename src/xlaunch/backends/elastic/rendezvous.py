"""Several machines: torch elastic's rendezvous places this node; its store carries the rest.

The rendezvous is the engine's own, through its public handler registry (``static`` or ``c10d``,
``etcd`` where installed): ``next_rendezvous()`` returns this node's rank among the nodes, a store
every node shares, and the address of the store the workers bootstrap their group from. Workers
start here as on one machine (`starter.DistStarter`), with global ranks
``node rank x processes per node + local rank``.

What torch elastic's agent would add is done through that store, under keys of xlaunch's own
(`watch`): a node whose worker fails tells the others which rank failed and how (the record the
judge made of it), and every node stops its workers when one has (a restart is then an attempt on
every node, meeting again); a node that stopped for another's failure leads its error with it
(`result.outcome.across_nodes`). Every node beats while its attempt runs: a node silent past the
keep-alive bound, or a store that stops answering, ends the attempt (without ``timeout=``, or
with the bound in ``rdzv_conf``). Waits for other nodes happen inside the store's C++ calls, which
nothing can interrupt: they are bounded by the launch's own timeout, and run off the launch
thread (the meeting in a thread of its own, which the launch leaves at its timeout or stop).
"""

from __future__ import annotations

import dataclasses
import json
import math
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from xlaunch.backends.elastic.watch import ALIVE_KEY, ENDED, FAILED_KEY, FAILURE_KEY, StoreWatch
from xlaunch.backends.environment import World
from xlaunch.backends.processes import LaunchStopped
from xlaunch.names import CHECK_S
from xlaunch.plan.specs import ElasticSpec, LaunchPlan
from xlaunch.result.errors import ProcessFailure
from xlaunch.result.outcome import (
    NodeFacts,
    RankExit,
    Unheard,
    cause_elsewhere,
    lead_line,
    node_failure,
    precedence,
)

# /<node rank>: that node's process count and host name
PROCESSES_KEY = "xlaunch/processes/attempt_{attempt}"
# A machine waiting for the others says so after this long, then again at this interval: a
# rendezvous nobody else reaches waits in silence otherwise, up to the engine's own bound.
SAY_WAITING_AFTER_S = 5.0
SAY_AGAIN_EVERY_S = 30.0
# torch elastic's own bound on a rendezvous (static's ``timeout``, c10d's ``join_timeout``),
# where neither ``timeout=`` nor ``rdzv_conf`` gives one.
ENGINE_BOUND_S = 600
C10D_READ_TIMEOUT_S = 60  # torch elastic's c10d: each call to its store, reaching it included
# Leaving the rendezvous tells the store; a store cut off is not waited for longer than this.
CLOSE_WAIT_S = 5.0
# A node whose workers were only stopped, or lost a peer, waits this long at most for the other
# node's word on why (it is told at the failure, before that node stops anything).
CAUSE_WAIT_S = 5.0
# torch elastic's c10d defaults: a node beats every interval; silent for max_attempt of them, lost.
KEEP_ALIVE_INTERVAL_S = 5
KEEP_ALIVE_MAX_ATTEMPT = 3


class NodeRendezvous:
    def __init__(self, plan: LaunchPlan, spec: ElasticSpec, port: int) -> None:
        self.plan, self.spec = plan, spec
        self.endpoint = spec.rdzv_endpoint or f"{spec.master_addr}:{port}"
        self.handler: Any = None  # made at the first meeting, in the launch thread
        self.store: Any = None
        self.node_rank = spec.node_rank
        self.host = socket.gethostname()
        self.hosts: list[str] = []  # each node's host name, by node rank
        self._watches: dict[int, StoreWatch] = {}  # attempt -> what the store says of the others
        self._attempt = -1
        self._unheard: dict[int, tuple[Unheard, ...]] = {}  # attempt -> the nodes given up on
        self._told: dict[int, list[ProcessFailure]] = {}  # attempt -> this node's failures told
        self._next_say = 0.0
        self._closed = threading.Event()

    def _handler(self) -> Any:
        """torch elastic's handler. c10d's connects to its store as it is made (and may wait for
        it): made at the first meeting, which the timeout and the stop button cut short."""
        from torch.distributed.elastic.rendezvous import (
            RendezvousParameters,
            rendezvous_handler_registry,
        )

        if self.handler is None:
            parameters = RendezvousParameters(
                backend=self.spec.rdzv_backend, endpoint=self.endpoint, run_id=self.spec.rdzv_id,
                min_nodes=self.plan.num_nodes, max_nodes=self.plan.num_nodes, **self._conf())
            self.handler = rendezvous_handler_registry.create_handler(parameters)
        if self._closed.is_set():  # the launch ended (its timeout) while the handler was made
            self.close()
            raise LaunchStopped
        return self.handler

    def _conf(self) -> dict[str, Any]:
        conf = dict(self.spec.rdzv_conf)
        if self.plan.timeout is not None:
            limit = max(1, math.ceil(self.plan.timeout))
            conf.setdefault("timeout", limit)
            conf.setdefault("join_timeout", limit)
            conf.setdefault("read_timeout", limit)  # c10d: connecting to its store, each call
        if self.spec.rdzv_backend == "static":
            conf.setdefault("rank", self.spec.node_rank)
        return conf

    def meet(self, attempt: int, cancelled: threading.Event) -> World:
        """Wait for every node (each attempt: a restart meets again), then this node's place.
        The meeting runs in a thread of its own, in torch's C++ calls nothing can cut short (a
        store connecting tries again after its own timeout): the launch thread leaves it at the
        launch's cancel (its timeout, the stop button), raising `LaunchStopped`."""
        met, found = threading.Event(), []

        def meeting() -> None:
            try:
                found.append(self._handler().next_rendezvous())
            except BaseException as error:  # raised in the launch thread
                found.append(error)
            finally:
                met.set()
        threading.Thread(target=meeting, daemon=True, name="xlaunch-rendezvous").start()
        threading.Thread(target=self._say_while_waiting, args=(met,), daemon=True,
                         name="xlaunch-rendezvous-wait").start()
        while not met.wait(CHECK_S):
            if cancelled.is_set():
                raise LaunchStopped
        if isinstance(found[0], BaseException):
            raise found[0]
        info = found[0]
        self.store, self.node_rank = info.store, info.rank
        bootstrap = info.bootstrap_store_info
        assert bootstrap is not None  # every rendezvous of torch >= 2.4 gives it
        per_node = self.plan.num_processes
        self.hosts = self._same_counts(attempt, info.rank, info.world_size)
        self._watch(attempt, info.rank, info.world_size)
        if self.spec.rdzv_backend != "static":  # the launch line could not say where it sits
            again = f" (attempt {attempt + 1} of {self.spec.max_restarts + 1})" if attempt else ""
            print(f"xlaunch: the {self.spec.rdzv_backend} rendezvous made this machine node "
                  f"{info.rank} of {info.world_size}, ranks {info.rank * per_node}-"
                  f"{(info.rank + 1) * per_node - 1}{again}", file=sys.stderr, flush=True)
        return World(rank_offset=info.rank * per_node, world_size=info.world_size * per_node,
                     local_world_size=per_node, node_rank=info.rank, num_nodes=info.world_size,
                     master_addr=bootstrap.master_addr, master_port=int(bootstrap.master_port),
                     store_prefix=f"/xlaunch/{self.spec.rdzv_id}")

    def _same_counts(self, attempt: int, node_rank: int, num_nodes: int) -> list[str]:
        """Every node must run as many processes as this one: global ranks are numbered by node
        from that count. Refused on every node alike, each told every node's count. Each
        node's host name, by node rank."""
        key = PROCESSES_KEY.format(attempt=attempt)
        self.store.set(f"{key}/{node_rank}",
                       json.dumps({"processes": self.plan.num_processes, "host": self.host}))
        nodes = [json.loads(self.store.get(f"{key}/{node}")) for node in range(num_nodes)]
        counts = [int(node["processes"]) for node in nodes]
        if len(set(counts)) > 1:
            each = ", ".join(f"node {node}: {count}" for node, count in enumerate(counts))
            raise ValueError(
                f"the nodes asked for different numbers of processes ({each}): every machine "
                "must launch the same num_processes (global ranks are numbered node by node "
                "from it)")
        return [str(node["host"]) for node in nodes]

    def bound(self) -> str:
        """How long the rendezvous waits before it gives up, and what sets that."""
        name = "timeout" if self.spec.rdzv_backend == "static" else "join_timeout"
        conf = self._conf()
        if name in conf:
            given = "rdzv_conf" if name in self.spec.rdzv_conf else "the launch's timeout="
            meeting = f"gives up after {conf[name]} s ({given})"
        else:
            meeting = f"gives up after {ENGINE_BOUND_S} s (torch elastic's own bound; timeout= " \
                      f"or rdzv_conf={{'{name}': seconds}} change it)"
        if self.spec.rdzv_backend != "c10d" or self.handler is not None:
            return meeting
        # c10d's handler is still reaching the store at the endpoint: torch waits read_timeout
        # a try, and tries twice when this machine's names might be the endpoint's.
        read = conf.get("read_timeout", C10D_READ_TIMEOUT_S)
        return (f"has had no answer yet from its store there (each try to reach it gives up "
                f"after {read} s: rdzv_conf={{'read_timeout': seconds}} or timeout= change it; "
                f"torch tries twice when this machine may be the one to host it); the meeting "
                f"{meeting}")

    def waiting(self, attempt: int) -> str:
        """What this node was waiting for when its time ran out, for the timeout's error to say:
        the other nodes, to meet; once they met, a store or a node gone quiet, as the watch last
        found them ("" when none was)."""
        watch = self._watches.get(attempt)
        if watch is None:
            store = (", whose store there had not answered" if self.spec.rdzv_backend == "c10d"
                     and self.handler is None else "")
            return (f"it was waiting for the {self.plan.num_nodes} nodes to meet at "
                    f"{self.endpoint} (torch elastic's {self.spec.rdzv_backend} rendezvous{store})")
        return self._quiet(watch)[2]

    def _say_while_waiting(self, met: threading.Event) -> None:
        started, wait = time.monotonic(), SAY_WAITING_AFTER_S
        while not met.wait(wait):
            print(f"xlaunch: waiting for the {self.plan.num_nodes} nodes to meet at {self.endpoint} "
                  f"(torch elastic's {self.spec.rdzv_backend} rendezvous, "
                  f"{time.monotonic() - started:.0f} s so far); it {self.bound()}",
                  file=sys.stderr, flush=True)
            wait = SAY_AGAIN_EVERY_S

    # The store lives on another machine: a call to it can block for minutes when that machine
    # is cut off (no reset arrives; torch's store gives up after its own timeout). Nothing here
    # makes one in the launch thread once the nodes have met: it must see its workers end, and
    # the caller's timeout and stop button wait for it. Store calls run in daemon threads
    # (`watch.StoreWatch`, `_tell`); the launch thread reads what they found.

    def _watch(self, attempt: int, node: int, num_nodes: int) -> None:
        self._attempt = attempt  # an earlier attempt's watch ends

        def current() -> bool:
            return self._attempt == attempt and not self._closed.is_set()
        interval, _, _ = self.keep_alive()
        others = [other for other in range(num_nodes) if other != node]
        self._watches[attempt] = StoreWatch(self.store, attempt, node, others,
                                            self.spec.monitor_interval, interval, current)

    def keep_alive(self) -> tuple[float, float, bool]:
        """(interval, bound, enforced): a node beats every interval; one silent for the bound
        is lost. Enforced without ``timeout=`` (which bounds it otherwise), or when
        ``rdzv_conf`` names the keep-alive settings."""
        conf = self.spec.rdzv_conf
        interval = float(conf.get("keep_alive_interval", KEEP_ALIVE_INTERVAL_S))
        attempts = int(conf.get("keep_alive_max_attempt", KEEP_ALIVE_MAX_ATTEMPT))
        if interval <= 0 or attempts < 1:
            raise ValueError(
                f"rdzv_conf keep_alive_interval={interval:g} and keep_alive_max_attempt="
                f"{attempts}: a machine beats every interval (seconds, more than 0) and is lost "
                "after that many silent intervals (1 or more)")
        bound = interval * attempts
        named = "keep_alive_interval" in conf or "keep_alive_max_attempt" in conf
        return interval, bound, self.plan.timeout is None or named

    def _tell(self, what: Callable[[], object]) -> threading.Thread:
        """A write to the store, in the background: a cut-off store must not hold the stop."""
        def tell() -> None:
            try:
                what()
            except Exception:  # the store's host may be gone already; its own workers fail anyway
                pass
        telling = threading.Thread(target=tell, daemon=True, name="xlaunch-store-tell")
        telling.start()
        return telling

    def report_failure(self, attempt: int, rank_exit: RankExit) -> None:
        """Tell the other nodes which rank failed here, and how (as the judge sees it): the first
        rank that ended in failure, then any that ranks before everything told so far (one that
        lost its peer here can end before the peer that raised; each is told under its own key)."""
        watch = self._watches.get(attempt)
        failure = node_failure(rank_exit)
        if watch is None or failure is None:
            return
        told_here = self._told.setdefault(attempt, [])
        if told_here and precedence(failure) >= min(map(precedence, told_here)):
            return
        number = len(told_here)
        told_here.append(failure)
        told = dataclasses.replace(failure, node=self.node_rank, host=self.host).to_share()

        def tell() -> None:
            watch.store.set(watch.key(FAILURE_KEY, told=number), told.to_json())
            watch.store.add(watch.key(FAILED_KEY), 1)  # after the record: read once counted
        self._tell(tell)

    def failed_elsewhere(self, attempt: int) -> str | None:
        """Why this node's workers must stop: another node told a failure, or went silent past
        the keep-alive bound (as the watch last found it; never waits on the store)."""
        watch = self._watches.get(attempt)
        if watch is None:
            return None
        told = sorted(watch.records.copy().values(), key=lambda record: record.secondary)
        if told:
            return f"{lead_line(told[0])} (told through the rendezvous store)"
        return self._silence(attempt, watch)

    def _silence(self, attempt: int, watch: StoreWatch) -> str | None:
        """Say what this node waits for once a node (or the store) is quiet; give up on it at
        the bound. A store that stopped answering explains every node's silence: it is what
        is said and judged (its answers come every monitor interval, a node's beats less often)."""
        store, quiet, what = self._quiet(watch)
        interval, bound, enforced = self.keep_alive()
        now = time.monotonic()
        if what and now >= self._next_say:
            self._next_say = now + SAY_AGAIN_EVERY_S
            print(f"xlaunch: {what}; {self._gives_up(bound, enforced)}", file=sys.stderr,
                  flush=True)
        per_node = self.plan.num_processes
        lost = tuple(Unheard(node, self.hosts[node] if node < len(self.hosts) else "",
                             tuple(range(node * per_node, (node + 1) * per_node)), seconds,
                             self.endpoint if store else "")
                     for node, seconds in quiet.items() if seconds >= bound)
        if not enforced or not lost:
            return None
        self._unheard[attempt] = lost
        return "; ".join(f"node {node.node}{self._host(node.node)} not heard from for "
                         f"{node.seconds:.0f} s" for node in lost)

    def _quiet(self, watch: StoreWatch) -> tuple[float, dict[int, float], str]:
        """(how long the store has been quiet, 0 when it answers; how long each node has; what
        of it is worth saying, "" when nothing is)."""
        store, quiet = watch.silent()
        interval, bound, _ = self.keep_alive()
        if store >= min(interval, bound / 2):
            what = (f"no answer from the rendezvous store at {self.endpoint} for {store:.0f} s "
                    "(this machine may be cut off from the other nodes)")
            return (store, dict.fromkeys(quiet, store),
                    what if store >= min(SAY_WAITING_AFTER_S, bound / 2) else "")
        loud = {node: seconds for node, seconds in quiet.items() if seconds >= 2 * interval}
        return 0.0, quiet, "; ".join(f"node {node}{self._host(node)} not heard from through the "
                                     f"store for {seconds:.0f} s" for node, seconds in loud.items())

    def _host(self, node: int) -> str:
        return f" (host {self.hosts[node]})" if node < len(self.hosts) else ""

    def _gives_up(self, bound: float, enforced: bool) -> str:
        if not enforced:
            return f"the launch's timeout ({self.plan.timeout} s) ends the wait"
        interval, _, _ = self.keep_alive()
        return (f"the launch gives up after {bound:g} s without a sign (rdzv_conf "
                f"keep_alive_interval={interval:g} s x keep_alive_max_attempt="
                f"{bound / interval:g} change it)")

    def after(self, attempt: int, exits: Sequence[RankExit], timed_out: bool) -> NodeFacts:
        """This node's attempt has ended: say so, and what the other nodes told it (waiting a
        little for their word when this node's ranks were only stopped or lost a peer)."""
        watch = self._watches.get(attempt)
        if watch is None:
            return NodeFacts(self.node_rank, self.host)
        ended = self._tell(lambda: watch.store.add(watch.key(ALIVE_KEY), ENDED))
        gave_up = attempt in self._unheard  # the store, or a node, went silent: nothing to wait for
        if not gave_up:  # told before this process may exit: a node gone silent would be lost
            ended.join(CLOSE_WAIT_S)
        if not timed_out and not gave_up and cause_elsewhere(exits, self.plan.world_size):
            watch.wait_for_cause(CAUSE_WAIT_S)
        told = tuple(dataclasses.replace(record, told=True)
                     for _, record in sorted(watch.records.copy().items()))
        return NodeFacts(self.node_rank, self.host, told, self._unheard.get(attempt, ()))

    def close(self) -> None:
        """Leave the rendezvous; waits at most CLOSE_WAIT_S for a store that may be cut off."""
        self._closed.set()

        if self.handler is None:
            return

        def shutdown() -> None:
            try:
                self.handler.shutdown()
            except Exception:
                pass
        closing = threading.Thread(target=shutdown, daemon=True, name="xlaunch-rendezvous-close")
        closing.start()
        closing.join(CLOSE_WAIT_S)
