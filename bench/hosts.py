"""Two simulated hosts, xlaunch beside plain torchrun, in the same run (issue 33, point 7).

    sudo python bench/hosts.py [--repeats 5] [--json bench/results/hosts.json]

Two network namespaces joined by a bridge (the multi-host tier's, `tests/hosts/netns.py`), each
with its own address and host name; on each, a launch of 2 CPU processes (gloo) meeting through
the static rendezvous at host 1 (10.77.0.1), as a user runs two machines: ``xlaunch`` (a script
calling ``notebook_launcher``) and ``torchrun`` (the same world, a script that forms its group
itself). Both hosts' commands start together; each side's figure is the wall time from that
start until the host's command exited (interpreter start and ``import torch`` included on both
sides). The sides take turns, who goes first changing each repetition; medians.

- result: a 2x2 world (4 ranks) all-reduces and passes a barrier; both hosts exit with status 0;
- error: rank 3 (host 2) raises ``RuntimeError("rank three gives up")`` after the all-reduce
  while the others wait in a barrier; time until each host's command ended, and whether what
  that host printed names the exception (its message), counted over the repetitions.

Needs root and iproute2 (as the multi-host tier); prints why and exits 0 where namespaces cannot
be made. Leaves no namespace or process behind. Not part of the test command.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.hosts.netns import Host, make_hosts, node_env, remove_hosts, why_no_hosts  # noqa: E402

MESSAGE = "rank three gives up"

XLAUNCH = f'''
import sys, xlaunch
scenario, node_rank, port = sys.argv[1], int(sys.argv[2]), sys.argv[3]

def train():
    import torch, torch.distributed as dist
    total = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(total)
    if scenario == "error" and dist.get_rank() == 3:
        raise RuntimeError("{MESSAGE}")
    dist.barrier()
    return dist.get_world_size(), total.item()

print("result", xlaunch.notebook_launcher(
    train, num_processes=2, num_nodes=2, node_rank=node_rank, master_addr="10.77.0.1",
    use_port=port, rdzv_id="bench-" + port), flush=True)
'''

TORCHRUN = f'''
import sys, torch, torch.distributed as dist
scenario = sys.argv[1]
dist.init_process_group("gloo")
total = torch.tensor([float(dist.get_rank())])
dist.all_reduce(total)
if scenario == "error" and dist.get_rank() == 3:
    raise RuntimeError("{MESSAGE}")
dist.barrier()
if dist.get_rank() in (0, 2):
    print("result", dist.get_world_size(), total.item(), flush=True)
dist.destroy_process_group()
'''


def commands(side: str, scenario: str, node: int, port: int, folder: Path) -> list[str]:
    if side == "xlaunch":
        return [sys.executable, str(folder / "xlaunch_node.py"), scenario, str(node), str(port)]
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    return [torchrun, "--nnodes", "2", "--nproc-per-node", "2", "--node-rank", str(node),
            "--master-addr", "10.77.0.1", "--master-port", str(port), "--rdzv-id",
            f"bench-{port}", str(folder / "torchrun_node.py"), scenario]


def one_launch(hosts: list[Host], side: str, scenario: str, port: int,
               folder: Path) -> list[dict[str, Any]]:
    """Both hosts' commands started together; per host: seconds to exit, status, output."""
    env = {**node_env(), "XLAUNCH_LIVE_VIEW": "0"}
    started = time.monotonic()
    nodes = [host.start(*commands(side, scenario, node, port, folder), env=env)
             for node, host in enumerate(hosts)]
    ends: list[dict[str, Any]] = [{} for _ in nodes]
    pending = set(range(len(nodes)))
    while pending:
        for index in list(pending):
            if nodes[index].poll() is not None:
                ends[index]["seconds"] = time.monotonic() - started
                pending.discard(index)
        if time.monotonic() - started > 180:
            raise RuntimeError(f"{side} {scenario}: still running after 180 s")
        time.sleep(0.005)
    for end, node in zip(ends, nodes, strict=True):
        out, err = node.communicate()
        end.update(status=node.returncode, output=out + err)
    for host in hosts:  # nothing left of this launch before the next
        deadline = time.monotonic() + 10
        while host.running() and time.monotonic() < deadline:
            time.sleep(0.05)
    return ends


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    why = why_no_hosts()
    if why is not None:
        print(f"SKIPPED: {why}")
        return 0
    if not Path(sys.executable).with_name("torchrun").exists():
        print("SKIPPED: no torchrun beside this python")
        return 0
    load_before = os.getloadavg()[0]
    folder = Path(tempfile.mkdtemp(prefix="xlaunch-bench-hosts-"))
    (folder / "xlaunch_node.py").write_text(XLAUNCH)
    (folder / "torchrun_node.py").write_text(TORCHRUN)
    tag = uuid.uuid4().hex[:5]
    hosts = make_hosts(2, tag)
    samples: dict[str, list[list[dict[str, Any]]]] = {}
    port = 29600
    try:
        for repeat in range(args.repeats):
            sides = ["xlaunch", "torchrun"] if repeat % 2 == 0 else ["torchrun", "xlaunch"]
            for scenario in ("result", "error"):
                for side in sides:
                    port += 1
                    ends = one_launch(hosts, side, scenario, port, folder)
                    samples.setdefault(f"{side} {scenario}", []).append(ends)
                    print(f"  {repeat + 1}/{args.repeats} {side:8} {scenario:6} " + ", ".join(
                        f"host {n + 1}: {end['seconds']:.2f} s (exit {end['status']})"
                        for n, end in enumerate(ends)), flush=True)
    finally:
        left = remove_hosts(hosts, tag)
        shutil.rmtree(folder, ignore_errors=True)
    if left:
        print(f"killed at the end: {left}")
    print(table(samples, args, load_before))
    if args.json:
        args.json.write_text(json.dumps(
            {key: [[{k: v for k, v in end.items()} for end in ends] for ends in runs]
             for key, runs in samples.items()}, indent=1))
    return 0


