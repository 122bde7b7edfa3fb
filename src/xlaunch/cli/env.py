"""``xlaunch env``: the detected machine and what a launch with the given options would do.

Planning is pure, so this binds no socket, starts no process and writes no file: what it shows is
what a launch would decide, read from the same `make_plan`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
from collections.abc import Mapping
from typing import Any

from xlaunch.cli.options import add_launch_arguments, options_from, usage_error
from xlaunch.detect import Machine, detect
from xlaunch.detect.machine import Gpus
from xlaunch.detect.runtime import install_line, installed_version, installed_versions
from xlaunch.plan import LaunchOptions, make_plan
from xlaunch.plan.specs import PATHS

# Variables that change what detection or a TPU launch does; shown so a bug report carries them.
VARIABLES = (
    "XLAUNCH_ACCELERATOR", "PJRT_DEVICE", "CPU_NUM_DEVICES", "GPU_NUM_DEVICES",
    "CUDA_VISIBLE_DEVICES", "TPU_ACCELERATOR_TYPE", "TPU_WORKER_ID", "TPU_PROCESS_ADDRESSES",
    "CLOUD_TPU_TASK_ID", "TPU_PROCESS_BOUNDS", "TPU_VISIBLE_CHIPS", "COLAB_TPU_ADDR", "TPU_NAME",
    "KAGGLE_KERNEL_RUN_TYPE", "XLAUNCH_TPU_RUNTIME", "TPU_WORKER_HOSTNAMES", "TORCH_TPU_TOPOLOGY",
    "TORCH_TPU_SLICEBUILDER_ADDRESSES", "TORCH_TPU_INTERNAL_HANDSHAKE_PORT",
    "TORCH_DEVICE_BACKEND_AUTOLOAD",
)

# The NCCL that torch's CUDA wheels load comes as its own package, one per CUDA major release.
NCCL_PACKAGES = ("nvidia-nccl-cu13", "nvidia-nccl-cu12", "nvidia-nccl-cu11")
REFUSED_EXIT = 2  # the launch described would be refused: the same status as ``xlaunch run``'s


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_launch_arguments(parser)


def main(args: argparse.Namespace) -> int:
    try:
        options = options_from(args)
    except (ValueError, TypeError) as error:
        return usage_error(str(error))
    report = env_report(options=options)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    # The table is printed either way; the status says whether the launch it describes would run
    # (2: refused, as `xlaunch run` with the same options exits), 1: the environment is unreadable.
    if report["environment"] is None:
        return 1
    return REFUSED_EXIT if report["refusal"] is not None else 0


def env_report(
    environ: Mapping[str, str] | None = None, root: str | os.PathLike[str] = "/",
    options: LaunchOptions | None = None,
) -> dict[str, Any]:
    """What `xlaunch env` shows, as plain data (the ``--json`` output), for `detect`'s inputs."""
    variables = os.environ if environ is None else environ
    environment = plan = refusal = None
    machine = Machine.here(str(root))  # the cores and memory the plan's refusals quote
    try:
        env = detect(environ, root)
        environment = env.as_dict()
        plan = make_plan(env, options, machine, variables).as_dict()
    except (ValueError, RuntimeError) as error:  # a bad XLAUNCH_ACCELERATOR, a refused launch
        refusal = str(error)
    gpus = Gpus.here(root)
    return {
        "environment": environment,
        "machine": {
            "cpu_cores": machine.cores,
            # What this process already did that decides how a launch may start its workers.
            "autograd_threads": machine.autograd_threads,
            "cuda_initialised": machine.cuda_initialised,
            "xla_runtime_initialised": machine.xla_runtime_initialised,
            "memory_available": machine.memory_available,
            "memory_total": machine.memory_total,
            "gpus": list(gpus.names),
            "nvidia_driver": gpus.driver,
        },
        "plan": plan,
        "refusal": refusal,
        "missing": missing(plan, environment),
        "versions": {
            "python": platform.python_version(),
            # os.uname, not platform.platform(): that runs `uname -p` in a subprocess.
            "os": "{0.sysname}-{0.release}-{0.machine}".format(os.uname()),
            "xlaunch": installed_version("xlaunch"),
            **installed_versions(),
            "numpy": installed_version("numpy"),
            **cuda_versions(),
        },
        "variables": {name: variables[name] for name in VARIABLES if name in variables},
    }


