"""GPUs and CPU processes, carried out by torch elastic's agent.

The engine (`torch.distributed.elastic`) starts, watches, restarts and stops the workers. What this
module adds is what users of the engine run into:

- Root cause first: workers record their own exception (worker.py) before exiting, so the error
  that reaches the caller is the rank that raised, not a peer's "connection closed by peer".
- A single-node launch opens no socket beyond loopback. The engine's static rendezvous starts a
  TCPStore listening on every interface; here one node rendezvouses through a `FileStore` in a
  private directory (a rendezvous backend registered with the engine), workers form their process
  group through another `FileStore`, and gloo/NCCL are told to use the loopback interface.
- A whole-launch ``timeout`` that dumps each rank's Python stack before stopping it.
- Signal handlers the engine installs are put back, so the next cell's Ctrl-C is a Ctrl-C again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import pickle
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ..errors import LaunchError, LaunchTimeout, ProcessFailure
from ..plan import LaunchPlan
from ..worker import (
    CANCELLED_EXIT,
    MIXED_PRECISION_VAR,
    LaunchDir,
    Worker,
    check_picklable,
    dump_stacks,
    read_failures,
    to_cpu,
    worker_pids,
)

LOCAL_RDZV = "xlaunch-local"
HANDLED_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
SHUTDOWN_GRACE_S = 3  # a worker that ignores its stop signal is killed after this


def launch(plan: LaunchPlan, function: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    """Run ``function(*args)`` in every worker of this node; return local rank 0's result."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    if plan.start_method != "fork":
        check_picklable(function, args)
    port = _choose_port(plan)
    launch_dir = LaunchDir.create()
    prefix_output = plan.log_line_prefix_template is None
    entry = _Entry(function, args, launch_dir.path, plan, port, prefix_output)
    config = _launch_config(plan, port, launch_dir)
    monitor = _Monitor(launch_dir, plan.timeout, plan.num_processes)
    try:
        with _signal_handlers_restored(), _engine_quiet(), _no_shared_store(config), monitor:
            results = elastic_launch(config, _worker_main)(entry)
    except ChildFailedError as failed:
        raise _launch_error(failed, launch_dir, monitor) from None
    except SignalException as stopped:
        if monitor.fired:
            raise _timeout_error(monitor) from None
        raise KeyboardInterrupt(f"launch stopped by {stopped.sigval.name}") from None
    except BaseException:
        # KeyboardInterrupt from the timeout, or the rendezvous giving up at the same limit.
        if monitor.fired:
            raise _timeout_error(monitor) from None
        raise
    finally:
        launch_dir.remove()
    # Keyed by global rank: this node's local rank 0 holds the smallest of its ranks.
    return results[min(results)] if results else None


def _worker_main(entry: _Entry) -> Any:
    """The engine's entrypoint: a named module-level function, as it expects."""
    return entry()


