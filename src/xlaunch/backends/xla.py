"""TPU cores (and XLA's CPU/GPU devices) through torch_xla's ``xmp.spawn``.

The caller never touches the XLA runtime. It forks a *launch leader* in a process group of its
own, and the leader calls ``xmp.spawn``:

- ``xmp.spawn(nprocs=1)`` runs the function in the calling process and leaves the runtime
  initialised there, after which every later spawn in that process refuses. In the leader that
  state dies with the leader, so the next launch in the same notebook works.
- One process group holds the whole launch: a timeout or the stop button ends it with one signal.
- ``xmp.spawn`` returns None, and its process pool reports a dead replica only as "terminated
  abruptly". Replica 0 leaves its result in the launch directory; the leader records its pool's
  exit codes; and its stderr, inherited by the replicas, runs through a pipe the caller copies
  to its own stderr, keeping the last lines for the report of a replica that died without a word.

Everything torch_xla-specific is here, imported inside functions (it takes seconds to import and
may query the TPU metadata server), so a successor runtime can sit beside this module.
"""

from __future__ import annotations

import codecs
import contextlib
import faulthandler
import importlib.util
import json
import os
import pickle
import re
import select
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from importlib import metadata
from pathlib import Path
from typing import Any, NoReturn

from ..errors import LaunchError, LaunchTimeout, ProcessFailure
from ..plan import LaunchPlan
from ..worker import (
    CANCELLED_EXIT,
    MIXED_PRECISION_VAR,
    WORLD_VAR,
    LaunchDir,
    Worker,
    check_picklable,
    die_with_parent,
    dump_stacks,
    read_failures,
    to_cpu,
    worker_pids,
)

FAILURE_GRACE_S = 3.0  # after a replica fails, its peers get this long to end on their own
STOP_GRACE_S = 2.0  # the leader's time to stop its pool before the whole group is killed
TAIL_BYTES = 32768
TAIL_LINES = 30
STACK_FRAMES = 8  # innermost frames kept from each crash dump in the tail
POLL_S = 0.05
PJRT_DEVICES = {"tpu": "TPU", "cuda": "CUDA", "cpu": "CPU"}
TPU_NODE_PORT_WAIT_S = 120.0


