"""What happens inside the replicas, for real on torch_xla's CPU device: the launch report
(compilations, CPU fallbacks), restarts of the whole XLA launch, the persistent compile cache.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import pytest

pytestmark = [
    pytest.mark.xla,
    pytest.mark.timeout(240),
    pytest.mark.skipif(importlib.util.find_spec("torch_xla") is None,
                       reason="needs torch_xla (the xla test tier)"),
]

import xlaunch  # noqa: E402
from xlaunch import LaunchError, ProcessState, last_report  # noqa: E402

STEPS = 8


def train_loop(changing_shapes: bool) -> int:
    """A Linear forward/backward loop; with changing shapes each step is a new graph."""
    import torch
    import torch_xla

    device = torch_xla.device()
    model = torch.nn.Linear(16, 4).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        batch = 4 + step if changing_shapes else 4
        loss = model(torch.randn(batch, 16, device=device)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        torch_xla.sync()
    return STEPS


def test_a_loop_whose_shapes_change_is_warned_about_and_a_steady_one_is_not(capfd) -> None:
    xlaunch.notebook_launcher(train_loop, (True,))
    changing = last_report()
    rank = changing.ranks[0]
    assert changing.path == "xla" and rank.compiles >= STEPS and rank.steps >= STEPS
    assert rank.compile_seconds > 0 and rank.executions >= STEPS
    assert any(w.startswith("recompilation:") for w in changing.warnings), changing.warnings
    printed = capfd.readouterr().err
    assert "xlaunch report: xla launch" in printed and "warning: recompilation" in printed

    xlaunch.notebook_launcher(train_loop, (False,))
    steady = last_report()
    assert steady.ranks[0].compiles < STEPS and steady.warnings == ()


def histogram() -> list[float]:
    import torch
    import torch_xla

    values = torch.arange(10.0, device=torch_xla.device())
    return torch.histc(values, bins=2, min=0, max=10).cpu().tolist()


def test_an_op_without_an_xla_lowering_is_named_as_a_cpu_fallback() -> None:
    assert xlaunch.notebook_launcher(histogram) == [5.0, 5.0]
    report = last_report()
    assert report.ranks[0].cpu_fallbacks.get("aten::histc", 0) >= 1
    assert any("aten::histc" in w and w.startswith("CPU fallbacks") for w in report.warnings)


def compile_then_fail() -> None:
    import torch
    import torch_xla

    (torch.ones(3, device=torch_xla.device()) * 2).sum().item()
    raise ValueError("failed after compiling")


def test_a_failed_launch_carries_its_report() -> None:
    with pytest.raises(LaunchError, match="failed after compiling") as caught:
        xlaunch.notebook_launcher(compile_then_fail)
    report = caught.value.report
    assert report is last_report() and report.ranks[0].compiles >= 1


def test_the_compilation_analysis_names_the_lines_behind_compilations(
        monkeypatch: pytest.MonkeyPatch, capfd) -> None:
    monkeypatch.setenv("XLAUNCH_XLA_DEBUG", "1")
    xlaunch.notebook_launcher(train_loop, (True,))
    sources = dict(last_report().ranks[0].compile_sources)
    assert any(where.endswith(".py:" + str(line)) for where in sources
               for line in range(1, 200)), sources
    assert any(Path(where.rsplit(":", 1)[0]).name == Path(__file__).name for where in sources)
    assert "Compilation Analysis" not in capfd.readouterr().err  # not flooding the cell
    assert any("triggered most often at" in w for w in last_report().warnings)


def fail_on_first_attempt(folder: str) -> dict[str, Any]:
    attempt = ProcessState().restart_count
    Path(folder, f"attempt-{attempt}").write_text(str(os.getpid()))
    if attempt == 0:
        raise RuntimeError("the first attempt fails")
    return {"attempt": attempt}


def test_max_restarts_runs_the_whole_xla_launch_again(tmp_path: Path) -> None:
    assert xlaunch.notebook_launcher(fail_on_first_attempt, (str(tmp_path),), max_restarts=1) == {
        "attempt": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["attempt-0", "attempt-1"]


def always_fail(folder: str) -> None:
    raise RuntimeError(f"attempt {ProcessState().restart_count} failed")


def test_each_failed_attempts_root_cause_is_kept(tmp_path: Path) -> None:
    with pytest.raises(LaunchError) as caught:
        xlaunch.notebook_launcher(always_fail, (str(tmp_path),), max_restarts=2)
    assert "attempt 2 failed" in caught.value.root_cause.message
    assert [a[0].message for a in caught.value.earlier_attempts] == ["attempt 0 failed",
                                                                      "attempt 1 failed"]


def cached_graph() -> list[str]:
    import torch
    import torch_xla
    import torch_xla.debug.metrics as met

    (torch.arange(8.0, device=torch_xla.device()) * 3).sum().item()
    return [*met.metric_names(), *met.counter_names()]


def test_the_compile_cache_is_written_and_read_back_by_the_next_launch(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    first = xlaunch.notebook_launcher(cached_graph, compile_cache=cache)
    written = [path for path in cache.rglob("*") if path.is_file()]
    assert written and all(path.parent.name == "process-0" for path in written)
    assert "PersistentCacheMiss" in first
    second = xlaunch.notebook_launcher(cached_graph, compile_cache=str(cache))
    # The CPU device writes the cache but cannot deserialize it: the load is tried, no more.
    assert "PersistentCacheLoad" in second


def test_a_compile_cache_under_home_is_the_replicas_home(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``~`` (given, or the default where the plan had no HOME) is expanded in the replica."""
    monkeypatch.setenv("HOME", str(tmp_path))
    xlaunch.notebook_launcher(cached_graph, compile_cache="~/cache")
    assert [path for path in (tmp_path / "cache" / "process-0").rglob("*") if path.is_file()]


def replica_noop(index: int) -> None:
    return None


def own_process_mark() -> bool:
    import glob
    import tempfile

    from xlaunch.worker.launch_dir import Mark

    marks = glob.glob(f"{tempfile.gettempdir()}/xlaunch-{os.getppid()}-*/attempt-0/"
                      f"{Mark.BEGAN}-{os.getpid()}")
    return bool(marks)


def test_each_process_of_torch_xlas_pool_says_it_began_before_anything_else() -> None:
    """The pool's processes are the pool's; the launch knows each by the mark it wrote first."""
    assert xlaunch.notebook_launcher(own_process_mark) is True


