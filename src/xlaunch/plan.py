"""Environment + the caller's options -> one `LaunchPlan`. Every refusal and decision lives here.

Keeping the decisions in one place means a bad argument is refused before any process starts,
`xlaunch env` can show what a launch would do without doing it, and each backend only carries out
a plan it never has to second-guess: the port, the threads per CPU process, the interface workers
meet on, the PJRT device, the engine's check interval are all decided here.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from .environment import Environment
from .machine import Machine
from .options import DEFAULT_MONITOR_INTERVAL, DEFAULT_PORT, LaunchOptions
from .ports import choose_port
from .refusals import check_values, refuse_unused
from .tpu_layout import tpu_layout

# Left at its default, the engine checks its workers this often instead (see options.py).
FAST_MONITOR_INTERVAL = 0.01
PJRT_DEVICES = {"tpu": "TPU", "cuda": "CUDA", "cpu": "CPU"}
COMPILE_CACHE_VAR = "XLAUNCH_COMPILE_CACHE"
PATHS = {
    "xla": "torch_xla xmp.spawn",
    "elastic": "torch.distributed.elastic",
    "inline": "in the calling process, no worker processes",
}


@dataclass(frozen=True)
class XlaSpec:
    """TPU cores (or XLA's CPU/GPU devices) through ``xmp.spawn`` in a launch leader."""

    threads_per_process: int  # replicas per process (2 on v2/v3 chips)
    nprocs: int | None  # xmp.spawn's nprocs: None spawns the layout, 1 runs one replica
    pjrt_device: str | None  # set for the workers unless already set; None on a TPU Node
    start_method: str = "fork"
    worker_env: Mapping[str, str] = field(default_factory=dict)  # set in every replica
    unset_env: tuple[str, ...] = ()  # removed before the replicas start
    legacy_tpu_node: bool = False  # a remote TPU Node (torch_xla <= 2.0 only)
    line_prefix: str | None = "[rank ${rank}] "  # None: output is not prefixed
    max_restarts: int = 0  # the whole launch runs again after a failure, up to this many times
    compile_cache: str | None = None  # torch_xla's persistent compilation cache; None: off


@dataclass(frozen=True)
class ElasticSpec:
    """GPUs or CPU processes through torch elastic's agent."""

    dist_backend: str  # nccl | gloo
    start_method: str
    port: int  # MASTER_PORT for the workers; where node 0's store listens with several nodes
    num_nodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    rdzv_backend: str = "static"
    rdzv_endpoint: str = ""
    rdzv_conf: Mapping[str, Any] = field(default_factory=dict)
    rdzv_id: str = "none"
    max_restarts: int = 0
    monitor_interval: float = FAST_MONITOR_INTERVAL
    log_line_prefix_template: str | None = None  # the engine prefixes (and tees) when set
    cpu_threads: int = 0  # torch threads per CPU worker; 0 leaves torch's choice
    loopback_only: bool = True  # one node: everything meets through files and on `lo`

    @property
    def socket_ifname(self) -> str | None:
        return "lo" if self.loopback_only else None


@dataclass(frozen=True)
class InlineSpec:
    """One process: the caller's own; nothing starts."""


PathSpec = XlaSpec | ElasticSpec | InlineSpec


@dataclass(frozen=True)
class LaunchPlan:
    """Everything a backend needs to start this node's workers, decided up front."""

    accelerator: str  # tpu | cuda | cpu
    num_processes: int  # processes on this node
    world_size: int  # replicas in the whole job
    spec: PathSpec
    mixed_precision: str = "no"
    timeout: float | None = None
    report: bool = True
    notes: tuple[str, ...] = ()  # what the user should be told about this plan

    @property
    def path(self) -> str:
        return {XlaSpec: "xla", ElasticSpec: "elastic", InlineSpec: "inline"}[type(self.spec)]

    @property
    def dist_backend(self) -> str | None:
        if isinstance(self.spec, XlaSpec):
            return "xla"
        return self.spec.dist_backend if isinstance(self.spec, ElasticSpec) else None

    def summary(self) -> str:
        """One line saying what will run, so a launch never silently does something else."""
        spec = self.spec
        count = self.world_size // getattr(spec, "num_nodes", 1)
        one, many = {"tpu": ("TPU core", "TPU cores"), "cuda": ("GPU", "GPUs"),
                     "cpu": ("CPU process", "CPU processes")}[self.accelerator]
        text = f"{count} {one if count == 1 else many}"
        if isinstance(spec, XlaSpec):
            text += f" through torch_xla ({self.num_processes} process(es)"
            text += f" x {spec.threads_per_process} threads)" if spec.threads_per_process > 1 else ")"
        elif isinstance(spec, ElasticSpec):
            text += f" through torch elastic ({spec.dist_backend}, {spec.start_method})"
            if spec.num_nodes > 1:
                text += f" on node {spec.node_rank} of {spec.num_nodes}"
        else:
            text += " in this process"
        return text

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.update(path=self.path, dist_backend=self.dist_backend)
        return data


def default_start_method() -> str:
    return "fork" if sys.platform.startswith("linux") else "spawn"


def make_plan(env: Environment, options: LaunchOptions | None = None,
              machine: Machine | None = None) -> LaunchPlan:
    """Decide how to launch, or raise `ValueError` (`RuntimeError` for a taken port) saying why."""
    options = options or LaunchOptions()
    check_values(options)
    machine = machine or Machine.here()
    if not options.cpu_only and env.xla_device is not None:
        plan = _xla_plan(env, options)
    elif env.accelerator == "cuda" and not options.cpu_only:
        plan = _cuda_plan(env, options)
    else:
        plan = _cpu_plan(options, machine)
    refuse_unused(plan, options)
    return plan


def _common(options: LaunchOptions) -> dict[str, Any]:
    return dict(mixed_precision=options.mixed_precision.strip().lower(), timeout=options.timeout,
                report=options.report)


def _xla_plan(env: Environment, options: LaunchOptions) -> LaunchPlan:
    if options.mixed_precision.strip().lower() == "fp16" and env.accelerator == "tpu":
        raise ValueError("mixed_precision='fp16' is not supported on TPU: TPUs compute in "
                         "bfloat16. Use mixed_precision='bf16'.")
    if options.num_nodes > 1:
        raise ValueError(
            "num_nodes > 1 does not apply to TPUs: on a TPU pod run the same launch on every host "
            "(for example `gcloud compute tpus tpu-vm ssh --worker=all`); torch_xla forms the world.")
    if env.tpu_holders:
        raise RuntimeError(_held(env))
    layout = tpu_layout(env, options.num_processes)
    notes = ("legacy TPU Node runtime (remote TPU, no local chips)",) if env.legacy_tpu_node else ()
    template = options.log_line_prefix_template
    spec = XlaSpec(
        threads_per_process=layout.threads_per_process, nprocs=layout.nprocs,
        pjrt_device=None if env.legacy_tpu_node else PJRT_DEVICES.get(env.accelerator, "CPU"),
        start_method=options.start_method or "fork", worker_env=layout.env,
        unset_env=layout.unset_env, legacy_tpu_node=env.legacy_tpu_node,
        line_prefix=template if template is not None else XlaSpec.line_prefix,
        max_restarts=options.max_restarts, compile_cache=compile_cache(env, options.compile_cache))
    return LaunchPlan(env.accelerator, layout.processes, layout.replicas, spec,
                      notes=notes + layout.notes, **_common(options))


def compile_cache(env: Environment, asked: bool | str | os.PathLike[str] | None) -> str | None:
    """Where torch_xla keeps compiled graphs between launches, or None for no cache.

    On by default where it pays (TPU, XLA on GPUs: the CPU device cannot read a cache back);
    ``False`` turns it off; ``True`` or a folder turns it on on any XLA device.
    """
    if asked is False or (asked is None and env.accelerator not in ("tpu", "cuda")):
        return None
    if asked is None or asked is True:
        default = os.path.join(os.path.expanduser("~"), ".cache", "xlaunch", "xla-compile")
        return os.environ.get(COMPILE_CACHE_VAR) or default
    return os.fspath(asked)


def _held(env: Environment) -> str:
    holders = "; ".join(holder.describe() for holder in env.tpu_holders)
    own = [holder for holder in env.tpu_holders if holder.pid == os.getpid()]
    text = (f"The TPU is in use: {holders}. A TPU can be held by one process at a time, so the "
            "launch would fail inside the runtime. ")
    if own:
        return text + ("That process is this one: something in it already used the TPU. "
                       "Restart the runtime (Colab: Runtime > Restart session; Kaggle: Run > "
                       "Restart & clear cell outputs) and launch before touching the TPU.")
    pids = " ".join(str(holder.pid) for holder in env.tpu_holders)
    return text + (f"End that process (`kill {pids}`, or stop the notebook or script it belongs "
                   "to) and launch again.")


def _cuda_plan(env: Environment, options: LaunchOptions) -> LaunchPlan:
    if env.device_count == 0:
        raise ValueError("a GPU launch was asked for (XLAUNCH_ACCELERATOR=cuda) but no GPU is "
                         "visible (check the driver and CUDA_VISIBLE_DEVICES)")
    count = env.device_count if options.num_processes is None else options.num_processes
    if count > env.device_count:
        raise ValueError(
            f"num_processes={count} asks for more processes than this machine has GPUs "
            f"({env.device_count}); use at most {env.device_count}")
    return _torch_plan("cuda", count, "nccl", options, cpu_threads=0)


def _cpu_plan(options: LaunchOptions, machine: Machine) -> LaunchPlan:
    count = options.num_processes
    notes: tuple[str, ...] = ()
    if count is None:
        count = 1
        if not options.cpu_only:
            notes = ("no TPU or GPU found: running 1 process on the CPU "
                     "(pass num_processes=N for N CPU processes)",)
    machine.check_cpu_processes(count)
    # Each process would start a thread per core and they would fight over the cores (the demo
    # trained 2.5x slower on 2 cores); torchrun sets OMP_NUM_THREADS for the same reason.
    threads = 0 if "OMP_NUM_THREADS" in os.environ or count == 1 else max(1, machine.cores // count)
    plan = _torch_plan("cpu", count, "gloo", options, cpu_threads=threads)
    return replace(plan, notes=notes)


def _torch_plan(accelerator: str, count: int, dist_backend: str, options: LaunchOptions,
                cpu_threads: int) -> LaunchPlan:
    world = count * options.num_nodes
    if count == 1 and options.num_nodes == 1:
        return LaunchPlan(accelerator, 1, 1, InlineSpec(), **_common(options))
    loopback = options.num_nodes == 1 and not options.rdzv_endpoint
    interval = options.monitor_interval
    spec = ElasticSpec(
        dist_backend=dist_backend, start_method=options.start_method or default_start_method(),
        port=choose_port(options.use_port, options.use_port == DEFAULT_PORT, options.master_addr,
                         loopback=options.num_nodes == 1, owner=options.node_rank == 0),
        num_nodes=options.num_nodes, node_rank=options.node_rank, master_addr=options.master_addr,
        rdzv_backend=options.rdzv_backend, rdzv_endpoint=options.rdzv_endpoint,
        rdzv_conf=dict(options.rdzv_conf or {}), rdzv_id=options.rdzv_id,
        max_restarts=options.max_restarts,
        monitor_interval=FAST_MONITOR_INTERVAL if interval is DEFAULT_MONITOR_INTERVAL else interval,
        log_line_prefix_template=options.log_line_prefix_template, cpu_threads=cpu_threads,
        loopback_only=loopback)
    return LaunchPlan(accelerator, count, world, spec, **_common(options))


def describe_path(plan: LaunchPlan) -> str:
    return f"{plan.path} ({PATHS[plan.path]})"
