"""The ``xlaunch`` command: ``env``, ``run``, ``check`` and ``demo``, one function each.

Each subcommand is a function in `COMMANDS` that adds its parser and sets ``handler``. Handlers
import what they need when they run, so ``xlaunch env`` stays cheap and never imports torch or
torch_xla (the versions it reports come from package metadata). ``run`` and ``demo`` declare their
options in their own modules, which are imported to build the parser and so import torch only
inside their handlers. A new command looks like::

    def add_demo(commands):
        from xlaunch.cli import demo

        parser = commands.add_parser("demo", help="a small training run on this machine")
        demo.add_arguments(parser)
        parser.set_defaults(handler=demo.main)
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from xlaunch import __version__


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="xlaunch", description="Run training on every TPU core, GPU or CPU process."
    )
    parser.add_argument("--version", action="version", version=f"xlaunch {__version__}")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)
    for add in COMMANDS:
        add(commands)
    args = parser.parse_args(argv)
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        code = handler(args)
        sys.stdout.flush()
    except BrokenPipeError:  # `xlaunch env | head`: the reader has gone; exit without a traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    return code


def add_env(commands: Any) -> None:
    from xlaunch.cli import env

    parser = commands.add_parser(
        "env", help="show the detected machine and what a launch would do",
        description="Show the detected machine and what xlaunch.launch(fn) would do, with the "
                    "launch options given (default: none), without starting anything. Paste the "
                    "output into bug reports.",
    )
    env.add_arguments(parser)
    parser.set_defaults(handler=env.main)


def add_run(commands: Any) -> None:
    from xlaunch.cli import run

    parser = commands.add_parser(
        "run", help="run a script in every TPU core, GPU or CPU process",
        description="Run `python script.py ARGS` in every process of this machine, on the paths "
                    "xlaunch.launch takes (on a TPU pod: run the same command on every host).",
    )
    run.add_arguments(parser)
    parser.set_defaults(handler=run.main)


def add_check(commands: Any) -> None:
    from xlaunch.cli import check

    parser = commands.add_parser(
        "check", help="a real small launch on this machine's hardware, and a verdict",
        description="Launch on every TPU core, every GPU, or 2 CPU processes and check, step by "
                    "step (each timed): every rank starts and knows its rank, an all-reduce sums "
                    "right, a barrier passes, a few training steps at one shape stop compiling, "
                    "the result comes back. Exits 0 only when every step held. Paste the output "
                    "(with `xlaunch env`'s) into bug reports.",
    )
    check.add_arguments(parser)
    parser.set_defaults(handler=check.main)


def add_demo(commands: Any) -> None:
    from xlaunch.cli import demo

    parser = commands.add_parser(
        "demo", help="train a small model across this machine's processes and check they agree",
        description="A small data-parallel training (model and data made in place, no downloads) "
                    "on every TPU core, GPU, or 2 CPU processes; exits non-zero unless every rank "
                    "ends with identical parameters.",
    )
    demo.add_arguments(parser)
    parser.set_defaults(handler=demo.main)


COMMANDS: list[Callable[[Any], None]] = [add_env, add_run, add_check, add_demo]


