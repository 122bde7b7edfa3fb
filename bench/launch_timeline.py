"""Where the time of one 2-process CPU launch goes: a timeline of the caller and both workers.

    python bench/launch_timeline.py [--launches 5] [--processes 2]

Each step of a launch (the launch thread, the process tree's guard, each worker's start, set-up,
process group and function, the owner's wait for the ends, the clean-up) is wrapped to write the
system-wide monotonic clock to one file, from the caller and from the forked workers alike; the
timeline of the last launch is printed with every step's median duration over all launches. A
profiling aid, not a test: it wraps xlaunch's own functions (named below).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

os.environ.setdefault("XLAUNCH_ACCELERATOR", "cpu")

import xlaunch
from xlaunch.backends import processes, supervise
from xlaunch.backends.elastic import job, starter
from xlaunch.worker import launch_dir, rank

LOG = os.path.join(tempfile.gettempdir(), f"xlaunch-timeline-{os.getpid()}.log")

# (owner, attribute, step name): each call's start and end are written to the log.
STEPS: list[tuple[Any, str, str]] = [
    (supervise.Attempt, "run", "launch thread: the attempt's whole run"),
    (processes.ProcessSet, "__init__", "caller: start the process tree's guard"),
    (processes.ProcessSet, "start", "caller: fork a worker"),
    (rank.Worker, "__init__", "worker: set-up (pid file, signals, output, tree)"),
    (job.DistJob, "_form_group", "worker: process group (FileStore, gloo, barrier)"),
    (rank.Worker, "run", "worker: the function, its report"),
    (rank.Worker, "send_back", "worker: its value written"),
    (starter.DistStarter, "_watch", "caller: wait for every worker's end"),
    (supervise.Attempt, "outcome", "caller: read what each worker left, map the value"),
    (processes.ProcessSet, "close", "caller: end the process tree"),
    (launch_dir.LaunchDir, "remove", "caller: remove the launch folder"),
]


def mark(name: str) -> None:
    with open(LOG, "a") as log:
        log.write(f"{time.monotonic():.6f}\t{os.getpid()}\t{name}\n")


def wrapped(original: Callable[..., Any], name: str) -> Callable[..., Any]:
    def step(*args: Any, **kwargs: Any) -> Any:
        mark(f"+{name}")
        try:
            return original(*args, **kwargs)
        finally:
            mark(f"-{name}")
    return step


def trivial() -> object:
    if os.environ.get("XLAUNCH_TIMELINE_VALUE_MB"):  # a large value back, from rank 0
        import torch
        import torch.distributed as dist

        if dist.get_rank() == 0:
            return torch.ones(int(os.environ["XLAUNCH_TIMELINE_VALUE_MB"]) * 2**20 // 4)
    return 1


def one_launch(processes: int) -> list[tuple[float, int, str]]:
    if os.path.exists(LOG):
        os.remove(LOG)
    mark("+call")
    xlaunch.notebook_launcher(trivial, num_processes=processes, report=False)
    mark("-call")
    rows = []
    with open(LOG) as log:
        for line in log:
            stamp, pid, name = line.rstrip("\n").split("\t")
            rows.append((float(stamp), int(pid), name))
    return rows


def durations(rows: list[tuple[float, int, str]]) -> dict[str, float]:
    """Each step's time, ms; a step polled many times (the engine's end) from first to last."""
    started: dict[tuple[int, str], float] = {}
    spans: dict[str, list[float]] = defaultdict(list)
    for stamp, pid, name in rows:
        if name[0] == "+":
            started.setdefault((pid, name[1:]), stamp)
        else:
            spans[name[1:]].append((stamp - started.pop((pid, name[1:]))) * 1000)
    return {name: max(values) for name, values in spans.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=5)
    parser.add_argument("--processes", type=int, default=2)
    args = parser.parse_args()
    for owner, attribute, name in STEPS:
        setattr(owner, attribute, wrapped(getattr(owner, attribute), name))
    one_launch(args.processes)  # warm-up: imports, first fork
    measured = [one_launch(args.processes) for _ in range(args.launches)]
    last = measured[-1]
    start, caller = last[0][0], last[0][1]
    print(f"the last of {args.launches} launches, {args.processes} processes "
          f"(ms from the call; load average {os.getloadavg()[0]:.2f}):")
    workers: dict[int, str] = {}
    for stamp, pid, name in last:
        who = "caller" if pid == caller else workers.setdefault(pid, f"worker {len(workers)}")
        print(f"  {(stamp - start) * 1000:7.1f}  {who:<9} {'starts' if name[0] == '+' else 'ends  '}"
              f" {name[1:]}")
    print("median over the launches (ms; for several workers, the slowest):")
    table: dict[str, list[float]] = defaultdict(list)
    for rows in measured:
        for name, took in durations(rows).items():
            table[name].append(took)
    for name, values in table.items():
        print(f"  {statistics.median(values):7.1f}  {name}")
    os.remove(LOG)


if __name__ == "__main__":
    main()
