"""Every use of another library's private API, in one place.

Each helper names the upstream file it follows and the releases it was checked on, and
tests/test_compat.py (and the tiers' own tests) checks it on each release the suite runs: torch
2.8.0, 2.13.0 and 2.15.0 (core tiers), torch_xla 2.8 and 2.9, torch-tpu 0.2.0, pytorch-lightning
2.6.6. Where that private detail is missing
(a newer or older release changed it) the helper warns once, loudly, saying what no longer works,
instead of degrading without a word.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import multiprocessing.context
import os
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

_warned: set[str] = set()


def _loud(key: str, text: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(f"xlaunch: {text}", RuntimeWarning, stacklevel=3)


# --- torch_xla ----------------------------------------------------------------------------------
# torch_xla 2.x, torch_xla/csrc/init_python_bindings.cpp: _XLAC._xla_runtime_is_initialized()
# (checked on torch_xla 2.8.0 and 2.9.0: the xla tiers)
# answers without initialising the runtime (every public query initialises it).


def xla_runtime_is_initialized() -> bool:
    """Whether this process already started the XLA runtime; never imports torch_xla."""
    torch_xla = sys.modules.get("torch_xla")
    xlac = getattr(torch_xla, "_XLAC", None)
    if torch_xla is None or xlac is None:
        return False  # not imported, or its import has not got that far (an interrupted one)
    check = getattr(xlac, "_xla_runtime_is_initialized", None)
    if check is None:
        _loud("xla-init", "torch_xla._XLAC._xla_runtime_is_initialized is missing in this "
              "torch_xla; an XLA device used before the launch is no longer detected")
        return False
    return bool(check())


# torch_xla 2.x, torch_xla/csrc/init_python_bindings.cpp: _XLAC._get_xla_sharding_spec(tensor),
# the sharding annotation of an XLA tensor as text ("{devices=[4,1]0,1,2,3}"); checked on torch_xla
# 2.8.0 and 2.9.0 (`xlaunch check --spmd`, the xla tiers). torch_xla has no public reader of it.


def xla_sharding_spec(tensor: Any) -> str:
    """How ``tensor`` is sharded, as torch_xla prints it; "" (said loudly) where unreadable."""
    import torch_xla

    reader = getattr(getattr(torch_xla, "_XLAC", None), "_get_xla_sharding_spec", None)
    if reader is None:
        _loud("xla-sharding", "torch_xla._XLAC._get_xla_sharding_spec is missing in this "
              "torch_xla; `xlaunch check --spmd` cannot read how a tensor is sharded")
        return ""
    return str(reader(tensor))


# --- Stand-ins inside a worker ------------------------------------------------------------------
# Public functions a worker's own code finds standing in while it runs, put back after, never in
# the caller: a script's torch.distributed.init_process_group (torch 2.8-2.15), its xmp.spawn and
# torch_xla.launch, torch_xla.runtime.use_spmd in a replica without SPMD (torch_xla 2.8, 2.9).


@contextlib.contextmanager
def standing_in(owner: Any, name: str, stand_in: Any) -> Iterator[None]:
    """``owner.name`` is ``stand_in`` inside, put back after; said loudly where it is gone."""
    original = getattr(owner, name, None)
    if original is None:
        _loud(f"stand-in {name}", f"{getattr(owner, '__name__', owner)}.{name} is gone in this "
              "release: the worker's code calls nothing in its place")
        yield
        return
    setattr(owner, name, stand_in)  # a write: test_layout
    try:
        yield
    finally:
        setattr(owner, name, original)  # a write: test_layout


# --- Lightning: "am I in a notebook?", decided at import ----------------------------------------
# Lightning 2.x, lightning_fabric/utilities/imports.py: ``_IS_INTERACTIVE = hasattr(sys, "ps1") or
# bool(sys.flags.interactive)``, computed once when Lightning is imported and copied by ``from ...
# import`` into the modules below; checked on pytorch-lightning 2.6.6 (the package and the unified
# ``lightning`` one). Imported in a notebook before the launch, Lightning carries the kernel's
# answer into the forked workers and refuses ``strategy="ddp"`` there.
LIGHTNING_INTERACTIVE = tuple(
    f"{package}.{module}" for package, modules in (
        ("lightning_fabric", ("utilities.imports", "strategies.launchers.multiprocessing")),
        ("lightning.fabric", ("utilities.imports", "strategies.launchers.multiprocessing")),
        ("pytorch_lightning", ("trainer.connectors.accelerator_connector",
                               "callbacks.progress.rich_progress")),
        ("lightning.pytorch", ("trainer.connectors.accelerator_connector",
                               "callbacks.progress.rich_progress")))
    for module in modules)


def lightning_in_a_worker() -> None:
    """In a worker, not interactive: what a Lightning imported before the fork believes too."""
    for name in LIGHTNING_INTERACTIVE:
        module = sys.modules.get(name)
        if module is None:
            continue
        if not hasattr(module, "_IS_INTERACTIVE"):
            _loud("lightning", f"{name}._IS_INTERACTIVE is gone in this Lightning; imported in a "
                  "notebook before the launch, it may refuse strategy='ddp' in the workers")
            continue
        module._IS_INTERACTIVE = False  # type: ignore[attr-defined]  # a write: test_layout


# --- CPython: an exception raised in another thread ---------------------------------------------
# CPython C API PyThreadState_SetAsyncExc (Include/ceval.h), through ctypes.pythonapi (checked on
# CPython 3.11: a one-process launch's timeout outside the main thread).


def raise_in_thread(thread_id: int, exception: type[BaseException]) -> bool:
    """Raise ``exception`` in ``thread_id`` at its next Python instruction; False if impossible."""
    setter = getattr(getattr(ctypes, "pythonapi", None), "PyThreadState_SetAsyncExc", None)
    if setter is None:
        _loud("async-exc", "PyThreadState_SetAsyncExc is not available in this Python; a timeout "
              "outside the main thread cannot interrupt the function")
        return False
    return bool(setter(ctypes.c_ulong(thread_id), ctypes.py_object(exception)))


# --- CPython: the default start method a spawn or forkserver start fixes -----------------------
# CPython 3.8-3.13, Lib/multiprocessing/spawn.py: get_preparation_data(), which every spawn and
# forkserver start calls in the parent (popen_spawn_posix, popen_forkserver), asks the *default*
# context for its start method without allow_none, and that fixes it to the platform's default
# (DefaultContext._actual_context, Lib/multiprocessing/context.py; python/cpython#109263). A
# process of an explicit context then leaves the caller unable to call set_start_method. Checked
# on CPython 3.10, 3.11, 3.12 and 3.13.


@contextlib.contextmanager
def default_start_method_kept() -> Iterator[None]:
    """Start processes inside: multiprocessing's default start method stays as it was (unset
    stays unset), whatever CPython's spawn preparation fixes on the way."""
    default = getattr(multiprocessing.context, "_default_context", None)
    if not hasattr(default, "_actual_context"):
        _loud("mp-default", "multiprocessing's default context has no _actual_context in this "
              "Python; a spawn or forkserver launch may fix the caller's start method")
        yield
        return
    before = default._actual_context  # type: ignore[union-attr]
    try:
        yield
    finally:
        # Only what CPython's preparation set: the platform's default, where nothing was set.
        if before is None and default._actual_context is default._default_context:  # type: ignore[union-attr]
            default._actual_context = None  # type: ignore[union-attr]  # a write: test_layout


