"""What the report says about compilation: XLA's graphs judged on a steady run, torch.compile's
graphs from dynamo's own counters in each rank, and links for the installed release."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys

from xlaunch import last_report, notebook_launcher
from xlaunch.backends.xla.metrics import late_compiles
from xlaunch.result.report import RankReport, recompile_docs, recompiles, warnings_for

MIB = 2**20


def test_a_short_run_that_warmed_up_is_not_recompiling():
    """The 6-step DDP run that warned '12 graphs in 15 steps': all 12 came in its first steps."""
    short = RankReport(0, 1.0, MIB, compiles=12, steps=15, executions=15, late_compiles=0)
    assert not recompiles(short) and warnings_for([short], None) == []
    longer = RankReport(0, 1.0, MIB, compiles=12, steps=51, executions=51, late_compiles=0)
    assert not recompiles(longer)
    still = RankReport(0, 1.0, MIB, compiles=16, steps=8, executions=16, late_compiles=8)
    assert recompiles(still)
    # Without the metrics' samples, a short run is not judged at all.
    assert not recompiles(RankReport(0, 1.0, MIB, compiles=12, steps=15))
    assert recompiles(RankReport(0, 1.0, MIB, compiles=40, steps=40))


def test_late_compiles_counts_compilations_after_half_the_executions():
    def metric(*stamps):
        return (len(stamps), 0.0, tuple((stamp, 1.0) for stamp in stamps))

    warm = late_compiles(metric(1.0, 2.0, 3.0), [metric(*range(1, 16)), None])
    assert warm == 0
    still = late_compiles(metric(*(step + 0.5 for step in range(12))), [metric(*range(1, 13))])
    assert still == 5  # compiled at 7.5 .. 11.5, after the 7th of 12 executions
    assert late_compiles(metric(1.0), [metric(1.0, 2.0)]) is None  # too few to judge
    assert late_compiles(None, [None]) is None


def test_the_recompilation_link_matches_the_installed_torch_xla():
    try:
        version = importlib.metadata.version("torch_xla")
    except importlib.metadata.PackageNotFoundError:
        assert recompile_docs() == "https://docs.pytorch.org/xla/master/perf/recompilation.html"
        return
    release = ".".join(version.split(".")[:2])
    assert f"/release/r{release}/" in recompile_docs()


def compiled_training(shapes: list[int]) -> int:
    import torch

    model = torch.nn.Linear(4, 1)
    compiled = torch.compile(model, backend="eager")
    for rows in shapes:
        compiled(torch.randn(rows, 4)).sum().backward()
    return len(shapes)


def test_each_rank_reports_what_torch_compile_did(monkeypatch):
    monkeypatch.setenv("XLAUNCH_ACCELERATOR", "cpu")
    notebook_launcher(compiled_training, args=([8] * 6,), num_processes=2)
    report = last_report()
    assert [rank.rank for rank in report.ranks] == [0, 1]
    for rank in report.ranks:
        assert rank.dynamo_graphs == 1 and rank.dynamo_graph_breaks == 0, rank
        assert rank.dynamo_recompiles == 0
    assert "torch.compile: 1 graph(s), 0 graph break(s), 0 recompilation(s)" in str(report)
    assert not report.warnings


def test_a_rank_that_never_used_torch_compile_reports_none(monkeypatch):
    monkeypatch.setenv("XLAUNCH_ACCELERATOR", "cpu")
    notebook_launcher(sum, args=([1, 2],), num_processes=2)
    assert all(rank.dynamo_graphs is None for rank in last_report().ranks)


KEEPS_RECOMPILING = """
import torch, xlaunch

def train():
    torch._dynamo.config.automatic_dynamic_shapes = False  # every new shape is a new graph
    model = torch.nn.Linear(4, 1)
    compiled = torch.compile(model, backend="eager")
    for rows in range(1, 8):
        compiled(torch.randn(rows, 4)).sum().backward()

xlaunch.notebook_launcher(train, num_processes=2)
"""


def test_a_loop_that_keeps_recompiling_is_warned_about():
    env = dict(os.environ, XLAUNCH_ACCELERATOR="cpu")
    result = subprocess.run([sys.executable, "-c", KEEPS_RECOMPILING], env=env,
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr
    warning = [line for line in result.stderr.splitlines()
               if line.startswith("warning: torch.compile recompilation: rank")]
    assert warning, result.stderr
    assert "recompiled 6 times" in warning[0] and "TORCH_LOGS=recompiles" in warning[0]


def test_the_rank_record_carries_the_dynamo_counts():
    rank = RankReport(0, 1.0, MIB, dynamo_graphs=3, dynamo_graph_breaks=1, dynamo_recompiles=2,
                      late_compiles=1)
    assert RankReport.from_json(rank.to_json()) == rank
