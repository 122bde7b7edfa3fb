"""``split_between_processes``: each rank's contiguous share of a list, tuple, dict or tensor."""

from __future__ import annotations

import sys
from typing import Any


def share_of(inputs: Any, rank: int, size: int, apply_padding: bool) -> Any:
    """This rank's share; a dict's values are split alike and must have equal lengths."""
    if isinstance(inputs, dict):
        lengths = {len(value) for value in inputs.values()}
        if len(lengths) > 1:
            raise ValueError("split_between_processes: the dict's values must have equal "
                             f"lengths, got {sorted(lengths)}")
        length = lengths.pop() if lengths else 0
        start, end, padded = _bounds(length, rank, size, apply_padding)
        return {key: _share(value, start, end, padded) for key, value in inputs.items()}
    start, end, padded = _bounds(len(inputs), rank, size, apply_padding)
    return _share(inputs, start, end, padded)


def _bounds(length: int, rank: int, size: int, apply_padding: bool) -> tuple[int, int, int]:
    """[start, end) of this rank's share, and the length it is padded to (0: no padding)."""
    base, extra = divmod(length, size)
    start = rank * base + min(rank, extra)
    end = start + base + (1 if rank < extra else 0)
    padded = base + (1 if extra else 0) if apply_padding else 0
    return start, end, padded


def _share(items: Any, start: int, end: int, padded: int) -> Any:
    loaded_torch = sys.modules.get("torch")  # a tensor can only exist once torch is imported
    is_tensor = loaded_torch is not None and isinstance(items, loaded_torch.Tensor)
    if not (is_tensor or isinstance(items, (list, tuple))):
        raise TypeError("split_between_processes takes a list, tuple, tensor or a dict of them; "
                        f"got {type(items).__name__}")
    if is_tensor and items.dim() == 0:
        raise TypeError("split_between_processes cannot split a 0-dimensional tensor")
    share = items[start:end]
    missing = padded - (end - start)
    if missing <= 0 or len(items) == 0:
        return share
    # An empty share (fewer items than ranks) repeats the input's last item instead.
    filler = share[-1:] if end > start else items[-1:]
    if is_tensor:
        import torch

        return torch.cat([share, filler.expand(missing, *filler.shape[1:])])
    return share + filler * missing