# --- TorchTPU -----------------------------------------------------------------------------------
# torch-tpu 0.2.0, torch_tpu/_internal/distributed/distributed.py: set_tpu_launch_env() (marked
# experimental) writes its launch variables into os.environ, never overwriting one already set,
# and may write some before it raises ("expected TPU devices, got none"). Each value it generates
# is memoized in torch_tpu/_internal/env_utils.py ``_resolved_values`` and reused even after the
# variable is unset, so a second launch in the same process would get the first one's ports and
# topology; those entries are dropped before each call.
TPU_LAUNCH_VARS = ("TORCH_TPU_SLICEBUILDER_ADDRESSES", "TORCH_TPU_TOPOLOGY",
                   "TORCH_TPU_XPROF_SESSION_ID", "NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")


def tpu_launch_env(nproc_per_node: int, nnodes: int | None = None) -> dict[str, str]:
    """The variables TorchTPU's ``set_tpu_launch_env`` computes for this launch: what it writes
    into ``os.environ``, which the caller puts back (`backends.environment.overlay`)."""
    importlib.import_module("torch_tpu")  # installs torch.tpu even with autoload turned off
    from torch.tpu import distributed  # type: ignore[attr-defined]

    before = dict(os.environ)
    _forget_resolved(TPU_LAUNCH_VARS)
    try:
        with warnings.catch_warnings():
            # "<TorchTpu/ApiStage/ExperimentalApi/> set_tpu_launch_env is experimental": known.
            warnings.filterwarnings("ignore", message="<TorchTpu/ApiStage/")
            distributed.set_tpu_launch_env(nnodes=nnodes, nproc_per_node=nproc_per_node)
        return {name: value for name, value in os.environ.items() if before.get(name) != value}
    finally:
        _forget_resolved(TPU_LAUNCH_VARS)


