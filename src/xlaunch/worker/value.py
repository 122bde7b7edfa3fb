"""A rank's returned value, moved once: the worker writes it, the caller maps it.

The worker saves the value with ``torch.save`` into its launch folder (tensors moved to the CPU
first) and ends; the caller loads it with ``mmap=True``, so a tensor's storage is the file's pages,
not a second copy in the caller's memory, and no pipe holds the worker alive until the caller
reads. Removing the launch folder unlinks the file; the mapping stays valid. Without torch (a
function that never imported it) the value is pickled.
"""

from __future__ import annotations

import pickle
import sys
from pathlib import Path
from typing import Any

RESULT_FILE = "result"
_ZIP = b"PK\x03\x04"  # torch.save's format


def write_value(attempt: Path, value: Any) -> None:
    final = attempt / RESULT_FILE
    partial = final.with_name(RESULT_FILE + ".partial")
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.save(to_cpu(value), partial)
    else:
        with open(partial, "wb") as file:
            pickle.dump(value, file, protocol=pickle.HIGHEST_PROTOCOL)
    partial.replace(final)


def read_value(attempt: Path | None) -> Any:
    """The value local rank 0 sent back; None when it sent none."""
    file = None if attempt is None else attempt / RESULT_FILE
    if file is None or not file.exists():
        return None
    with open(file, "rb") as opened:
        saved_by_torch = opened.read(4) == _ZIP
        if not saved_by_torch:
            opened.seek(0)
            return pickle.load(opened)
    import torch

    return torch.load(file, mmap=True, weights_only=False)


def to_cpu(value: Any) -> Any:
    """Move tensors in a returned structure to the CPU so the caller can load them."""
    torch = sys.modules.get("torch")
    if torch is None:
        return value
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return type(value)((key, to_cpu(item)) for key, item in value.items())
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(to_cpu(item) for item in value))
    if isinstance(value, (list, tuple)):
        return type(value)(to_cpu(item) for item in value)
    return value
