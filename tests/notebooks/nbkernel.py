"""Driving a real Jupyter kernel from a test, and making sure it leaves no process behind.

`Kernel` runs cells one at a time through jupyter_client, as a person does in a notebook, and
collects what each cell shows (stdout, stderr, the displayed result, the error). The process
helpers find what a kernel started (its launch's workers) so that tests can check that none
outlived a launch, and kill, then report, any that did.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

KERNEL_NAME = "xlaunch-tests"
STARTUP_TIMEOUT = 120  # seconds for a kernel to answer; the machine may be busy
CELL_TIMEOUT = 300  # seconds for one cell; a launch that hangs fails here, not at pytest's limit


def descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def living(processes: list[psutil.Process]) -> list[psutil.Process]:
    """Processes still running; a zombie counts, since nobody reaped it."""
    return [p for p in processes if p.is_running()]


def kill_all(processes: list[psutil.Process]) -> list[psutil.Process]:
    """Kill what is still alive of ``processes`` (all started by a test kernel); return them."""
    survivors = living(processes)
    for process in survivors:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(survivors, timeout=10)
    return survivors


@dataclass
class CellRun:
    """What one executed cell produced, as the notebook shows it."""

    status: str  # "ok" or "error"
    stdout: str = ""
    stderr: str = ""
    results: list[str] = field(default_factory=list)  # text/plain of execute_result outputs
    displays: list[dict[str, Any]] = field(default_factory=list)  # display_data: mime type -> data
    error: dict[str, Any] | None = None  # ename, evalue, traceback
    # What a frontend keeps: each display id's last data (display_data, then its updates), and
    # each widget's state (comm_open, then its "update" messages), as a notebook stores them.
    display_states: dict[str, dict[str, Any]] = field(default_factory=dict)
    widget_states: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Every display and display update that names a display id, in order: (id, data).
    display_updates: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    # The cell's displays in order, as a notebook keeps them: [display id or None, last data].
    outputs: list[list[Any]] = field(default_factory=list)
    # The processes that sent the cell's displays and widget messages (the pid in each message's
    # id, which jupyter_client's Session writes as "<session>_<pid>_<n>").
    display_senders: set[int] = field(default_factory=set)

    @property
    def shown(self) -> list[dict[str, Any]]:
        """The displays the cell shows at the end, each at its last state; an output updated to
        an empty text (the launch's live view when no report takes its place) shows nothing."""
        return [data for _, data in self.outputs if data != {"text/plain": ""}]

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    @property
    def error_text(self) -> str:
        if self.error is None:
            return ""
        return "\n".join([self.error["ename"], self.error["evalue"], *self.error["traceback"]])

    def describe(self) -> str:
        return (f"status={self.status}\n--- stdout\n{self.stdout}\n--- stderr\n{self.stderr}\n"
                f"--- results\n{self.results}\n--- error\n{self.error_text}")


class Kernel:
    """One running ipykernel, driven cell by cell as a person in a notebook would."""

    def __init__(self, env: dict[str, str], cwd: Path, kernel_name: str = KERNEL_NAME) -> None:
        from jupyter_client import KernelManager

        self.manager = KernelManager(kernel_name=kernel_name)
        self.manager.start_kernel(env=env, cwd=str(cwd))
        self.client = self.manager.blocking_client()
        self.client.start_channels()
        try:
            self.client.wait_for_ready(timeout=STARTUP_TIMEOUT)
        except Exception:
            self.shutdown()
            raise
        self._seen: list[psutil.Process] = []

    @property
    def pid(self) -> int:
        return int(self.manager.provisioner.process.pid)  # type: ignore[union-attr]

    def children(self) -> list[psutil.Process]:
        """The kernel's live descendants (remembered, so shutdown can check on them)."""
        found = descendants(self.pid)
        self._seen.extend(found)
        return living(found)

    def run(self, code: str, timeout: float = CELL_TIMEOUT,
            while_running: Callable[[], None] | None = None,
            stdin_hook: Callable[[dict[str, Any]], None] | None = None) -> CellRun:
        """Execute ``code`` as one cell; ``while_running`` is called in a thread meanwhile.

        With ``stdin_hook`` the frontend offers stdin, as Jupyter does: the hook gets each input
        request (and answers it, or not)."""
        run = CellRun(status="?")

        def collect(message: dict[str, Any]) -> None:
            kind, content = message["msg_type"], message["content"]
            if kind in ("display_data", "update_display_data", "comm_open", "comm_msg"):
                run.display_senders.add(int(message["header"]["msg_id"].rsplit("_", 2)[1]))
            if kind == "stream":
                if content["name"] == "stdout":
                    run.stdout += content["text"]
                else:
                    run.stderr += content["text"]
            elif kind == "execute_result":
                run.results.append(content["data"].get("text/plain", ""))
            elif kind == "display_data":
                run.displays.append(content["data"])
                display_id = content.get("transient", {}).get("display_id")
                run.outputs.append([display_id, content["data"]])
                if display_id is not None:
                    run.display_states[display_id] = content["data"]
                    run.display_updates.append((display_id, content["data"]))
            elif kind == "update_display_data":
                display_id = content.get("transient", {}).get("display_id")
                run.display_updates.append((display_id, content["data"]))
                for output in run.outputs:
                    if display_id is not None and output[0] == display_id:
                        output[1] = content["data"]
                if display_id in run.display_states:
                    run.display_states[display_id] = content["data"]
            elif kind in ("comm_open", "comm_msg"):
                state = content.get("data", {}).get("state")
                if isinstance(state, dict):
                    run.widget_states.setdefault(content["comm_id"], {}).update(state)
            elif kind == "error":
                run.error = content

        helper = None
        if while_running is not None:
            helper = threading.Thread(target=while_running, name="cell-helper", daemon=True)
            helper.start()
        try:
            reply = self.client.execute_interactive(
                code, timeout=timeout, output_hook=collect, allow_stdin=stdin_hook is not None,
                stdin_hook=stdin_hook)
        except TimeoutError:
            # Free the kernel for the next test: stop the cell and let its reply arrive.
            self.interrupt()
            with contextlib.suppress(Exception):
                self.client.get_shell_msg(timeout=30)
            raise
        finally:
            if helper is not None:
                helper.join(timeout)
        run.status = reply["content"]["status"]
        return run

    def interrupt(self) -> None:
        self.manager.interrupt_kernel()

    def shutdown(self) -> list[psutil.Process]:
        """Stop the kernel; return (after killing them) its processes that outlived it."""
        processes = list(self._seen)
        if self.manager.has_kernel:
            processes += descendants(self.pid)
        self.client.stop_channels()
        if self.manager.has_kernel:
            self.manager.shutdown_kernel(now=True)
        return kill_all(processes)
