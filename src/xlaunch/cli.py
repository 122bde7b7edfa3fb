"""The ``xlaunch`` command: ``env``, ``run`` and ``demo``, one function each.

Each subcommand is a function in `COMMANDS` that adds its parser and sets ``handler``. Handlers
import what they need when they run, so ``xlaunch env`` stays cheap and never imports torch or
torch_xla (the versions it reports come from package metadata). ``run`` and ``demo`` declare their
options in their own modules, which are imported to build the parser and so import torch only
inside their handlers. A new command looks like::

    def add_demo(commands):
        from . import demo

        parser = commands.add_parser("demo", help="a small training run on this machine")
        demo.add_arguments(parser)
        parser.set_defaults(handler=demo.main)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from collections.abc import Callable, Mapping, Sequence
from importlib import metadata
from typing import Any

from . import __version__
from .environment import detect
from .plan import PATHS, make_plan

# Variables that change what detection or a TPU launch does; shown so a bug report carries them.
VARIABLES = (
    "XLAUNCH_ACCELERATOR", "PJRT_DEVICE", "CPU_NUM_DEVICES", "GPU_NUM_DEVICES",
    "CUDA_VISIBLE_DEVICES", "TPU_ACCELERATOR_TYPE", "TPU_WORKER_ID", "TPU_PROCESS_ADDRESSES",
    "CLOUD_TPU_TASK_ID", "TPU_PROCESS_BOUNDS", "TPU_VISIBLE_CHIPS", "COLAB_TPU_ADDR", "TPU_NAME",
    "KAGGLE_KERNEL_RUN_TYPE",
)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="xlaunch", description="Run training on every TPU core, GPU or CPU process."
    )
    parser.add_argument("--version", action="version", version=f"xlaunch {__version__}")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)
    for add in COMMANDS:
        add(commands)
    args = parser.parse_args(argv)
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        code = handler(args)
        sys.stdout.flush()
    except BrokenPipeError:  # `xlaunch env | head`: the reader has gone; exit without a traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    return code


def add_env(commands: Any) -> None:
    parser = commands.add_parser(
        "env", help="show the detected machine and what a launch would do",
        description="Show the detected machine and what xlaunch.launch(fn) would do with default "
                    "arguments. Paste the output into bug reports.",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(handler=env_command)


def add_run(commands: Any) -> None:
    from . import run

    parser = commands.add_parser(
        "run", help="run a script in every TPU core, GPU or CPU process",
        description="Run `python script.py ARGS` in every process of this machine, on the paths "
                    "xlaunch.launch takes (on a TPU pod: run the same command on every host).",
    )
    run.add_arguments(parser)
    parser.set_defaults(handler=run.main)


def add_demo(commands: Any) -> None:
    from . import demo

    parser = commands.add_parser(
        "demo", help="train a small model across this machine's processes and check they agree",
        description="A small data-parallel training (model and data made in place, no downloads) "
                    "on every TPU core, GPU, or 2 CPU processes; exits non-zero unless every rank "
                    "ends with identical parameters.",
    )
    demo.add_arguments(parser)
    parser.set_defaults(handler=demo.main)


COMMANDS: list[Callable[[Any], None]] = [add_env, add_run, add_demo]


def env_command(args: argparse.Namespace) -> int:
    report = env_report()
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    # A plan refused is an answer (exit 0); an environment that cannot be read is an error.
    return 0 if report["environment"] is not None else 1


def env_report(
    environ: Mapping[str, str] | None = None, root: str | os.PathLike[str] = "/"
) -> dict[str, Any]:
    """What `xlaunch env` shows, as plain data (the ``--json`` output), for `detect`'s inputs."""
    variables = os.environ if environ is None else environ
    environment = plan = refusal = None
    try:
        env = detect(environ, root)
        environment = env.as_dict()
        plan = make_plan(env).as_dict()
    except (ValueError, RuntimeError) as error:  # a bad XLAUNCH_ACCELERATOR, a refused launch
        refusal = str(error)
    return {
        "environment": environment,
        "plan": plan,
        "refusal": refusal,
        "missing": missing(plan),
        "versions": {
            "python": platform.python_version(),
            "os": platform.platform(),
            **{name: _version(name) for name in ("xlaunch", "torch", "torch_xla", "libtpu")},
        },
        "variables": {name: variables[name] for name in VARIABLES if name in variables},
    }


def missing(plan: dict[str, Any] | None) -> list[str]:
    """What the planned launch needs that is not installed, each with the line that installs it."""
    needed = []
    if _version("torch") is None:
        needed.append("torch is not installed: pip install torch")
    if plan is not None and plan["path"] == "xla" and _version("torch_xla") is None:
        from .backends.xla import install_line

        needed.append(f"torch_xla is not installed, and the XLA path needs it: {install_line()}")
    return needed


def format_report(report: dict[str, Any]) -> str:
    plan = report["plan"]
    lines = ["environment (xlaunch.detect())"]
    environment = dict(report["environment"] or {"error": report["refusal"]})
    holders = environment.pop("tpu_holders", None)
    lines += _rows(environment)
    if holders is not None:
        lines += _rows({"tpu_holders": "; ".join(
            f"pid {h['pid']} ({h['command']}) holds {h['device']}" for h in holders) or "none"})
    lines.append("default launch (xlaunch.launch(fn))")
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
                     "PJRT device": spec["pjrt_device"] or "(TPU Node: XRT)",
                     "compile cache": spec["compile_cache"] or "off",
                     "restarts": spec["max_restarts"],
                     "worker environment": " ".join(changes) or None})
    elif plan["path"] == "elastic":
        rows.update({"start method": spec["start_method"], "port": spec["port"],
                     "interface": "lo (loopback only)" if spec["loopback_only"] else "any",
                     "rendezvous": spec["rdzv_backend"],
                     "threads per process": spec["cpu_threads"] or "torch's default",
                     "engine check interval": f"{spec['monitor_interval']} s"})
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


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None
