"""Output without newlines through a launch, against the same output in the caller's process.

    python bench/output_linear.py [--chars 200000]

A progress bar redrawn with carriage returns, or dots printed with ``end=""``, reaches hundreds
of thousands of characters without a newline. Each rank's output passes through a prefixing
stream; this prints how long the printing loop took in the caller and inside rank 0 of a
2-process launch (three runs each), so a cost that grows faster than the output shows.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import xlaunch


def dots(count: int) -> float:
    started = time.perf_counter()
    for _ in range(count):
        print(".", end="")
    print(flush=True)
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chars", type=int, default=200_000)
    count = parser.parse_args().chars
    os.environ["XLAUNCH_ACCELERATOR"] = "cpu"
    here = [dots(count) for _ in range(3)]
    ranks = [xlaunch.notebook_launcher(dots, args=(count,), num_processes=2, report=False)
             for _ in range(3)]
    print(f"{count} characters without a newline: in the caller {statistics.median(here):.3f} s, "
          f"in rank 0 of a 2-process launch {statistics.median(ranks):.3f} s (medians of 3)",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