def cuda_versions() -> dict[str, str | None]:
    """The CUDA release torch was built for and the NCCL version it loads; None where absent.

    Read without importing torch (`xlaunch env` imports none, and a notebook must reach its launch
    with CUDA untouched): torch's own ``torch/version.py`` read as a file, and the version of the
    NCCL package its CUDA wheel installed. Where torch is already imported, torch itself is asked
    (``torch.version.cuda``, ``torch.cuda.nccl.version()``: neither initialises CUDA).
    """
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "version"):
        cuda = getattr(torch.version, "cuda", None)
        nccl = None
        if cuda:
            try:
                nccl = ".".join(str(part) for part in torch.cuda.nccl.version())
            except Exception:  # a build without NCCL
                nccl = None
        return {"cuda": cuda, "nccl": nccl}
    cuda = _torch_cuda_from_file()
    # The NCCL wheel of torch's own CUDA major release first (a venv may hold another's too).
    major = f"nvidia-nccl-cu{cuda.split('.')[0]}" if cuda else None
    ordered = sorted(NCCL_PACKAGES, key=lambda name: name.replace("_", "-") != major)
    return {"cuda": cuda, "nccl": next(
        (version for version in map(installed_version, ordered) if version), None)}


def _torch_cuda_from_file() -> str | None:
    """``cuda = '12.8'`` in the installed torch's ``version.py`` (None on a CPU build)."""
    from importlib import metadata

    try:
        text = metadata.distribution("torch").locate_file("torch/version.py").read_text()
    except (metadata.PackageNotFoundError, OSError):
        return None
    found = re.search(r"^cuda\s*(?::[^=\n]*)?=\s*['\"]([^'\"]+)['\"]", text, re.M)
    return found.group(1) if found else None


def missing(plan: dict[str, Any] | None, environment: dict[str, Any] | None = None) -> list[str]:
    """What the planned launch needs that is not installed, each with the line that installs it.

    On a TPU with no runtime that fits, the one line that fits this TPU and this torch.
    """
    needed = []
    versions = installed_versions()
    if versions["torch"] is None:
        needed.append("torch is not installed: pip install torch")
    generation = (environment or {}).get("tpu_generation")
    on_tpu = (environment or {}).get("accelerator") == "tpu"
    has_chips = on_tpu and bool((environment or {}).get("tpu_chips"))
    if has_chips and (environment or {}).get("tpu_runtime") is None:
        needed.append(f"no TPU runtime installed here works with torch {versions['torch']} on this "
                      f"TPU ({generation or 'unknown generation'}): {install_line(generation)}")
    elif plan is not None and plan["path"] == "xla" and versions["torch_xla"] is None:
        line = install_line(generation if on_tpu else None, runtime="torch_xla")
        needed.append(f"torch_xla is not installed, and the XLA path needs it: {line}")
    elif plan is not None and plan["path"] == "torch_tpu" and versions["torch-tpu"] is None:
        needed.append("torch-tpu is not installed, and the TorchTPU path needs it: "
                      f"{install_line(generation, runtime='torch_tpu')}")
    return needed


def format_report(report: dict[str, Any]) -> str:
    plan = report["plan"]
    lines = ["environment (xlaunch.detect())"]
    environment = dict(report["environment"] or {"error": report["refusal"]})
    holders = environment.pop("tpu_holders", None)
    if "tpu_runtime" in environment:
        environment["tpu_runtime"] = _runtime_row(environment, report["versions"])
    lines += _rows(environment)
    if holders is not None:
        lines += _rows({"tpu_holders": "; ".join(
            f"pid {h['pid']} ({h['command']}) holds {h['device']}" for h in holders) or "none"})
    if "machine" in report:
        lines.append("machine (what a launch plans with)")
        lines += _rows(_machine_rows(report["machine"]))
    lines.append("launch (xlaunch.launch(fn) with these options)")
    if report["environment"] is None:
        lines.append("  not planned: the environment could not be read")
    elif plan is None:
        lines += _rows({"refused": report["refusal"]})
    else:
        lines += _rows(_plan_rows(plan))
        lines += [_row("note", note) for note in plan["notes"]]
    lines += [_row("missing", text) for text in report.get("missing", ())]
    lines.append("versions")
    versions = report["versions"]
    # CUDA and NCCL only where present: a CPU build of torch has neither.
    lines += _rows({key: value for key, value in versions.items()
                    if value is not None or key not in ("cuda", "nccl")})
    lines.append("variables")
    lines += _rows(report["variables"] or {"(none set)": ""})
    return "\n".join(lines)


