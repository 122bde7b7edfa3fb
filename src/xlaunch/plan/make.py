"""Environment + the caller's options -> one `LaunchPlan`: the path, and its spec decided here.

Every decision and every refusal lives in the plan package: this module picks the path and fills
its spec; `refusals` refuses values out of range and options the path would leave unused;
`tpu_layout` and `torch_tpu` refuse process counts a TPU runtime cannot lay out. Keeping them in
one package means a bad argument is refused before any process starts, `xlaunch env` can show
what a launch would do without doing it, and each backend only carries out a plan it never has to
second-guess: the port, the threads per CPU process, the interface workers meet on, the PJRT
device, the check interval are all decided here.
"""

from __future__ import annotations

import ipaddress
import os
import sys
from collections.abc import Mapping
from dataclasses import replace
from typing import Any, cast

from xlaunch.detect.environment import Environment
from xlaunch.detect.machine import Machine
from xlaunch.names import IN_A_WORKER, WORKER_VAR, Accelerator, DistBackend, MixedPrecision, StartMethod
from xlaunch.plan.options import LaunchOptions, port_left_at_default
from xlaunch.plan.refusals import check_values, refuse_unused
from xlaunch.plan.specs import (
    ElasticSpec,
    InlineSpec,
    LaunchPlan,
    TorchTpuSpec,
    XlaSpec,
)
from xlaunch.plan.torch_tpu import torch_tpu_layout
from xlaunch.plan.tpu_layout import tpu_layout

PJRT_DEVICES = {"tpu": "TPU", "cuda": "CUDA", "cpu": "CPU"}
COMPILE_CACHE_VAR = "XLAUNCH_COMPILE_CACHE"


def default_start_method() -> StartMethod:
    return "fork" if sys.platform.startswith("linux") else "spawn"


def make_plan(env: Environment, options: LaunchOptions | None = None,
              machine: Machine | None = None, environ: Mapping[str, str] | None = None) -> LaunchPlan:
    """Decide how to launch, or raise `ValueError` (`RuntimeError`: a held TPU, a device this
    process already used, a launch inside a worker) saying why.

    Pure: reads only ``env``, ``options``, ``machine`` (`Machine.here`'s facts; None: unknown) and
    ``environ`` (the caller's variables; None: none); binds no socket, starts no process, writes
    no file, so `xlaunch env` can show a plan without doing any of it.
    """
    options = options or LaunchOptions()
    check_values(options)
    machine = machine or Machine(cores=1, memory_available=None)
    environ = environ or {}
    if machine.pid and environ.get(WORKER_VAR) == str(machine.pid):
        raise RuntimeError(f"notebook_launcher was called inside a launched function (this "
                           f"process is a worker of a launch). {IN_A_WORKER}.")
    if options.spmd:
        refuse_spmd_beyond_xla(env, options)
    if not options.cpu_only and env.accelerator == "tpu" and env.tpu_runtime == "torch_tpu":
        plan = torch_tpu_plan(env, options, machine)
    elif not options.cpu_only and env.xla_device is not None:
        plan = _xla_plan(env, options, machine, environ)
    elif env.accelerator == "cuda" and not options.cpu_only:
        plan = _cuda_plan(env, options, machine, environ)
    else:
        plan = _cpu_plan(options, machine, environ)
    plan = replace(plan, memory_total=machine.memory_total)
    refuse_unused(plan, options)
    return plan


def refuse_fp16_on_tpu(options: LaunchOptions) -> None:
    if mixed_precision(options) == "fp16":
        raise ValueError("mixed_precision='fp16' is not supported on TPU: TPUs compute in "
                         "bfloat16. Use mixed_precision='bf16'.")


def mixed_precision(options: LaunchOptions) -> MixedPrecision:
    """The option as the plan holds it (check_values has refused anything else)."""
    return cast(MixedPrecision, options.mixed_precision.strip().lower())


def common(options: LaunchOptions) -> dict[str, Any]:
    return dict(mixed_precision=mixed_precision(options), timeout=options.timeout,
                report=options.report, stop_grace=float(options.stop_grace))


