"""What a `tqdm.auto` bar costs a rank in a notebook, and what it costs the notebook.

    python bench/bar_cost.py [--steps 20000] [--repeats 3]

In a real Jupyter kernel of this interpreter (jupyter_client, as the notebook tests drive one),
each rank of a 2-process CPU launch runs the same loop: ``--steps`` steps of 100 us of CPU work
(a loop calibrated in the kernel: 10,000 bar updates a second on an idle core), through
``tqdm.auto.tqdm`` with the bar on, or with ``disable=True``. Launched by xlaunch's
`notebook_launcher` and by accelerate's, each with the bar on and off, taking turns in every
repetition. Each rank writes its loop's wall time and its process's CPU time (every thread: the
bar's cost wherever it is paid) to a file; on a machine shared with other work the CPU time is the
steadier figure. The frontend counts the iopub messages the kernel sent for the bar (widget and
display messages; the launch's live view, `xlaunch-live`, counted apart). Prints a markdown table
of medians.

accelerate's forked workers send nothing the notebook shows: jupyter_client drops every message a
forked process sends ("attempted to send message from fork"), so its bar never reaches the cell
and its count is 0 whatever the bar does.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

BAR_MESSAGES = ("comm_open", "comm_msg", "comm_close", "display_data", "update_display_data",
                "clear_output")

SETUP = '''
import os, time
from pathlib import Path
from tqdm.auto import tqdm

def spin(count):
    for _ in range(count):
        pass

def calibrate():
    """Iterations of spin() that take 100 us of CPU here (best of 5)."""
    best = min(_timed(100_000) for _ in range(5))
    return max(1, int(100_000 * 1e-4 / best))

def _timed(count):
    started = time.process_time()
    spin(count)
    return time.process_time() - started

WORK = calibrate()

def loop(folder, tag, steps, bar):
    rank = int(os.environ.get("RANK", "0"))
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in tqdm(range(steps), disable=not bar, desc=f"rank {rank}"):
        spin(WORK)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    Path(folder, f"{tag}-{rank}").write_text(f"{wall} {cpu}")
'''

LAUNCHERS = {
    "xlaunch": "from xlaunch import notebook_launcher as launch_it\n",
    "accelerate": "from accelerate import notebook_launcher as launch_it\n",
}


def kernel_manager(folder: Path) -> Any:
    """A kernel of this interpreter, through a kernelspec of its own (as the tests make one)."""
    from jupyter_client import KernelManager

    spec = folder / "kernels" / "bar-cost"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "bar cost", "language": "python"}))
    os.environ["JUPYTER_PATH"] = os.pathsep.join(
        filter(None, [str(folder), os.environ.get("JUPYTER_PATH")]))
    manager = KernelManager(kernel_name="bar-cost")
    env = dict(os.environ, XLAUNCH_ACCELERATOR="cpu", IPYTHONDIR=str(folder / "ipython"))
    log = open(folder / "kernel.log", "wb")  # the kernel's own output (accelerate's drops)
    manager.start_kernel(env=env, cwd=str(folder), stdout=log, stderr=log)
    return manager


def run_cell(client: Any, code: str) -> dict[str, int]:
    """Run ``code``; count the bar's messages (all, and the most one widget or display got) and
    the live view's."""
    counts = {"bar": 0, "live": 0}
    per_output: dict[str, int] = {}
    errors: list[str] = []

    def hook(message: dict[str, Any]) -> None:
        kind, content = message["msg_type"], message["content"]
        if kind == "error":
            errors.append("\n".join(content["traceback"]))
        if kind not in BAR_MESSAGES:
            return
        display_id = str(content.get("transient", {}).get("display_id", ""))
        if display_id.startswith("xlaunch-live"):
            counts["live"] += 1
            return
        counts["bar"] += 1
        output = str(content.get("comm_id") or display_id)
        per_output[output] = per_output.get(output, 0) + 1

    reply = client.execute_interactive(code, timeout=600, output_hook=hook)
    if reply["content"]["status"] != "ok":
        raise RuntimeError(f"the cell failed:\n{''.join(errors)}\n{code}")
    counts["most"] = max(per_output.values(), default=0)
    return counts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=3)
    options = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="bar-cost-"))
    manager = kernel_manager(folder)
    client = manager.blocking_client()
    client.start_channels()
    results: dict[tuple[str, bool], list[tuple[float, float, int, int, int, float, float]]] = {}
    try:
        client.wait_for_ready(timeout=120)
        run_cell(client, SETUP)
        for repeat in range(options.repeats):
            for launcher, imports in LAUNCHERS.items():
                for bar in (True, False):
                    tag = f"{launcher}-{bar}-{repeat}"
                    counts = run_cell(client, imports + (
                        f"launch_it(loop, args=({str(folder)!r}, {tag!r}, {options.steps}, "
                        f"{bar}), num_processes=2)\n"))
                    times = [[float(v) for v in (folder / f"{tag}-{rank}").read_text().split()]
                             for rank in (0, 1)]
                    results.setdefault((launcher, bar), []).append(
                        (times[0][0], times[1][0], counts["bar"], counts["live"], counts["most"],
                         times[0][1], times[1][1]))
                    print(f"{tag}: loop {times[0][0]:.3f} / {times[1][0]:.3f} s, CPU "
                          f"{times[0][1]:.3f} / {times[1][1]:.3f} s, bar messages "
                          f"{counts['bar']}, live view {counts['live']}", file=sys.stderr)
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
    print(f"\n{options.steps} steps of 100 us of CPU work per rank, 2 CPU processes, medians of "
          f"{options.repeats}\n")
    print("| launcher | bar | rank 0 loop, wall (s) | rank 1 loop, wall (s) | CPU rank 0 / 1 (s) "
          "| CPU vs bar off | wall vs bar off | bar messages to the cell | most to one widget "
          "| to it per second | live view updates |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for (launcher, bar), runs in results.items():
        def median(index: int, rows: list[Any] = runs) -> float:
            return statistics.median(row[index] for row in rows)

        off = results[(launcher, False)]
        cpu = (median(5) + median(6)) / 2
        cpu_off = (median(5, off) + median(6, off)) / 2
        slowest = statistics.median(max(row[0], row[1]) for row in runs)
        slowest_off = statistics.median(max(row[0], row[1]) for row in off)
        print(f"| {launcher} | {'on' if bar else 'off'} | {median(0):.3f} | {median(1):.3f} | "
              f"{median(5):.3f} / {median(6):.3f} | {cpu / cpu_off:.3f} | "
              f"{slowest / slowest_off:.3f} | {median(2):g} | {median(4):g} | "
              f"{median(4) / slowest:.1f} | {median(3):g} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
