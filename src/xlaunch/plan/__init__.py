"""Environment + the caller's options -> one `LaunchPlan`: every decision and every refusal.

Pure: planning binds no socket, starts no process and writes no file, so `xlaunch env` can show
what a launch would do without doing any of it, and a bad argument is refused before anything runs.
"""

from __future__ import annotations

from xlaunch.plan.make import make_plan
from xlaunch.plan.options import LaunchOptions
from xlaunch.plan.specs import ElasticSpec, InlineSpec, LaunchPlan, PathSpec, TorchTpuSpec, XlaSpec

__all__ = ["ElasticSpec", "InlineSpec", "LaunchOptions", "LaunchPlan", "PathSpec", "TorchTpuSpec",
           "XlaSpec", "make_plan"]
