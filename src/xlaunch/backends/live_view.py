"""A live view of the ranks in the launching cell: one small table updated in place while the
launch runs, a row per rank (its state, elapsed seconds, its last line or bar).

Made by the relay (`backends.displays`), hence only when the caller is a Jupyter kernel and the
workers are forked; ``XLAUNCH_LIVE_VIEW=0`` turns it off. Every state comes from facts the caller
already has, never a guess: the workers' marks in the launch folder (``pid-N``: running;
``returned-N``: finished; ``failure-N.json``: failed; ``cancelled-N`` or the launch's own
``cancelled`` mark: stopped; none yet: starting), the owner's record that it stopped the workers
(`owner_stopped`: a failed peer, the timeout, the stop button; a rank still running is then
stopped), and what the relay received from each rank (its last line, its live line, its bar's
text). The relay's thread calls `tick` at most every `REFRESH_S` seconds; it reads one folder
and publishes only when the table changed (elapsed seconds are whole). At the end the launch
replaces it with its report, or with nothing (`finish`).
"""

from __future__ import annotations

import contextlib
import html
import os
import re
import time
from collections.abc import Callable
from typing import Any

from xlaunch.worker.launch_dir import FAILURE, PID, LaunchDir, Mark, cancelled, written_at

LIVE_ENV = "XLAUNCH_LIVE_VIEW"  # "0": no live view
REFRESH_S = 0.5
LINE_CHARS = 80  # a row's last line, shortened to this
DISPLAY_ID = "xlaunch-live"
_TAGS = re.compile(r"<[^>]*>")


def live_view_on() -> bool:
    return os.environ.get(LIVE_ENV, "1") != "0"


class LiveView:
    """The table's state; `tick` and the ``saw_*`` calls run in the relay's thread only."""

    def __init__(self, publish: Any, folder: str, ranks: int) -> None:
        self._publish = publish
        self._launch = LaunchDir(folder)
        self._ranks = ranks
        self.display_id = f"{DISPLAY_ID}-{os.urandom(4).hex()}"
        self._last: dict[int, str] = {}  # rank -> its last line or bar, as received
        self._shown: str | None = None  # the table last published
        self._plain = ""
        self._next = 0.0
        self.updates = 0  # messages published (the first display included)
        # Whether the workers' owner stopped them (set by the launch: its owner's record).
        self.owner_stopped: Callable[[], bool] = lambda: False

    @property
    def shown(self) -> bool:
        """Whether the table is in the cell (an update of its display id reaches it)."""
        return self._shown is not None

    # --- what the relay received -------------------------------------------------------------

    def saw_text(self, rank: int, pieces: list[tuple[str, str]]) -> None:
        for _, text in reversed(pieces):
            segment = text.rstrip("\n").rsplit("\r", 1)[-1] if "\r" in text else text.rstrip("\n")
            if segment.strip():
                self._last[rank] = segment
                return

    def saw_display(self, rank: int, msg_type: str, content: dict[str, Any]) -> None:
        """A rank's live line (a text display of its own) or a widget's text (a bar's counts)."""
        if msg_type in ("display_data", "update_display_data"):
            text = content.get("data", {}).get("text/plain")
            display_id = str(content.get("transient", {}).get("display_id", ""))
            if isinstance(text, str) and display_id.startswith("xlaunch-line"):
                self._last[rank] = _without_prefix(text)
        elif msg_type == "comm_msg":
            state = content.get("data", {}).get("state")
            value = state.get("value") if isinstance(state, dict) else None
            if isinstance(value, str):
                text = html.unescape(_TAGS.sub("", value)).strip()
                if text:
                    self._last[rank] = text

    # --- in the relay's thread ---------------------------------------------------------------

    def next_due(self) -> float:
        return self._next

    def tick(self, now: float | None = None, force: bool = False) -> None:
        """Publish the table when it changed, at most every `REFRESH_S` seconds."""
        now = time.monotonic() if now is None else now
        if not force and now < self._next:
            return
        self._next = now + REFRESH_S
        rows = self.rows()
        if not rows:  # no rank known yet (their rows show as their workers start): no empty table
            return
        table = self.render(rows)
        if table == self._shown:
            return
        first = self._shown is None
        self._shown = table
        self._send("display_data" if first else "update_display_data",
                   {"text/html": table, "text/plain": self._plain})

    def finish(self, data: dict[str, Any] | None) -> None:
        """The launch ended: the table becomes ``data`` (the report's), or nothing."""
        if self._shown is None:
            return
        self._send("update_display_data", data if data is not None else {"text/plain": ""})

    def _send(self, msg_type: str, data: dict[str, Any]) -> None:
        with contextlib.suppress(Exception):  # the launch never fails for its view
            self._publish(msg_type, {"data": data, "metadata": {},
                                     "transient": {"display_id": self.display_id}}, {}, [])
            self.updates += 1

    # --- the facts ---------------------------------------------------------------------------

    def rows(self) -> list[tuple[int, str, int | None, str]]:
        """(rank, state, elapsed whole seconds or None, last line) for each rank."""
        attempt = self._launch.newest_attempt()
        marks: dict[str, dict[int, float]] = {
            kind: written_at(attempt, name) if attempt is not None else {}
            for kind, name in (("pid", PID), ("returned", Mark.RETURNED),
                               ("cancelled", Mark.CANCELLED), ("failure", FAILURE))}
        stopped = (attempt is not None and cancelled(attempt)) or self.owner_stopped()
        ranks = sorted(set(range(self._ranks)) | set(marks["pid"]))
        wall = time.time()
        rows = []
        for rank in ranks:
            started = marks["pid"].get(rank)
            ended = None
            if rank in marks["failure"]:
                state, ended = "failed", marks["failure"][rank]
            elif rank in marks["returned"]:
                state, ended = "finished", marks["returned"][rank]
            elif rank in marks["cancelled"] or (stopped and started is not None):
                state = "stopped"
            elif started is not None:
                state = "running"
            else:
                state = "stopped" if stopped else "starting"
            elapsed = None if started is None else max(0, int((ended or wall) - started))
            rows.append((rank, state, elapsed, _short(self._last.get(rank, ""))))
        return rows

    def render(self, rows: list[tuple[int, str, int | None, str]]) -> str:
        lines = [f"rank {rank}: {state}" + (f", {elapsed} s" if elapsed is not None else "")
                 + (f"  {last}" if last else "") for rank, state, elapsed, last in rows]
        self._plain = "\n".join(lines)
        cells = "".join(
            f'<tr class="xlaunch-live-rank"><td>{rank}</td><td>{state}</td>'
            f'<td>{"" if elapsed is None else f"{elapsed} s"}</td>'
            f'<td style="text-align:left;font-family:monospace">{html.escape(last)}</td></tr>'
            for rank, state, elapsed, last in rows)
        return ('<div class="xlaunch-live"><table><thead><tr><th>rank</th><th>state</th>'
                '<th>elapsed</th><th style="text-align:left">last line</th></tr></thead>'
                f"<tbody>{cells}</tbody></table></div>")


def _without_prefix(text: str) -> str:
    return re.sub(r"^\[ranks? [0-9,-]+\] ", "", text)


def _short(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= LINE_CHARS else text[:LINE_CHARS - 1] + "\u2026"
