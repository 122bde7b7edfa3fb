"""A stack dump as users read it: their own frames, not the launcher's or Python's machinery."""

from __future__ import annotations

import sysconfig

LAUNCHER_FILES = ("/xlaunch/worker/", "/xlaunch/backends/")
_STDLIB = sysconfig.get_paths()["stdlib"]


def user_frames_first(dump: str) -> str:
    """Each thread's frames of the user's code: the launcher's and the engine's below them go,
    and so do threads that run nothing of the user's (Python's own machinery waiting)."""
    blocks: list[list[str]] = []
    for line in dump.splitlines():
        if line.startswith(("Thread 0x", "Current thread 0x")) or not blocks:
            blocks.append([])
        if line.strip():
            blocks[-1].append(line)
    kept = []
    for block in blocks:
        frames = []
        for line in block:
            if line.lstrip().startswith("File ") and any(name in line for name in LAUNCHER_FILES):
                break
            frames.append(line)
        if any(_users(line) for line in frames):
            kept.append(frames)
    if len(kept) == 1 and kept[0] and kept[0][0].startswith("Current thread"):
        kept[0] = kept[0][1:]  # one thread: its frames say it all
    return "\n".join(line for block in (kept or blocks[:1]) for line in block)


def _users(line: str) -> bool:
    text = line.strip()
    return text.startswith("File ") and _STDLIB not in text or text.startswith("File \"<stdin>")