def launch(plan: LaunchPlan, function: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    """Run ``function(*args)`` on every replica of ``plan``; return replica 0's result."""
    _refuse_initialised_runtime()
    if plan.start_method != "fork":
        check_picklable(function, args)
    env = {WORLD_VAR: "xla", MIXED_PRECISION_VAR: plan.mixed_precision, **plan.worker_env}
    if plan.legacy_tpu_node:
        env.update(prepare_tpu_node(os.environ))
    launch_dir = LaunchDir.create()
    job = _Job(function, args, launch_dir.path, env, plan.threads_per_process == 1)
    leader = _Leader(plan, job)
    try:
        leader.start()
        leader.wait()
        leader.close()
        return leader.outcome()
    except BaseException:
        leader.stop()
        raise
    finally:
        leader.close()
        launch_dir.remove()


class _Job:
    """What every replica runs (a plain object, so ``spawn`` can pickle it)."""

    def __init__(self, function: Callable[..., Any], args: tuple[Any, ...], launch_dir: str,
                 env: dict[str, str], prefix_output: bool) -> None:
        self.function, self.args, self.launch_dir = function, args, launch_dir
        # Two replicas sharing a process (v2/v3 threads) would share one prefixed stdout.
        self.env, self.prefix_output = env, prefix_output


def _replica(index: int, job: _Job | None = None) -> None:
    """One replica: xmp.spawn calls it with the global ordinal, in a thread of its process."""
    job = job or _JOB
    assert job is not None
    if not faulthandler.is_enabled():  # spawn/forkserver: a crash still leaves its stack on fd 2
        faulthandler.enable(file=2, all_threads=False)
    world_size, local_ordinal = _world()
    worker = Worker(job.launch_dir, 0, index, world_size, job.env, job.prefix_output)
    result = worker.run(job.function, job.args)
    if local_ordinal != 0:  # each host of a pod returns its own first replica's result
        return
    try:
        data = pickle.dumps(to_cpu(result))
    except Exception as error:  # noqa: BLE001 - reported as this replica's failure
        worker.record_failure(TypeError(
            f"the function returned a value that cannot be sent back to the caller "
            f"({type(result).__name__}): {error}"))
        raise SystemExit(1) from None
    partial = worker.attempt / "result.tmp"
    partial.write_bytes(data)
    partial.replace(worker.attempt / "result.pkl")


def _world() -> tuple[int, int]:
    """World size and this replica's ordinal on its host: torch_xla.runtime, else its forerunners."""
    try:
        import torch_xla.runtime as xr

        return int(xr.world_size()), int(xr.local_ordinal())
    except (ImportError, AttributeError):
        import torch_xla.core.xla_model as xm

        return int(xm.xrt_world_size()), int(xm.get_local_ordinal())


# --- the launch leader (a forked child of the caller) ------------------------------------------

_POOL: list[Any] = []  # the multiprocessing processes the leader started: xmp.spawn's pool
# The job, for replicas forked from the leader. xmp.spawn's pool pickles what it is given even
# under fork, and a closure, a lambda or an argument such as a lock cannot be pickled.
_JOB: _Job | None = None


class _RecordingSet(set):  # type: ignore[type-arg]
    """Stands in for multiprocessing's set of started children, remembering every one."""

    def add(self, process: Any) -> None:
        _POOL.append(process)
        super().add(process)


def _lead(plan: LaunchPlan, job: _Job, stderr_fd: int) -> NoReturn:
    attempt = LaunchDir(job.launch_dir).attempt_dir(0)
    code = 1
    try:
        with contextlib.suppress(OSError):  # the caller does it too; whoever comes first wins
            os.setpgid(0, 0)
        os.dup2(stderr_fd, 2)
        os.close(stderr_fd)
        faulthandler.enable(file=2, all_threads=False)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, _stop_pool if plan.xla_nprocs is None else signal.SIG_DFL)
        os.register_at_fork(after_in_child=_default_sigterm)
        die_with_parent()
        for name in plan.unset_env:
            os.environ.pop(name, None)
        if not plan.legacy_tpu_node:
            os.environ.setdefault("PJRT_DEVICE", PJRT_DEVICES.get(plan.accelerator, "CPU"))
        os.environ.update(job.env)
        import multiprocessing.process

        multiprocessing.process._children = _RecordingSet()  # type: ignore[attr-defined]
        import torch_xla.distributed.xla_multiprocessing as xmp

        global _JOB
        _JOB = job
        args = () if plan.start_method == "fork" else (job,)
        xmp.spawn(_replica, args=args, nprocs=plan.xla_nprocs, start_method=plan.start_method)
        code = 0
    except SystemExit as stop:  # a replica's failure, already recorded by its Worker
        code = stop.code if isinstance(stop.code, int) else 1
    except BaseException as error:  # noqa: BLE001 - the caller reports it
        if type(error).__name__ != "BrokenProcessPool":  # the exit codes below say more
            _write_json(attempt / "leader.json", _describe(error))
    finally:
        with contextlib.suppress(Exception):
            exits = {str(p.pid): p.exitcode for p in _POOL if p.pid is not None}
            _write_json(attempt / "exits.json", exits)
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def _stop_pool(signum: int, frame: Any) -> None:
    """The leader's SIGTERM: kill the pool and reap it, so no replica outlives the leader."""
    for process in _POOL:
        with contextlib.suppress(Exception):
            os.kill(process.pid, signal.SIGKILL)
    deadline = time.monotonic() + STOP_GRACE_S / 2
    with contextlib.suppress(ChildProcessError):
        while time.monotonic() < deadline:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                time.sleep(0.01)
    os._exit(128 + signum)


