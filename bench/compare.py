"""xlaunch against the launchers it replaces, measured side by side in one run.

    python bench/compare.py                 # every CPU figure (dev venv: torch, accelerate)
    python bench/compare.py --quick         # a smoke run: 2 processes, few repetitions
    python bench/compare.py --xla           # the XLA figure (run with the torch_xla venv's python)

Within each repetition the launchers take turns, the first one changing from one repetition to the
next, so a noisy neighbour slows both sides alike; the figures are medians and the ratio is ours
over theirs. Every launch is checked to have really run its processes (each one writes its rank
and pid to a file). Nothing here asserts a timing: this is a benchmark, not a test. The markdown
table printed at the end carries the date and the machine, ready to paste into bench/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

SIZES = (2, 4, 8)
FAILURE_TOKEN = "bench-failure-7f3a"  # the message rank 1 raises; looked for in the caller's error
HANG_LIMIT_S = 120  # a launch that has not returned after this is recorded as hung
LAUNCH_HANG_LIMIT_S = 60  # the same for a launch of the trivial function
XLA_ENV = {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "1", "XLAUNCH_ACCELERATOR": "xla"}


# ----------------------------------------------------------------------------------------------
# Results


@dataclass
class Row:
    """One line of the table: our figure against the alternative's, with the goal on the ratio."""

    figure: str
    ours: str
    theirs: str
    ours_samples: list[float]
    theirs_samples: list[float]
    unit: str = "s"  # "s" (shown in s or ms) or "s/proc" (a slope)
    goal: float | None = None  # the largest ratio ours/theirs that meets the goal
    note: str = ""

    @property
    def ours_median(self) -> float | None:
        return statistics.median(self.ours_samples) if self.ours_samples else None

    @property
    def theirs_median(self) -> float | None:
        return statistics.median(self.theirs_samples) if self.theirs_samples else None

    @property
    def ratio(self) -> float | None:
        ours, theirs = self.ours_median, self.theirs_median
        if ours is None or theirs is None or theirs <= 0:
            return None
        return ours / theirs

    @property
    def met(self) -> str:
        if self.goal is None:
            return "-"
        if self.ratio is None:
            return "n/a"
        return "yes" if self.ratio <= self.goal else "**no**"


@dataclass
class Report:
    machine: dict[str, Any]
    options: dict[str, Any]
    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, rows: list[Row]) -> None:
        for row in rows:
            print(f"  = {row.figure}: {row.ours} {fmt(row.ours_median, row.unit)}, {row.theirs} "
                  f"{fmt(row.theirs_median, row.unit)}, ratio {fmt_ratio(row.ratio)}"
                  + (f" (goal <= {row.goal}x: {row.met.strip('*')})" if row.goal is not None else ""),
                  flush=True)
        self.rows.extend(rows)

    def note(self, text: str) -> None:
        print(f"  ! {text}", flush=True)
        self.notes.append(text)


def fmt(value: float | None, unit: str = "s") -> str:
    if value is None:
        return "n/a"
    if unit == "s/proc":
        return f"{value * 1e3:+.1f} ms/proc"
    if abs(value) < 0.01:
        return f"{value * 1e3:.2f} ms"
    if abs(value) < 1:
        return f"{value * 1e3:.0f} ms"
    return f"{value:.2f} s"


def fmt_ratio(ratio: float | None) -> str:
    return "n/a" if ratio is None else f"{ratio:.2f}x"


def print_table(report: Report) -> str:
    """The results as markdown: machine and conditions, one line per figure, then the notes."""
    m = report.machine
    lines = [
        f"### xlaunch vs {m['compared_with']} ({m['date']})",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['os']}; Python {m['python']}, torch {m['torch']}"
        + (f", accelerate {m['accelerate']}" if m.get("accelerate") else "")
        + (f", torch_xla {m['torch_xla']}" if m.get("torch_xla") else "")
        + f", xlaunch {m['xlaunch']}.",
        f"Conditions: load average {m['load_before']} before, {m['load_after']} after; "
        f"{report.options['repeats']} repetitions, alternating; command `{report.options['command']}`.",
        "",
        "| Figure | xlaunch | median | alternative | median | ratio | goal | met |",
        "|---|---|---:|---|---:|---:|---:|:---:|",
    ]
    for row in report.rows:
        goal = "-" if row.goal is None else f"<= {row.goal}x"
        lines.append(
            f"| {row.figure} | {row.ours} | {fmt(row.ours_median, row.unit)} | {row.theirs} | "
            f"{fmt(row.theirs_median, row.unit)} | {fmt_ratio(row.ratio)} | {goal} | {row.met} |"
        )
    notes = list(dict.fromkeys(f"{row.figure}: {row.note}" for row in report.rows if row.note))
    notes += report.notes
    if notes:
        lines.append("")
        lines.extend(f"- {text}" for text in notes)
    table = "\n".join(lines)
    print("\n" + table + "\n", flush=True)
    return table