def _xla_plan(env: Environment, options: LaunchOptions, machine: Machine,
              environ: Mapping[str, str]) -> LaunchPlan:
    if env.accelerator == "tpu":
        refuse_fp16_on_tpu(options)
    if options.num_nodes > 1:
        raise ValueError(
            "num_nodes > 1 does not apply to TPUs: on a TPU pod run the same launch on every host "
            "(for example `gcloud compute tpus tpu-vm ssh --worker=all`); torch_xla forms the world.")
    if env.legacy_tpu_node:
        raise RuntimeError(TPU_NODE)
    if env.tpu_holders:
        raise RuntimeError(held(env, machine))
    if machine.xla_runtime_initialised:
        raise RuntimeError(XLA_INITIALISED)
    if options.spmd or tpu_layout(env, options.num_processes).nprocs == 1:
        refuse_forked_after_autograd(machine, "spmd=True" if options.spmd else "one replica")
    if options.spmd:
        return _spmd_plan(env, options, environ)
    layout = tpu_layout(env, options.num_processes)
    method, fork_notes = start_method(options, "fork", machine.autograd_threads)
    template = options.log_line_prefix_template
    spec = XlaSpec(
        threads_per_process=layout.threads_per_process, nprocs=layout.nprocs,
        pjrt_device=PJRT_DEVICES.get(env.accelerator, "CPU"),
        start_method=method, layout_env=layout.env,
        unset_env=layout.unset_env,
        line_prefix=template if template is not None else XlaSpec.line_prefix,
        max_restarts=options.max_restarts, compile_cache=compile_cache(env, options.compile_cache, environ))
    return LaunchPlan(env.accelerator, layout.processes, layout.replicas, spec,
                      notes=layout.notes + fork_notes, **common(options))


FORKED_AFTER_AUTOGRAD = (
    "this process already ran autograd on its device threads (a torch.compile'd backward starts "
    "them on torch's CUDA builds), and a worker forked from it fails at its first backward "
    "(\"Unable to handle autograd's threading in combination with fork-based "
    "multiprocessing\")")
FORKED_AFTER_CUDA = (
    "CUDA is already initialised in this process (something before the launch touched the GPU: a "
    "tensor or model moved with .cuda() or .to('cuda'), or a torch.cuda call such as "
    "torch.cuda.get_device_name()), and a worker forked from it cannot use the GPUs")
XLA_INITIALISED = (
    "The XLA runtime is already initialised in this process, and torch_xla cannot start "
    "replicas after that. Something in an earlier cell used the XLA device: an XLA tensor or "
    "model (.to(torch_xla.device())), torch_xla.device() / xm.xla_device(), or an ordinal or "
    "world-size query (xr.global_ordinal(), xr.world_size()). Restart the kernel and launch "
    "before any cell touches the XLA device (do that work inside the launched function).")


def start_method(options: LaunchOptions, default: StartMethod, autograd_threads: bool,
                 cuda_initialised: bool = False) -> tuple[StartMethod, tuple[str, ...]]:
    """The workers' start method: spawn instead of a default one whose workers could not run."""
    method = cast(StartMethod, options.start_method or default)
    why = (FORKED_AFTER_AUTOGRAD if autograd_threads and method == "fork" else
           FORKED_AFTER_CUDA if cuda_initialised and method in ("fork", "forkserver") else None)
    if why is None:
        return method, ()
    if options.start_method is not None:
        raise RuntimeError(f"start_method={method!r}: {why}. Leave start_method at its default "
                           "(the workers are then spawned), or restart the kernel and launch "
                           "before that.")
    return "spawn", (f"the workers are spawned, not forked: {why}; their function travels by "
                     "value. Restart the kernel to fork them again",)


def refuse_forked_after_autograd(machine: Machine, what: str) -> None:
    """A launch whose one worker must be forked (SPMD, one replica) cannot start another way."""
    if machine.autograd_threads:
        raise RuntimeError(f"{what} forks its worker, and {FORKED_AFTER_AUTOGRAD}. Restart the "
                           "kernel and launch before any torch.compile'd backward in it (do that "
                           "work inside the launched function).")


TPU_NODE = (
    "This runtime is a legacy TPU Node (COLAB_TPU_ADDR / TPU_NAME name a remote TPU; this machine "
    "has no TPU chips), which only torch_xla 2.0 and older could use, and Google ended TPU Nodes in "
    "2025: xlaunch needs a TPU VM. Switch the runtime to one (Colab: Runtime > Change runtime "
    "type > a v5e or v6e TPU; Kaggle: a TPU v3-8 or v5e-8 accelerator).")


