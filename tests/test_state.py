"""ProcessState in real gloo worlds on the CPU: which ranks ran what, and in what order.

Workers are forked (the default start method; processes of torch.multiprocessing's context,
started by the launch's owner) and join a process group through a FileStore, so no network is
needed. Order is read from one append-only event log: each line is a single
``O_APPEND`` write, so line order is the order in which the ranks wrote them. The sleeps below only
give a broken barrier the chance to show; nothing asserts on durations.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import redirect_stdout
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing

import xlaunch
from xlaunch.state import ProcessState

WORLD_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "XLAUNCH_WORLD", "XLAUNCH_MIXED_PRECISION")
# local ranks per world size; with 3 processes, ranks 0-1 and rank 2 stand for two machines
LOCAL_RANKS = {2: [0, 1], 3: [0, 1, 0]}


class EventLog:
    def __init__(self, path: Path) -> None:
        self.path = path

    def __call__(self, rank: int, event: str) -> None:
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        try:
            os.write(fd, f"{rank} {event}\n".encode())
        finally:
            os.close(fd)

    def read(self) -> list[tuple[int, str]]:
        lines = self.path.read_text().splitlines() if self.path.exists() else []
        return [(int(rank), event) for rank, event in (line.split(" ", 1) for line in lines)]

    def ranks_that(self, event: str) -> list[int]:
        return sorted(rank for rank, seen in self.read() if seen == event)


def _enter_world(rank: int, size: int, store: str, local_ranks: list[int],
                 target: Callable[[int], None]) -> None:
    for name in WORLD_ENV:
        os.environ.pop(name, None)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    os.environ["LOCAL_RANK"] = str(local_ranks[rank])
    dist.init_process_group("gloo", store=dist.FileStore(store, size), rank=rank,
                            world_size=size, timeout=timedelta(seconds=60))
    try:
        target(rank)
    finally:
        dist.destroy_process_group()


def run_world(target: Callable[[int], None], size: int, folder: Path,
              local_ranks: list[int] | None = None, timeout: float = 120) -> None:
    """Run ``target(rank)`` in ``size`` forked processes of one gloo group; raise what failed."""
    context = torch.multiprocessing.start_processes(
        _enter_world, args=(size, str(folder / "store"), local_ranks or list(range(size)), target),
        nprocs=size, join=False, start_method="fork")
    deadline = time.monotonic() + timeout
    try:
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                raise TimeoutError(f"world of {size} processes still running after {timeout} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
            process.join(5)


def _properties(state: ProcessState) -> dict[str, Any]:
    return dict(
        process_index=state.process_index, local_process_index=state.local_process_index,
        num_processes=state.num_processes, is_main_process=state.is_main_process,
        is_local_main_process=state.is_local_main_process, is_last_process=state.is_last_process,
        backend=state.backend, device=str(state.device), mixed_precision=state.mixed_precision)


def _autocast_report(state: ProcessState) -> dict[str, Any]:
    report = {}
    for precision in ("bf16", "fp16", "no"):
        os.environ["XLAUNCH_MIXED_PRECISION"] = precision.upper()
        with state.autocast():
            product = torch.ones(2, 2) @ torch.ones(2, 2)
            report[precision] = [torch.is_autocast_enabled("cpu"), str(product.dtype)]
    del os.environ["XLAUNCH_MIXED_PRECISION"]
    return report


def _as_plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, dict):
        return {key: _as_plain(item) for key, item in value.items()}
    return list(value)


def _split_inputs(length: int) -> dict[str, Any]:
    return {
        "list": list(range(length)),
        "tuple": tuple(f"item{i}" for i in range(length)),
        "tensor": torch.arange(length * 2).reshape(length, 2),
        "dict": {"ids": list(range(length)), "rows": torch.arange(length) * 10},
    }


def _split_report(state: ProcessState) -> dict[str, Any]:
    """kind/length/padding -> this rank's share, as plain lists, and its Python type."""
    report = {}
    for length in (5, 6, 7):
        for kind, inputs in _split_inputs(length).items():
            for padding in (False, True):
                with state.split_between_processes(inputs, apply_padding=padding) as share:
                    report[f"{kind}/{length}/{padding}"] = [type(share).__name__, _as_plain(share)]
    return report


