"""What to do instead: hints added to errors whose message alone does not say it."""

from __future__ import annotations

import re

# torch_xla calls that older scripts still make; each was removed in the release named.
REMOVED_XLA_CALLS = {
    "get_ordinal": ("2.7", "torch_xla.runtime.global_ordinal()"),
    "xrt_world_size": ("2.7", "torch_xla.runtime.world_size()"),
}
_MISSING_ATTRIBUTE = re.compile(r"module '(torch_xla[\w.]*)' has no attribute '(\w+)'")


def hint_for(error: BaseException) -> str | None:
    """A line naming the replacement of a removed torch_xla call, or what to do instead of a
    launcher inside a launch, or None."""
    if isinstance(error, RuntimeError) and "Runtime is already initialized" in str(error):
        from xlaunch.worker.nested import in_worker

        if in_worker():
            return ("this replica already runs the launched function: call your function "
                    "directly instead of xmp.spawn or torch_xla.launch inside it (a script run "
                    "with `xlaunch run` has them run in place)")
    if not isinstance(error, AttributeError):
        return None
    found = _MISSING_ATTRIBUTE.search(str(error))
    if found is None or found[2] not in REMOVED_XLA_CALLS:
        return None
    release, replacement = REMOVED_XLA_CALLS[found[2]]
    return (f"{found[1]}.{found[2]} was removed in torch_xla {release}: use {replacement} "
            "(or xlaunch.ProcessState(), which works on every release)")