def _spmd_plan(env: Environment, options: LaunchOptions,
               environ: Mapping[str, str]) -> LaunchPlan:
    """SPMD: one process per host, forked, SPMD on before the runtime, driving every device."""
    if options.num_processes not in (None, 1):
        raise ValueError(
            f"num_processes={options.num_processes} with spmd=True: SPMD is one process per host, "
            f"driving every device of it ({env.device_count} here); leave num_processes at None "
            "(or 1), or launch without spmd for one process per device")
    template = options.log_line_prefix_template
    spec = XlaSpec(
        threads_per_process=1, nprocs=1, pjrt_device=PJRT_DEVICES.get(env.accelerator, "CPU"),
        start_method="fork", unset_env=tpu_layout(env, None).unset_env,
        line_prefix=template if template is not None else XlaSpec.line_prefix,
        max_restarts=options.max_restarts, compile_cache=compile_cache(env, options.compile_cache, environ),
        spmd_devices=env.device_count)
    hosts = len(env.tpu_hosts) if env.tpu_hosts else 1
    notes = (f"a pod slice of {hosts} hosts: run the same launch on every host (one SPMD process "
             "each; torch_xla forms the world)",) if hosts > 1 else ()
    return LaunchPlan(env.accelerator, 1, hosts, spec, num_nodes=hosts, notes=notes,
                      **common(options))


def refuse_spmd_beyond_xla(env: Environment, options: LaunchOptions) -> None:
    """SPMD is torch_xla's: elsewhere, name the path and what serves there."""
    if not options.cpu_only and env.xla_device is not None and env.tpu_runtime != "torch_tpu":
        return
    if not options.cpu_only and env.accelerator == "tpu" and env.tpu_runtime == "torch_tpu":
        raise ValueError(
            "spmd=True is torch_xla's SPMD, and this TPU runs TorchTPU: shard a large model there "
            "with FSDP2 / DTensor over tpu_dist in the usual multi-process launch (spmd=False)")
    path = "GPU" if env.accelerator == "cuda" and not options.cpu_only else "CPU"
    raise ValueError(
        f"spmd=True is torch_xla's SPMD, and this launch takes the {path} path (one process per "
        "device, through torch.distributed), which has no SPMD: on a GPU machine use FSDP / "
        "DTensor in the usual launch; to try SPMD on this machine's CPU, set "
        "XLAUNCH_ACCELERATOR=xla and PJRT_DEVICE=CPU (CPU_NUM_DEVICES=4 gives 4 devices) with "
        "torch_xla installed")


def compile_cache(env: Environment, asked: bool | str | os.PathLike[str] | None,
                  environ: Mapping[str, str]) -> str | None:
    """Where torch_xla keeps compiled graphs between launches, or None for no cache.

    On by default where it pays (TPU, XLA on GPUs: the CPU device cannot read a cache back);
    ``False`` turns it off; ``True`` or a folder turns it on on any XLA device.
    """
    if asked is False or (asked is None and env.accelerator not in ("tpu", "cuda")):
        return None
    if asked is None or asked is True:
        # "~" (no HOME given) is the replica's home: expanded where the cache is set up.
        default = os.path.join(environ.get("HOME", "~"), ".cache", "xlaunch", "xla-compile")
        return environ.get(COMPILE_CACHE_VAR) or default
    return os.fspath(asked)


def held(env: Environment, machine: Machine) -> str:
    holders = "; ".join(holder.describe() for holder in env.tpu_holders)
    own = [holder for holder in env.tpu_holders if holder.pid == machine.pid]
    text = (f"The TPU is in use: {holders}. A TPU can be held by one process at a time, so the "
            "launch would fail inside the runtime. ")
    if own:
        return text + ("That process is this one: something in it already used the TPU. "
                       "Restart the runtime (Colab: Runtime > Restart session; Kaggle: Run > "
                       "Restart & clear cell outputs) and launch before touching the TPU.")
    pids = " ".join(str(holder.pid) for holder in env.tpu_holders)
    return text + (f"End that process (`kill {pids}`, or stop the notebook or script it belongs "
                   "to) and launch again.")


def _cuda_plan(env: Environment, options: LaunchOptions, machine: Machine,
               environ: Mapping[str, str]) -> LaunchPlan:
    if env.device_count == 0:
        raise ValueError("a GPU launch was asked for (XLAUNCH_ACCELERATOR=cuda) but no GPU is "
                         "visible (check the driver and CUDA_VISIBLE_DEVICES)")
    count = env.device_count if options.num_processes is None else options.num_processes
    if count > env.device_count:
        raise ValueError(
            f"num_processes={count} asks for more processes than this machine has GPUs "
            f"({env.device_count}); use at most {env.device_count}")
    return _torch_plan("cuda", count, "nccl", options, 0, machine, environ)