@pytest.fixture(scope="module", params=[2, 3], ids=["2-processes", "3-processes"])
def world(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One world runs every helper; the tests below each read what it left behind."""
    size = request.param
    folder = tmp_path_factory.mktemp(f"world{size}")
    log = EventLog(folder / "events.log")

    # Made and decorated in the parent before the world exists, as a notebook would.
    made_in_parent = ProcessState()
    parent_view = _properties(made_in_parent)

    @made_in_parent.on_main_process
    def early_main(rank: int) -> str:
        log(rank, "early on_main_process")
        return "ran"

    @xlaunch.on_last_process
    def early_last(rank: int) -> None:
        log(rank, "early on_last_process")

    @xlaunch.on_process(process_index=1)
    def early_process_1(rank: int) -> None:
        log(rank, "early on_process(1)")

    @made_in_parent.on_local_process(local_process_idx=0)
    def early_local_0(rank: int) -> None:
        log(rank, "early on_local_process(idx=0)")

    def scenario(rank: int) -> None:
        state = ProcessState()
        record: dict[str, Any] = {"fresh": _properties(state),
                                  "captured": _properties(made_in_parent)}

        if state.is_last_process:
            time.sleep(0.3)
        log(rank, "before barrier")
        state.wait_for_everyone()
        log(rank, "after barrier")

        for name, block in [("main first", state.main_process_first),
                            ("local main first", state.local_main_process_first),
                            ("module main first", xlaunch.main_process_first)]:
            leading = state.is_local_main_process if name == "local main first" \
                else state.is_main_process
            with block():
                log(rank, f"{name} start")
                if leading:
                    time.sleep(0.3)
                log(rank, f"{name} end")
            xlaunch.wait_for_everyone()

        decorated = {
            "on_main_process": state.on_main_process,
            "on_local_main_process": state.on_local_main_process,
            "on_last_process": state.on_last_process,
            "on_process()": state.on_process(),
            "on_process": state.on_process,
            "on_process(1)": state.on_process(process_index=1),
            "on_local_process(idx=0)": state.on_local_process(local_process_idx=0),
            "on_local_process(index=1)": state.on_local_process(local_process_index=1),
            "module on_main_process": xlaunch.on_main_process,
            "module on_local_main_process": xlaunch.on_local_main_process,
            "module on_local_process(1)": xlaunch.on_local_process(local_process_index=1),
        }
        for name, decorator in decorated.items():
            decorator(lambda name=name: log(rank, name))()
        record["early_main_returned"] = early_main(rank)
        early_last(rank)
        early_process_1(rank)
        early_local_0(rank)

        record["split"] = _split_report(state)
        with redirect_stdout(io.StringIO()) as printed:
            state.print("hello from", rank, sep="-")
        record["printed"] = printed.getvalue()
        record["autocast"] = _autocast_report(state)
        (folder / f"record-{rank}.json").write_text(json.dumps(record))

    run_world(scenario, size, folder, LOCAL_RANKS[size])
    records = [json.loads((folder / f"record-{rank}.json").read_text()) for rank in range(size)]
    return dict(size=size, log=log, records=records, parent_view=parent_view)


def test_properties_in_each_rank(world: dict[str, Any]) -> None:
    size, local_ranks = world["size"], LOCAL_RANKS[world["size"]]
    for rank, record in enumerate(world["records"]):
        expected = dict(
            process_index=rank, local_process_index=local_ranks[rank], num_processes=size,
            is_main_process=rank == 0, is_local_main_process=local_ranks[rank] == 0,
            is_last_process=rank == size - 1, backend="gloo", device="cpu", mixed_precision="no")
        assert record["fresh"] == expected
        # the state made in the parent reports each worker's own rank once inside the world
        assert record["captured"] == expected


def test_state_made_before_the_world_reports_one_process_there(world: dict[str, Any]) -> None:
    view = world["parent_view"]
    assert (view["process_index"], view["num_processes"], view["backend"]) == (0, 1, None)
    assert view["is_main_process"] and view["is_last_process"]


def test_wait_for_everyone_holds_every_rank_until_all_arrive(world: dict[str, Any]) -> None:
    events = [event for _, event in world["log"].read() if event.endswith("barrier")]
    arrivals = events.index("after barrier")
    assert events[:arrivals] == ["before barrier"] * world["size"]
    assert events[arrivals:] == ["after barrier"] * world["size"]


@pytest.mark.parametrize("block", ["main first", "module main first"])
def test_main_process_first_runs_the_main_block_before_any_other(
        world: dict[str, Any], block: str) -> None:
    lines = [(rank, event) for rank, event in world["log"].read() if event.startswith(block + " ")]
    assert lines[:2] == [(0, f"{block} start"), (0, f"{block} end")]
    assert sorted(rank for rank, _ in lines[2:]) == sorted(2 * list(range(1, world["size"])))


def test_local_main_process_first_lets_each_machine_leader_go_first(
        world: dict[str, Any]) -> None:
    local_ranks = LOCAL_RANKS[world["size"]]
    lines = [(rank, event) for rank, event in world["log"].read()
             if event.startswith("local main first ")]
    leaders = {rank for rank, local in enumerate(local_ranks) if local == 0}
    last_leader_end = max(i for i, (rank, event) in enumerate(lines)
                          if rank in leaders and event.endswith("end"))
    first_follower_start = min(i for i, (rank, _) in enumerate(lines) if rank not in leaders)
    assert last_leader_end < first_follower_start
    assert {rank for rank, _ in lines} == set(range(world["size"]))


def test_decorators_run_only_where_they_should(world: dict[str, Any]) -> None:
    size, log = world["size"], world["log"]
    local_ranks = LOCAL_RANKS[size]
    local_mains = [rank for rank, local in enumerate(local_ranks) if local == 0]
    local_ones = [rank for rank, local in enumerate(local_ranks) if local == 1]
    expected = {
        "on_main_process": [0], "on_local_main_process": local_mains,
        "on_last_process": [size - 1], "on_process()": [0], "on_process": [0],
        "on_process(1)": [1], "on_local_process(idx=0)": local_mains,
        "on_local_process(index=1)": local_ones, "module on_main_process": [0],
        "module on_local_main_process": local_mains, "module on_local_process(1)": local_ones,
        "early on_main_process": [0], "early on_last_process": [size - 1],
        "early on_process(1)": [1], "early on_local_process(idx=0)": local_mains,
    }
    assert {name: log.ranks_that(name) for name in expected} == expected
    returned = [record["early_main_returned"] for record in world["records"]]
    assert returned == ["ran"] + [None] * (size - 1)


def test_split_between_processes_gives_contiguous_balanced_shares(world: dict[str, Any]) -> None:
    size, records = world["size"], world["records"]
    for length in (5, 6, 7):
        for kind, inputs in _split_inputs(length).items():
            whole = _as_plain(inputs)
            shares = [record["split"][f"{kind}/{length}/False"] for record in records]
            padded = [record["split"][f"{kind}/{length}/True"] for record in records]
            python_type = type(inputs).__name__
            assert {name for name, _ in shares + padded} == {python_type}
            shares = [share for _, share in shares]
            padded = [share for _, share in padded]
            if kind == "dict":
                keyed = {key: [share[key] for share in shares] for key in whole}
                padded_keyed = {key: [share[key] for share in padded] for key in whole}
            else:
                keyed, padded_keyed = {"": shares}, {"": padded}
                whole = {"": whole}
            for key, parts in keyed.items():
                assert sum(parts, []) == whole[key], (kind, length, key)
                assert max(map(len, parts)) - min(map(len, parts)) <= 1
                longest = -(-length // size)
                for part, padded_part in zip(parts, padded_keyed[key], strict=True):
                    assert len(padded_part) == longest
                    assert padded_part[:len(part)] == part
                    assert padded_part[len(part):] == [part[-1]] * (longest - len(part))


def test_print_only_on_the_main_process(world: dict[str, Any]) -> None:
    printed = [record["printed"] for record in world["records"]]
    assert printed == ["hello from-0\n"] + [""] * (world["size"] - 1)


def test_autocast_applies_the_mixed_precision_on_cpu(world: dict[str, Any]) -> None:
    for record in world["records"]:
        assert record["autocast"] == {
            "bf16": [True, "torch.bfloat16"],
            "fp16": [True, "torch.float16"],
            "no": [False, "torch.float32"],
        }


def test_seed_tutorial_examples_as_written(tmp_path: Path) -> None:
    """The Portuguese tutorial's snippets with ``accelerator`` replaced by a ProcessState."""
    from tqdm.auto import tqdm

    log = EventLog(tmp_path / "events.log")
    state = ProcessState()

    class args:  # stands in for the tutorial's argparse namespace
        max_train_steps = 3

    class repo:  # stands in for the tutorial's Hub repository
        @staticmethod
        def push_to_hub() -> None:
            log(state.process_index, "push_to_hub")

    def do_thing_once_per_server() -> None:
        log(state.process_index, "once per server")

    def do_thing_once() -> None:
        log(state.process_index, "once")

    def do_thing_on_index_zero() -> None:
        log(state.process_index, "on index zero")

    def do_thing_on_index_zero_on_each_server() -> None:
        log(state.process_index, "on local index zero")

    def tutorial(rank: int) -> None:
        bar_output = io.StringIO()
        progress_bar = tqdm(range(args.max_train_steps), disable=not state.is_local_main_process,
                            file=bar_output)
        for _ in progress_bar:
            pass
        progress_bar.close()
        if bar_output.getvalue():
            log(rank, "progress bar")

        with redirect_stdout(io.StringIO()) as printed:
            if state.is_local_main_process:
                print("Accelerate is the best")
        if printed.getvalue() == "Accelerate is the best\n":
            log(rank, "printed")

        @state.on_local_main_process
        def do_my_thing() -> None:
            "Something done once per server"
            do_thing_once_per_server()

        do_my_thing()

        if state.is_main_process:
            repo.push_to_hub()

        @state.on_main_process  # type: ignore[no-redef]
        def do_my_thing() -> None:
            "Something done once per server"
            do_thing_once()

        do_my_thing()

        @state.on_process(process_index=0)  # type: ignore[no-redef]
        def do_my_thing() -> None:
            "Something done on process index 0"
            do_thing_on_index_zero()

        do_my_thing()

        @state.on_local_process(local_process_idx=0)  # type: ignore[no-redef]
        def do_my_thing() -> None:
            "Something done on process index 0 on each server"
            do_thing_on_index_zero_on_each_server()

        do_my_thing()

        state.wait_for_everyone()
        log(rank, "past wait_for_everyone")

    run_world(tutorial, 3, tmp_path, LOCAL_RANKS[3])
    local_mains = [0, 2]
    assert {event: log.ranks_that(event) for event in (
        "progress bar", "printed", "once per server", "push_to_hub", "once", "on index zero",
        "on local index zero", "past wait_for_everyone")} == {
        "progress bar": local_mains, "printed": local_mains, "once per server": local_mains,
        "push_to_hub": [0], "once": [0], "on index zero": [0],
        "on local index zero": local_mains, "past wait_for_everyone": [0, 1, 2],
    }


@pytest.fixture
def no_launch(monkeypatch: pytest.MonkeyPatch) -> ProcessState:
    for name in WORLD_ENV:
        monkeypatch.delenv(name, raising=False)
    assert not dist.is_initialized(), "an earlier test left a process group in this process"
    return ProcessState()


def test_without_a_launch_everything_runs_in_one_process(
        no_launch: ProcessState, capsys: pytest.CaptureFixture[str]) -> None:
    state = no_launch
    device = "cuda" if torch.cuda.is_available() else "cpu"
    assert _properties(state) == dict(
        process_index=0, local_process_index=0, num_processes=1, is_main_process=True,
        is_local_main_process=True, is_last_process=True, backend=None, device=device,
        mixed_precision="no")
    state.wait_for_everyone()
    xlaunch.wait_for_everyone()
    ran: list[Any] = []
    with state.main_process_first(), state.local_main_process_first():
        ran.append("block")
    for decorator in (state.on_main_process, state.on_local_main_process, state.on_last_process,
                      state.on_process(), state.on_local_process(local_process_idx=0),
                      xlaunch.on_process(process_index=0), xlaunch.on_last_process):
        ran.append(decorator(lambda: "decorated")())
    ran.append(state.on_process(process_index=1)(lambda: "decorated")())
    assert ran == ["block"] + ["decorated"] * 7 + [None]
    with state.split_between_processes([1, 2, 3], apply_padding=True) as share:
        assert share == [1, 2, 3]
    state.print("only one process")
    assert capsys.readouterr().out == "only one process\n"


def test_autocast_in_one_process(no_launch: ProcessState,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    assert _autocast_report(no_launch)["bf16"] == [True, "torch.bfloat16"]
    monkeypatch.setenv("XLAUNCH_MIXED_PRECISION", "fp8")
    with pytest.raises(ValueError, match="fp8"):
        no_launch.autocast()


def test_a_script_under_torchrun_without_a_group(no_launch: ProcessState,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(name, value)
    state = no_launch
    assert (state.process_index, state.num_processes, state.local_process_index) == (2, 4, 0)
    assert (state.is_main_process, state.is_local_main_process, state.backend) == (
        False, True, None)
    assert state.on_main_process(lambda: "ran")() is None
    with pytest.raises(RuntimeError, match="init_process_group"):
        state.wait_for_everyone()


def test_misuse_is_a_clear_error(no_launch: ProcessState) -> None:
    with pytest.raises(TypeError, match="process_index="):
        no_launch.on_process(1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="not two different values"):
        no_launch.on_local_process(local_process_index=1, local_process_idx=2)
    with pytest.raises(ValueError, match="equal lengths"):
        with no_launch.split_between_processes({"a": [1, 2], "b": [1]}):
            pass
    with pytest.raises(TypeError, match="set"):
        with no_launch.split_between_processes({1, 2, 3}):
            pass


def test_importing_and_asking_the_state_does_not_import_torch() -> None:
    code = (
        "import sys, xlaunch, xlaunch.state\n"
        "state = xlaunch.ProcessState()\n"
        "answers = (state.process_index, state.num_processes, state.is_main_process,\n"
        "           state.backend, state.mixed_precision)\n"
        "xlaunch.wait_for_everyone()\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "print(answers)\n"
    )
    env = {key: value for key, value in os.environ.items() if key not in WORLD_ENV}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "(0, 1, True, None, 'no')"


# --- the device follows the launch's accelerator --------------------------------------------------


def device_and_bf16_matmul() -> tuple[str, str]:
    """The state's device and what its autocast computes, on a machine whose torch sees a GPU.

    No GPU exists here: torch's answer is made the fake machine's for this call only (in a worker,
    or restored in the caller), the one thing the fake machine cannot be for torch.
    """
    available = torch.cuda.is_available
    torch.cuda.is_available = lambda: True  # type: ignore[assignment]
    try:
        state = ProcessState()
        with state.autocast():
            product = torch.ones(2, 2) @ torch.ones(2, 2)
        return str(state.device), str(product.dtype)
    finally:
        torch.cuda.is_available = available  # type: ignore[assignment]


@pytest.mark.parametrize("processes", [1, 2])
@pytest.mark.parametrize("how", ["XLAUNCH_ACCELERATOR=cpu", "debug_launcher"])
def test_a_cpu_launch_on_a_gpu_machine_is_on_the_cpu(tmp_path: Path, processes: int,
                                                     how: str) -> None:
    """A GPU present, a CPU launch: its processes (one, in the caller, included) are on the CPU,
    and bf16 autocast computes in bfloat16 there, not in float32 under a CUDA autocast."""
    from tests.fakes import fake_machine
    from xlaunch.api import run_plan
    from xlaunch.detect import Machine, detect
    from xlaunch.plan import LaunchOptions, make_plan

    gpu_box = fake_machine(tmp_path, gpus=1)
    forced = how == "XLAUNCH_ACCELERATOR=cpu"
    env = detect({"XLAUNCH_ACCELERATOR": "cpu"} if forced else {}, root=gpu_box)
    assert env.accelerator == ("cpu" if forced else "cuda")
    options = LaunchOptions(num_processes=processes, mixed_precision="bf16", cpu_only=not forced)
    plan = make_plan(env, options, Machine.here(), os.environ)
    assert plan.accelerator == "cpu"
    assert run_plan(plan, device_and_bf16_matmul, ()) == ("cpu", "torch.bfloat16")
