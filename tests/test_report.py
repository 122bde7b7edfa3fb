"""The launch report on the CPU paths: each rank's wall time and peak memory, kept and shown.

The XLA figures (compilations, CPU fallbacks) are tested for real in tests/xla; the warnings are
pure functions of the figures and are tested here as data.
"""

from __future__ import annotations

import pytest

import xlaunch
from xlaunch import LaunchError, LaunchReport, RankReport, last_report, notebook_launcher
from xlaunch.result.report import make_report, warnings_for

MIB = 2**20


@pytest.fixture(autouse=True)
def cpu_only(monkeypatch):
    monkeypatch.setenv("XLAUNCH_ACCELERATOR", "cpu")


def hold_memory(mib: int) -> int:
    block = bytearray(mib * MIB)
    block[::4096] = b"x" * len(block[::4096])  # touch every page, so it is resident
    return xlaunch.ProcessState().process_index


def test_each_rank_reports_its_peak_memory_and_wall_time():
    assert notebook_launcher(hold_memory, args=(300,), num_processes=2) == 0
    report = last_report()
    assert isinstance(report, LaunchReport) and report.path == "elastic"
    assert [rank.rank for rank in report.ranks] == [0, 1]
    for rank in report.ranks:
        assert rank.peak_rss_bytes >= 300 * MIB
        assert 0 < rank.wall_seconds <= report.wall_seconds
        assert rank.compiles is None and rank.cpu_fallbacks == {}
    assert "rank 1:" in str(report) and "peak memory" in str(report)


def test_the_inline_path_reports_the_one_process():
    notebook_launcher(hold_memory, args=(50,))
    report = last_report()
    assert report.path == "inline" and [rank.rank for rank in report.ranks] == [0]
    assert report.ranks[0].peak_rss_bytes >= 50 * MIB


def fail_on_rank_one():
    if xlaunch.ProcessState().process_index == 1:
        raise ValueError("rank 1 failed")
    xlaunch.wait_for_everyone()


def test_a_failed_launch_carries_the_report_of_the_workers_that_ran():
    with pytest.raises(LaunchError) as caught:
        notebook_launcher(fail_on_rank_one, num_processes=2)
    report = caught.value.report
    assert report is last_report() and 1 in [rank.rank for rank in report.ranks]


def launch_on_a_small_machine(report: bool) -> None:
    """A machine whose memory (10 MiB) every rank passes: the memory warning always fires."""
    from xlaunch.api import run_plan
    from xlaunch.detect import Machine, detect
    from xlaunch.plan import LaunchOptions, make_plan

    small = Machine(cores=2, memory_available=None, memory_total=10 * MIB)
    plan = make_plan(detect(), LaunchOptions(num_processes=2, report=report), machine=small)
    run_plan(plan, hold_memory, (1,))


def test_report_true_prints_the_warnings_and_false_prints_nothing(capfd):
    launch_on_a_small_machine(report=True)
    assert "xlaunch: warning: host memory: rank 0 peaked at" in capfd.readouterr().err
    launch_on_a_small_machine(report=False)
    assert "warning" not in capfd.readouterr().err
    report = last_report()  # kept all the same
    assert report.path == "elastic" and any(w.startswith("host memory") for w in report.warnings)


def test_warnings_name_what_to_do():
    steady = RankReport(0, 1.0, 100 * MIB, compiles=3, compile_seconds=0.5, executions=40,
                        transfers_to_device=2, transfers_from_device=1, steps=20)
    changing = RankReport(1, 1.0, 900 * MIB, compiles=16, compile_seconds=4.0, executions=16,
                          transfers_to_device=8, transfers_from_device=8, steps=8, late_compiles=8,
                          cpu_fallbacks={"aten::histc": 8},
                          compile_sources=(("train.py:12", 7), ("train.py:30", 1)))
    assert warnings_for([steady], memory_total=2**40) == []
    long_run = RankReport(2, 9.0, MIB, compiles=6, steps=1000)  # a few graphs, then reused
    assert warnings_for([long_run], memory_total=None) == []
    warnings = warnings_for([steady, changing], memory_total=1000 * MIB)
    assert any(w.startswith("recompilation: rank 1 compiled 16 graphs in 8 steps, 8 of them in "
                            "its later half") for w in warnings)
    assert any("train.py:12 (7x)" in w for w in warnings)
    assert any("aten::histc (8 time(s))" in w for w in warnings)
    assert any(w.startswith("host memory: rank 1 peaked at 900 MiB") for w in warnings)
    report = make_report("xla", 2.0, [changing, steady], memory_total=1000 * MIB)
    assert [rank.rank for rank in report.ranks] == [0, 1]
    assert str(report).count("warning:") == len(report.warnings) == 4


def test_the_rank_record_round_trips():
    rank = RankReport(3, 1.5, 7, compiles=2, cpu_fallbacks={"aten::median": 1},
                      compile_sources=(("a.py:1", 2),))
    assert RankReport.from_json(rank.to_json()) == rank