def table(samples: dict[str, list[list[dict[str, Any]]]], args: argparse.Namespace,
          load_before: float) -> str:
    import torch

    import xlaunch

    def median(key: str, host: int) -> float:
        return statistics.median(ends[host]["seconds"] for ends in samples[key])

    def named(key: str, host: int) -> str:
        return f"{sum(MESSAGE in ends[host]['output'] for ends in samples[key])}/" \
               f"{len(samples[key])}"

    def ok(key: str) -> str:
        return f"{sum(all(e['status'] == 0 for e in ends) for ends in samples[key])}/" \
               f"{len(samples[key])}"

    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    cpu = platform.processor() or platform.machine()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    lines = [f"{now}; {cpu}, {os.cpu_count()} cores; "
             f"Python {platform.python_version()}, torch {torch.__version__}, xlaunch "
             f"{xlaunch.__version__}; load average {load_before:.2f} before, "
             f"{os.getloadavg()[0]:.2f} after; medians of {args.repeats}",
             f"command: python bench/hosts.py --repeats {args.repeats} (as root)",
             "", "| Figure | xlaunch | torchrun | ratio |", "|---|---:|---:|---:|"]
    for host in (0, 1):
        ours, theirs = median("xlaunch result", host), median("torchrun result", host)
        lines.append(f"| 2x2 run to result, host {host + 1} (all exited 0: {ok('xlaunch result')}"
                     f" / {ok('torchrun result')}) | {ours:.2f} s | {theirs:.2f} s | "
                     f"{ours / theirs:.2f}x |")
    for host in (0, 1):
        ours, theirs = median("xlaunch error", host), median("torchrun error", host)
        lines.append(f"| rank 3 raises on host 2: host {host + 1} ends | {ours:.2f} s | "
                     f"{theirs:.2f} s | {ours / theirs:.2f}x |")
    for host in (0, 1):
        lines.append(f"| rank 3 raises on host 2: host {host + 1}'s output names the exception "
                     f"| {named('xlaunch error', host)} | {named('torchrun error', host)} | - |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