class _Entry:
    """The function each worker process runs (a plain object so ``spawn`` can pickle it)."""

    def __init__(self, function: Callable[..., Any], args: tuple[Any, ...], launch_dir: str,
                 plan: LaunchPlan, port: int, prefix_output: bool) -> None:
        self.function = function
        self.args = args
        self.launch_dir = launch_dir
        self.dist_backend = plan.dist_backend or "gloo"
        self.start_method = plan.start_method
        self.local_only = _without_network(plan)
        self.env = {MIXED_PRECISION_VAR: plan.mixed_precision, **plan.worker_env}
        if self.local_only:
            self.env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            self.env.setdefault("GLOO_SOCKET_IFNAME", os.environ.get("GLOO_SOCKET_IFNAME", "lo"))
            self.env.setdefault("NCCL_SOCKET_IFNAME", os.environ.get("NCCL_SOCKET_IFNAME", "lo"))
        self.prefix_output = prefix_output
        self.cpu_threads = 0
        if "OMP_NUM_THREADS" not in os.environ and plan.num_processes > 1:
            # Each process would start a thread per core and they would fight over the cores
            # (the demo trained 2.5x slower on 2 cores); torchrun sets OMP_NUM_THREADS for this.
            self.cpu_threads = max(1, (os.cpu_count() or 1) // plan.num_processes)
            self.env["OMP_NUM_THREADS"] = str(self.cpu_threads)

    def __call__(self) -> Any:
        import torch.distributed as dist

        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ["LOCAL_RANK"])
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        worker = Worker(self.launch_dir, attempt, rank, world, self.env, self.prefix_output)
        if worker.cancelled:
            raise SystemExit(CANCELLED_EXIT)
        if self.cpu_threads or self.dist_backend == "nccl":
            import torch

            if self.cpu_threads:
                torch.set_num_threads(self.cpu_threads)  # forked: the variable alone comes too late
            if self.dist_backend == "nccl":
                torch.cuda.set_device(local_rank)
        try:
            if self.local_only:
                store = dist.FileStore(str(Path(worker.attempt) / "group-store"), world)
                dist.init_process_group(self.dist_backend, store=store, rank=rank, world_size=world)
            else:
                dist.init_process_group(self.dist_backend, rank=rank, world_size=world)
            # Gloo finishes connecting pairs lazily: a rank that returned at once and exited
            # would break a peer still connecting. Everyone starts the function together.
            dist.barrier()
        except Exception as error:  # noqa: BLE001 - reported as this rank's failure
            worker.record_failure(error)
            raise SystemExit(1) from None
        try:
            result = worker.run(self.function, self.args)
            if local_rank != 0:
                return None
            result = to_cpu(result)
            try:
                pickle.dumps(result)
            except Exception as error:  # noqa: BLE001
                worker.record_failure(TypeError(
                    f"the function returned a value that cannot be sent back to the caller "
                    f"({type(result).__name__}): {error}"))
                raise SystemExit(1) from None
            return result
        finally:
            # A forked worker ends in os._exit, which frees everything; gloo's own teardown cost
            # 20-80 ms a rank. Workers that end in a full interpreter shutdown tear down first.
            if self.dist_backend == "nccl" or self.start_method != "fork":
                with contextlib.suppress(Exception):
                    dist.destroy_process_group()


def _launch_config(plan: LaunchPlan, port: int, launch_dir: LaunchDir) -> Any:
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.launcher.api import LaunchConfig

    tee = Std.ALL if plan.log_line_prefix_template else Std.NONE
    rdzv_backend, endpoint, rdzv_conf = _rendezvous(plan, port, launch_dir)
    options: dict[str, Any] = dict(
        min_nodes=plan.num_nodes, max_nodes=plan.num_nodes, nproc_per_node=plan.num_processes,
        run_id=plan.rdzv_id,  # every node must name the same run; "none" is a name too
        rdzv_backend=rdzv_backend, rdzv_endpoint=endpoint, rdzv_configs=rdzv_conf,
        max_restarts=plan.max_restarts, monitor_interval=plan.monitor_interval,
        start_method=plan.start_method, log_line_prefix_template=plan.log_line_prefix_template,
        logs_specs=DefaultLogsSpecs(log_dir=os.path.join(launch_dir.path, "logs"), tee=tee),
        signals_to_handle=",".join(HANDLED_SIGNALS), shutdown_timeout=SHUTDOWN_GRACE_S,
    )
    known = {field.name for field in dataclasses.fields(LaunchConfig)}
    return LaunchConfig(**{key: value for key, value in options.items() if key in known})


def _rendezvous(plan: LaunchPlan, port: int, launch_dir: LaunchDir) -> tuple[str, str, dict[str, Any]]:
    """Which engine rendezvous to use; one node needs no listening socket at all."""
    conf = dict(plan.rdzv_conf)
    if _without_network(plan):
        if plan.rdzv_backend == "static":
            _register_local_rendezvous()
            return LOCAL_RDZV, os.path.join(launch_dir.path, "rdzv-store"), {"port": port, **conf}
        if plan.rdzv_backend == "c10d":
            conf.setdefault("store_type", "file")
            return "c10d", os.path.join(launch_dir.path, "c10d-store"), conf
    endpoint = plan.rdzv_endpoint or f"{plan.master_addr}:{port}"
    if plan.timeout is not None:
        # Waiting for other nodes happens inside the store's C++ calls, which nothing can
        # interrupt: bound those waits by the launch's own limit.
        limit = max(1, math.ceil(plan.timeout))
        conf.setdefault("timeout", limit)
        conf.setdefault("join_timeout", limit)
    if plan.rdzv_backend == "static":
        conf.setdefault("rank", plan.node_rank)
    return plan.rdzv_backend, endpoint, conf


