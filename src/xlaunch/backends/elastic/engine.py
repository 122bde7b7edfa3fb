"""torch elastic's agent, run in the launch thread; the facts it leaves, gathered for the caller.

The engine runs in a thread of its own, so it installs no signal handlers of its own (the caller
keeps its Ctrl-C) and a stop never lands in its fork. Every process it starts is recorded with the
signals it and the launcher send, which is how a worker killed by the out-of-memory killer is told
from one the engine stopped after a peer failed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from xlaunch import _compat
from xlaunch.backends.elastic.entry import Job, worker_main
from xlaunch.backends.envvars import overlay
from xlaunch.backends.exits import AttemptFiles, ChildExit, elastic_exits
from xlaunch.backends.supervise import stop_processes
from xlaunch.plan.specs import ElasticSpec, LaunchPlan
from xlaunch.worker.launch_dir import LaunchDir, dump_stacks, worker_pids
from xlaunch.worker.process_tree import ProcessTree
from xlaunch.worker.rank import WorkerSetup

LOCAL_RDZV = "xlaunch-local"


@dataclasses.dataclass(frozen=True)
class EngineExtras:
    """What a path built on the engine adds (TorchTPU): the same agent, workers, facts."""

    worker_env: Mapping[str, str] = dataclasses.field(default_factory=dict)  # in every worker
    # In the caller's environment while the engine starts its workers: what a spawned worker
    # must find before its first import (torch's device-backend autoload reads it then).
    at_start: Mapping[str, str | None] = dataclasses.field(default_factory=dict)
    job: Callable[..., Job] = Job  # (function, args, setup, spec) -> what each worker runs


class EngineRun:
    """One launch on the engine: `supervise` drives it (see supervise.Supervised)."""

    def __init__(self, plan: LaunchPlan, spec: ElasticSpec, port: int,
                 function: Callable[..., Any], args: tuple[Any, ...], launch_dir: LaunchDir,
                 extras: EngineExtras | None = None) -> None:
        self.plan, self.spec, self.port = plan, spec, port
        self.extras = extras or EngineExtras()
        self.function, self.args = function, args
        self.launch_dir = launch_dir
        self.children: list[_compat.Child] = []
        self.results: dict[int, Any] | None = None
        self.engine_error: BaseException | None = None
        self.stacks: dict[int, str] = {}
        self.stacks_from: Path | None = None  # the attempt whose workers the stacks are of
        self.tree: ProcessTree | None = None
        self._gate = threading.Lock()
        self._cancelled = False
        self._started = False

    def run(self) -> None:
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.launcher.api import elastic_launch

        with self._gate:
            if self._cancelled:
                return
            self._started = True
            self.tree = ProcessTree()
        forked = self.spec.start_method == "fork"
        setup = WorkerSetup(self.launch_dir.folder, {**self._worker_env(), **self.extras.worker_env},
                            line_prefix="[rank ${rank}] " if self._prefix_here() else None,
                            tree=self.tree.ticket(forked), tempdir=tempfile.gettempdir())
        job = self.extras.job(self.function, self.args, setup, self.spec)
        try:
            with _compat.engine_loggers_quiet(), _shared_store_off(self.spec), \
                    overlay(self.extras.at_start), \
                    _compat.engine_join_grace(self.plan.stop_grace), \
                    _temp_files_in(self.launch_dir.folder), _compat.recording_children() as children:
                self.children = children
                self.results = elastic_launch(self._config(), worker_main)(job)
        except ChildFailedError:
            pass  # the facts are in the children and the launch directory
        except BaseException as error:  # handed to the caller's thread
            self.engine_error = error

    def check(self) -> None:
        return None

    def expire(self) -> None:
        """Stacks first, then every process of the launch."""
        self.launch_dir.cancel()
        attempt = self.launch_dir.latest_attempt()
        if attempt is not None:
            self.stacks = dump_stacks(attempt, worker_pids(attempt))
            self.stacks_from = attempt
        self._stop_all()

    def stop(self) -> bool:
        with self._gate:
            self._cancelled = True
            started = self._started
        self.launch_dir.cancel()
        self._stop_all()
        # Several nodes still meeting: nothing of ours runs yet and the wait cannot be cut short.
        return started and (self.spec.loopback_only or bool(self.children))

    def _stop_all(self) -> None:
        stop_processes(self.children, self.tree, self.plan.stop_grace)

    def end(self) -> None:
        if self.tree is not None:
            self.tree.end()

    def attempts(self, timed_out: bool) -> list[tuple[Any, ...]]:
        children = [ChildExit(c.pid, c.exitcode, frozenset(c.signals_sent)) for c in self.children]
        paths = self.launch_dir.attempts()
        folders = [AttemptFiles.read(folder) for folder in paths]
        if timed_out and self.stacks_from in paths:
            # The engine may have restarted the workers after the stop (they found the launch
            # cancelled and left): the stacks belong to the attempt they were taken from.
            index = paths.index(self.stacks_from)
            folders[index] = dataclasses.replace(folders[index], stacks=self.stacks)
        offset = self.spec.node_rank * self.plan.num_processes
        return elastic_exits(children, folders, self.plan.num_processes, offset)

    def _prefix_here(self) -> bool:
        return self.spec.log_line_prefix_template is None

    def _worker_env(self) -> dict[str, str]:
        env: dict[str, str] = self.plan.worker_variables()
        if self.spec.loopback_only:
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(self.port))
        if self.spec.socket_ifname is not None:  # the user's own choice of interface wins
            for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
                env[name] = os.environ.get(name, self.spec.socket_ifname)
        if self.spec.cpu_threads:
            env["OMP_NUM_THREADS"] = str(self.spec.cpu_threads)
        return env

    def _config(self) -> Any:
        from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
        from torch.distributed.launcher.api import LaunchConfig

        spec = self.spec
        tee = Std.ALL if spec.log_line_prefix_template else Std.NONE
        rdzv_backend, endpoint, rdzv_conf = self._rendezvous()
        options: dict[str, Any] = dict(
            min_nodes=self.plan.num_nodes, max_nodes=self.plan.num_nodes,
            nproc_per_node=self.plan.num_processes,
            run_id=spec.rdzv_id,  # every node must name the same run; "none" is a name too
            rdzv_backend=rdzv_backend, rdzv_endpoint=endpoint, rdzv_configs=rdzv_conf,
            max_restarts=spec.max_restarts, monitor_interval=spec.monitor_interval,
            start_method=spec.start_method, log_line_prefix_template=spec.log_line_prefix_template,
            logs_specs=DefaultLogsSpecs(log_dir=os.path.join(self.launch_dir.folder, "logs"), tee=tee),
            shutdown_timeout=self.plan.stop_grace,
        )
        known = {field.name for field in dataclasses.fields(LaunchConfig)}
        return LaunchConfig(**{key: value for key, value in options.items() if key in known})

    def _rendezvous(self) -> tuple[str, str, dict[str, Any]]:
        """Which engine rendezvous to use; one node needs no listening socket at all."""
        spec = self.spec
        conf = dict(spec.rdzv_conf)
        if spec.loopback_only:
            if spec.rdzv_backend == "static":
                _register_local_rendezvous()
                store = os.path.join(self.launch_dir.folder, "rdzv-store")
                return LOCAL_RDZV, store, {"port": self.port, **conf}
            if spec.rdzv_backend == "c10d":
                conf.setdefault("store_type", "file")
                return "c10d", os.path.join(self.launch_dir.folder, "c10d-store"), conf
        endpoint = spec.rdzv_endpoint or f"{spec.master_addr}:{self.port}"
        if self.plan.timeout is not None:
            # Waiting for other nodes happens inside the store's C++ calls, which nothing can
            # interrupt: bound those waits by the launch's own limit.
            limit = max(1, math.ceil(self.plan.timeout))
            conf.setdefault("timeout", limit)
            conf.setdefault("join_timeout", limit)
        if spec.rdzv_backend == "static":
            conf.setdefault("rank", spec.node_rank)
        return spec.rdzv_backend, endpoint, conf


def _register_local_rendezvous() -> None:
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry as registry

    with contextlib.suppress(ValueError):  # already registered in this process
        registry.register(LOCAL_RDZV, _local_handler)


def _local_handler(params: Any) -> Any:
    from xlaunch.backends.elastic.local_rdzv import LocalRendezvousHandler

    return LocalRendezvousHandler(params.endpoint, params.run_id, int(params.get("port")))


def _shared_store_off(spec: ElasticSpec) -> contextlib.AbstractContextManager[None]:
    """c10d over a file still starts a TCPStore for the workers unless told not to share one."""
    if not (spec.loopback_only and spec.rdzv_backend == "c10d"):
        return contextlib.nullcontext()
    return overlay({_compat.SHARED_STORE_OFF: "1"})


@contextlib.contextmanager
def _temp_files_in(folder: str) -> Iterator[None]:
    """The engine's temporary files (error files it unpickles) go to the launch's 0700 folder.

    torch.multiprocessing names a file in the temp directory, deletes it, and after a failure
    unpickles whatever file then has that name: in a shared /tmp another user could plant one.
    """
    saved = tempfile.tempdir
    tempfile.tempdir = folder
    try:
        yield
    finally:
        tempfile.tempdir = saved
