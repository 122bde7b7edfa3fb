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
    printed = capfd.readouterr().err
    assert "xlaunch report: elastic launch, 2 rank(s) reported" in printed  # what it is about
    assert "\nwarning: host memory: rank 0 peaked at" in printed
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


# When a launch shows its report: (path, has a warning, has torch.compile counters, no rank
# reported) -> shown. Always on the TPU paths; elsewhere only with a warning or torch.compile
# counters; never when no rank reported (an empty table says nothing).
SHOWN = [
    # path        warning compile empty  shown
    ("xla",       False,  False,  False, True),
    ("xla",       True,   False,  False, True),
    ("xla",       False,  True,   False, True),
    ("xla",       True,   True,   False, True),
    ("xla",       False,  False,  True,  False),
    ("xla",       True,   False,  True,  False),
    ("torch_tpu", False,  False,  False, True),
    ("torch_tpu", True,   False,  False, True),
    ("torch_tpu", False,  True,   False, True),
    ("torch_tpu", False,  False,  True,  False),
    ("elastic",   False,  False,  False, False),
    ("elastic",   True,   False,  False, True),
    ("elastic",   False,  True,   False, True),
    ("elastic",   True,   True,   False, True),
    ("elastic",   False,  False,  True,  False),
    ("elastic",   True,   False,  True,  False),
    ("inline",    False,  False,  False, False),
    ("inline",    True,   False,  False, True),
    ("inline",    False,  True,   False, True),
    ("inline",    False,  False,  True,  False),
]


def a_report(path, warning: bool, compile_counters: bool, empty: bool) -> LaunchReport:
    counters = dict(dynamo_graphs=1, dynamo_graph_breaks=0, dynamo_recompiles=0) if compile_counters else {}
    ranks = () if empty else tuple(RankReport(rank, 1.0, 100 * MIB, **counters) for rank in (0, 1))
    warnings = ("host memory: rank 0 peaked at ...",) if warning else ()
    return LaunchReport(path, 2.0, ranks, warnings, memory_total=8 * 2**30)


@pytest.mark.parametrize("path, warning, compile_counters, empty, shown", SHOWN)
def test_when_the_report_is_shown(path, warning, compile_counters, empty, shown):
    from xlaunch.result.report import report_shown

    assert report_shown(a_report(path, warning, compile_counters, empty)) is shown


@pytest.mark.parametrize("in_notebook", [True, False], ids=["notebook", "terminal"])
@pytest.mark.parametrize("path, warning, compile_counters, empty, shown", SHOWN)
def test_a_launch_shows_the_report_by_that_rule_as_a_table_or_as_text(
        monkeypatch, capsys, in_notebook, path, warning, compile_counters, empty, shown):
    from xlaunch import api
    from xlaunch.plan import LaunchOptions, make_plan

    displayed: list[object] = []
    monkeypatch.setattr(api, "_kernel_display", lambda: displayed.append if in_notebook else None)
    report = a_report(path, warning, compile_counters, empty)
    for enabled in (True, False):
        plan = make_plan(xlaunch.detect(), LaunchOptions(num_processes=2, report=enabled))
        api._print_report(plan, report)
        printed = capsys.readouterr().err
        if enabled and shown and in_notebook:
            assert displayed == [report] and printed == ""
        elif enabled and shown:
            assert displayed == [] and printed == str(report) + "\n"
        else:  # nothing to say, or report=False
            assert displayed == [] and printed == ""
        displayed.clear()


def test_repr_is_the_text_summary():
    report = a_report("elastic", warning=True, compile_counters=True, empty=False)
    assert repr(report) == str(report)
    assert repr(report).startswith("xlaunch report: elastic launch, 2 rank(s) reported, 2.00 s\n")
    assert "RankReport(" not in repr(report) and "warning: host memory" in repr(report)
