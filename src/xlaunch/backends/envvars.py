"""Environment variables set for the length of a block, then put back as they were."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping


@contextlib.contextmanager
def overlay(values: Mapping[str, str | None]) -> Iterator[None]:
    """Set each variable (None removes it) for the block; restore every one afterwards."""
    saved = {name: os.environ.get(name) for name in values}
    _apply(values)
    try:
        yield
    finally:
        _apply(saved)


def _apply(values: Mapping[str, str | None]) -> None:
    for name, value in values.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
