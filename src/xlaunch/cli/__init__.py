"""The ``xlaunch`` command: ``env``, ``run``, ``check`` and ``demo``, a module each.

Each command is a row of `COMMANDS`: its module declares the options (``add_arguments``) and
carries the command out (``main``). A module imports torch only inside ``main``, so building the
parser stays cheap and ``xlaunch env`` never imports torch or torch_xla (the versions it reports
come from package metadata). A new command is a module with those two functions and a row here.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable, Sequence

from xlaunch import __version__

# name -> (its module, the one-line help, the description its --help prints)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "env": ("xlaunch.cli.env", "show the detected machine and what a launch would do",
            "Show the detected machine and what xlaunch.launch(fn) would do, with the launch "
            "options given (default: none), without starting anything. Paste the output into "
            "bug reports."),
    "run": ("xlaunch.cli.run", "run a script in every TPU core, GPU or CPU process",
            "Run `python script.py ARGS` in every process of this machine, on the paths "
            "xlaunch.launch takes (on a TPU pod: run the same command on every host)."),
    "check": ("xlaunch.cli.check", "a real small launch on this machine's hardware, and a verdict",
              "Launch on every TPU core, every GPU, or 2 CPU processes and check, step by step "
              "(each timed): every rank starts and knows its rank, an all-reduce sums right, a "
              "barrier passes, a few training steps at one shape stop compiling, the result "
              "comes back. Exits 0 only when every step held. Paste the output (with `xlaunch "
              "env`'s) into bug reports."),
    "demo": ("xlaunch.cli.demo",
             "train a small model across this machine's processes and check they agree",
             "A small data-parallel training (model and data made in place, no downloads) on "
             "every TPU core, GPU, or 2 CPU processes; exits non-zero unless every rank ends "
             "with identical parameters."),
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="xlaunch", description="Run training on every TPU core, GPU or CPU process."
    )
    parser.add_argument("--version", action="version", version=f"xlaunch {__version__}")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)
    for name, (module_name, help_line, description) in COMMANDS.items():
        module = importlib.import_module(module_name)
        command = commands.add_parser(name, help=help_line, description=description)
        module.add_arguments(command)
        command.set_defaults(handler=module.main)
    args = parser.parse_args(argv)
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        code = handler(args)
        sys.stdout.flush()
    except BrokenPipeError:  # `xlaunch env | head`: the reader has gone; exit without a traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    return code
