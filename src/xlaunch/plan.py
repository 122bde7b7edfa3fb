"""Environment + the caller's arguments -> one `LaunchPlan`. Every refusal lives here.

Keeping the decisions in one pure function means a bad argument is refused before any process
starts, `xlaunch env` can show what a launch would do without doing it, and each backend only
carries out a plan it never has to second-guess.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from .environment import Environment
from .tpu_layout import TpuLayout, tpu_layout

DEFAULT_PORT = "29500"
DEFAULT_MONITOR_INTERVAL = 0.1
# Left at its default, the engine checks its workers this often instead: its first check comes
# one interval after the start, which was most of a short launch's time at 0.1 s.
FAST_MONITOR_INTERVAL = 0.01
MIXED_PRECISIONS = ("no", "fp16", "bf16")
RDZV_BACKENDS = ("static", "c10d", "etcd", "etcd-v2")
START_METHODS = ("fork", "spawn", "forkserver")


@dataclass(frozen=True)
class LaunchPlan:
    """Everything a backend needs to start this node's workers, decided up front."""

    backend: str  # "xla" (xmp.spawn), "elastic" (torch elastic agent), "inline" (the caller)
    accelerator: str  # tpu | cuda | cpu
    num_processes: int  # processes on this node
    num_nodes: int = 1
    node_rank: int = 0
    threads_per_process: int = 1  # XLA replicas per process (2 on v2/v3 chips)
    dist_backend: str | None = None  # xla | nccl | gloo; None when one process runs inline
    start_method: str = "fork"
    mixed_precision: str = "no"
    master_addr: str = "127.0.0.1"
    port: int = 29500
    port_is_default: bool = True
    rdzv_backend: str = "static"
    rdzv_endpoint: str = ""
    rdzv_conf: Mapping[str, Any] = field(default_factory=dict)
    rdzv_id: str = "none"
    max_restarts: int = 0
    monitor_interval: float = 0.1
    log_line_prefix_template: str | None = None
    timeout: float | None = None
    worker_env: Mapping[str, str] = field(default_factory=dict)  # set in every worker
    unset_env: tuple[str, ...] = ()  # removed before workers start
    notes: tuple[str, ...] = ()  # what the user should be told about this plan
    xla_nprocs: int | None = None  # XLA path: xmp.spawn's nprocs, None (the layout) or 1 replica
    legacy_tpu_node: bool = False  # XLA path to a remote TPU Node (torch_xla <= 2.0 only)

    @property
    def world_size(self) -> int:
        """Replicas in the whole job: processes x threads on every node."""
        return self.num_processes * self.threads_per_process * self.num_nodes

    @property
    def local_only(self) -> bool:
        """A single-node launch needs no address beyond loopback."""
        return self.num_nodes == 1

    def summary(self) -> str:
        """One line saying what will run, so a launch never silently does something else."""
        count = self.num_processes * self.threads_per_process
        one, many = {"tpu": ("TPU core", "TPU cores"), "cuda": ("GPU", "GPUs"),
                     "cpu": ("CPU process", "CPU processes")}[self.accelerator]
        text = f"{count} {one if count == 1 else many}"
        if self.backend == "xla":
            text += f" through torch_xla ({self.num_processes} process(es)"
            text += f" x {self.threads_per_process} threads)" if self.threads_per_process > 1 else ")"
        elif self.backend == "elastic":
            text += f" through torch elastic ({self.dist_backend}, {self.start_method})"
        else:
            text += " in this process"
        if self.num_nodes > 1:
            text += f" on node {self.node_rank} of {self.num_nodes}"
        return text

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["rdzv_conf"] = dict(self.rdzv_conf)
        data["worker_env"] = dict(self.worker_env)
        data["world_size"] = self.world_size
        return data


def default_start_method() -> str:
    return "fork" if sys.platform.startswith("linux") else "spawn"


def make_plan(
    env: Environment,
    *,
    num_processes: int | None = None,
    mixed_precision: str = "no",
    use_port: str | int = DEFAULT_PORT,
    master_addr: str = "127.0.0.1",
    node_rank: int = 0,
    num_nodes: int = 1,
    rdzv_backend: str = "static",
    rdzv_endpoint: str = "",
    rdzv_conf: Mapping[str, Any] | None = None,
    rdzv_id: str = "none",
    max_restarts: int = 0,
    monitor_interval: float = DEFAULT_MONITOR_INTERVAL,
    log_line_prefix_template: str | None = None,
    timeout: float | None = None,
    start_method: str | None = None,
    cpu_only: bool = False,
) -> LaunchPlan:
    """Decide how to launch, or raise `ValueError` saying what to change."""
    precision = _mixed_precision(mixed_precision)
    _check_counts(num_processes, num_nodes, node_rank, max_restarts)
    port, port_is_default = _port(use_port)
    if rdzv_backend not in RDZV_BACKENDS:
        raise ValueError(f"rdzv_backend={rdzv_backend!r} is not one of {', '.join(RDZV_BACKENDS)}")
    if not monitor_interval > 0:
        raise ValueError(f"monitor_interval must be a positive number of seconds, not {monitor_interval!r}")
    if timeout is not None and not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds or None, not {timeout!r}")
    method = start_method or default_start_method()
    if method not in START_METHODS:
        raise ValueError(f"start_method={method!r} is not one of {', '.join(START_METHODS)}")

    common: dict[str, Any] = dict(
        num_nodes=num_nodes, node_rank=node_rank, start_method=method, mixed_precision=precision,
        master_addr=master_addr, port=port, port_is_default=port_is_default,
        rdzv_backend=rdzv_backend, rdzv_endpoint=rdzv_endpoint, rdzv_conf=dict(rdzv_conf or {}),
        rdzv_id=rdzv_id, max_restarts=max_restarts,
        monitor_interval=(FAST_MONITOR_INTERVAL if monitor_interval == DEFAULT_MONITOR_INTERVAL
                          else float(monitor_interval)),
        log_line_prefix_template=log_line_prefix_template, timeout=timeout,
    )
    accelerator = "cpu" if cpu_only else env.accelerator
    if not cpu_only and env.xla_device is not None:
        return _xla_plan(env, num_processes, precision, common)
    if accelerator == "cuda":
        return _cuda_plan(env, num_processes, common)
    return _cpu_plan(num_processes, cpu_only, common)


