"""``xlaunch run script.py ARGS...``: a script on the same launch paths as a notebook's function.

Kaggle script kernels and TPU VMs run scripts, not cells; on a pod the same command runs on every
host. Each worker runs the script as ``__main__`` with the script's own ``sys.argv``, so a script
written for ``python script.py`` or ``torchrun script.py`` runs unchanged. Options carry torchrun's
and ``accelerate launch``'s names (both spellings) where they mean the same thing, so a command
line moved from either keeps working.

Importing this module must stay cheap (no torch): the command-line parser imports it for every
``xlaunch`` command, ``xlaunch env`` included.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import runpy
import sys
from collections.abc import Iterator
from types import TracebackType
from typing import Any

from .plan import MIXED_PRECISIONS, RDZV_BACKENDS, START_METHODS

TIMEOUT_EXIT = 124  # what coreutils' `timeout` exits with; no rank failed, the clock ran out
INTERRUPTED_EXIT = 130  # 128 + SIGINT, as a shell reports Ctrl-C


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare ``run``'s options: torchrun's name, its underscore spelling, accelerate's name."""
    parser.add_argument("--num-processes", "--num_processes", "--nproc-per-node", "--nproc_per_node",
                        dest="num_processes", type=_process_count, default=None, metavar="N",
                        help="processes on this node (default: every TPU core or GPU, 1 on a CPU)")
    parser.add_argument("--num-nodes", "--nnodes", "--num_machines", dest="num_nodes", type=int,
                        default=1, metavar="N", help="machines taking part (GPU/CPU; default 1)")
    parser.add_argument("--node-rank", "--node_rank", "--machine_rank", dest="node_rank", type=int,
                        default=0, metavar="R", help="this machine's index, 0 to num-nodes-1")
    parser.add_argument("--master-addr", "--master_addr", "--main_process_ip", dest="master_addr",
                        default="127.0.0.1", metavar="HOST",
                        help="address of node 0 (multi-node static rendezvous)")
    parser.add_argument("--master-port", "--master_port", "--main_process_port", dest="master_port",
                        default=None, metavar="PORT",
                        help="port on node 0 (default 29500, or a free one when that is taken)")
    parser.add_argument("--rdzv-backend", "--rdzv_backend", dest="rdzv_backend", default="static",
                        metavar="NAME", help=f"one of {', '.join(RDZV_BACKENDS)} (default static)")
    parser.add_argument("--rdzv-endpoint", "--rdzv_endpoint", dest="rdzv_endpoint", default="",
                        metavar="HOST:PORT", help="rendezvous endpoint (default master-addr:port)")
    parser.add_argument("--rdzv-id", "--rdzv_id", dest="rdzv_id", default="none", metavar="ID",
                        help="job id shared by every node")
    parser.add_argument("--max-restarts", "--max_restarts", dest="max_restarts", type=int, default=0,
                        metavar="N", help="restart the workers up to N times after a failure")
    parser.add_argument("--monitor-interval", "--monitor_interval", dest="monitor_interval",
                        type=float, default=None, metavar="SECONDS",
                        help="how often the agent checks the workers (default: every 0.01 s)")
    add_common_arguments(parser)
    parser.add_argument("--cpu", action="store_true",
                        help="debug: run CPU processes over gloo even where a TPU or GPU is present")
    parser.add_argument("script", help="the Python script to run in every process")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS",
                        help="the script's own arguments (everything after the script)")


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    """Options ``run`` and ``demo`` share, so the two commands spell them alike."""
    parser.add_argument("--mixed-precision", "--mixed_precision", dest="mixed_precision",
                        default="no", metavar="MODE",
                        help=f"{', '.join(MIXED_PRECISIONS)} (read in workers through "
                             "ProcessState().autocast())")
    parser.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                        help="stop every process after this long (exit status 124; default: %(default)s)")
    parser.add_argument("--start-method", "--start_method", dest="start_method", default=None,
                        metavar="METHOD",
                        help=f"{', '.join(START_METHODS)} for GPU/CPU workers (default fork on Linux)")