def _default_sigterm() -> None:
    """In processes the leader forks (the pool): SIGTERM kills, as the pool's terminate() expects."""
    with contextlib.suppress(ValueError):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


# --- the caller's side ---------------------------------------------------------------------------


class _Leader:
    """The caller's handle on the leader: start it, watch it, stop it, report what happened."""

    def __init__(self, plan: LaunchPlan, job: _Job) -> None:
        self.plan, self.job = plan, job
        self.attempt = LaunchDir(job.launch_dir).attempt_dir(0)
        self.pid = 0
        self._exit_fd: int | None = None
        self.status: int | None = None  # the leader's exit code once reaped (-N: signal N)
        self.stopped = False
        self.tail = _Tail()

    def start(self) -> None:
        read_end, write_end = os.pipe()
        for stream in (sys.stdout, sys.stderr):  # buffered text would be written twice
            with contextlib.suppress(Exception):
                stream.flush()
        try:
            pid = os.fork()
        except BaseException:
            os.close(read_end)
            os.close(write_end)
            raise
        if pid == 0:  # the leader: it must never return into the caller's code
            try:
                os.close(read_end)
                _lead(self.plan, self.job, write_end)
            finally:
                os._exit(1)
        os.close(write_end)
        with contextlib.suppress(OSError):  # the child does it too; whoever comes first wins
            os.setpgid(pid, pid)
        self.pid = pid
        self.tail.start(read_end)
        with contextlib.suppress(AttributeError, OSError):  # Linux 5.3+: readable once it exits
            self._exit_fd = os.pidfd_open(pid)

    def exited(self) -> bool:
        """Whether the leader has exited; it stays unreaped, so its group id stays ours."""
        try:
            return self.status is not None or os.waitid(
                os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
        except ChildProcessError:  # reaped behind our back (SIGCHLD ignored in the caller)
            return True

    def wait(self) -> None:
        timeout = self.plan.timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        failed_at = None
        while not self.exited():
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise self._timed_out()
            if failed_at is None and any(self.attempt.glob("failure-*.json")):
                failed_at = now
            if failed_at is not None and now - failed_at >= FAILURE_GRACE_S:
                self.stop()  # peers stuck in a collective would wait for the failed one forever
                return
            if self._exit_fd is None:
                time.sleep(POLL_S)
            else:  # wakes the moment the leader exits, not up to a poll later
                select.select([self._exit_fd], [], [], POLL_S)

    def stop(self) -> None:
        if not self.pid or self.status is not None:
            return
        self.stopped = True
        LaunchDir(self.job.launch_dir).cancel()  # a replica not started yet will not start
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        while not self.exited() and time.monotonic() < deadline:
            time.sleep(POLL_S)
        self.close()

    def close(self) -> None:
        """Kill whatever is left in the launch's group, reap the leader, drain its stderr."""
        if self._exit_fd is not None:
            os.close(self._exit_fd)
            self._exit_fd = None
        if self.pid and self.status is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)
            try:
                self.status = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
            except ChildProcessError:
                self.status = 0  # unknown: the launch directory tells what happened
            deadline = time.monotonic() + STOP_GRACE_S
            with contextlib.suppress(ProcessLookupError, PermissionError):
                while time.monotonic() < deadline:  # until every member of the group is gone
                    os.killpg(self.pid, 0)
                    time.sleep(POLL_S)
        self.tail.stop()

    def _timed_out(self) -> LaunchTimeout:
        pids = worker_pids(self.attempt)
        stacks = dump_stacks(self.attempt, pids)
        by_pid = {pids[rank]: text for rank, text in stacks.items() if text}
        self.stop()
        failures = [
            ProcessFailure(rank=rank, pid=pid,
                           stack=stacks.get(rank) or by_pid.get(pid) or "(no stack arrived)")
            for rank, pid in sorted(pids.items())
        ]
        where = "" if failures else " (no replica had started yet)"
        return LaunchTimeout(
            f"the launch did not finish within timeout={self.plan.timeout} s and was "
            f"stopped{where}", failures)

    def outcome(self) -> Any:
        records = read_failures(self.attempt)
        failures = list(records.values()) + self._crashes(set(records))
        world = self.plan.world_size
        if failures:
            raise LaunchError(
                f"the XLA launch failed: {len({f.rank for f in failures})} of {world} "
                "replica(s) failed", failures)
        leader = _read_json(self.attempt / "leader.json")
        if leader:
            raise LaunchError("the XLA launch failed before its replicas ran", [ProcessFailure(
                rank=0, pid=self.pid, exitcode=self.status, **leader)])
        if self.status != 0:
            raise LaunchError("the XLA launch failed: its leader process ended unexpectedly", [
                ProcessFailure(rank=0, pid=self.pid, exitcode=self.status,
                               stderr_tail=self.tail.lines())])
        result = self.attempt / "result.pkl"
        return pickle.loads(result.read_bytes()) if result.exists() else None

    def _crashes(self, reported: set[int]) -> list[ProcessFailure]:
        """Replicas that died without a Python exception: signal, abort, os._exit."""
        exits = {int(pid): code for pid, code in (_read_json(self.attempt / "exits.json") or {})
                 .items() if code is not None}
        if self.plan.xla_nprocs == 1 and self.status is not None:
            exits[self.pid] = self.status  # the leader was the replica
        ranks: dict[int, list[int]] = {}
        for rank, pid in worker_pids(self.attempt).items():
            ranks.setdefault(pid, []).append(rank)
        known = {rank for listed in ranks.values() for rank in listed}
        # A process that died before it learnt its rank gets one no other process has.
        spare = iter(sorted(set(range(self.plan.world_size + len(exits))) - known))
        failures = []
        for pid, code in exits.items():
            if code in (0, CANCELLED_EXIT) or (self.stopped and code < 0):
                continue
            # The pool terminates (SIGTERM) the rest once one dies: those are not the cause.
            when = 0 if code == -signal.SIGTERM else time.time_ns()
            for rank in ranks.get(pid) or [next(spare)]:
                if rank not in reported:
                    failures.append(ProcessFailure(rank=rank, pid=pid, exitcode=code,
                                                   timestamp_ns=when,
                                                   stderr_tail=self.tail.lines(rank)))
        return failures


