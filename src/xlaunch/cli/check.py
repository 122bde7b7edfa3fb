"""``xlaunch check``: a real small launch on this machine's hardware, and a verdict.

What ``accelerate test`` is to accelerate: the launch ``xlaunch.launch(fn)`` would make (every TPU
core, every GPU, or 2 CPU processes on a CPU-only machine), running a few steps that each prove
one thing (check_steps.py): every rank starts and knows its rank, an all-reduce sums right on
every rank, a barrier passes, a few training steps at one shape compile and then stop compiling,
and the result comes back. Each step is timed; the last line is the verdict (``"ok"`` in
``--json``), and the exit status is 0 only when every step held. A step that failed is named,
with the error.

Importing this module must stay cheap (no torch): the parser imports it for every command.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from typing import Any

from xlaunch.cli.options import add_launch_arguments, options_from

CHECK_TIMEOUT_S = 300.0  # a handful of tiny steps: still running after this, the launch is stuck
CALLER_STEPS = ("plan",)
RESULT_STEP = "result"


@dataclass
class Step:
    name: str
    ok: bool | None = None  # None: not reached
    seconds: float | None = None
    detail: str = ""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_launch_arguments(parser)
    parser.set_defaults(timeout=CHECK_TIMEOUT_S)


def main(args: argparse.Namespace) -> int:
    verdict = run_check(args)
    print(json.dumps(verdict, indent=2) if args.json else format_verdict(verdict))
    return 0 if verdict["ok"] else 1


def run_check(args: argparse.Namespace) -> dict[str, Any]:
    """Plan and run the check; every outcome becomes the verdict's data (nothing raises)."""
    names = worker_steps(args.spmd)
    steps = {name: Step(name) for name in (*CALLER_STEPS, *names, RESULT_STEP)}
    verdict: dict[str, Any] = {"ok": False, "failed_step": None, "error": None, "plan": None,
                               "report": None}
    started = time.perf_counter()
    plan = _plan(args, steps["plan"])
    if plan is not None:
        verdict["plan"] = plan.as_dict()
        _launch(plan, steps, verdict, names)
    failed = next((step for step in steps.values() if step.ok is False), None)
    verdict.update(ok=failed is None and all(step.ok for step in steps.values()),
                   failed_step=failed.name if failed else None,
                   error=verdict["error"] or (failed.detail if failed else None),
                   seconds=time.perf_counter() - started,
                   steps=[asdict(step) for step in steps.values()])
    return verdict


def _plan(args: argparse.Namespace, step: Step) -> Any:
    from xlaunch.api import plan_here
    from xlaunch.cli.demo import default_num_processes
    from xlaunch.detect import detect

    started = time.perf_counter()
    try:
        env = detect()
        count = args.num_processes
        if count is None and args.total_processes is None:
            count = default_num_processes(env)
        plan = plan_here(options_from(args, **({} if count is None else {"num_processes": count})),
                         env)
    except (ValueError, TypeError, RuntimeError) as error:  # forced hardware that is absent, too
        step.ok, step.detail = False, str(error)
        return None
    step.ok, step.seconds = True, time.perf_counter() - started
    step.detail = f"{plan.describe_path()}: {plan.summary()}"
    return plan


def worker_steps(spmd: bool) -> tuple[str, ...]:
    from xlaunch.cli.check_spmd import SPMD_STEPS
    from xlaunch.cli.check_steps import STEPS

    return SPMD_STEPS if spmd else STEPS