def _machine_rows(machine: dict[str, Any]) -> dict[str, Any]:
    """Cores and memory as the refusals quote them (MiB), then the GPUs the driver lists."""
    available, total = machine["memory_available"], machine["memory_total"]
    if available is None and total is None:
        memory = None
    else:
        shown = [f"{available >> 20} MiB available" if available is not None else None,
                 f"{total >> 20} MiB in all" if total is not None else None]
        memory = ", ".join(part for part in shown if part)
    rows: dict[str, Any] = {"cpu cores": machine["cpu_cores"], "memory": memory}
    gpus = Gpus(tuple(machine["gpus"]), machine["nvidia_driver"])
    rows["gpus"] = gpus.summary() or "none"
    if gpus.driver:
        rows["nvidia driver"] = gpus.driver
    # What this process did before the launch: each decides how its workers may start.
    for key, row in (("autograd_threads", "autograd threads"), ("cuda_initialised", "CUDA started"),
                     ("xla_runtime_initialised", "XLA runtime")):
        rows[row] = f"{'yes' if machine.get(key) else 'no'}, in this process"
    return rows


def _runtime_row(environment: dict[str, Any], versions: dict[str, Any]) -> str | None:
    """The TPU runtime with its version and libtpu's: ``torch_tpu 0.2.0 (libtpu 0.0.52)``."""
    runtime = environment["tpu_runtime"]
    if runtime is None:
        return "none that fits" if environment.get("accelerator") == "tpu" else None
    version = versions.get("torch-tpu" if runtime == "torch_tpu" else "torch_xla")
    return f"{runtime} {version or '(not installed)'} (libtpu {versions.get('libtpu') or '-'})"


def _plan_rows(plan: dict[str, Any]) -> dict[str, Any]:
    """The decisions a launch would carry out, in words: one row each."""
    spec = plan["spec"]
    rows: dict[str, Any] = {
        "path": f"{plan['path']} ({PATHS.get(plan['path'], '?')})",
        "accelerator": plan["accelerator"],
        "processes": plan["num_processes"],
        "world size": plan["world_size"],
        "distributed backend": plan["dist_backend"],
    }
    if plan["path"] == "xla":
        changes = [f"{k}={v}" for k, v in spec["layout_env"].items()]
        changes += [f"-{name}" for name in spec["unset_env"]]
        rows.update({"threads per process": spec["threads_per_process"],
                     "start method": spec["start_method"],
                     "PJRT device": spec["pjrt_device"],
                     "compile cache": spec["compile_cache"] or "off",
                     "restarts": spec["max_restarts"],
                     "worker environment": " ".join(changes) or None})
    elif plan["path"] == "torch_tpu":
        rows.update({"start method": spec["start_method"], "TPU topology": spec["topology"],
                     "port": spec["port"], "rendezvous": spec["rdzv_backend"],
                     "chosen at launch": "TorchTPU's slice-builder ports (set_tpu_launch_env) "
                                         "and a free handshake port",
                     "restarts": spec["max_restarts"]})
    elif plan["path"] == "elastic":
        fallback = " (a free one if it is taken at launch)" if spec["port_fallback"] else ""
        rows.update({"start method": spec["start_method"], "port": f"{spec['port']}{fallback}",
                     "interface": "lo (loopback only)" if spec["loopback_only"] else "any",
                     "rendezvous": spec["rdzv_backend"],
                     "threads per process": spec["cpu_threads"] or "torch's default",
                     "check interval": f"{spec['monitor_interval']} s"})
    return {key: value for key, value in rows.items() if value is not None}


def _rows(items: dict[str, Any]) -> list[str]:
    return [_row(key, value) for key, value in items.items()]


def _row(key: str, value: Any) -> str:
    # At least two spaces after the key, so the table splits cleanly even on long variable names.
    return f"  {key.ljust(max(24, len(key) + 2))}{_show(value)}".rstrip()


def _show(value: Any) -> str:
    if value is None:
        return "-"
    return str(value).lower() if isinstance(value, bool) else str(value)