def _forget_resolved(names: tuple[str, ...]) -> None:
    module = sys.modules.get("torch_tpu._internal.env_utils")
    resolved = getattr(module, "_resolved_values", None)
    if not isinstance(resolved, dict):
        _loud("tpu-resolved", "torch_tpu._internal.env_utils._resolved_values is gone in this "
              "torch-tpu; a second launch in this process may reuse the first one's TorchTPU "
              "ports and topology")
        return
    for name in names:
        resolved.pop(name, None)


@dataclass(frozen=True)
class CacheStats:
    compiles: int
    hits: int
    compile_seconds: float | None = None


# torch-tpu 0.2.0, torch_tpu/_internal/device/_device_module.py: ``torch.tpu._get_cache_stats()``
# (private) returns the compilation cache's entries, each with ``num_compilations``,
# ``num_cache_hits`` and ``num_cache_reqs`` (CacheEntryStats); ``_get_cache_hits()`` and
# ``_get_cache_misses()`` give the totals. torch_tpu/_loader.py sets ``_LOADED`` once it set up
# the TPU device; asking the cache before the runtime runs would start it.


def tpu_cache_stats() -> CacheStats | None:
    """The compilation cache's counters, or None where TorchTPU's runtime does not run here."""
    loader = sys.modules.get("torch_tpu._loader")
    torch = sys.modules.get("torch")
    tpu = getattr(torch, "tpu", None)
    if loader is None or tpu is None or not getattr(loader, "_LOADED", False):
        return None
    is_initialized = getattr(tpu, "is_initialized", None)
    if is_initialized is None or not is_initialized():
        return None
    try:
        return _cache_stats(tpu)
    except Exception as error:  # a report never fails the training
        _loud("tpu-cache", f"torch.tpu's compilation cache counters could not be read ({error}); "
              "the report shows no compilations for TorchTPU")
        return None


def _cache_stats(tpu: Any) -> CacheStats | None:
    entries = tpu._get_cache_stats() if hasattr(tpu, "_get_cache_stats") else None
    if isinstance(entries, dict):
        entries = list(entries.values())
    if isinstance(entries, (list, tuple)) and all(hasattr(e, "num_compilations") for e in entries):
        seconds = None
        times: list[Any] = [getattr(entry, "compile_time", None) for entry in entries]
        if times and all(hasattr(t, "total_seconds") for t in times):
            seconds = sum(t.total_seconds() for t in times)
        return CacheStats(sum(int(e.num_compilations) for e in entries),
                          sum(int(e.num_cache_hits) for e in entries), seconds)
    if hasattr(tpu, "_get_cache_misses") and hasattr(tpu, "_get_cache_hits"):
        return CacheStats(int(tpu._get_cache_misses()), int(tpu._get_cache_hits()))
    _loud("tpu-cache-shape", "torch.tpu._get_cache_stats() returned an unknown shape in this "
          "torch-tpu; the report shows no compilations for TorchTPU")
    return None


# --- torch.compile (dynamo): what it compiled in this process -----------------------------------
# torch 2.8, 2.13 and 2.15 (checked: the core tiers), torch/_dynamo/utils.py: ``counters``
# (a defaultdict of Counters): "stats"
# "unique_graphs" (graphs captured), "frames" "ok" (frames compiled, recompilations included),
# "graph_break" (one key per break reason). torch/_dynamo/convert_frame.py:
# ``FRAME_COMPILE_COUNTER`` (frame id -> times that frame was compiled).


def dynamo_counts() -> dict[str, Any] | None:
    """torch.compile's running totals in this process; None where dynamo was never imported.

    ``per_frame`` maps each compiled frame to the times it was compiled, so the caller can tell
    recompilations in a stretch of the run (a frame compiled again) from first compilations.
    Read-only: never imports torch or dynamo (a worker that did not use torch.compile pays
    nothing).
    """
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return None
    counters = getattr(utils, "counters", None)
    if not isinstance(counters, dict):
        _loud("dynamo", "torch._dynamo.utils.counters is gone in this torch; the report no longer "
              "says what torch.compile compiled")
        return None
    frames = sys.modules.get("torch._dynamo.convert_frame")
    per_frame = getattr(frames, "FRAME_COMPILE_COUNTER", None)
    if frames is not None and not isinstance(per_frame, dict):
        _loud("dynamo-frames", "torch._dynamo.convert_frame.FRAME_COMPILE_COUNTER is gone in "
              "this torch; the report no longer counts torch.compile's recompilations")
    return {
        "graphs": int(counters.get("stats", {}).get("unique_graphs", 0)),
        "graph_breaks": int(sum(counters.get("graph_break", {}).values())),
        "frames": int(counters.get("frames", {}).get("ok", 0)),
        "per_frame": dict(per_frame) if isinstance(per_frame, dict) else {},
    }


