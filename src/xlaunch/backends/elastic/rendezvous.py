"""Several machines: torch elastic's rendezvous places this node; its store carries the rest.

The rendezvous is the engine's own, through its public handler registry (``static`` or ``c10d``,
``etcd`` where installed): ``next_rendezvous()`` returns this node's rank among the nodes, a store
every node shares, and the address of the store the workers bootstrap their group from. Workers
start here as on one machine (`starter.DistStarter`), with global ranks
``node rank x processes per node + local rank``.

What torch elastic's agent would add is done through that store, under keys of xlaunch's own: a
node whose worker fails says so, and every node stops its workers when one has (a restart is then
an attempt on every node, meeting again). Waits for other nodes happen inside the store's C++
calls, which nothing can interrupt: they are bounded by the launch's own timeout.
"""

from __future__ import annotations

import math
import sys
import threading
import time
from typing import Any

from xlaunch.backends.environment import World
from xlaunch.plan.specs import ElasticSpec, LaunchPlan

FAILED_KEY = "xlaunch/failed/attempt_{attempt}"
PROCESSES_KEY = "xlaunch/processes/attempt_{attempt}"  # /<node rank>: that node's process count
# A machine waiting for the others says so after this long, then again at this interval: a
# rendezvous nobody else reaches waits in silence otherwise, up to the engine's own bound.
SAY_WAITING_AFTER_S = 5.0
SAY_AGAIN_EVERY_S = 30.0
# torch elastic's own bound on a rendezvous (static's ``timeout``, c10d's ``join_timeout``),
# where neither ``timeout=`` nor ``rdzv_conf`` gives one.
ENGINE_BOUND_S = 600
# Leaving the rendezvous tells the store; a store cut off is not waited for longer than this.
CLOSE_WAIT_S = 5.0


class NodeRendezvous:
    def __init__(self, plan: LaunchPlan, spec: ElasticSpec, port: int) -> None:
        self.plan, self.spec = plan, spec
        self.endpoint = spec.rdzv_endpoint or f"{spec.master_addr}:{port}"
        self.handler: Any = None  # made at the first meeting, in the launch thread
        self.store: Any = None
        self.node_rank = spec.node_rank
        self._watched: dict[int, str | None] = {}  # attempt -> another node's failure, once seen
        self._closed = threading.Event()

    def _handler(self) -> Any:
        """torch elastic's handler. c10d's connects to its store as it is made (and may wait for
        it): made in the launch thread, so that the timeout and the stop button apply."""
        from torch.distributed.elastic.rendezvous import (
            RendezvousParameters,
            rendezvous_handler_registry,
        )

        if self.handler is None:
            parameters = RendezvousParameters(
                backend=self.spec.rdzv_backend, endpoint=self.endpoint, run_id=self.spec.rdzv_id,
                min_nodes=self.plan.num_nodes, max_nodes=self.plan.num_nodes, **self._conf())
            self.handler = rendezvous_handler_registry.create_handler(parameters)
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

    def meet(self, attempt: int) -> World:
        """Wait for every node (each attempt: a restart meets again), then this node's place."""
        met = threading.Event()
        threading.Thread(target=self._say_while_waiting, args=(met,), daemon=True,
                         name="xlaunch-rendezvous-wait").start()
        try:
            info = self._handler().next_rendezvous()
        finally:
            met.set()
        self.store, self.node_rank = info.store, info.rank
        bootstrap = info.bootstrap_store_info
        assert bootstrap is not None  # every rendezvous of torch >= 2.4 gives it
        per_node = self.plan.num_processes
        self._same_counts(attempt, info.rank, info.world_size)
        if self.spec.rdzv_backend != "static":  # the launch line could not say where it sits
            again = f" (attempt {attempt})" if attempt else ""
            print(f"xlaunch: the {self.spec.rdzv_backend} rendezvous made this machine node "
                  f"{info.rank} of {info.world_size}, ranks {info.rank * per_node}-"
                  f"{(info.rank + 1) * per_node - 1}{again}", file=sys.stderr, flush=True)
        return World(rank_offset=info.rank * per_node, world_size=info.world_size * per_node,
                     local_world_size=per_node, node_rank=info.rank, num_nodes=info.world_size,
                     master_addr=bootstrap.master_addr, master_port=int(bootstrap.master_port),
                     store_prefix=f"/xlaunch/{self.spec.rdzv_id}")

    def _same_counts(self, attempt: int, node_rank: int, num_nodes: int) -> None:
        """Every node must run as many processes as this one: global ranks are numbered by node
        from that count. Refused on every node alike, each told every node's count."""
        key = PROCESSES_KEY.format(attempt=attempt)
        self.store.set(f"{key}/{node_rank}", str(self.plan.num_processes))
        counts = [int(self.store.get(f"{key}/{node}")) for node in range(num_nodes)]
        if len(set(counts)) > 1:
            each = ", ".join(f"node {node}: {count}" for node, count in enumerate(counts))
            raise ValueError(
                f"the nodes asked for different numbers of processes ({each}): every machine "
                "must launch the same num_processes (global ranks are numbered node by node "
                "from it)")

    def bound(self) -> str:
        """How long the rendezvous waits before it gives up, and what sets that."""
        name = "timeout" if self.spec.rdzv_backend == "static" else "join_timeout"
        conf = self._conf()
        if name in conf:
            given = "rdzv_conf" if name in self.spec.rdzv_conf else "the launch's timeout="
            return f"gives up after {conf[name]} s ({given})"
        return f"gives up after {ENGINE_BOUND_S} s (torch elastic's own bound; timeout= or " \
               f"rdzv_conf={{'{name}': seconds}} change it)"

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
    # makes one in the launch thread: it must see its workers end, and the caller's timeout and
    # stop button wait for it. Store calls run in daemon threads; the launch thread reads what
    # they found.

    def report_failure(self, attempt: int) -> None:
        """Tell the other nodes (in the background: a cut-off store must not hold the stop)."""
        def tell() -> None:
            try:
                self.store.set(FAILED_KEY.format(attempt=attempt), f"node {self.node_rank}")
            except Exception:  # the store's host may be gone already; its own workers fail anyway
                pass
        threading.Thread(target=tell, daemon=True, name="xlaunch-store-tell").start()

    def failed_elsewhere(self, attempt: int) -> str | None:
        """Why this node's workers must stop: another node said one of its workers failed (as
        the store watcher last found it; never waits on the store)."""
        if attempt not in self._watched:
            self._watched[attempt] = None
            threading.Thread(target=self._watch_store, args=(attempt,), daemon=True,
                             name="xlaunch-store-watch").start()
        return self._watched[attempt]

    def _watch_store(self, attempt: int) -> None:
        key = FAILED_KEY.format(attempt=attempt)
        while not self._closed.wait(self.spec.monitor_interval) and attempt == max(self._watched):
            try:
                if not self.store.check([key]):
                    continue
                node = self.store.get(key).decode()
            except Exception:  # a node that finished and closed the store is no failure
                return
            if node != f"node {self.node_rank}":
                self._watched[attempt] = f"a worker on {node} failed"
            return

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
