"""A script (or ``-m module``) run as ``__main__`` inside each worker, unchanged.

Scripts written for ``python script.py``, ``torchrun`` or pytorch/xla's own examples each start
their world their own way. Inside an xlaunch worker that world already exists, so:

- a script's ``init_process_group(...)`` replaces the launcher's group with the one it asked for:
  its backend and its timeout (nccl on a machine without GPUs fails, as under torchrun); on one
  machine with the default ``env://`` it meets through a file, private as the launcher's group's
  (`launch_dir.SCRIPT_GROUP_STORE`);
- a script's ``xmp.spawn(fn, args)`` or ``torch_xla.launch(fn, args)`` runs ``fn(ordinal, *args)``
  in place: this process already is that replica, and a second spawn would find the runtime
  started ("Runtime is already initialized").
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import os
import runpy
import sys
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any

from xlaunch import _compat
from xlaunch.names import STORE_DIR_VAR
from xlaunch.worker.launch_dir import SCRIPT_GROUP_STORE
from xlaunch.worker.private import private_file


def run_script(target: str, script_args: list[str], module: bool = False) -> None:
    """The launched function: ``python script.py ARGS`` (or ``python -m module ARGS``) here.

    Module-level so that ``--start-method spawn`` can pickle it. sys.argv and sys.path are put
    back afterwards because with one process this runs in the ``xlaunch`` process itself.
    """
    saved_argv, saved_path = sys.argv, list(sys.path)
    source = _module_file(target) if module else target
    sys.argv = [source, *script_args]
    sys.path.insert(0, os.getcwd() if module else os.path.dirname(target))
    try:
        with _scripts_own_group(), _xla_spawn_in_place():
            if module:
                runpy.run_module(target, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(target, run_name="__main__")
    except BaseException as error:
        # The root cause should open at the script's line, not in runpy's machinery.
        error.__traceback__ = _from_script(error.__traceback__, source)
        raise
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path


@contextlib.contextmanager
def _scripts_own_group() -> Iterator[None]:
    dist: Any = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        yield
        return
    original = dist.init_process_group
    signature = inspect.signature(original)
    stores = itertools.count()
    launchers = [True]  # the group the launcher made, until the script asks for its own

    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        asked = signature.bind(*args, **kwargs)
        if launchers and dist.is_initialized():  # it gives way to the one the script asks for
            launchers.clear()
            dist.destroy_process_group()
        store_dir = os.environ.get(STORE_DIR_VAR)
        given = asked.arguments
        if store_dir and given.get("store") is None and given.get("init_method") is None:
            world = int(os.environ["WORLD_SIZE"])
            given["store"] = dist.FileStore(_private_store(store_dir, next(stores)), world)
            given["rank"], given["world_size"] = int(os.environ["RANK"]), world
        return original(*asked.args, **asked.kwargs)

    with _compat.standing_in(dist, "init_process_group", init_process_group):
        yield


def _private_store(folder: str, number: int) -> str:
    """The file the script's ``number``-th group meets through, in the attempt's private folder:
    created exclusively, 0600, by whichever rank comes first (torch's FileStore would create it
    0644 under the user's umask); the others find it made."""
    store = os.path.join(folder, SCRIPT_GROUP_STORE.format(number))
    with contextlib.suppress(FileExistsError):
        os.close(private_file(store))
    return store


@contextlib.contextmanager
def _xla_spawn_in_place() -> Iterator[None]:
    from xlaunch.state import in_xla_replica

    if not in_xla_replica():
        yield
        return
    import torch_xla
    import torch_xla.distributed.xla_multiprocessing as xmp

    with _compat.standing_in(xmp, "spawn", _in_place), \
            _compat.standing_in(torch_xla, "launch", _in_place):
        yield


def _in_place(fn: Callable[..., Any], args: tuple[Any, ...] = (), *_: Any, **__: Any) -> None:
    """``xmp.spawn``/``torch_xla.launch`` inside a replica: call ``fn(ordinal, *args)`` here."""
    from xlaunch.state import ProcessState

    fn(ProcessState().process_index, *args)


def _module_file(name: str) -> str:
    import importlib.util

    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        spec = None
    return spec.origin if spec is not None and spec.origin else name


def _from_script(traceback: TracebackType | None, script: str) -> TracebackType | None:
    """The traceback from the script's first frame on; all of it if the script has none."""
    entry = traceback
    while entry is not None and entry.tb_frame.f_code.co_filename != script:
        entry = entry.tb_next
    return entry or traceback