# --- Jupyter: what a forked worker displays ----------------------------------------------------
# ipykernel 7.4.0 (checked: the notebook tier), ipykernel/ipkernel.py: the kernel's ``session``
# (a jupyter_client ``Session``) is the one ``shell.display_pub`` (display_data,
# update_display_data, clear_output: zmqshell.py ``ZMQDisplayPublisher``) and every comm
# (comm_open/comm_msg/comm_close: ipykernel/comm/comm.py ``publish_msg``) send through, as
# ``session.send(socket, msg_or_type, content, parent, ident, buffers, track, header, metadata)``.
# jupyter_client/session.py ``Session.send`` drops whatever a forked process sends ("attempted to
# send message from fork"). In a forked worker xlaunch replaces ``send`` on that one session
# object (the worker's copy: the kernel's own is untouched) so those messages go to the caller.
# ``kernel.iopub_socket`` takes sends from any thread (ipykernel/iostream.py BackgroundSocket);
# ``kernel.get_parent("shell")`` (ipykernel >= 6) is the request the launching cell made.
ROUTED_MESSAGES = frozenset({"display_data", "update_display_data", "clear_output",
                             "comm_open", "comm_msg", "comm_close"})
# (msg_type, content, metadata, buffers) -> True when taken
MessageSink = Any


def _running_kernel() -> Any:
    """The ipykernel kernel this process runs (or was forked from); None outside a kernel."""
    ipython = sys.modules.get("IPython")
    get_ipython = getattr(ipython, "get_ipython", None)
    shell = get_ipython() if get_ipython is not None else None
    return getattr(shell, "kernel", None) if shell is not None else None


def kernel_publisher() -> Any:
    """In a Jupyter kernel: ``publish(msg_type, content, metadata, buffers)`` on its iopub channel
    under the request running now (the launching cell); None anywhere else."""
    kernel = _running_kernel()
    if kernel is None:
        return None
    session = getattr(kernel, "session", None)
    iopub = getattr(kernel, "iopub_socket", None)
    get_parent = getattr(kernel, "get_parent", None)
    if session is None or iopub is None or get_parent is None or not hasattr(session, "send"):
        _loud("kernel-iopub", "this ipykernel has no session/iopub_socket/get_parent (checked on "
              "ipykernel 7.4); what workers display (display(), widgets, tqdm.auto bars) is "
              "dropped: use text output (from tqdm import tqdm)")
        return None
    parent = get_parent("shell")

    def publish(msg_type: str, content: dict[str, Any], metadata: dict[str, Any] | None,
                buffers: list[bytes] | None) -> None:
        topic = (f"comm-{content.get('comm_id')}" if msg_type.startswith("comm_")
                 else "display_data").encode()
        session.send(iopub, msg_type, content, parent=parent, ident=topic,
                     metadata=metadata or {}, buffers=buffers or None)

    return publish


def route_kernel_messages(sink: MessageSink) -> bool:
    """In a forked worker of a kernel: displays and comm messages go to ``sink``, not the
    kernel's sockets. False (and a loud warning) where this ipykernel differs."""
    kernel = _running_kernel()
    if kernel is None:
        return False
    shell = getattr(kernel, "shell", None)
    sessions = {id(s): s for s in (getattr(kernel, "session", None),
                                   getattr(getattr(shell, "display_pub", None), "session", None))
                if s is not None and hasattr(s, "send")}
    if not sessions:
        _loud("kernel-session", "this ipykernel's kernel has no session (checked on ipykernel "
              "7.4); what workers display (display(), widgets, tqdm.auto bars) is dropped: use "
              "text output (from tqdm import tqdm)")
        return False
    for session in sessions.values():
        session.send = _routed(session.send, sink)
    return True


def _routed(original: Any, sink: MessageSink) -> Any:
    def send(stream: Any, msg_or_type: Any, content: Any = None, parent: Any = None,
             ident: Any = None, buffers: Any = None, track: bool = False, header: Any = None,
             metadata: Any = None) -> Any:
        if isinstance(msg_or_type, dict):
            msg_type = msg_or_type.get("header", {}).get("msg_type")
            content, metadata = msg_or_type.get("content"), msg_or_type.get("metadata")
            buffers = buffers or msg_or_type.get("buffers")
        else:
            msg_type = msg_or_type
        if msg_type in ROUTED_MESSAGES and sink(msg_type, content or {}, metadata, buffers):
            return None
        return original(stream, msg_or_type, content, parent, ident, buffers, track, header,
                        metadata)

    return send
