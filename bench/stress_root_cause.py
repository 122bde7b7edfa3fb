"""How often the right rank is named as the root cause: launches in a row, counted.

    python bench/stress_root_cause.py [--launches 15]
    # every core busy: one busy loop per core beside it
    for i in $(seq $(nproc)); do python3 -c "while True: pass" & done
    python bench/stress_root_cause.py; kill $(jobs -p)

Each scenario is one real launch on CPU processes (gloo) in which one rank fails while its peers
wait in ``wait_for_everyone()``; the launch's `LaunchError` must name that rank as the root cause
and list every rank exactly once. Prints one line per scenario and exits non-zero on any miss.
Not part of the test command: it exists to be run under load, where races show.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

from xlaunch import LaunchError, ProcessState, debug_launcher, wait_for_everyone


def fail(culprit: int, how: str) -> None:
    if ProcessState().process_index == culprit:
        if how == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise ValueError(f"rank {culprit} failed on purpose")
    wait_for_everyone()


SCENARIOS = [  # (name, processes, culprit, how)
    ("rank 1 of 2 SIGKILLed while rank 0 waits", 2, 1, "sigkill"),
    ("rank 2 of 4 SIGKILLed while the others wait", 4, 2, "sigkill"),
    ("rank 1 of 2 raises while rank 0 waits", 2, 1, "raise"),
    ("rank 2 of 4 raises while the others wait", 4, 2, "raise"),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=15)
    args = parser.parse_args()
    load = os.getloadavg()[0]
    print(f"{args.launches} launches per scenario, {os.cpu_count()} cores, load {load:.1f}")
    misses = 0
    for name, processes, culprit, how in SCENARIOS:
        right, seen, started = 0, [], time.perf_counter()
        for _ in range(args.launches):
            try:
                debug_launcher(fail, args=(culprit, how), num_processes=processes, timeout=120)
                seen.append("no error")
            except LaunchError as error:
                root = error.root_cause
                listed = sorted(f.rank for f in error.failures)
                ok = root is not None and root.rank == culprit and listed == list(range(processes))
                right += ok
                seen.append(root.rank if root else None)
        misses += args.launches - right
        print(f"{name}: named {right}/{args.launches} "
              f"({time.perf_counter() - started:.1f} s){'' if right == args.launches else f' seen {seen}'}")
    return 1 if misses else 0


if __name__ == "__main__":
    sys.exit(main())
