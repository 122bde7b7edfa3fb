"""What a worker's environment holds: every variable xlaunch gives a worker, on every path.

Five layers, each later one winning over the ones before it:

1. the caller's environment, which a worker inherits (fork) or is handed (spawn), less xlaunch's
   own names (`names.WORKER_VARS`: only a launch sets them, a preset ``XLAUNCH_WORLD=xla`` would
   tell a GPU worker it is an XLA replica) and what the plan removes (Kaggle's single-process
   presets, which break torch_xla's multi-process layout);
2. the launch's (`launch_environment`, from the plan): the mixed precision and the device that
   `ProcessState` reads, accelerate's names for the same options (``accelerate launch`` sets them:
   an ``Accelerator()`` in the function reads them), ``USE_TORCH_XLA=0`` in GPU, CPU and TorchTPU
   workers (accelerate and transformers would take XLA where torch_xla is installed), torch's
   threads per CPU process, and the
   interface a one-machine group meets on. The last two are defaults: a value the caller set wins;
3. the path's own, made as the launch starts (`launch_environment` too): torch_xla's device and
   chip layout, which ``xmp.spawn`` reads in the process that calls it (the caller's
   ``PJRT_DEVICE`` wins) and its compilation analysis's files (`xla_layer`); TorchTPU's launch
   variables, from its own ``set_tpu_launch_env``, and its handshake port (`torch_tpu_layer`);
4. the rank's (`rank_layer`, elastic and TorchTPU workers): torchrun's names for its place, so
   Lightning, accelerate and transformers find the launch's world - ``MASTER_ADDR`` and
   ``MASTER_PORT`` among them, winning over TorchTPU's: they name the store the group forms
   through - and where a script's own group meets on one machine;
5. the process's (`worker_environment`): which attempt this is, its pid (a launch inside a worker
   is refused), and on XLA the world it is a replica of.

`worker_environment` puts them together, in a worker, as it starts; `apply` sets them and
`overlay` sets them for a block, after which the environment is exactly what it was. Values are
strings; None removes a variable.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from xlaunch import _compat
from xlaunch.backends.ports import free_port
from xlaunch.names import (
    DEVICE_VAR,
    MIXED_PRECISION_VAR,
    RESTART_VAR,
    STORE_DIR_VAR,
    WORKER_VAR,
    WORKER_VARS,
    WORLD_VAR,
)
from xlaunch.plan.options import DEFAULT_MASTER_ADDR
from xlaunch.plan.specs import ElasticSpec, LaunchPlan, TorchTpuSpec, XlaSpec
from xlaunch.worker.launch_dir import XLA_DEBUG

Variables = Mapping[str, "str | None"]  # None: the variable is removed

DEBUG_VAR = "XLAUNCH_XLA_DEBUG"  # 1: the replicas run torch_xla's compilation analysis
DEBUG_FILE_VAR = "PT_XLA_DEBUG_FILE"
SOCKET_IFNAMES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
HANDSHAKE_PORT_VAR = "TORCH_TPU_INTERNAL_HANDSHAKE_PORT"
DEFAULT_HANDSHAKE_PORT = "36423"  # TorchTPU's own default, what every host of a slice assumes


@dataclass(frozen=True)
class World:
    """Where this node's workers sit in the job: decided by the launch before any starts."""

    rank_offset: int  # global rank of this node's local rank 0
    world_size: int
    local_world_size: int
    node_rank: int = 0
    num_nodes: int = 1
    master_addr: str = DEFAULT_MASTER_ADDR
    master_port: int = 0
    # One machine: the group meets through a file in the attempt's folder; several: through the
    # rendezvous's store (a TCPStore at master_addr:master_port), under this prefix.
    store_prefix: str | None = None


# --- layers 2 and 3, in the caller as the launch starts ---------------------------------------

def launch_environment(plan: LaunchPlan, caller: Mapping[str, str],
                       path: Variables | None = None) -> dict[str, str | None]:
    """The launch's layer, then the path's own (``path``), as every worker of the launch gets
    them; ``caller``: the caller's environment, whose own choices win where the launch only
    offers a default."""
    spec = plan.spec
    values: dict[str, str | None] = {MIXED_PRECISION_VAR: plan.mixed_precision}
    if plan.mixed_precision != "no":
        values["ACCELERATE_MIXED_PRECISION"] = plan.mixed_precision
    if not isinstance(spec, XlaSpec):  # an XLA replica's world names its device
        values[DEVICE_VAR] = plan.accelerator
        if plan.accelerator == "cpu":
            values["ACCELERATE_USE_CPU"] = "True"  # ``accelerate launch --cpu``
    if isinstance(spec, ElasticSpec):
        # What accelerate and transformers read as "a native pytorch job in an environment with
        # torch xla installed": where torch_xla is installed (Colab's and Kaggle's TPU runtimes)
        # they would otherwise take XLA, every rank rank 0 of a world of 1 on xla:0. Read when
        # they are first imported: one imported in the caller before a forked launch keeps what
        # it read there. A one-process launch, in the caller's own process, is left alone.
        values["USE_TORCH_XLA"] = "0"
        if spec.socket_ifname is not None:
            values.update({name: spec.socket_ifname for name in SOCKET_IFNAMES
                           if name not in caller})
        if spec.cpu_threads:  # the plan leaves it at 0 where the caller set OMP_NUM_THREADS
            values["OMP_NUM_THREADS"] = str(spec.cpu_threads)
    values.update(path or {})
    return values