def write_json(path: Path, data: dict[str, Any]) -> None:
    """The results, one row per line (samples rounded to the microsecond), so the file stays small."""
    rows = [dict(row, ours_samples=[round(x, 6) for x in row["ours_samples"]],
                 theirs_samples=[round(x, 6) for x in row["theirs_samples"]]) for row in data["rows"]]
    head = json.dumps({key: value for key, value in data.items() if key != "rows"}, indent=2)
    body = ",\n".join("    " + json.dumps(row) for row in rows)
    path.write_text(f'{head[:-2]},\n  "rows": [\n{body}\n  ]\n}}\n')


def machine_info(compared_with: str, torch_needed: bool = True) -> dict[str, Any]:
    cpu = platform.processor() or "unknown CPU"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()

    def version(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    torch_version = version("torch")
    if torch_needed:
        import torch

        torch_version = torch.__version__
    return dict(
        date=datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"), cpu=cpu, cores=cores,
        os=f"{platform.system()} {platform.release()}", python=platform.python_version(),
        torch=torch_version, accelerate=version("accelerate"), torch_xla=version("torch_xla"),
        xlaunch=version("xlaunch"), compared_with=compared_with, load_before=load_average(),
        load_after=None,
    )


def load_average() -> str:
    try:
        return "/".join(f"{value:.2f}" for value in os.getloadavg())
    except OSError:
        return "n/a"


# ----------------------------------------------------------------------------------------------
# Helpers


def free_port() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return str(probe.getsockname()[1])


def current_rank() -> int:
    """The rank of this worker: from its process group, else from the engine's RANK variable."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    return int(os.environ.get("RANK", "-1"))


def record_rank(out_dir: str) -> None:
    """The trivial function every launcher runs: leave a trace of this process, nothing more."""
    Path(out_dir, f"rank-{current_rank()}-pid-{os.getpid()}").touch()


def check_ranks(out_dir: str, expected: int) -> str | None:
    """None when ``expected`` distinct processes, ranks 0..expected-1, ran; otherwise what ran."""
    names = [name.split("-") for name in os.listdir(out_dir) if name.startswith("rank-")]
    ranks = sorted({int(parts[1]) for parts in names})
    pids = {parts[3] for parts in names}
    if ranks == list(range(expected)) and len(pids) == expected:
        return None
    return f"ran {len(pids)} process(es) with ranks {ranks} for num_processes={expected}"


class Hung(Exception):
    pass


@contextlib.contextmanager
def hang_guard(seconds: float = HANG_LIMIT_S) -> Iterator[None]:
    """Interrupt a launch that does not come back (the caller's main thread gets `Hung`)."""

    def expire(signum: int, frame: Any) -> None:
        raise Hung(f"no result after {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@contextlib.contextmanager
def quiet(log: Path) -> Iterator[None]:
    """Send everything the launchers and workers print (fd 1 and 2) to a log, not the console."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(log, "ab") as sink:
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def first_line(error: BaseException, limit: int = 160) -> str:
    """The telling line of an error's message: the last ``SomeError: ...`` line inside it (torch's
    reports are framed in rules and carry the worker's traceback), else its first line."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip().strip("=-")]
    raised = [line for line in lines if re.match(r"[\w.]*(Error|Exception|Interrupt)\b", line)]
    return (raised[-1] if raised else lines[0] if lines else "")[:limit]


def turns(items: list[Any], repetition: int) -> list[Any]:
    """The order for one repetition: everyone goes first in turn."""
    shift = repetition % len(items)
    return items[shift:] + items[:shift]


def least_squares_slope(points: list[tuple[float, float]]) -> float | None:
    if len({x for x, _ in points}) < 2:
        return None
    mean_x = statistics.fmean(x for x, _ in points)
    mean_y = statistics.fmean(y for _, y in points)
    return sum((x - mean_x) * (y - mean_y) for x, y in points) / sum((x - mean_x) ** 2 for x, _ in points)


# ----------------------------------------------------------------------------------------------
# The launchers, each called the way its users call it


def ours_notebook(function: Callable[..., Any], args: tuple[Any, ...], n: int) -> Any:
    import xlaunch

    return xlaunch.notebook_launcher(function, args=args, num_processes=n)


def ours_debug(function: Callable[..., Any], args: tuple[Any, ...], n: int) -> Any:
    import xlaunch

    return xlaunch.debug_launcher(function, args=args, num_processes=n)


def accelerate_notebook(function: Callable[..., Any], args: tuple[Any, ...], n: int) -> Any:
    from accelerate import notebook_launcher

    # Its default port is fixed (29500); a free one keeps it clear of other programs' launches.
    return notebook_launcher(function, args=args, num_processes=n, use_port=free_port())


def accelerate_debug(function: Callable[..., Any], args: tuple[Any, ...], n: int) -> Any:
    from accelerate import debug_launcher

    return debug_launcher(function, args=args, num_processes=n)


def with_partial_state(function: Callable[..., Any], *args: Any) -> Any:
    """What an accelerate user's function starts with: the state, which forms the process group."""
    from accelerate import PartialState

    PartialState(cpu=True)
    return function(*args)


def accelerate_notebook_with_state(function: Callable[..., Any], args: tuple[Any, ...], n: int) -> Any:
    return accelerate_notebook(with_partial_state, (function, *args), n)


def _floor_worker(index: int, n: int, store_dir: str, function: Callable[..., Any],
                  args: tuple[Any, ...]) -> None:
    import torch.distributed as dist

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # as xlaunch's workers meet
    store = dist.FileStore(os.path.join(store_dir, "store"), n)
    dist.init_process_group("gloo", store=store, rank=index, world_size=n)
    dist.barrier()
    function(*args)


def floor_start_processes(function: Callable[..., Any], args: tuple[Any, ...], n: int) -> Any:
    """The floor: torch's own process layer, forking workers that form the same FileStore gloo
    group and pass one barrier, with nothing else (no report, no tree, no records)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="xlaunch-bench-floor-") as store_dir:
        mp.start_processes(_floor_worker, args=(n, store_dir, function, args), nprocs=n,
                           start_method="fork")


LAUNCHERS: dict[str, Callable[..., Any]] = {
    "xlaunch.notebook_launcher": ours_notebook,
    "floor: torch.multiprocessing.start_processes + FileStore group + barrier": floor_start_processes,
    "xlaunch.debug_launcher": ours_debug,
    "accelerate.notebook_launcher": accelerate_notebook,
    "accelerate.notebook_launcher, fn makes PartialState(cpu=True)": accelerate_notebook_with_state,
    "accelerate.debug_launcher": accelerate_debug,
}
# (ours, theirs, goal on the ratio ours/theirs). Ours always forms the process group before the
# function starts; accelerate's notebook_launcher leaves that to the function (the second pair).
PAIRS = [
    ("xlaunch.notebook_launcher",
     "floor: torch.multiprocessing.start_processes + FileStore group + barrier", 1.2),
    ("xlaunch.notebook_launcher", "accelerate.notebook_launcher", None),
    ("xlaunch.notebook_launcher", "accelerate.notebook_launcher, fn makes PartialState(cpu=True)", None),
    ("xlaunch.debug_launcher", "accelerate.debug_launcher", None),
]


def timed_launch(name: str, function: Callable[..., Any], n: int,
                 log: Path) -> tuple[float | None, str | None]:
    """Seconds one launch of ``function(out_dir)`` took (None: it hung, and was interrupted), and
    what went wrong with its ranks if anything did."""
    with tempfile.TemporaryDirectory(prefix="xlaunch-bench-") as out_dir:
        with quiet(log):
            start = time.perf_counter()
            try:
                with hang_guard(LAUNCH_HANG_LIMIT_S):
                    LAUNCHERS[name](function, (out_dir,), n)
            except Hung as hung:
                return None, f"hung ({hung}; interrupted, then stopped by its own launcher)"
            except Exception as error:  # a launcher that fails is a result too
                return None, f"failed with {type(error).__name__}: {first_line(error)}"
            elapsed = time.perf_counter() - start
        return elapsed, check_ranks(out_dir, n)


# ----------------------------------------------------------------------------------------------
# Figure: launch of a trivial function, and its growth with the number of processes


def launch_figure(report: Report, sizes: tuple[int, ...], repeats: int, log: Path) -> None:
    print(f"\n# Launch of a trivial function on CPU: {', '.join(map(str, sizes))} processes", flush=True)
    names = list(LAUNCHERS)
    for name in names:  # warm-up, not counted: imports, first fork of a large parent
        timed_launch(name, record_rank, 2, log)
    samples: dict[tuple[str, int], list[float]] = {}
    broken: set[tuple[str, int]] = set()
    for n in sizes:
        for repetition in range(repeats):
            shown = []
            for name in turns(names, repetition):
                elapsed, problem = timed_launch(name, record_rank, n, log)
                if problem:
                    report.note(f"{name}, {n} processes, repetition {repetition + 1}: {problem}")
                    broken.add((name, n))
                samples.setdefault((name, n), [])
                if elapsed is not None:
                    samples[name, n].append(elapsed)
                shown.append(f"{name} {fmt(elapsed) if elapsed is not None else 'FAILED'}")
            print(f"  n={n} rep {repetition + 1}/{repeats}: " + ", ".join(shown), flush=True)
        rows = []
        for ours, theirs, goal in PAIRS:
            bad = [name for name in (ours, theirs) if (name, n) in broken]
            rows.append(Row(f"Launch, {n} processes", ours, theirs, samples[ours, n], samples[theirs, n],
                            goal=goal, note=f"{' and '.join(bad)}: see the notes below" if bad else ""))
        report.add(rows)
    if len(sizes) < 2:
        print("  (one size only: no slope)")
        return
    slopes: dict[str, list[float]] = {}
    for name in names:
        points = [(n, statistics.median(samples[name, n])) for n in sizes if samples[name, n]]
        slope = least_squares_slope(points)
        slopes[name] = [] if slope is None else [slope]
    size_text = ", ".join(map(str, sizes))
    report.add([
        Row(f"Launch growth per extra process ({size_text})", ours, theirs, slopes[ours], slopes[theirs],
            unit="s/proc",
            note="least-squares slope over the median launch time at each size")
        for ours, theirs, _ in PAIRS
    ])


# ----------------------------------------------------------------------------------------------
# Figure: a rank fails while the others wait in a barrier


def fail_ours() -> None:
    import xlaunch

    if xlaunch.ProcessState().process_index == 1:
        raise ValueError(FAILURE_TOKEN)
    xlaunch.wait_for_everyone()


def fail_accelerate() -> None:
    from accelerate import PartialState

    state = PartialState(cpu=True)
    if state.process_index == 1:
        raise ValueError(FAILURE_TOKEN)
    state.wait_for_everyone()


def fail_floor() -> None:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError(FAILURE_TOKEN)
    dist.barrier()


FAILING = {
    "floor: torch.multiprocessing.start_processes + FileStore group + barrier": fail_floor,
    "xlaunch.notebook_launcher": fail_ours,
    "xlaunch.debug_launcher": fail_ours,
    "accelerate.notebook_launcher": fail_accelerate,
    "accelerate.debug_launcher": fail_accelerate,
}


def timed_failure(name: str, log: Path) -> tuple[float, str]:
    """Seconds from the call to the exception in the caller, and whether it carries the message."""
    with quiet(log):
        start = time.perf_counter()
        try:
            with hang_guard():
                LAUNCHERS[name](FAILING[name], (), 2)
        except Hung:
            return time.perf_counter() - start, "hung"
        except BaseException as error:  # whatever the launcher raises is the result
            elapsed = time.perf_counter() - start
            if FAILURE_TOKEN in str(error):
                return elapsed, f"{type(error).__name__}, message in it"
            chain = "".join(traceback.format_exception(type(error), error, error.__traceback__))
            where = "only in a chained exception" if FAILURE_TOKEN in chain else "message missing"
            return elapsed, f"{type(error).__name__}, {where} (says: {first_line(error, 140)!r})"
        return time.perf_counter() - start, "no exception"


def tally(outcomes: Counter[str]) -> str:
    total = sum(outcomes.values())
    return "; ".join(f"{outcome} ({count}/{total})" for outcome, count in outcomes.most_common())


def failure_figure(report: Report, repeats: int, log: Path) -> None:
    print("\n# Failure: rank 1 raises while rank 0 waits in a barrier (2 processes)", flush=True)
    names = list(FAILING)
    samples: dict[str, list[float]] = {name: [] for name in names}
    outcomes: dict[str, Counter[str]] = {name: Counter() for name in names}
    for repetition in range(repeats):
        shown = []
        for name in turns(names, repetition):
            elapsed, outcome = timed_failure(name, log)
            samples[name].append(elapsed)
            outcomes[name][outcome] += 1
            shown.append(f"{name} {fmt(elapsed)}")
        print(f"  rep {repetition + 1}/{repeats}: " + ", ".join(shown), flush=True)
    report.add([  # the goal: within 1.2x the floor's own time to see the failure
        Row("Failure to exception", ours, theirs, samples[ours], samples[theirs], goal=goal,
            note=f"ours: {tally(outcomes[ours])} / theirs: {tally(outcomes[theirs])}")
        for ours, theirs, goal in PAIRS if theirs in FAILING
    ])


# ----------------------------------------------------------------------------------------------
# Figure: wait_for_everyone in a 2-process world


def barrier_latencies(out_file: str, calls: int) -> None:
    """In each worker: both barriers, alternating, timed one by one; rank 0 writes the samples."""
    from accelerate import PartialState

    import xlaunch

    state = PartialState(cpu=True)  # forms the group in accelerate's world, joins ours otherwise
    ours, theirs = xlaunch.wait_for_everyone, state.wait_for_everyone
    times: dict[str, list[float]] = {"ours": [], "theirs": []}
    for call in range(calls + 10):  # the first 10 of each are warm-up
        pair = [("ours", ours), ("theirs", theirs)]
        for side, barrier in (pair if call % 2 == 0 else pair[::-1]):
            start = time.perf_counter()
            barrier()
            if call >= 10:
                times[side].append(time.perf_counter() - start)
    if state.process_index == 0:
        Path(out_file).write_text(json.dumps(times))


def barrier_figure(report: Report, repeats: int, calls: int, log: Path) -> None:
    print(f"\n# wait_for_everyone in a 2-process CPU world ({calls} calls per launch)", flush=True)
    worlds = ["xlaunch.notebook_launcher", "accelerate.notebook_launcher"]
    samples: dict[str, dict[str, list[float]]] = {world: {"ours": [], "theirs": []} for world in worlds}
    for repetition in range(repeats):
        for world in turns(worlds, repetition):
            with tempfile.TemporaryDirectory(prefix="xlaunch-bench-") as out_dir:
                out_file = os.path.join(out_dir, "times.json")
                try:
                    with quiet(log), hang_guard():
                        LAUNCHERS[world](barrier_latencies, (out_file, calls), 2)
                except Hung as hung:
                    report.note(f"wait_for_everyone in the world of {world}: the launch hung ({hung})")
                    continue
                times = json.loads(Path(out_file).read_text())
            for side in ("ours", "theirs"):
                samples[world][side].extend(times[side])
            medians = {side: fmt(statistics.median(times[side])) for side in times}
            print(f"  rep {repetition + 1}/{repeats}, world of {world}: ours {medians['ours']}, "
                  f"theirs {medians['theirs']}", flush=True)
    report.add([
        Row(f"wait_for_everyone, 2 processes (world: {world.split('.')[0]})",
            "xlaunch.wait_for_everyone()", "PartialState(cpu=True).wait_for_everyone()",
            samples[world]["ours"], samples[world]["theirs"], goal=1.0,
            note=f"median of {len(samples[world]['ours'])} calls on rank 0, the two calls alternating")
        for world in worlds
    ])


# ----------------------------------------------------------------------------------------------
# Figure: cold start in a fresh interpreter


COLD = {
    "import xlaunch; xlaunch.detect()": "import xlaunch; xlaunch.detect()",
    "import accelerate": "import accelerate",
}


def timed_interpreter(statement: str) -> tuple[float, float]:
    """(seconds the statement took inside a fresh interpreter, wall seconds of that interpreter)."""
    code = (f"import time; start = time.perf_counter()\n{statement}\n"
            "print(time.perf_counter() - start)")
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    wall = time.perf_counter() - start
    return float(done.stdout.strip().splitlines()[-1]), wall


# ----------------------------------------------------------------------------------------------
# Figure: a large returned value, moved from the worker to the caller

VALUE_MB = 500


def _big_value() -> Any:
    import torch

    # One thread on both sides: a launch of 2 CPU processes gives each worker half the cores,
    # and filling the tensor must cost the same on both sides for the figure to time the move.
    torch.set_num_threads(1)
    return torch.ones(VALUE_MB * 2**20 // 4)  # float32: VALUE_MB MiB


def _big_value_on_rank_0() -> Any:
    """Only rank 0's value comes back; the other rank makes none (as the queue's one worker)."""
    import torch.distributed as dist

    return _big_value() if dist.get_rank() == 0 else None


def _value_by_queue(queue: Any, received: Any) -> None:
    queue.put(_big_value())
    received.wait()  # the tensor's memory is handed over from this process: it must stay alive


def _peak_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return 0


def _current_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def value_child(side: str) -> None:
    """In a fresh interpreter: one launch returning the value; seconds and peak memory added."""
    import torch
    import torch.multiprocessing as mp

    os.environ["XLAUNCH_ACCELERATOR"] = "cpu"
    import xlaunch  # imported before the clock, as a notebook has it

    before = _current_kib()
    start = time.perf_counter()
    if side == "ours":
        value = xlaunch.notebook_launcher(_big_value_on_rank_0, num_processes=2, report=False)
    else:  # a plain fork and queue: torch's reductions share the tensor's memory
        context = mp.get_context("fork")
        queue, received = context.SimpleQueue(), context.Event()
        worker = context.Process(target=_value_by_queue, args=(queue, received))
        worker.start()
        value = queue.get()
        received.set()
        worker.join()
    seconds = time.perf_counter() - start
    assert isinstance(value, torch.Tensor) and float(value[-1]) == 1.0
    float(value.sum())  # every page read, on both sides
    print(json.dumps({"seconds": seconds, "extra_mib": (_peak_kib() - before) / 1024}))


def value_figure(report: Report, repeats: int) -> None:
    print(f"\n# A {VALUE_MB} MiB tensor returned to the caller (fresh interpreters)", flush=True)
    samples: dict[str, list[float]] = {"ours": [], "queue": []}
    memory: dict[str, list[float]] = {"ours": [], "queue": []}
    for repetition in range(repeats):
        for side in turns(["ours", "queue"], repetition):
            done = subprocess.run([sys.executable, __file__, "--value-child", side],
                                  capture_output=True, text=True, timeout=600)
            if done.returncode != 0:
                report.note(f"value, {side}, repetition {repetition + 1}: {done.stderr[-300:]}")
                continue
            result = json.loads(done.stdout.strip().splitlines()[-1])
            samples[side].append(result["seconds"])
            memory[side].append(result["extra_mib"])
        print(f"  rep {repetition + 1}/{repeats}: ours {fmt(samples['ours'][-1:] and samples['ours'][-1])}"
              f", fork and queue {fmt(samples['queue'][-1:] and samples['queue'][-1])}", flush=True)
    peak = {side: f"{statistics.median(v):.0f} MiB" if v else "-" for side, v in memory.items()}
    report.add([Row(f"Returning a {VALUE_MB} MiB tensor, call to value", "xlaunch.notebook_launcher",
                    "a plain fork and queue (torch's shared-memory reduction)", samples["ours"],
                    samples["queue"], goal=1.2,
                    note=f"caller's peak memory above its start: ours {peak['ours']}, "
                         f"fork and queue {peak['queue']}")])


def cold_figure(report: Report, repeats: int) -> None:
    print("\n# Cold start in a fresh interpreter", flush=True)
    names = list(COLD)
    inside: dict[str, list[float]] = {name: [] for name in names}
    wall: dict[str, list[float]] = {name: [] for name in names}
    for repetition in range(repeats):
        shown = []
        for name in turns(names, repetition):
            took, whole = timed_interpreter(COLD[name])
            inside[name].append(took)
            wall[name].append(whole)
            shown.append(f"{name}: {fmt(took)} ({fmt(whole)} whole interpreter)")
        print(f"  rep {repetition + 1}/{repeats}: " + "; ".join(shown), flush=True)
    ours, theirs = names
    report.add([
        Row("Cold start (the statement)", ours, theirs, inside[ours], inside[theirs], goal=0.1,
            note="timed inside a fresh interpreter, around the statement"),
        Row("Cold start (whole interpreter)", ours, theirs, wall[ours], wall[theirs],
            note="python -c, start to exit, interpreter start-up included"),
    ])


# ----------------------------------------------------------------------------------------------
# XLA: our launch against calling xmp.spawn directly, each in a fresh interpreter


def xla_tensor(out_dir: str) -> None:
    import torch
    import torch_xla

    device = torch_xla.device() if hasattr(torch_xla, "device") else None
    if device is None:
        import torch_xla.core.xla_model as xm

        device = xm.xla_device()
    value = float((torch.ones(2, device=device) + 1).sum().cpu())
    Path(out_dir, f"ran-{os.getpid()}-{value:g}").touch()


def xla_tensor_indexed(index: int, out_dir: str) -> None:
    xla_tensor(out_dir)


XLA_SIDES = {  # side -> (what is launched, whether the caller imports torch_xla first)
    "ours": ("xlaunch.notebook_launcher", True),
    "ours-no-import": ("xlaunch.notebook_launcher, caller never imports torch_xla", False),
    "theirs": ('xmp.spawn(fn, start_method="fork")', True),
    "ours-spmd": ("xlaunch.notebook_launcher(spmd=True), 4 devices", True),
    "theirs-spmd": ("a forked process: use_spmd() + the function, 4 devices", True),
}
SPMD_DEVICES = "4"


def raw_spmd(folder: str) -> None:
    """The floor of an SPMD launch: fork, switch SPMD on, run the function, end."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            import torch_xla.runtime as xr

            xr.use_spmd()
            xla_tensor(folder)
            code = 0
        finally:
            os._exit(code)
    os.waitpid(pid, 0)


def xla_child(side: str, out_dir: str) -> None:
    """In a fresh interpreter: import, then time two launches; prints the seconds of each."""
    import torch  # noqa: F401 - imports are paid before the clock starts

    if XLA_SIDES[side][1]:
        import torch_xla.distributed.xla_multiprocessing as xmp  # does not start the runtime
    if side != "theirs":
        import xlaunch  # the user's import; what the call imports (the backend) is timed
    for launch in range(2):
        folder = os.path.join(out_dir, str(launch))
        os.mkdir(folder)
        start = time.perf_counter()
        if side == "theirs":
            xmp.spawn(xla_tensor_indexed, args=(folder,), start_method="fork")
        elif side == "theirs-spmd":
            raw_spmd(folder)
        else:
            xlaunch.notebook_launcher(xla_tensor, args=(folder,), spmd=side == "ours-spmd")
        print(f"elapsed {time.perf_counter() - start}", flush=True)


def xla_available() -> str | None:
    """None when the XLA figure can run; otherwise why not."""
    import importlib.util

    if importlib.util.find_spec("torch_xla") is None:
        return f"torch_xla is not installed for {sys.executable} (run this with the torch_xla venv's python)"
    if importlib.util.find_spec("xlaunch") is None:
        return f"xlaunch is not installed for {sys.executable}"
    if importlib.util.find_spec("xlaunch.backends.xla") is None:
        return "xlaunch's XLA backend (src/xlaunch/backends/xla/) is not there yet"
    return None


def xla_figure(report: Report, repeats: int) -> None:
    print("\n# XLA (PJRT_DEVICE=CPU, CPU_NUM_DEVICES=1): one XLA tensor, two launches in each fresh "
          "interpreter", flush=True)
    sides = list(XLA_SIDES)
    first: dict[str, list[float]] = {side: [] for side in sides}
    second: dict[str, list[float]] = {side: [] for side in sides}
    for repetition in range(repeats):
        shown = []
        for side in turns(sides, repetition):
            env = {**os.environ, **XLA_ENV}
            if side.endswith("spmd"):
                env["CPU_NUM_DEVICES"] = SPMD_DEVICES
            with tempfile.TemporaryDirectory(prefix="xlaunch-bench-") as out_dir:
                done = subprocess.run(
                    [sys.executable, os.path.abspath(__file__), "--xla-child", side, out_dir],
                    capture_output=True, text=True, env=env, timeout=HANG_LIMIT_S,
                )
                ran = [len([name for name in os.listdir(os.path.join(out_dir, str(launch)))
                            if name.startswith("ran-")]) if os.path.isdir(os.path.join(out_dir, str(launch)))
                       else 0 for launch in range(2)]
            elapsed = [float(line.split()[1]) for line in done.stdout.splitlines()
                       if line.startswith("elapsed ")]
            if done.returncode != 0 or len(elapsed) != 2 or ran != [1, 1]:
                tail = (done.stdout + done.stderr).strip().splitlines()[-5:]
                report.note(f"{XLA_SIDES[side][0]} failed (exit {done.returncode}, replicas that ran: "
                            f"{ran}): " + " | ".join(tail))
                continue
            first[side].append(elapsed[0])
            second[side].append(elapsed[1])
            shown.append(f"{side} {fmt(elapsed[0])} then {fmt(elapsed[1])}")
        print(f"  rep {repetition + 1}/{repeats}: " + "; ".join(shown), flush=True)
    ours, no_import, theirs, spmd, raw = (XLA_SIDES[side][0] for side in sides)
    report.add([
        Row("XLA launch, one tensor (first in the interpreter)", ours, theirs, first["ours"],
            first["theirs"], goal=1.1, note="torch and torch_xla imported by the caller before the clock"),
        Row("XLA launch, one tensor (second in the interpreter)", ours, theirs, second["ours"],
            second["theirs"], goal=1.1),
        Row("SPMD launch, one tensor (second in the interpreter)", spmd, raw, second["ours-spmd"],
            second["theirs-spmd"], goal=1.2, note="4 XLA CPU devices"),
        Row("XLA launch, second, torch_xla not imported by the caller", no_import, theirs,
            second["ours-no-import"], second["theirs"], goal=1.1,
            note="ours with only torch imported in the caller (the first launch imports torch_xla "
                 "once); theirs as above (xmp.spawn needs the import)"),
    ])


# ----------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=None,
                        help="repetitions of each figure (default 7; 2 with --quick)")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: 2 processes only, few repetitions, fewer barrier calls")
    parser.add_argument("--json", metavar="PATH", help="also write every sample and the machine here")
    parser.add_argument("--xla", action="store_true",
                        help="the XLA figure instead of the CPU ones (run with the torch_xla venv's python)")
    parser.add_argument("--only", metavar="FIGURES", default="launch,failure,barrier,value,cold",
                        help="comma-separated CPU figures to run: launch, failure, barrier, cold")
    parser.add_argument("--barrier-calls", type=int, default=None,
                        help="wait_for_everyone calls per launch (default 300; 50 with --quick)")
    parser.add_argument("--xla-child", nargs=2, metavar=("SIDE", "DIR"), help=argparse.SUPPRESS)
    parser.add_argument("--value-child", metavar="SIDE", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.repeats is None:
        args.repeats = 2 if args.quick else 7
    if args.barrier_calls is None:
        args.barrier_calls = 50 if args.quick else 300
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.xla_child:
        xla_child(*args.xla_child)
        return 0
    if args.value_child:
        value_child(args.value_child)
        return 0
    command = "python bench/compare.py " + " ".join(sys.argv[1:] if argv is None else argv)
    options = dict(repeats=args.repeats, quick=args.quick, xla=args.xla, command=command.strip())
    if args.xla:
        missing = xla_available()
        if missing:
            print(f"SKIPPED the XLA figure: {missing}.")
            return 0
        report = Report(machine_info('xmp.spawn (torch_xla)', torch_needed=False), options)
        xla_figure(report, args.repeats)
    else:
        os.environ["XLAUNCH_ACCELERATOR"] = "cpu"
        try:
            import accelerate  # noqa: F401
        except ImportError:
            print(f"accelerate is not installed for {sys.executable}: use the dev venv "
                  "(pip install -e .[dev])")
            return 2
        report = Report(machine_info("accelerate"), options)
        figures = {name.strip() for name in args.only.split(",")}
        sizes = (2,) if args.quick else SIZES
        with tempfile.TemporaryDirectory(prefix="xlaunch-bench-log-") as log_dir:
            log = Path(log_dir, "launchers.log")
            try:
                if "launch" in figures:
                    launch_figure(report, sizes, args.repeats, log)
                if "failure" in figures:
                    failure_figure(report, args.repeats, log)
                if "barrier" in figures:
                    barrier_figure(report, max(1, min(args.repeats, 3)), args.barrier_calls, log)
            except Exception:
                print("A launch went wrong; the launchers' own output ends with:", file=sys.stderr)
                print("\n".join(log.read_text(errors="replace").splitlines()[-40:]), file=sys.stderr)
                raise
        if "value" in figures:
            value_figure(report, max(1, min(args.repeats, 5)))
        if "cold" in figures:
            cold_figure(report, max(args.repeats, 5))
    report.machine["load_after"] = load_average()
    table = print_table(report)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        data = dict(machine=report.machine, options=options, notes=report.notes, table=table,
                    rows=[dict(asdict(row), ours_median=row.ours_median, theirs_median=row.theirs_median,
                               ratio=row.ratio, met=row.met.strip("*")) for row in report.rows])
        write_json(Path(args.json), data)
        print(f"results written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
