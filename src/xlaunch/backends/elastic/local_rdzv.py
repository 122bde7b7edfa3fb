"""A rendezvous for one node that opens no socket: the engine's agent meets only itself.

The engine's static rendezvous starts a TCPStore that listens on every interface, an
unauthenticated store reachable from outside the host. One node needs no meeting point on the
network, so its agent keeps its bookkeeping in a `FileStore` inside the launch's private directory.
Registered with the engine's handler registry under ``xlaunch-local``; nothing else changes.
"""

from __future__ import annotations

import itertools
from typing import Any

from torch.distributed import FileStore
from torch.distributed.elastic.rendezvous import RendezvousHandler


class LocalRendezvousHandler(RendezvousHandler):
    def __init__(self, store_path: str, run_id: str, port: int) -> None:
        self._store_path = store_path
        self._run_id = run_id
        self._port = port
        self._rounds = itertools.count()
        self._closed = False

    def get_backend(self) -> str:
        return "xlaunch-local"

    @property
    def use_agent_store(self) -> bool:
        # Workers form their process group through their own FileStore, not the agent's.
        return False

    def next_rendezvous(self) -> Any:
        # A fresh file per round, so a restart never reads keys its failed predecessor left.
        store = FileStore(f"{self._store_path}-{next(self._rounds)}", 1)
        try:
            from torch.distributed.elastic.rendezvous.api import RendezvousInfo, RendezvousStoreInfo
        except ImportError:  # torch < 2.4 takes a plain tuple
            return store, 0, 1
        return RendezvousInfo(store, 0, 1, RendezvousStoreInfo("127.0.0.1", self._port))

    def is_closed(self) -> bool:
        return self._closed

    def set_closed(self) -> None:
        self._closed = True

    def num_nodes_waiting(self) -> int:
        return 0

    def get_run_id(self) -> str:
        return self._run_id

    def shutdown(self) -> bool:
        return True
