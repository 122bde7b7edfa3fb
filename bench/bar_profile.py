"""Where a rank's time goes with a `tqdm.auto` bar on, under xlaunch, in a real Jupyter kernel.

    python bench/bar_profile.py [--steps 60000] [--py-spy PATH]

The loop of `bench/bar_cost.py` (100 us of CPU work per step, a `tqdm.auto` bar updated every
step) on each rank of a 2-process launch, sampled by py-spy (a sampling profiler: it slows
nothing it samples; ``pip install py-spy`` anywhere, it is not one of the project's
dependencies) at 250 Hz: rank 0's process for the loop, and the kernel for the whole launch.
Each of rank 0's samples is put in one class by its innermost frames: the work itself, tqdm's
bookkeeping, ipywidgets (the widget's state: traitlets, the comm), xlaunch's share (the kernel
session's send routed to the relay: `_compat`, `worker/displays.py`, the prefixed stream), or
other. In the kernel, the samples in which the relay's thread (`backends/displays.py`) was busy
rather than waiting are counted, as a share of one core.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bar_cost

RATE = 250
LOOP = '''
def loop_with_pid(folder, steps):
    rank = int(os.environ.get("RANK", "0"))
    Path(folder, f"pid-{rank}").write_text(str(os.getpid()))
    time.sleep(1.0)  # the profiler attaches
    for _ in tqdm(range(steps), desc=f"rank {rank}"):
        spin(WORK)
    Path(folder, f"done-{rank}").touch()
'''
XLAUNCH = ("xlaunch/_compat.py", "xlaunch/worker/displays.py", "xlaunch/worker/output.py")
WAITING = ("select (", "poll (", "wait (", "_wait_for_tstate_lock", "sleep (", "recv (")


def samples(raw: Path) -> list[tuple[list[str], int]]:
    """py-spy's raw output: each stack (outermost first) and how many samples it had."""
    found = []
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if stack:
            found.append((stack.split(";"), int(count)))
    return found


def rank_class(frames: list[str]) -> str:
    """The class of one of rank 0's samples, from the frames inside the launched function."""
    inside = [i for i, frame in enumerate(frames) if frame.startswith("loop_with_pid ")]
    if not inside:
        return "other (not in the loop: the worker's own threads, set-up)"
    tail = frames[inside[0] + 1:]
    text = ";".join(tail)
    if not tail or tail[-1].startswith("spin "):
        return "the work (spin)"
    if any(part in text for part in XLAUNCH):
        return "xlaunch: the routed send to the relay"
    if any(part in text for part in ("ipywidgets", "traitlets", "comm/")):
        return "ipywidgets: the widget's state, its comm"
    if "tqdm" in text:
        return "tqdm's bookkeeping"
    return "other"


def record(py_spy: str, pid: int, out: Path, idle: bool = False) -> subprocess.Popen[bytes]:
    command = [py_spy, "record", "-p", str(pid), "-r", str(RATE), "-f", "raw", "-o", str(out),
               "--nonblocking", *(["--idle"] if idle else [])]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60_000)
    parser.add_argument("--py-spy", default=shutil.which("py-spy"))
    options = parser.parse_args()
    if not options.py_spy:
        print("SKIPPED: py-spy not found (pip install py-spy, or --py-spy PATH)")
        return 0
    folder = Path(tempfile.mkdtemp(prefix="bar-profile-"))
    manager = bar_cost.kernel_manager(folder)
    client = manager.blocking_client()
    client.start_channels()
    spies: list[subprocess.Popen[bytes]] = []

    def attach() -> None:
        while not (folder / "pid-0").exists():
            time.sleep(0.01)
        spies.append(record(options.py_spy, int((folder / "pid-0").read_text()),
                            folder / "rank0.txt"))

    try:
        client.wait_for_ready(timeout=120)
        bar_cost.run_cell(client, bar_cost.SETUP + LOOP)
        bar_cost.run_cell(client, "from xlaunch import notebook_launcher\n"
                                  "notebook_launcher(print, num_processes=2)\n")  # imports, once
        kernel = record(options.py_spy, manager.provisioner.process.pid, folder / "kernel.txt",
                        idle=True)
        attacher = threading.Thread(target=attach)
        attacher.start()
        bar_cost.run_cell(client, "notebook_launcher(loop_with_pid, args=("
                                  f"{str(folder)!r}, {options.steps}), num_processes=2)\n")
        attacher.join()
        kernel.send_signal(2)
        kernel.wait()
        for spy in spies:
            spy.wait()  # it ends with the process it samples
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
    classes: Counter[str] = Counter()
    for frames, count in samples(folder / "rank0.txt"):
        classes[rank_class(frames)] += count
    total = sum(classes.values())
    print(f"\nrank 0, {options.steps} steps with the bar on: {total} samples at {RATE} Hz\n")
    print("| where | samples | share |\n|---|---:|---:|")
    for name, count in classes.most_common():
        print(f"| {name} | {count} | {100 * count / total:.1f}% |")
    relay = [(frames, count) for frames, count in samples(folder / "kernel.txt")
             if any(frame.startswith("DisplayRelay._loop ") for frame in frames)]
    busy = sum(count for frames, count in relay if not any(w in frames[-1] for w in WAITING))
    seconds = sum(count for _, count in relay) / RATE
    print(f"\nthe kernel's relay thread: busy in {busy} of {sum(c for _, c in relay)} samples "
          f"over {seconds:.1f} s: {100 * busy / RATE / max(seconds, 1e-9):.1f}% of one core")
    return 0


if __name__ == "__main__":
    sys.exit(main())
