"""What a launch left, judged: `Outcome` -> the result, a `LaunchError` or a `LaunchTimeout`;
and the `LaunchReport` of what each rank did. Imports nothing from the backends or the plan."""

from __future__ import annotations

from xlaunch.result.errors import LaunchError, LaunchTimeout, ProcessFailure
from xlaunch.result.outcome import Outcome, RankExit, judge
from xlaunch.result.report import LaunchReport, RankReport, make_report

__all__ = ["LaunchError", "LaunchReport", "LaunchTimeout", "Outcome", "ProcessFailure",
           "RankExit", "RankReport", "judge", "make_report"]
