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
import os

from xlaunch.cli.options import add_launch_arguments, launch_and_report, options_from, usage_error


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``run``'s options: every launch option, then the script and its own arguments."""
    add_launch_arguments(parser)
    parser.add_argument("-m", "--module", action="store_true",
                        help="run the target as a module, as `python -m module`")
    parser.add_argument("script", help="the Python script (or, with -m, module) to run in "
                                       "every process")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS",
                        help="the script's own arguments (everything after the script)")


def main(args: argparse.Namespace) -> int:
    """Plan, launch, and turn the outcome into an exit status a shell or a scheduler can act on."""
    from xlaunch.api import plan_here, run_plan
    from xlaunch.worker.script import run_script

    target = args.script if args.module else os.path.abspath(args.script)
    if not args.module and not os.path.isfile(target):
        return usage_error(f"can't open file {args.script!r}: no such file")
    try:
        plan = plan_here(options_from(args))
    except (ValueError, TypeError, RuntimeError) as error:  # RuntimeError: this process can't
        return usage_error(str(error))
    work = (target, list(args.script_args), args.module)
    return launch_and_report(lambda: run_plan(plan, run_script, work))
