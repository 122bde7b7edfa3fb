"""Several machines: torch elastic's rendezvous places this node; its store carries the rest.

The rendezvous is the engine's own, through its public handler registry (``static`` or ``c10d``,
``etcd`` where installed): ``next_rendezvous()`` returns this node's rank among the nodes, a store
every node shares, and the address of the store the workers bootstrap their group from. Workers
start here as on one machine (`attempt.DistAttempt`, the launch's owner), with global ranks
``node rank x processes per node + local rank``.

What torch elastic's agent would add is done through that store, under keys of xlaunch's own: a
node whose worker fails says so, and every node stops its workers when one has (a restart is then
an attempt on every node, meeting again). Waits for other nodes happen inside the store's C++
calls, which nothing can interrupt: they are bounded by the launch's own timeout.
"""

from __future__ import annotations

import math
import sys
from typing import Any

from xlaunch.backends.elastic.job import World
from xlaunch.plan.specs import ElasticSpec, LaunchPlan

FAILED_KEY = "xlaunch/failed/attempt_{attempt}"


class NodeRendezvous:
    def __init__(self, plan: LaunchPlan, spec: ElasticSpec, port: int) -> None:
        from torch.distributed.elastic.rendezvous import (
            RendezvousParameters,
            rendezvous_handler_registry,
        )

        self.plan, self.spec = plan, spec
        endpoint = spec.rdzv_endpoint or f"{spec.master_addr}:{port}"
        parameters = RendezvousParameters(
            backend=spec.rdzv_backend, endpoint=endpoint, run_id=spec.rdzv_id,
            min_nodes=plan.num_nodes, max_nodes=plan.num_nodes, **self._conf())
        self.handler = rendezvous_handler_registry.create_handler(parameters)
        self.store: Any = None
        self.node_rank = spec.node_rank

    def _conf(self) -> dict[str, Any]:
        conf = dict(self.spec.rdzv_conf)
        if self.plan.timeout is not None:
            limit = max(1, math.ceil(self.plan.timeout))
            conf.setdefault("timeout", limit)
            conf.setdefault("join_timeout", limit)
        if self.spec.rdzv_backend == "static":
            conf.setdefault("rank", self.spec.node_rank)
        return conf

    def meet(self, attempt: int) -> World:
        """Wait for every node (each attempt: a restart meets again), then this node's place."""
        info = self.handler.next_rendezvous()
        self.store, self.node_rank = info.store, info.rank
        bootstrap = info.bootstrap_store_info
        assert bootstrap is not None  # every rendezvous of torch >= 2.4 gives it
        per_node = self.plan.num_processes
        if self.spec.rdzv_backend != "static":  # the launch line could not say where it sits
            again = f" (attempt {attempt})" if attempt else ""
            print(f"xlaunch: the {self.spec.rdzv_backend} rendezvous made this machine node "
                  f"{info.rank} of {info.world_size}, ranks {info.rank * per_node}-"
                  f"{(info.rank + 1) * per_node - 1}{again}", file=sys.stderr, flush=True)
        return World(rank_offset=info.rank * per_node, world_size=info.world_size * per_node,
                     local_world_size=per_node, node_rank=info.rank, num_nodes=info.world_size,
                     master_addr=bootstrap.master_addr, master_port=int(bootstrap.master_port),
                     store_prefix=f"/xlaunch/{self.spec.rdzv_id}")

    def report_failure(self, attempt: int) -> None:
        try:
            self.store.set(FAILED_KEY.format(attempt=attempt), f"node {self.node_rank}")
        except Exception:  # the store's host may be gone already; its own workers fail anyway
            pass

    def failed_elsewhere(self, attempt: int) -> str | None:
        """Why this node's workers must stop: another node said one of its workers failed."""
        key = FAILED_KEY.format(attempt=attempt)
        try:
            if not self.store.check([key]):
                return None
            node = self.store.get(key).decode()
        except Exception:  # a node that finished and closed the store is no failure
            return None
        return None if node == f"node {self.node_rank}" else f"a worker on {node} failed"

    def close(self) -> None:
        try:
            self.handler.shutdown()
        except Exception:
            pass
