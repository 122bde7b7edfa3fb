"""What ``run`` and ``demo`` share: their common options, the one `LaunchOptions` built from a
command line, and how a launch's end becomes an exit status.

Importing this module must stay cheap (no torch): the parser imports it for every command.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from xlaunch.plan.options import (
    DEFAULT_MASTER_ADDR,
    DEFAULT_MONITOR_INTERVAL,
    DEFAULT_PORT,
    DEFAULT_RDZV_BACKEND,
    DEFAULT_RDZV_ID,
    DEFAULT_STOP_GRACE,
    MIXED_PRECISIONS,
    RDZV_BACKENDS,
    START_METHODS,
    LaunchOptions,
)

TIMEOUT_EXIT = 124  # what coreutils' `timeout` exits with; no rank failed, the clock ran out
INTERRUPTED_EXIT = 130  # 128 + SIGINT, as a shell reports Ctrl-C


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    """Every launch option (``run``, ``env``, ``check``): torchrun's name, its underscore
    spelling, accelerate's name."""
    parser.add_argument("--num-processes", "--nproc-per-node", "--nproc_per_node",
                        dest="num_processes", type=_process_count, default=None, metavar="N",
                        help="processes on this machine (default: every TPU core or GPU, 1 on a "
                             "CPU); torchrun's 'auto' and 'gpu' mean the default, 'cpu' one "
                             "process per core")
    parser.add_argument("--num_processes", dest="total_processes", type=int, default=None,
                        metavar="N", help="accelerate's spelling: processes on ALL machines "
                                          "together (divided by --num_machines)")
    parser.add_argument("--standalone", action="store_true",
                        help="torchrun's one-machine mode (the default here; nothing to set up)")
    parser.add_argument("--num-nodes", "--nnodes", "--num_machines", dest="num_nodes", type=int,
                        default=1, metavar="N", help="machines taking part (GPU/CPU; default 1)")
    parser.add_argument("--node-rank", "--node_rank", "--machine_rank", dest="node_rank", type=int,
                        default=0, metavar="R", help="this machine's index, 0 to num-nodes-1")
    parser.add_argument("--master-addr", "--master_addr", "--main_process_ip", dest="master_addr",
                        default=DEFAULT_MASTER_ADDR, metavar="HOST",
                        help="address of node 0 (multi-node static rendezvous)")
    parser.add_argument("--master-port", "--master_port", "--main_process_port", dest="master_port",
                        default=None, metavar="PORT",
                        help=f"port on node 0 (default {DEFAULT_PORT}, or a free one when that "
                             "is taken)")
    parser.add_argument("--rdzv-backend", "--rdzv_backend", dest="rdzv_backend",
                        default=DEFAULT_RDZV_BACKEND, metavar="NAME",
                        help=f"one of {', '.join(RDZV_BACKENDS)} (default: %(default)s)")
    parser.add_argument("--rdzv-endpoint", "--rdzv_endpoint", dest="rdzv_endpoint", default="",
                        metavar="HOST:PORT", help="rendezvous endpoint (default master-addr:port)")
    parser.add_argument("--rdzv-id", "--rdzv_id", dest="rdzv_id", default=DEFAULT_RDZV_ID,
                        metavar="ID",
                        help="job id shared by every node")
    parser.add_argument("--max-restarts", "--max_restarts", dest="max_restarts", type=int, default=0,
                        metavar="N", help="restart the workers up to N times after a failure")
    parser.add_argument("--monitor-interval", "--monitor_interval", dest="monitor_interval",
                        type=float, default=None, metavar="SECONDS",
                        help="how often a launch checks what no worker's end reports (another "
                             f"node's failure; default: every {DEFAULT_MONITOR_INTERVAL:g} s)")
    add_common_arguments(parser)
    parser.add_argument("--cpu", action="store_true",
                        help="debug: run CPU processes over gloo even where a TPU or GPU is present")


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    """Options ``run`` and ``demo`` share, so the two commands spell them alike."""
    parser.add_argument("--mixed-precision", "--mixed_precision", dest="mixed_precision",
                        default="no", metavar="MODE",
                        help=f"{', '.join(MIXED_PRECISIONS)} (read in workers through "
                             "ProcessState().autocast())")
    parser.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                        help="stop every process after this long (exit status 124; default: %(default)s)")
    parser.add_argument("--stop-grace", type=float, default=DEFAULT_STOP_GRACE, metavar="SECONDS",
                        help="at a stop, SIGKILL follows SIGTERM after this long "
                             "(default: %(default)s)")
    parser.add_argument("--spmd", action="store_true",
                        help="torch_xla's SPMD: one process per host drives every device")
    parser.add_argument("--start-method", "--start_method", dest="start_method", default=None,
                        metavar="METHOD",
                        help=f"{', '.join(START_METHODS)} for GPU/CPU workers (default fork on Linux)")


def options_from(args: argparse.Namespace, **overrides: Any) -> LaunchOptions:
    """The one options object for a command's arguments; `ValueError` for spellings that clash."""
    if hasattr(args, "rdzv_backend"):
        _reconcile_spellings(args)

    values: dict[str, Any] = dict(
        num_processes=args.num_processes, mixed_precision=args.mixed_precision,
        timeout=args.timeout, start_method=args.start_method, stop_grace=args.stop_grace,
        spmd=args.spmd)
    if hasattr(args, "rdzv_backend"):  # every launch option, not only the common ones
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


def launch_and_report(start: Any) -> int:
    """Run ``start()``; a failed launch becomes its message on stderr and the failed rank's status.

    The message is `LaunchError`'s own text, which already leads with the root cause.
    """
    from xlaunch.result.errors import LaunchError, LaunchTimeout

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
    except (RuntimeError, ImportError) as refused:  # a taken port, a held TPU, no torch_xla
        print(f"xlaunch: error: {refused}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as stop:  # its message says what was stopped, and anything left
        print(f"xlaunch: {stop or 'interrupted; every worker was stopped'}", file=sys.stderr)
        return INTERRUPTED_EXIT
    return 0


def usage_error(message: str) -> int:
    print(f"xlaunch: error: {message}", file=sys.stderr)
    return 2


def _reconcile_spellings(args: argparse.Namespace) -> None:
    """torchrun's and accelerate's options, said the way xlaunch plans them."""
    if args.standalone and args.num_nodes > 1:
        raise ValueError("--standalone is torchrun's one-machine mode; it cannot go with "
                         f"--nnodes {args.num_nodes}")
    if args.num_processes == "cpu":
        args.num_processes, args.cpu = os.cpu_count() or 1, True
    if args.total_processes is None:
        return
    if args.num_processes is not None:
        raise ValueError("give --num-processes (per machine) or accelerate's --num_processes "
                         "(all machines together), not both")
    per_machine, left = divmod(args.total_processes, args.num_nodes)
    if left or per_machine < 1:
        raise ValueError(
            f"--num_processes={args.total_processes} is accelerate's count of processes on all "
            f"{args.num_nodes} machines together, so it must divide evenly between them; for "
            "a count per machine use --num-processes (or torchrun's --nproc-per-node)")
    args.num_processes = per_machine


def _process_count(text: str) -> int | str | None:
    """torchrun's ``--nproc-per-node``: a number, or ``auto``/``gpu`` (every device) or ``cpu``."""
    word = text.strip().lower()
    if word in ("auto", "gpu"):
        return None
    if word == "cpu":
        return "cpu"
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a whole number, 'auto', 'gpu' or 'cpu', got {text!r}") from None