def _xla_plan(env: Environment, num_processes: int | None, precision: str,
              common: dict[str, Any]) -> LaunchPlan:
    if precision == "fp16" and env.accelerator == "tpu":
        raise ValueError(
            "mixed_precision='fp16' is not supported on TPU: TPUs compute in bfloat16. "
            "Use mixed_precision='bf16'."
        )
    if env.legacy_tpu_node:
        notes: tuple[str, ...] = ("legacy TPU Node runtime (remote TPU, no local chips)",)
    else:
        notes = ()
    if common["num_nodes"] > 1:
        raise ValueError(
            "num_nodes > 1 does not apply to TPUs: on a TPU pod run the same launch on every host "
            "(for example `gcloud compute tpus tpu-vm ssh --worker=all`); torch_xla forms the world."
        )
    layout: TpuLayout = tpu_layout(env, num_processes)
    return LaunchPlan(
        backend="xla", accelerator=env.accelerator, num_processes=layout.processes,
        threads_per_process=layout.threads_per_process, dist_backend="xla",
        worker_env=layout.env, unset_env=layout.unset_env, notes=notes + layout.notes,
        xla_nprocs=layout.nprocs, legacy_tpu_node=env.legacy_tpu_node, **common,
    )


def _cuda_plan(env: Environment, num_processes: int | None, common: dict[str, Any]) -> LaunchPlan:
    if env.device_count == 0:
        raise ValueError("a GPU launch was asked for (XLAUNCH_ACCELERATOR=cuda) but no GPU is visible "
                         "(check the driver and CUDA_VISIBLE_DEVICES)")
    count = env.device_count if num_processes is None else num_processes
    if count > env.device_count:
        raise ValueError(
            f"num_processes={count} asks for more processes than this machine has GPUs "
            f"({env.device_count}); use at most {env.device_count}"
        )
    return _torch_plan("cuda", count, "nccl", common)


def _cpu_plan(num_processes: int | None, cpu_only: bool, common: dict[str, Any]) -> LaunchPlan:
    notes: tuple[str, ...] = ()
    if num_processes is None:
        num_processes = 1
        if not cpu_only:
            notes = ("no TPU or GPU found: running 1 process on the CPU "
                     "(pass num_processes=N for N CPU processes)",)
    return _torch_plan("cpu", num_processes, "gloo", common, notes)


def _torch_plan(accelerator: str, count: int, dist_backend: str, common: dict[str, Any],
                notes: tuple[str, ...] = ()) -> LaunchPlan:
    inline = count == 1 and common["num_nodes"] == 1
    return LaunchPlan(
        backend="inline" if inline else "elastic", accelerator=accelerator, num_processes=count,
        dist_backend=None if inline else dist_backend, notes=notes, **common,
    )


def _mixed_precision(value: object) -> str:
    text = str(value).strip().lower() if isinstance(value, str) else None
    if text not in MIXED_PRECISIONS:
        raise ValueError(f"mixed_precision={value!r} is not one of {', '.join(MIXED_PRECISIONS)}")
    return text


def _check_counts(num_processes: int | None, num_nodes: int, node_rank: int,
                  max_restarts: int) -> None:
    if num_processes is not None and (not _is_int(num_processes) or num_processes < 1):
        raise ValueError(f"num_processes must be a whole number of at least 1, not {num_processes!r}")
    if not _is_int(num_nodes) or num_nodes < 1:
        raise ValueError(f"num_nodes must be a whole number of at least 1, not {num_nodes!r}")
    if not _is_int(node_rank) or not 0 <= node_rank < num_nodes:
        raise ValueError(f"node_rank={node_rank!r} must be between 0 and num_nodes-1={num_nodes - 1}")
    if not _is_int(max_restarts) or max_restarts < 0:
        raise ValueError(f"max_restarts must be a whole number of at least 0, not {max_restarts!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _port(use_port: str | int) -> tuple[int, bool]:
    is_default = str(use_port) == DEFAULT_PORT
    try:
        port = int(use_port)
    except (TypeError, ValueError):
        port = -1
    if not 0 < port < 65536:
        raise ValueError(f"use_port={use_port!r} is not a port number (1-65535)")
    return port, is_default
