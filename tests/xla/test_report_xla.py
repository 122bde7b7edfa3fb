"""The recompilation warning on the XLA device needs a steady run to judge: a short run that
compiled its graphs while warming up is not warned about, a loop that keeps compiling is."""

from __future__ import annotations

import importlib.metadata
import importlib.util

import pytest

pytestmark = [
    pytest.mark.xla,
    pytest.mark.timeout(300),
    pytest.mark.skipif(importlib.util.find_spec("torch_xla") is None,
                       reason="needs torch_xla (the xla test tier)"),
]

import xlaunch  # noqa: E402
from xlaunch import last_report  # noqa: E402


def warm_up_then_steady(steps: int) -> int:
    """Many graphs in the first step (set-up work of several shapes), then one steady step."""
    import torch
    import torch_xla

    device = torch_xla.device()
    kept = []  # a result nobody holds is never computed, so never compiled
    for size in range(2, 9):  # seven different graphs, once each
        kept.append((torch.ones(size, device=device) * 2).sum())
        torch_xla.sync()
    model = torch.nn.Linear(8, 1).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.ones(4, 8, device=device)).sum().backward()
        optimizer.step()
        torch_xla.sync()
    return steps


def keeps_compiling(steps: int) -> int:
    import torch
    import torch_xla

    device = torch_xla.device()
    kept = []
    for step in range(steps):
        kept.append((torch.ones(3 + step, device=device) * 2).sum())
        torch_xla.sync()
    return steps


def test_a_short_run_that_warmed_up_is_not_warned_about():
    xlaunch.notebook_launcher(warm_up_then_steady, (6,))
    rank = last_report().ranks[0]
    # The old rule (more than 4 graphs, one per two steps) warned here.
    assert rank.compiles > 4 and rank.compiles * 2 >= rank.steps, rank
    assert rank.late_compiles is not None and rank.late_compiles <= 1, rank
    assert not last_report().warnings


def test_a_loop_that_keeps_compiling_is_warned_about_with_this_releases_link():
    xlaunch.notebook_launcher(keeps_compiling, (16,))
    report = last_report()
    assert report.ranks[0].late_compiles >= 7, report.ranks[0]
    (warning,) = [w for w in report.warnings if w.startswith("recompilation:")]
    release = ".".join(importlib.metadata.version("torch_xla").split(".")[:2])
    assert f"docs.pytorch.org/xla/release/r{release}/perf/recompilation.html" in warning