def _launch(plan: Any, steps: dict[str, Step], verdict: dict[str, Any],
            names: tuple[str, ...], config: Any = None) -> None:
    from xlaunch.api import last_report, run_plan
    from xlaunch.cli.check_spmd import SpmdConfig, run_spmd_checks
    from xlaunch.cli.check_steps import CheckConfig, run_checks
    from xlaunch.result.errors import LaunchError

    launched = time.time()
    devices = getattr(plan.spec, "spmd_devices", 0)
    try:
        if devices:
            result = run_plan(plan, run_spmd_checks, (config or SpmdConfig(devices),))
        else:
            result = run_plan(plan, run_checks, (config or CheckConfig(world_size=plan.world_size),))
    except LaunchError as error:
        _failed_in_worker(error, steps, names)
        verdict["error"] = str(error)
        result = None
    except Exception as error:  # a port taken, torch_xla missing: the verdict says
        steps[names[0]].ok, steps[names[0]].detail = False, f"{type(error).__name__}: {error}"
        verdict["error"] = steps[names[0]].detail
        result = None
    report = last_report()
    if report is not None:
        verdict["report"] = {"path": report.path, "wall_seconds": report.wall_seconds,
                             "ranks": [asdict(rank) for rank in report.ranks],
                             "warnings": list(report.warnings)}
    if result is not None:
        _passed(result, launched, steps, report, plan, names)


def _failed_in_worker(error: Any, steps: dict[str, Step], names: tuple[str, ...]) -> None:
    """The step the root-cause rank named; a rank that died without naming one fails the first."""
    for failure in error.failures:
        name, _, detail = (failure.message or "").partition(": ")
        if failure.exc_type == "CheckFailed" and name in names:
            steps[name].ok, steps[name].detail = False, f"rank {failure.rank}: {detail}"
            break
    else:
        first = error.failures[0] if error.failures else None
        steps[names[0]].ok = False
        steps[names[0]].detail = first.headline() if first is not None else str(error)
    for name in names:  # the steps before the failed one passed on every rank
        if steps[name].ok is False:
            break
        steps[name].ok = True


def _passed(result: Any, launched: float, steps: dict[str, Step], report: Any, plan: Any,
            names: tuple[str, ...]) -> None:
    for name in names:
        steps[name].ok = True
        steps[name].seconds = result["timings"].get(name)
        steps[name].detail = result["details"].get(name, "")
    first = steps[names[0]]
    first.seconds = max(0.0, result["started_at"] - launched) + (first.seconds or 0)
    back = steps[RESULT_STEP]
    back.seconds = max(0.0, time.time() - result["returned_at"])
    problem = _report_problem(report, plan)
    if result.get("world_size") != plan.world_size or problem:
        back.ok = False
        back.detail = problem or f"rank 0 returned world size {result.get('world_size')}"
        return
    back.ok, back.detail = True, f"rank 0's result came back; {_report_line(report)}"


def _report_problem(report: Any, plan: Any) -> str | None:
    """On a TPU path the report's own counters must show no recompilation (and, on XLA, the
    compilations themselves)."""
    if report is None or len(report.ranks) != plan.num_processes:
        count = 0 if report is None else len(report.ranks)
        return f"the launch report holds {count} rank(s), expected {plan.num_processes}"
    if plan.path in ("xla", "torch_tpu"):
        if plan.path == "xla" and any(not rank.compiles for rank in report.ranks):
            return "the launch report counted no XLA compilation on some rank"
        warned = [text for text in report.warnings if text.startswith("recompilation")]
        if warned:
            return warned[0]
    return None


def _report_line(report: Any) -> str:
    compiles = [rank.compiles for rank in report.ranks if rank.compiles is not None]
    text = f"report of {len(report.ranks)} rank(s)"
    return text + (f", {max(compiles)} XLA graph(s) at most per rank" if compiles else "")


def format_verdict(verdict: dict[str, Any]) -> str:
    lines = ["xlaunch check"]
    for step in verdict["steps"]:
        mark = {True: "ok", False: "FAIL", None: "-"}[step["ok"]]
        seconds = "" if step["seconds"] is None else f"{step['seconds']:.2f} s"
        detail = step["detail"] if step["ok"] is not None else "not reached"
        lines.append(f"  {mark:<5}{step['name']:<12}{seconds:>9}  {detail}")
    if verdict["ok"]:
        lines.append(f"xlaunch check: ok, every step held ({verdict['seconds']:.1f} s)")
    else:
        lines.append(f"xlaunch check: FAILED at step {verdict['failed_step']}")
        if verdict["error"]:
            lines.append(str(verdict["error"]))
    return "\n".join(lines)


__all__ = ["add_arguments", "format_verdict", "main", "run_check"]
