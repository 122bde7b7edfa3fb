"""Workers' text in a notebook, shown by the caller: a line several ranks print alike, close
together, shows once with its ranks (``[ranks 0-3] loss 0.25``).

Each rank's output arrives as pieces (`worker.displays`, ``xlaunch_text``): whole lines with
the prefix they need, or a line's continuation. A whole, prefixed line waits `WINDOW_S` seconds
for the same line from other ranks; others join it, so it shows once with every rank that
printed it. A rank's own order is kept: joining a line moves the rank's lines that arrived after
it (its own alone) before it, or it does not join. Everything else goes out as it came. With
``fold=False`` (a custom ``log_line_prefix_template``, or ``XLAUNCH_FOLD_LINES=0``) nothing is
folded.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

WINDOW_S = 0.25
LOOKBACK = 64  # lines a new one is compared with: a flood of lines costs linear time
FOLD_ENV = "XLAUNCH_FOLD_LINES"  # "0": every rank's line shows on its own


@dataclass(eq=False)  # each line is itself: two alike are two
class _Line:
    arrived: float
    name: str  # stdout or stderr
    text: str
    prefix: str  # the first rank's own prefix ("" for a continuation)
    ranks: list[int] = field(default_factory=list)
    foldable: bool = False


class TextFolder:
    def __init__(self, fold: bool) -> None:
        self.fold = fold
        self._lines: list[_Line] = []

    def add(self, rank: int, name: str, pieces: list[tuple[str, str]],
            now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for prefix, text in pieces:
            foldable = self.fold and bool(prefix) and text.endswith("\n")
            if not (foldable and self._join(rank, name, text, now)):
                self._lines.append(_Line(now, name, text, prefix, [rank], foldable))

    def _join(self, rank: int, name: str, text: str, now: float) -> bool:
        """Join the same line of another rank, arrived within the window. The rank's own lines
        that arrived after that one (its lines alone) move before it: its order is kept."""
        lines = self._lines
        for index in range(len(lines) - 1, max(-1, len(lines) - 1 - LOOKBACK), -1):
            line = lines[index]
            if now - line.arrived > WINDOW_S:
                return False
            if line.foldable and line.name == name and line.text == text and rank not in line.ranks:
                later = [other for other in lines[index + 1:] if rank in other.ranks]
                if any(other.ranks != [rank] for other in later):
                    return False  # they are other ranks' lines too: none can move
                self._lines = [other for other in lines if other not in later]
                self._lines[index:index] = later
                line.ranks.append(rank)
                return True
        return False

    def due(self, now: float | None = None, everything: bool = False) -> list[tuple[str, str]]:
        """What can be shown now, in order, as (stream name, text); consecutive lines of one
        stream joined."""
        now = time.monotonic() if now is None else now
        out: list[tuple[str, str]] = []
        count = 0
        for line in self._lines:
            if not everything and now - line.arrived <= WINDOW_S:
                break
            count += 1
            text = _prefix(line) + line.text
            if out and out[-1][0] == line.name:
                out[-1] = (line.name, out[-1][1] + text)
            else:
                out.append((line.name, text))
        del self._lines[:count]
        return out

    def take_all(self) -> list[tuple[str, str]]:
        """Everything waiting, unfolded, each line as it came (what is not text made text): the
        relay's way out when `due` fails on a line a worker sent that is not text."""
        lines, self._lines = self._lines, []
        return [(str(line.name), f"{line.prefix}{line.text}") for line in lines]

    def next_due(self) -> float | None:
        return self._lines[0].arrived + WINDOW_S if self._lines else None  # what due() waits on


def _prefix(line: _Line) -> str:
    if len(line.ranks) < 2:
        return line.prefix
    return f"[ranks {rank_ranges(line.ranks)}] "


def rank_ranges(ranks: list[int]) -> str:
    """0,1,2,3,5 -> ``0-3,5``."""
    spans: list[list[int]] = []
    for rank in sorted(ranks):
        if spans and rank == spans[-1][1] + 1:
            spans[-1][1] = rank
        else:
            spans.append([rank, rank])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in spans)