class _Tail:
    """Copies the launch's stderr to the caller's, keeping the last bytes for failure reports."""

    def __init__(self) -> None:
        self.data = bytearray()
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, fd: int) -> None:
        self._thread = threading.Thread(target=self._pump, args=(fd,), name="xlaunch-stderr",
                                        daemon=True)
        self._thread.start()

    def _pump(self, fd: int) -> None:
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        try:
            while True:
                if not poller.poll(POLL_S * 1000):
                    if self._done.is_set():
                        break  # something outside the launch still holds the pipe
                    continue
                chunk = os.read(fd, 65536)
                if not chunk:
                    break
                self.data += chunk
                del self.data[:-TAIL_BYTES]
                with contextlib.suppress(Exception):
                    sys.stderr.write(decoder.decode(chunk))
                    sys.stderr.flush()
        finally:
            os.close(fd)

    def stop(self) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def lines(self, rank: int | None = None) -> str:
        """The last lines, less those another rank's ``[rank N]`` prefix claims.

        A crash dump lists the innermost frames first: only those are kept, so that the outer
        ones (the launcher's, or all of a notebook kernel's) do not push the message out.
        """
        kept: list[str] = []
        frames = 0
        for line in self.data.decode("utf-8", "replace").splitlines():
            claimed = re.match(r"\[rank (\d+)\] ", line)
            if not line.strip() or line.startswith("Extension modules:") or (
                    rank is not None and claimed and int(claimed[1]) != rank):
                continue
            frames = frames + 1 if line.startswith("  File ") else 0
            if frames <= STACK_FRAMES:
                kept.append(line)
            elif frames == STACK_FRAMES + 1:
                kept.append("  ...")
        return "\n".join(kept[-TAIL_LINES:])


