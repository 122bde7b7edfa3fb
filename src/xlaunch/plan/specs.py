"""What a launch will do, decided up front: a `LaunchPlan`, a core shared by every path plus one
typed spec for the path it takes. Plain frozen data: `xlaunch env` prints it, backends carry it out.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

from xlaunch.names import (
    DEVICE_VAR,
    MIXED_PRECISION_VAR,
    Accelerator,
    DistBackend,
    MixedPrecision,
    PathName,
    StartMethod,
)
from xlaunch.plan.options import (
    DEFAULT_MASTER_ADDR,
    DEFAULT_MONITOR_INTERVAL,
    DEFAULT_RDZV_BACKEND,
    DEFAULT_RDZV_ID,
    DEFAULT_STOP_GRACE,
)

PATHS: dict[PathName, str] = {
    "xla": "torch_xla xmp.spawn",
    "torch_tpu": "TorchTPU: torch.multiprocessing, torch elastic's rendezvous across hosts",
    "elastic": "torch.multiprocessing; torch elastic's rendezvous across machines",
    "inline": "in the calling process, no worker processes",
}


@dataclass(frozen=True)
class XlaSpec:
    """TPU cores (or XLA's CPU/GPU devices) through ``xmp.spawn``."""

    path: ClassVar[PathName] = "xla"
    threads_per_process: int  # replicas per process (2 on v2/v3 chips)
    nprocs: int | None  # xmp.spawn's nprocs: None spawns the layout, 1 runs one replica
    pjrt_device: str  # PJRT_DEVICE for the replicas
    start_method: StartMethod = "fork"
    worker_env: Mapping[str, str] = field(default_factory=dict)  # set in every replica
    unset_env: tuple[str, ...] = ()  # removed before the replicas start
    line_prefix: str | None = "[rank ${rank}] "  # None: output is not prefixed
    max_restarts: int = 0  # the whole launch runs again after a failure, up to this many times
    compile_cache: str | None = None  # torch_xla's persistent compilation cache; None: off
    spmd_devices: int = 0  # SPMD: the one process drives this many devices; 0: not SPMD


@dataclass(frozen=True)
class ElasticSpec:
    """GPUs or CPU processes: torch.multiprocessing, torch elastic's rendezvous across machines."""

    path: ClassVar[PathName] = "elastic"
    dist_backend: DistBackend
    start_method: StartMethod
    # MASTER_PORT for the workers (node 0's store with several nodes). The port is bound when the
    # launch starts, not here: a plan binds nothing, and a port probed now could be taken by then.
    port: int
    port_fallback: bool = False  # taken at launch time: use a free one instead (the default port)
    node_rank: int = 0
    master_addr: str = DEFAULT_MASTER_ADDR
    rdzv_backend: str = DEFAULT_RDZV_BACKEND
    rdzv_endpoint: str = ""
    rdzv_conf: Mapping[str, Any] = field(default_factory=dict)
    rdzv_id: str = DEFAULT_RDZV_ID
    max_restarts: int = 0
    # Seconds between checks on what does not arrive as a process's end (another node's failure);
    # a worker's end is seen the moment it happens.
    monitor_interval: float = float(DEFAULT_MONITOR_INTERVAL)
    # Each worker's line prefix (${rank}, ${local_rank}); None: "[rank N] " with several ranks.
    log_line_prefix_template: str | None = None
    cpu_threads: int = 0  # torch threads per CPU worker; 0 leaves torch's choice
    loopback_only: bool = True  # one node: everything meets through files and on `lo`

    @property
    def socket_ifname(self) -> str | None:
        return "lo" if self.loopback_only else None

    def place(self, num_nodes: int, machine: str) -> str:
        """Where this machine sits among ``num_nodes``, as far as the plan knows: ``static`` takes
        the given node rank; any other rendezvous numbers the machines as they arrive (and says
        where it put this one when they meet)."""
        if self.rdzv_backend == "static":
            return f"on {machine} {self.node_rank} of {num_nodes} (torch elastic's static rendezvous)"
        return f"as one of {num_nodes} {machine}s (torch elastic's {self.rdzv_backend} rendezvous " \
               "numbers them)"


@dataclass(frozen=True)
class TorchTpuSpec(ElasticSpec):
    """TPU devices through TorchTPU: one spawned process per device, as on the elastic path.

    TorchTPU's own launch variables (``set_tpu_launch_env``: slice-builder ports, topology) and
    its handshake port are chosen when the launch starts, not here: a plan binds and probes
    nothing, and a port picked now could be taken by then.
    """

    path: ClassVar[PathName] = "torch_tpu"
    # dist_backend is "tpu_dist" and start_method "spawn" (TorchTPU supports only spawn).
    # TORCH_TPU_TOPOLOGY for this many processes per host, from TorchTPU's table (the count was
    # checked against it). The backend does not pass it on: set_tpu_launch_env computes the same
    # value from the same table (a TORCH_TPU_TOPOLOGY the user set wins there). It is kept
    # because `xlaunch env` names it ("TPU topology"), so a bug report shows the layout.
    topology: str = ""


@dataclass(frozen=True)
class InlineSpec:
    """One process: the caller's own; nothing starts."""

    path: ClassVar[PathName] = "inline"


PathSpec = XlaSpec | TorchTpuSpec | ElasticSpec | InlineSpec


@dataclass(frozen=True)
class LaunchPlan:
    """Everything a backend needs to start this node's workers, decided up front."""

    accelerator: Accelerator
    num_processes: int  # processes on this node
    world_size: int  # replicas in the whole job
    spec: PathSpec
    num_nodes: int = 1
    mixed_precision: MixedPrecision = "no"
    timeout: float | None = None
    report: bool = True
    stop_grace: float = DEFAULT_STOP_GRACE  # a stop's SIGTERM, then SIGKILL after this long
    memory_total: int | None = None  # this machine's memory, for the report's memory warning
    notes: tuple[str, ...] = ()  # what the user should be told about this plan

    @property
    def path(self) -> PathName:
        return self.spec.path

    @property
    def dist_backend(self) -> str | None:
        if isinstance(self.spec, XlaSpec):
            return "xla"
        return self.spec.dist_backend if isinstance(self.spec, ElasticSpec) else None

    def worker_variables(self) -> dict[str, str]:
        """What every worker's environment gets from the options: xlaunch's own variable, and
        the ones ``accelerate launch`` sets for the same options (accelerate 1.x,
        ``accelerate/utils/launch.py``), so an ``Accelerator()`` in the workers reads them too.

        accelerate's are set only for what was asked (a precision, CPU processes): a variable
        the user set for accelerate stays when the launch asks nothing.

        Worker processes that are no XLA replicas (GPU, CPU, TorchTPU) get ``USE_TORCH_XLA=0``,
        the switch accelerate and transformers document for "a native pytorch job in an
        environment with torch xla installed": where torch_xla is installed (Colab's and Kaggle's
        TPU runtimes) they would otherwise take XLA for the device, and every rank would be rank 0
        of a world of 1 on ``xla:0``. A one-process launch runs in the caller's own process: it
        is left alone there. Both read it when first imported: an accelerate imported in the
        caller before a forked launch keeps what it read there.
        """
        variables: dict[str, str] = {MIXED_PRECISION_VAR: self.mixed_precision}
        if not isinstance(self.spec, XlaSpec):  # an XLA replica's world names its device
            variables[DEVICE_VAR] = self.accelerator
        if self.mixed_precision != "no":
            variables["ACCELERATE_MIXED_PRECISION"] = self.mixed_precision
        if self.accelerator == "cpu" and not isinstance(self.spec, XlaSpec):
            variables["ACCELERATE_USE_CPU"] = "True"  # ``accelerate launch --cpu``
        if isinstance(self.spec, ElasticSpec):
            variables["USE_TORCH_XLA"] = "0"
        return variables

    def summary(self) -> str:
        """One line saying what will run, so a launch never silently does something else."""
        spec = self.spec
        count = self.world_size // self.num_nodes
        one, many = {"tpu": ("TPU core", "TPU cores"), "cuda": ("GPU", "GPUs"),
                     "cpu": ("CPU process", "CPU processes")}[self.accelerator]
        if isinstance(spec, XlaSpec) and spec.spmd_devices:
            kind = "TPU" if self.accelerator == "tpu" else f"XLA {spec.pjrt_device}"
            devices = spec.spmd_devices
            hosts = f" on each of {self.num_nodes} hosts" if self.num_nodes > 1 else ""
            return (f"1 process driving {devices} {kind} device{'s' if devices > 1 else ''} "
                    f"(SPMD){hosts}")
        if isinstance(spec, XlaSpec) and self.accelerator != "tpu":
            # XLA's CPU or GPU devices: replicas are devices, several may share one process
            device = f"XLA {spec.pjrt_device} device"
            one, many = device, f"{device}s"
        text = f"{count} {one if count == 1 else many}"
        if isinstance(spec, XlaSpec):
            processes = "1 process" if self.num_processes == 1 else f"{self.num_processes} processes"
            text += f" through torch_xla ({processes}"
            text += f" x {spec.threads_per_process} threads)" if spec.threads_per_process > 1 else ")"
        elif isinstance(spec, TorchTpuSpec):
            text = f"{count} TPU device{'' if count == 1 else 's'} through TorchTPU " \
                   f"({spec.dist_backend}, {spec.start_method})"
            if self.num_nodes > 1:
                text += f" {spec.place(self.num_nodes, 'host')}"
        elif isinstance(spec, ElasticSpec):
            text += f" through torch.multiprocessing ({spec.dist_backend}, {spec.start_method})"
            if self.num_nodes > 1:
                text += f" {spec.place(self.num_nodes, 'node')}"
        else:
            text += " in this process"
        return text

    def describe_path(self) -> str:
        if isinstance(self.spec, XlaSpec) and self.spec.spmd_devices:
            return f"{self.path} (torch_xla SPMD in one forked process per host)"
        return f"{self.path} ({PATHS[self.path]})"

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.update(path=self.path, dist_backend=self.dist_backend)
        return data