def main(args: argparse.Namespace) -> int:
    """Plan, launch, and turn the outcome into an exit status a shell or a scheduler can act on."""
    from .environment import detect
    from .launcher import run_plan
    from .plan import make_plan

    script = os.path.abspath(args.script)
    if not os.path.isfile(script):
        return usage_error(f"can't open file {args.script!r}: no such file")
    try:
        plan = make_plan(detect(), options_from(args))
    except (ValueError, TypeError) as error:
        return usage_error(str(error))
    return launch_and_report(lambda: run_plan(plan, run_script, (script, list(args.script_args))))


def options_from(args: argparse.Namespace, **overrides: Any) -> Any:
    """The one options object for a command's arguments (``run`` and ``demo`` share it)."""
    from .options import DEFAULT_MONITOR_INTERVAL, DEFAULT_PORT, LaunchOptions

    values: dict[str, Any] = dict(
        num_processes=args.num_processes, mixed_precision=args.mixed_precision,
        timeout=args.timeout, start_method=args.start_method)
    if hasattr(args, "script"):  # ``run``: the engine's options too
        values.update(
            use_port=DEFAULT_PORT if args.master_port is None else args.master_port,
            master_addr=args.master_addr, node_rank=args.node_rank, num_nodes=args.num_nodes,
            rdzv_backend=args.rdzv_backend, rdzv_endpoint=args.rdzv_endpoint,
            rdzv_id=args.rdzv_id, max_restarts=args.max_restarts,
            monitor_interval=(DEFAULT_MONITOR_INTERVAL if args.monitor_interval is None
                              else args.monitor_interval),
            cpu_only=args.cpu)
    values.update(overrides)
    return LaunchOptions(**values)


def run_script(script: str, script_args: list[str]) -> None:
    """The launched function: ``python script.py ARGS`` inside this worker.

    Module-level so that ``--start-method spawn`` can pickle it. sys.argv and sys.path are put
    back afterwards because with one process this runs in the ``xlaunch`` process itself.
    """
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [script, *script_args]
    sys.path.insert(0, os.path.dirname(script))
    try:
        with _launcher_group_reused():
            runpy.run_path(script, run_name="__main__")
    except BaseException as error:
        # The root cause should open at the script's line, not in runpy's machinery.
        error.__traceback__ = _from_script(error.__traceback__, script)
        raise
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path


@contextlib.contextmanager
def _launcher_group_reused() -> Iterator[None]:
    """A torchrun script calls ``init_process_group()``; here the launcher has already made it.

    Without this such a script fails with "trying to initialize the default process group twice"
    in every worker. The call is answered with the group the launcher made (gloo on CPU, NCCL on
    GPU), which is the group that script asks for when run under torchrun on the same machine.
    """
    dist: Any = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        yield
        return
    original = dist.init_process_group

    @functools.wraps(original)
    def init_process_group(*args: Any, **kwargs: Any) -> None:
        if not dist.is_initialized():  # the script destroyed the launcher's group, then re-made it
            original(*args, **kwargs)

    dist.init_process_group = init_process_group
    try:
        yield
    finally:
        dist.init_process_group = original


def _from_script(traceback: TracebackType | None, script: str) -> TracebackType | None:
    """The traceback from the script's first frame on; all of it if the script has none."""
    entry = traceback
    while entry is not None and entry.tb_frame.f_code.co_filename != script:
        entry = entry.tb_next
    return entry or traceback


def launch_and_report(start: Any) -> int:
    """Run ``start()``; a failed launch becomes its message on stderr and the failed rank's status.

    The message is `LaunchError`'s own text, which already leads with the root cause.
    """
    from .errors import LaunchError, LaunchTimeout

    try:
        start()
    except LaunchTimeout as timed_out:
        print(timed_out, file=sys.stderr)
        return TIMEOUT_EXIT
    except LaunchError as failed:
        print(failed, file=sys.stderr)
        return failed.exitcode
    except (ValueError, TypeError) as refused:  # refused before any process started
        return usage_error(str(refused))
    except RuntimeError as refused:  # a taken port, a device initialised too early
        print(f"xlaunch: error: {refused}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("xlaunch: interrupted; every worker was stopped", file=sys.stderr)
        return INTERRUPTED_EXIT
    return 0


def usage_error(message: str) -> int:
    print(f"xlaunch: error: {message}", file=sys.stderr)
    return 2


def _process_count(text: str) -> int | None:
    """torchrun's ``--nproc-per-node auto`` means the launcher's choice, like leaving it out."""
    if text.strip().lower() == "auto":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number or 'auto', got {text!r}") from None