# --- checks before anything starts -----------------------------------------------------------------


def _refuse_initialised_runtime() -> None:
    torch_xla = sys.modules.get("torch_xla")  # never imported here: nothing can be initialised
    check = getattr(getattr(torch_xla, "_XLAC", None), "_xla_runtime_is_initialized", None)
    if check is None or not check():
        return
    raise RuntimeError(
        "The XLA runtime is already initialised in this process, and torch_xla cannot start "
        "replicas after that. Something in an earlier cell used the XLA device: an XLA tensor or "
        "model (.to(torch_xla.device())), torch_xla.device() / xm.xla_device(), or an ordinal or "
        "world-size query (xr.global_ordinal(), xr.world_size(), xm.get_ordinal()). Restart the "
        "kernel and launch before any cell touches the XLA device (do that work inside the "
        "launched function)."
    )


def prepare_tpu_node(environ: Mapping[str, str], xla_version: str | None = None) -> dict[str, str]:
    """Ready a legacy TPU Node for torch_xla <= 2.0; return the variables its workers need.

    A TPU Node is a remote TPU reached over gRPC (XRT). Its software must match torch_xla's, so
    the runtime version is selected with cloud-tpu-client, as torch_xla 1.x did on import.
    """
    version = xla_version or _installed_version("torch_xla")
    match = re.match(r"(\d+)\.(\d+)", version or "")
    release = (int(match[1]), int(match[2])) if match else None
    if release is None or release > (2, 0) or importlib.util.find_spec("cloud_tpu_client") is None:
        found = f"torch_xla {version}" if version else "torch_xla is not installed"
        raise RuntimeError(
            "This runtime is a legacy TPU Node (COLAB_TPU_ADDR / TPU_NAME name a remote TPU; this "
            "machine has no TPU chips). TPU Nodes run only with torch_xla 2.0 or older (the XRT "
            "runtime) plus cloud-tpu-client, and Google ended them in 2025; here "
            f"{found}. Switch to a TPU VM runtime (Colab: Runtime > Change runtime type > a v5e "
            "or v6e TPU), or install torch_xla<=2.0 with `pip install 'xlaunch[tpu-node]'`."
        )
    import cloud_tpu_client

    address = environ.get("COLAB_TPU_ADDR") or environ.get("TPU_NAME", "").split("grpc://")[-1]
    remote = ":" in address
    target = f"grpc://{address}" if remote else environ.get("TPU_NAME")
    client = cloud_tpu_client.Client(tpu=target)
    client.configure_tpu_version(f"pytorch-{release[0]}.{release[1]}", restart_type="ifNeeded")
    if not remote:
        return {}
    host, port = address.rsplit(":", 1)
    _wait_for_port(host, int(port), TPU_NODE_PORT_WAIT_S)  # the runtime restarts if it changed
    return {"XRT_TPU_CONFIG": f"tpu_worker;0;{address}"}


def _wait_for_port(host: str, port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        with socket.socket() as probe:
            probe.settimeout(2)
            if probe.connect_ex((host, port)) == 0:
                return
        if time.monotonic() >= deadline:
            raise RuntimeError(f"the TPU Node at {host}:{port} did not come up in {timeout:.0f} s")
        time.sleep(1)


def _installed_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _describe(error: BaseException) -> dict[str, Any]:
    return dict(exc_type=type(error).__qualname__, message=str(error), timestamp_ns=time.time_ns(),
                traceback="".join(traceback.format_exception(type(error), error,
                                                             error.__traceback__)))


def _write_json(path: Path, data: Any) -> None:
    partial = path.with_suffix(".tmp")
    partial.write_text(json.dumps(data))
    partial.replace(path)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