def _without_network(plan: LaunchPlan) -> bool:
    """One node and no rendezvous endpoint named: everything meets through files, nothing listens."""
    return plan.local_only and not plan.rdzv_endpoint


def _register_local_rendezvous() -> None:
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry as registry

    with contextlib.suppress(ValueError):  # already registered in this process
        registry.register(LOCAL_RDZV, _local_handler)


def _local_handler(params: Any) -> Any:
    from ._local_rdzv import LocalRendezvousHandler

    return LocalRendezvousHandler(params.endpoint, params.run_id, int(params.get("port")))


def _choose_port(plan: LaunchPlan) -> int:
    """The port workers see as MASTER_PORT (and where a multi-node store listens)."""
    if plan.num_nodes > 1 and plan.node_rank != 0:
        return plan.port  # node 0 owns it
    host = "127.0.0.1" if plan.local_only else plan.master_addr
    if _port_free(host, plan.port):
        return plan.port
    if plan.port_is_default and plan.local_only:
        return _free_port(host)
    raise RuntimeError(
        f"port {plan.port} on {host} is already in use (use_port={str(plan.port)!r}): another "
        f"launch or program holds it. Pass another use_port"
        + (", or leave use_port at its default to pick a free port." if plan.local_only else ".")
    )


def _port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host if host not in ("localhost",) else "127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


class _Monitor:
    """Watches the workers from the caller: when each one died, and the launch's ``timeout``.

    A worker killed by a signal (the OOM killer, a segfault) writes no record, and the engine
    reports only one failed process: often a peer whose collective broke because of it. Knowing
    when each worker was last seen alive puts the silent death ahead of the errors it caused.
    On ``timeout``: stacks first, then the workers, then the engine's wait.
    """

    POLL_S = 0.05  # "last seen alive" comes before the death, and the death before a peer's error

    def __init__(self, launch_dir: LaunchDir, timeout: float | None, workers: int) -> None:
        self.launch_dir = launch_dir
        self.timeout = timeout
        self.workers = workers
        self.fired = False
        self.stacks: dict[int, str] = {}
        self.pids: dict[int, int] = {}
        self.attempt: Path | None = None
        self.last_alive_ns: dict[int, int] = {}  # rank -> when it was last seen alive
        self.dead: set[int] = set()
        self._number = 0
        self._previous_ns = time.time_ns()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="xlaunch-monitor", daemon=True)
        self._caller_is_main = threading.current_thread() is threading.main_thread()

    def __enter__(self) -> _Monitor:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()

    def _watch(self) -> None:
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        while not self._done.wait(self.POLL_S):
            self._look()
            if deadline is not None and time.monotonic() >= deadline:
                self._expire()
                return

    def _look(self) -> None:
        now = time.time_ns()
        following = self.launch_dir.attempt_path(0 if self.attempt is None else self._number + 1)
        if following.exists():  # the first attempt, or a restart
            self.attempt, self.pids, self.last_alive_ns, self.dead = following, {}, {}, set()
            self._number = int(following.name.split("-")[1])
        if self.attempt is not None:
            if len(self.pids) < self.workers:
                self.pids = worker_pids(self.attempt)
            for rank, pid in self.pids.items():
                if rank in self.dead:
                    continue
                if _alive(pid):
                    self.last_alive_ns[rank] = now
                else:
                    self.dead.add(rank)
                    # Died before it was ever seen alive: its pid file was not there at the
                    # previous look, so it died after that.
                    self.last_alive_ns.setdefault(rank, self._previous_ns)
        self._previous_ns = now

    def _expire(self) -> None:
        self.fired = True
        self.launch_dir.cancel()
        attempt = self.launch_dir.latest_attempt()
        if attempt is not None:
            self.pids = worker_pids(attempt)
            self.stacks = dump_stacks(attempt, self.pids)
            for pid in self.pids.values():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        elif self._caller_is_main:
            # Still in rendezvous (other nodes never came): interrupt the caller's wait.
            import _thread

            _thread.interrupt_main()

    def silent_death(self, rank: int) -> ProcessFailure:
        """A worker that left no record, stamped with when it was last seen alive.

        One never seen at all started and died after the last look: that look bounds it.
        """
        return ProcessFailure(
            rank=rank, pid=self.pids.get(rank),
            timestamp_ns=self.last_alive_ns.get(rank, self._previous_ns),
            message="ended without raising a Python exception: killed by a signal (the "
                    "out-of-memory killer does this), a crash, or os._exit()")