def _cpu_plan(options: LaunchOptions, machine: Machine, environ: Mapping[str, str]) -> LaunchPlan:
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
    threads = 0 if "OMP_NUM_THREADS" in environ or count == 1 else max(1, machine.cores // count)
    plan = _torch_plan("cpu", count, "gloo", options, threads, machine, environ)
    return replace(plan, notes=notes + plan.notes)


def _torch_plan(accelerator: Accelerator, count: int, dist_backend: DistBackend,
                options: LaunchOptions, cpu_threads: int, machine: Machine,
                environ: Mapping[str, str]) -> LaunchPlan:
    world = count * options.num_nodes
    if count == 1 and options.num_nodes == 1:
        return LaunchPlan(accelerator, 1, 1, InlineSpec(), **common(options))
    # Forked workers of a process that initialised CUDA cannot use the GPUs (spawned ones can).
    method, fork_notes = start_method(options, default_start_method(), machine.autograd_threads,
                                      accelerator == "cuda" and machine.cuda_initialised)
    spec = ElasticSpec(dist_backend=dist_backend, start_method=method, cpu_threads=cpu_threads,
                       **engine_fields(options))
    return LaunchPlan(accelerator, count, world, spec, num_nodes=options.num_nodes,
                      notes=fork_notes + interface_notes(spec, options.num_nodes, environ),
                      **common(options))


def interface_notes(spec: ElasticSpec, num_nodes: int,
                    environ: Mapping[str, str]) -> tuple[str, ...]:
    """One machine's workers meet on loopback, unless the environment names an interface;
    several nodes meeting at a loopback address can only be on this machine."""
    if not spec.loopback_only:
        if num_nodes == 1 or spec.rdzv_endpoint or not is_loopback(spec.master_addr):
            return ()
        return (f"master_addr={spec.master_addr} is this machine's loopback: the {num_nodes} "
                "nodes can meet only if they all run here (right for trying several nodes on one "
                "machine); across machines, give every node node 0's address",)
    return tuple(
        f"{name}={environ[name]} is set in this environment: the workers' process group "
        "listens on that interface, which may be beyond loopback (unset it to keep a "
        "one-machine launch on loopback)"
        for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
        if environ.get(name, "lo") != "lo")


def is_loopback(address: str) -> bool:
    """An address (or ``localhost``) that reaches only the machine it is used on."""
    if address.lower() in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:  # a host name: where it points is for the resolver to say, not the plan
        return False


def engine_fields(options: LaunchOptions) -> dict[str, Any]:
    """What every launch whose workers form a torch.distributed group takes from the options."""
    return dict(
        port=int(options.use_port),
        # A port left at its default that is taken when the launch starts is replaced, on one
        # machine only (other nodes were told that port); a port the caller named, "29500"
        # included, is theirs: taken, it is an error naming it.
        port_fallback=port_left_at_default(options.use_port) and options.num_nodes == 1,
        node_rank=options.node_rank, master_addr=options.master_addr,
        rdzv_backend=options.rdzv_backend, rdzv_endpoint=options.rdzv_endpoint,
        rdzv_conf=dict(options.rdzv_conf or {}), rdzv_id=options.rdzv_id,
        max_restarts=options.max_restarts,
        monitor_interval=float(options.monitor_interval),
        log_line_prefix_template=options.log_line_prefix_template,
        loopback_only=options.num_nodes == 1 and not options.rdzv_endpoint)


def torch_tpu_plan(env: Environment, options: LaunchOptions, machine: Machine) -> LaunchPlan:
    """TorchTPU: spawned processes, one per device; checked against its tables."""
    refuse_fp16_on_tpu(options)
    if env.tpu_holders:
        raise RuntimeError(held(env, machine))
    layout = torch_tpu_layout(env, options)
    options = replace(options, num_nodes=layout.num_nodes, node_rank=layout.node_rank,
                      master_addr=layout.master_addr)
    spec = TorchTpuSpec(dist_backend="tpu_dist", start_method="spawn", topology=layout.topology,
                        **engine_fields(options))
    return LaunchPlan("tpu", layout.processes, layout.processes * layout.num_nodes, spec,
                      num_nodes=layout.num_nodes, notes=layout.notes, **common(options))
