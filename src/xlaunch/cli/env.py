"""``xlaunch env``: the detected machine and what a launch with the given options would do.

Planning is pure, so this binds no socket, starts no process and writes no file: what it shows is
what a launch would decide, read from the same `make_plan`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from collections.abc import Mapping
from typing import Any

from xlaunch.cli.options import add_launch_arguments, options_from, usage_error
from xlaunch.detect import detect
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
    # A plan refused is an answer (exit 0); an environment that cannot be read is an error.
    return 0 if report["environment"] is not None else 1


def env_report(
    environ: Mapping[str, str] | None = None, root: str | os.PathLike[str] = "/",
    options: LaunchOptions | None = None,
) -> dict[str, Any]:
    """What `xlaunch env` shows, as plain data (the ``--json`` output), for `detect`'s inputs."""
    variables = os.environ if environ is None else environ
    environment = plan = refusal = None
    try:
        env = detect(environ, root)
        environment = env.as_dict()
        plan = make_plan(env, options).as_dict()
    except (ValueError, RuntimeError) as error:  # a bad XLAUNCH_ACCELERATOR, a refused launch
        refusal = str(error)
    return {
        "environment": environment,
        "plan": plan,
        "refusal": refusal,
        "missing": missing(plan, environment),
        "versions": {
            "python": platform.python_version(),
            # os.uname, not platform.platform(): that runs `uname -p` in a subprocess.
            "os": "{0.sysname}-{0.release}-{0.machine}".format(os.uname()),
            "xlaunch": installed_version("xlaunch"),
            **installed_versions(),
        },
        "variables": {name: variables[name] for name in VARIABLES if name in variables},
    }


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
    lines += _rows(report["versions"])
    lines.append("variables")
    lines += _rows(report["variables"] or {"(none set)": ""})
    return "\n".join(lines)


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
        changes = [f"{k}={v}" for k, v in spec["worker_env"].items()]
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
                     "hosts": ",".join(spec["hosts"]) or None,
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