def _alive(pid: int) -> bool:
    """True until the process has exited (a zombie not yet reaped counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def _launch_error(failed: Any, launch_dir: LaunchDir, monitor: _Monitor) -> LaunchError:
    if monitor.fired:
        return _timeout_error(monitor)
    failures = read_failures(launch_dir.latest_attempt())
    # The engine reports the processes it found ended on their own, before it stopped the rest.
    ended = getattr(failed, "failures", {})
    for rank, engine_failure in ended.items():
        known = failures.get(rank)
        if known is not None:
            failures[rank] = dataclasses.replace(known, exitcode=engine_failure.exitcode)
        else:
            failures[rank] = dataclasses.replace(
                monitor.silent_death(rank), pid=engine_failure.pid, exitcode=engine_failure.exitcode)
    if all(_lost_a_peer(f) for f in failures.values() if f.exc_type):
        # Nobody raised on their own: a worker that died silently broke the others' collectives.
        # Those seen dead after the engine's own finds are the workers it then stopped.
        first = min((monitor.last_alive_ns.get(rank, 0) for rank in ended), default=None)
        for rank in monitor.dead:
            death = monitor.silent_death(rank)
            if first is None or death.timestamp_ns <= first:
                failures.setdefault(rank, death)
    return LaunchError(f"the launch failed: {len(failures)} rank(s) failed", failures.values())


# How gloo and NCCL report that a peer went away: the consequence of a failure, never its cause.
PEER_LOSS = ("closed by peer", "reset by peer", "broken pipe", "remote process exited",
             "communicator was aborted", "connection refused")


def _lost_a_peer(failure: ProcessFailure) -> bool:
    return any(sign in failure.message.lower() for sign in PEER_LOSS)


def _timeout_error(monitor: _Monitor) -> LaunchTimeout:
    failures = [
        ProcessFailure(rank=rank, pid=pid, stack=monitor.stacks.get(rank, "(no stack arrived)"))
        for rank, pid in sorted(monitor.pids.items())
    ]
    where = "" if failures else " (no worker had started: still waiting for the rendezvous)"
    return LaunchTimeout(
        f"the launch did not finish within timeout={monitor.timeout} s and was stopped{where}",
        failures,
    )


@contextlib.contextmanager
def _signal_handlers_restored() -> Iterator[None]:
    """The engine replaces SIGINT/SIGTERM handlers and never puts them back."""
    saved = {}
    if threading.current_thread() is threading.main_thread():
        for name in HANDLED_SIGNALS:
            number = getattr(signal, name)
            saved[number] = signal.getsignal(number)
    try:
        yield
    finally:
        for number, handler in saved.items():
            signal.signal(number, handler)


@contextlib.contextmanager
def _no_shared_store(config: Any) -> Iterator[None]:
    """c10d over a file still starts a TCPStore for the workers unless told not to share one."""
    if config.rdzv_backend != "c10d" or config.rdzv_configs.get("store_type") != "file":
        yield
        return
    key = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
    saved = os.environ.get(key)
    os.environ[key] = "1"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = saved


@contextlib.contextmanager
def _engine_quiet() -> Iterator[None]:
    """The engine logs each failure at ERROR; the LaunchError says it better, once.

    Its modules set their own levels, so each of their loggers is quieted, not just the parent;
    ``disabled`` rather than a level, which would clear every logger's cache at each launch.
    """
    prefixes = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing")
    loggers = [logger for name, logger in list(logging.Logger.manager.loggerDict.items())
               if name.startswith(prefixes) and isinstance(logger, logging.Logger)]
    saved = [(logger, logger.disabled) for logger in loggers]
    for logger in loggers:
        logger.disabled = True
    try:
        yield
    finally:
        for logger, disabled in saved:
            logger.disabled = disabled
