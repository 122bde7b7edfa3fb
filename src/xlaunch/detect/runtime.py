"""Which TPU runtime is installed, and the install line that fits when none is.

Read from package metadata only: importing torch_xla may query the TPU metadata server, and a
version is all detection needs.
"""

from __future__ import annotations

from importlib import metadata

NEWEST_TORCH_XLA = (2, 9)  # the newest torch_xla release; each needs the torch of its number


def install_line() -> str:
    """The torch_xla that matches the installed torch (they are released in lockstep)."""
    newest = ".".join(map(str, NEWEST_TORCH_XLA)) + ".0"
    pair = f'pip install torch=={newest} "torch_xla[tpu]=={newest}"'
    try:
        torch = metadata.version("torch").split("+")[0]
    except metadata.PackageNotFoundError:
        return pair
    release = tuple(int(part) for part in torch.split(".")[:2] if part.isdigit())
    if release > NEWEST_TORCH_XLA:
        return f"{pair}  (torch {torch} is newer than any torch_xla release)"
    return f'pip install "torch_xla[tpu]=={torch}"  (torch_xla must match torch {torch} exactly)'
