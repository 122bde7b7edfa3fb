"""What each rank measures of itself as its function ends: wall time, peak memory, what
torch.compile did (on every path), and what the path adds (the XLA metrics), left as a small
record in the attempt's folder for the report."""

from __future__ import annotations

import json
import os
import resource
import sys
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

from xlaunch._compat import dynamo_counts
from xlaunch.result.report import RankReport
from xlaunch.worker.launch_dir import REPORT
from xlaunch.worker.private import write_private


def peak_rss_bytes() -> int:
    """This process's peak resident memory, the figure the OOM killer's victims reach: Linux's
    ``ru_maxrss`` is the high-water mark /proc calls VmHWM (KiB; bytes on macOS), one system
    call where reading /proc cost 0.4 ms a rank."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def write_rank_report(attempt_dir: Path, rank: int, wall_seconds: float,
                      extra: Mapping[str, Any]) -> None:
    """The rank's report, one small file. Read once the rank's process has ended: a report cut
    short by its death is not read (its rank is reported by the owner's records anyway)."""
    report = RankReport(rank=rank, wall_seconds=wall_seconds, peak_rss_bytes=peak_rss_bytes(),
                        **extra)
    write_private(attempt_dir / REPORT.format(rank),
                  json.dumps({"pid": os.getpid(), "report": asdict(report)}))


def dynamo_since(baseline: Mapping[str, Any] | None) -> dict[str, Any]:
    """What torch.compile did in this process since ``baseline`` (`dynamo_counts()` then), as
    the report's fields; empty where it compiled nothing (a forked worker inherits its parent's
    totals, hence the difference). A recompilation is a frame compiled again since then."""
    now = dynamo_counts()
    if now is None:
        return {}
    before = baseline or {}
    graphs = now["graphs"] - before.get("graphs", 0)
    if now["frames"] - before.get("frames", 0) <= 0 and graphs <= 0:
        return {}
    earlier = before.get("per_frame", {})
    again = sum(max(0, count - earlier.get(frame, 0) - 1) for frame, count in now["per_frame"].items())
    return {"dynamo_graphs": graphs,
            "dynamo_graph_breaks": now["graph_breaks"] - before.get("graph_breaks", 0),
            "dynamo_recompiles": again}
