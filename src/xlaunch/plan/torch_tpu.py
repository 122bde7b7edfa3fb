"""How many TorchTPU processes a launch runs on this host, and on which hosts: checked, not guessed.

TorchTPU (``torch-tpu`` 0.2.0) runs one process per TPU device and takes only the process counts
its topology tables list (``torch_tpu/_internal/utils/hardware.py``): v5e/v6e 1, 4, 8; v4/v5p 1,
2, 4, 8; v7 2, 4, 8 (two devices per chip). Any other count fails inside TorchTPU ("No TPU
topology found for count: 2"), so it is refused here with the counts that work. It supports only
the ``spawn`` start method: after its runtime starts a forked child raises, and its C++ cache of
environment variables survives a fork, so a forked worker would read the parent's values.

On a multi-host slice GCE names every host in ``TPU_WORKER_HOSTNAMES`` and this host's index in
``TPU_WORKER_ID``; TorchTPU reads neither index (only Kubernetes' ``JOB_COMPLETION_INDEX``), so
the node rank comes from here and the hosts meet through torch elastic's rendezvous on host 0.
"""

from __future__ import annotations

from dataclasses import dataclass

from xlaunch.detect.chips import torch_tpu_generation
from xlaunch.detect.environment import Environment
from xlaunch.plan.options import DEFAULT_MASTER_ADDR, LaunchOptions


@dataclass(frozen=True)
class TorchTpuLayout:
    processes: int  # on this host
    topology: str  # TORCH_TPU_TOPOLOGY for that count
    num_nodes: int = 1
    node_rank: int = 0
    master_addr: str = DEFAULT_MASTER_ADDR
    notes: tuple[str, ...] = ()


def torch_tpu_layout(env: Environment, options: LaunchOptions) -> TorchTpuLayout:
    """The layout for ``options.num_processes``, or `ValueError` naming what works."""
    if options.start_method not in (None, "spawn"):
        raise ValueError(
            f"start_method={options.start_method!r} cannot be used with TorchTPU: it supports "
            "only 'spawn' (after its runtime starts a forked child raises, and its C++ cache of "
            "environment variables survives a fork, so a forked worker would read the parent's "
            "values). Leave start_method unset: TorchTPU launches spawn, in notebooks too.")
    known = torch_tpu_generation(env.tpu_generation)
    if known is None:
        raise ValueError(
            f"TorchTPU does not run on this TPU ({env.tpu_generation or 'unknown generation'}): "
            "it supports v4, v5e, v5p, v6e and v7 chips. v2/v3 TPUs (Kaggle's v3-8) run torch_xla: "
            "unset XLAUNCH_TPU_RUNTIME or set it to torch_xla.")
    if env.device_count == 0:
        raise ValueError(
            f"TorchTPU finds no TPU devices on this {known.generation} host: it counts TPU PCI "
            "functions opened through VFIO (/dev/vfio), and none is. Check that the TPU is "
            "attached to this VM or container (ls /dev/vfio).")
    usable = [count for count in known.counts if count <= env.device_count]
    count = env.device_count if options.num_processes is None else options.num_processes
    if count not in usable:
        raise ValueError(
            f"num_processes={count} does not fit TorchTPU on this TPU ({known.generation}, "
            f"{env.device_count} device(s)); use {_choices(usable)}. TorchTPU runs one process "
            "per device and only the layouts of its topology tables.")
    layout = TorchTpuLayout(count, known.topologies[count])
    return _on_hosts(layout, env, options) if env.tpu_hosts else _one_host(layout, options)


def _one_host(layout: TorchTpuLayout, options: LaunchOptions) -> TorchTpuLayout:
    return TorchTpuLayout(layout.processes, layout.topology, options.num_nodes, options.node_rank,
                          options.master_addr)


def _on_hosts(layout: TorchTpuLayout, env: Environment, options: LaunchOptions) -> TorchTpuLayout:
    """A multi-host slice: every host runs the same launch; GCE's variables say who is who."""
    hosts = env.tpu_hosts
    if env.tpu_host_index is None or env.tpu_host_index >= len(hosts):
        raise ValueError(
            f"TPU_WORKER_HOSTNAMES names {len(hosts)} hosts but TPU_WORKER_ID "
            f"({env.tpu_host_index!r}) does not say which one this is: set TPU_WORKER_ID to this "
            f"host's index, 0 to {len(hosts) - 1}.")
    given = options.given()
    for name, value in (("num_nodes", len(hosts)), ("node_rank", env.tpu_host_index),
                        ("master_addr", hosts[0])):
        if name in given and given[name] != value:
            raise ValueError(
                f"{name}={given[name]!r} disagrees with this TPU slice ({name}={value!r} from "
                "TPU_WORKER_HOSTNAMES and TPU_WORKER_ID): leave it at its default on a TPU slice.")
    note = (f"TPU slice: host {env.tpu_host_index} of {len(hosts)}, meeting at {hosts[0]}",)
    return TorchTpuLayout(layout.processes, layout.topology, len(hosts), env.tpu_host_index,
                          hosts[0], note)


def _choices(values: list[int]) -> str:
    words = [str(value) for value in values]
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]
