"""A stop at any moment of a launch, and the whole tree of processes a launch started.

The stop button is SIGINT to the notebook's kernel. These tests send it the way it failed before:
at random moments from the call on - while the first launch is still importing torch, while
workers fork, while they form their group, while they run - and check each time that the launch
ends in KeyboardInterrupt, that no process it started is left, and that the next launch works.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

ROUND = """
    import json, os, random, signal, sys, threading, time
    import psutil, xlaunch

    # Ctrl-C raises KeyboardInterrupt, as in a notebook kernel, even when this process started
    # with SIGINT ignored (a shell's background job).
    signal.signal(signal.SIGINT, signal.default_int_handler)

    def sleeper():
        time.sleep(100)

    def world():
        import torch.distributed as dist
        return dist.get_world_size()

    def still_running(settle):
        # A stop during the first launch's import of torch leaves that import to finish in the
        # launch thread (it cannot be cut short), and CUDA builds of torch run `ldconfig -p` as
        # they import (torch 2.15): a child of the caller for a few milliseconds, not the
        # launch's. What is still running once such children ended on their own (`settle`
        # seconds at most) is left; a worker left would sleep for 100 s, the tree's guard for ever.
        deadline = time.monotonic() + settle
        while True:
            left = {}
            for p in psutil.Process().children(recursive=True):
                try:
                    if p.status() != "zombie":
                        left[p.pid] = " ".join(p.cmdline())
                except psutil.NoSuchProcess:
                    pass
            if not left or time.monotonic() >= deadline:
                return [f"{pid} {command}" for pid, command in left.items()]
            time.sleep(0.05)

    def one_round(delay):
        timer = threading.Timer(delay, os.kill, (os.getpid(), signal.SIGINT))
        try:
            # On a busy machine a near-zero delay can fire before start() returns: the stop then
            # comes before the call, and is raised at once.
            timer.start()
            xlaunch.notebook_launcher(sleeper, num_processes=2)
            outcome = "returned"
        except KeyboardInterrupt:
            outcome = "interrupted"
        timer.join()
        left = still_running(settle=5.0 if sys.argv[5] == "fresh" else 0.0)
        relaunch = xlaunch.notebook_launcher(world, num_processes=2)
        return {"delay": delay, "outcome": outcome, "left": left, "relaunch": relaunch}

    rounds, low, high, seed = (int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]),
                               int(sys.argv[4]))
    if sys.argv[5] == "torch-first":
        import torch.distributed
    rng = random.Random(seed)
    for _ in range(rounds):
        print(json.dumps(one_round(rng.uniform(low, high))), flush=True)
"""


def run_rounds(tmp_path: Path, rounds: int, low: float, high: float, seed: int,
               torch_first: bool) -> subprocess.Popen[str]:
    script = tmp_path / f"rounds-{seed}.py"
    script.write_text(textwrap.dedent(ROUND))
    env = {**os.environ, "XLAUNCH_ACCELERATOR": "cpu"}
    return subprocess.Popen(
        [sys.executable, str(script), str(rounds), str(low), str(high), str(seed),
         "torch-first" if torch_first else "fresh"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def check_rounds(process: subprocess.Popen[str], expected: int) -> list[dict]:
    out, err = process.communicate(timeout=600)
    assert process.returncode == 0, err[-3000:]
    results = [json.loads(line) for line in out.splitlines()]
    assert len(results) == expected, err[-3000:]
    for result in results:
        assert result["outcome"] == "interrupted", result
        assert result["left"] == [], result
        assert result["relaunch"] == 2, result
    return results


def test_a_stop_at_any_moment_of_a_first_launch_while_torch_is_imported(tmp_path: Path) -> None:
    """20 fresh interpreters, each stopped 0-400 ms into its first launch (two at a time)."""
    for pair in range(10):
        running = [run_rounds(tmp_path, 1, 0.0, 0.4, seed=100 + 2 * pair + i, torch_first=False)
                   for i in range(2)]
        for process in running:
            check_rounds(process, 1)


def test_a_stop_in_the_first_milliseconds_with_torch_already_imported(tmp_path: Path) -> None:
    """20 launches in one interpreter, each stopped 0-20 ms after the call: during the fork."""
    check_rounds(run_rounds(tmp_path, 20, 0.0, 0.02, seed=7, torch_first=True), 20)


WORKER_WITH_A_CHILD = """
    import os, signal, subprocess, sys, time, xlaunch
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as a notebook kernel does
    folder, how = sys.argv[1], sys.argv[2]

    def train():
        rank = xlaunch.ProcessState().process_index
        child = subprocess.Popen(["sleep", "300"])
        with open(os.path.join(folder, f"child-{rank}"), "w") as note:
            note.write(str(child.pid))
        xlaunch.wait_for_everyone()
        if how == "failure" and rank == 1:
            raise ValueError("rank 1 failed after starting a child")
        time.sleep(300)

    try:
        xlaunch.notebook_launcher(train, num_processes=2, timeout=15 if how == "timeout" else None)
    except BaseException as error:
        print(type(error).__name__, flush=True)
"""


def child_pids(folder: Path, deadline_s: float = 60) -> list[int]:
    notes = [folder / "child-0", folder / "child-1"]
    deadline = time.monotonic() + deadline_s
    while not all(note.exists() and note.read_text() for note in notes):
        assert time.monotonic() < deadline, "the workers never started their children"
        time.sleep(0.05)
    return [int(note.read_text()) for note in notes]


def gone(pid: int, within_s: float = 10) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("how, expected", [
    ("sigint", "KeyboardInterrupt"), ("timeout", "LaunchTimeout"), ("failure", "LaunchError"),
    ("sigkill", None),
])
def test_a_stop_ends_what_each_worker_started_itself(tmp_path: Path, how: str,
                                                      expected: str | None) -> None:
    script = tmp_path / "tree.py"
    script.write_text(textwrap.dedent(WORKER_WITH_A_CHILD))
    env = {**os.environ, "XLAUNCH_ACCELERATOR": "cpu"}
    caller = subprocess.Popen([sys.executable, str(script), str(tmp_path), how],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        children = child_pids(tmp_path)
        if how == "sigint":
            caller.send_signal(signal.SIGINT)
        elif how == "sigkill":
            caller.kill()
        out, err = caller.communicate(timeout=120)
    finally:
        caller.kill()
    if expected is not None:
        assert out.strip().splitlines()[-1] == expected, err[-2000:]
    for pid in children:
        assert gone(pid), f"a worker's own child {pid} outlived the launch ({how})"