def xla_layer(spec: XlaSpec, caller: Mapping[str, str], folder: str) -> dict[str, str | None]:
    """torch_xla's: the device and the chip layout ``xmp.spawn`` reads where it is called; the
    presets that layout cannot live with, removed; the compilation analysis into ``folder``."""
    values: dict[str, str | None] = {name: None for name in spec.unset_env}
    values.update(spec.layout_env)
    values["PJRT_DEVICE"] = caller.get("PJRT_DEVICE", spec.pjrt_device)
    if caller.get(DEBUG_VAR) == "1":  # the analysis goes to files the report reads
        values.update(PT_XLA_DEBUG_LEVEL="1", PT_XLA_DEBUG_FILE=os.path.join(folder, XLA_DEBUG))
    return values


def torch_tpu_layer(plan: LaunchPlan, spec: TorchTpuSpec,
                    caller: Mapping[str, str]) -> dict[str, str | None]:
    """What TorchTPU's own ``set_tpu_launch_env`` gives this launch, and the handshake port (its
    default, 36423, would collide between two launches on one host). Values the caller set are
    kept: TorchTPU never overwrites one either."""
    values: dict[str, str | None] = {}
    if plan.num_nodes > 1:
        # TorchTPU derives NODE_RANK from JOB_COMPLETION_INDEX or by starting the TPU runtime in
        # a child process; GCE gives it as TPU_WORKER_ID, which the plan read.
        values = {"NODE_RANK": str(spec.node_rank), "NNODES": str(plan.num_nodes),
                  "MASTER_ADDR": spec.master_addr, "MASTER_PORT": str(spec.port)}
    with overlay(values):  # it writes into os.environ: nothing of it stays in the caller
        values.update(_compat.tpu_launch_env(plan.num_processes, plan.num_nodes))
    if HANDSHAKE_PORT_VAR not in caller:
        # Several hosts must agree on the coordinator's port: TorchTPU's default, unless set.
        values[HANDSHAKE_PORT_VAR] = (str(free_port()) if plan.num_nodes == 1
                                      else DEFAULT_HANDSHAKE_PORT)
    return values


# --- layers 4 and 5, in the worker -------------------------------------------------------------

def rank_layer(world: World, local_rank: int, attempt: int, run_id: str, max_restarts: int,
               store_dir: str | None) -> dict[str, str]:
    """What torchrun sets in each worker, and where a script's own group meets (``store_dir``:
    one machine's attempt folder)."""
    values = {"RANK": world.rank_offset + local_rank, "LOCAL_RANK": local_rank,
              "WORLD_SIZE": world.world_size, "LOCAL_WORLD_SIZE": world.local_world_size,
              "GROUP_RANK": world.node_rank, "GROUP_WORLD_SIZE": world.num_nodes,
              "ROLE_RANK": world.rank_offset + local_rank, "ROLE_NAME": "default",
              "ROLE_WORLD_SIZE": world.world_size, "MASTER_ADDR": world.master_addr,
              "MASTER_PORT": world.master_port, "TORCHELASTIC_RUN_ID": run_id,
              "TORCHELASTIC_RESTART_COUNT": attempt, "TORCHELASTIC_MAX_RESTARTS": max_restarts,
              "TORCHELASTIC_USE_AGENT_STORE": False}
    if store_dir is not None:
        values[STORE_DIR_VAR] = store_dir
    return {name: str(value) for name, value in values.items()}


def worker_environment(launch: Variables, rank: Variables | None = None, *, attempt: int,
                       pid: int | None, xla: bool = False) -> dict[str, str | None]:
    """Every variable a worker sets in itself as it starts, the layers in their order (see the
    module): ``launch`` from `launch_environment`, ``rank`` from `rank_layer`; ``pid``: the
    worker's own process (None: the function runs in the caller, one process)."""
    values: dict[str, str | None] = dict.fromkeys(WORKER_VARS)
    values.update(launch)
    values.update(rank or {})
    values[RESTART_VAR] = str(attempt)
    if pid is not None:
        values[WORKER_VAR] = str(pid)
        if xla:  # only this process is in that world, not what it starts
            values[WORLD_VAR] = f"xla:{pid}"
            debug = launch.get(DEBUG_FILE_VAR)
            if debug is not None:  # one analysis file per process, never interleaved
                values[DEBUG_FILE_VAR] = f"{debug}.{pid}"
    return values


def apply(values: Variables) -> None:
    """Set each variable in this process (None removes it)."""
    for name, value in values.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@contextlib.contextmanager
def overlay(values: Variables) -> Iterator[None]:
    """``values`` set for the block; afterwards the environment is exactly as it was before,
    whatever the block set or removed."""
    saved = dict(os.environ)
    apply(values)
    try:
        yield
    finally:
        for name in [name for name in os.environ if name not in saved]:
            del os.environ[name]
        apply({name: value for name, value in saved.items() if os.environ.get(name) != value})
