"""``xlaunch demo``: a small real data-parallel training, to see that a launch works end to end.

It is the README's first command, so it must prove something rather than print a greeting: a
2-layer MLP learns a fixed random linear map from seeded synthetic data, each rank training on its
own shard while gradients are averaged across ranks (DDP on GPU/CPU, an XLA all-reduce on TPU). If
the averaging works, every rank ends with bit-for-bit the same parameters; the last step gathers
them from every rank and compares, and the command fails when any rank differs. Model and data
are made in place: nothing is downloaded, so it runs on a machine without network access.

The training itself is in demo_training.py.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING

from xlaunch.cli.demo_training import DemoConfig, ranks_agree, train
from xlaunch.cli.options import add_common_arguments, launch_and_report, options_from, usage_error

if TYPE_CHECKING:
    from xlaunch.detect.environment import Environment
    from xlaunch.plan.specs import LaunchPlan

DEMO_TIMEOUT_S = 600.0  # tiny model: a demo still running after this is stuck, not slow


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-processes", "--num_processes", dest="num_processes", type=int,
                        default=None, metavar="N",
                        help="processes to train in (default: every TPU core or GPU; 2 on a CPU-only "
                             "machine, so the demo is distributed there too)")
    parser.add_argument("--epochs", type=int, default=DemoConfig.epochs, metavar="N",
                        help=f"passes over the data (default {DemoConfig.epochs})")
    parser.add_argument("--steps", type=int, default=None, metavar="N",
                        help="optimizer steps per epoch (default: one pass over each rank's shard)")
    add_common_arguments(parser)
    parser.set_defaults(timeout=DEMO_TIMEOUT_S)


def main(args: argparse.Namespace) -> int:
    """Show the machine and the plan, train across its processes, report PASS or fail."""
    from xlaunch.api import plan_here, run_plan
    from xlaunch.detect import detect

    if args.epochs < 1 or (args.steps is not None and args.steps < 1):
        return usage_error("--epochs and --steps must be at least 1")
    config = DemoConfig(epochs=args.epochs, steps_per_epoch=args.steps)
    try:
        env = detect()
        count = default_num_processes(env) if args.num_processes is None else args.num_processes
        plan = plan_here(options_from(args, num_processes=count), env)
    except (ValueError, TypeError, RuntimeError) as error:  # RuntimeError: this process can't
        return usage_error(str(error))
    print(summary(env, plan, config))
    sys.stdout.flush()  # before the workers' lines, which go straight to the same stream
    started = time.perf_counter()
    status = launch_and_report(lambda: run_plan(plan, train, (config,)))
    if status == 0:
        print(f"demo finished in {time.perf_counter() - started:.1f} s")
    return status


def default_num_processes(env: Environment) -> int | None:
    """The launcher's choice, except on a CPU-only machine: one process would prove nothing."""
    return 2 if env.xla_device is None and env.accelerator == "cpu" else None


def summary(env: Environment, plan: LaunchPlan, config: DemoConfig) -> str:
    """A few lines of what `xlaunch env` shows at length: what runs where."""
    from importlib import metadata

    machine = f"{env.platform}, {env.accelerator}"
    if env.tpu_generation:
        machine += f" {env.tpu_generation} ({env.tpu_chips} chips x {env.cores_per_chip} cores)"
    else:
        machine += f" ({env.device_count} device{'s' if env.device_count != 1 else ''})"
    versions = []
    for name in ("torch", "torch_xla"):
        try:
            versions.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            continue
    shard = -(-config.samples // plan.world_size)
    steps = config.steps_per_epoch or max(1, shard // config.batch_size)
    rows = {
        "machine": machine,
        "launch": f"{plan.describe_path()}: {plan.summary()}, world size {plan.world_size}, "
                  f"{plan.dist_backend or 'no process group'}",
        "training": f"MLP {config.features}-{config.hidden}-{config.outputs} on {config.samples} "
                    f"synthetic samples, {config.epochs} epoch(s) x {steps} steps, batch "
                    f"{config.batch_size} per rank, mixed precision {plan.mixed_precision}",
        "versions": ", ".join(versions) or "-",
    }
    return "\n".join(["xlaunch demo"] + [f"  {key:<10}{value}" for key, value in rows.items()])


__all__ = ["DemoConfig", "add_arguments", "default_num_processes", "main", "ranks_agree",
           "summary", "train"]
