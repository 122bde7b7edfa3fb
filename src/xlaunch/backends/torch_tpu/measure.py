"""What a TorchTPU rank did, as its function ends: compilations, cache hits, CPU fallbacks, and
TorchTPU's categorised warnings.

- Compilations and cache hits: ``torch.tpu._get_cache_stats()`` (private, through `_compat`),
  asked only where TorchTPU's runtime already runs in this process: asking starts it otherwise.
- CPU fallbacks: TorchTPU warns "Operator '<op>' is not implemented for TPU. Falling back to CPU".
- Its warnings carry a category prefix (``<TorchTpu/Performance/TcMalloc/> ...``).

Python shows a warning from one place once; to count every occurrence, warnings of those two
kinds always reach the counter, which then shows each only where the filters in place before
would have shown it (``ignore`` hides it, ``default``/``module``/``once`` show it once).
"""

from __future__ import annotations

import re
import warnings
from collections import Counter
from typing import Any

from xlaunch import _compat

_FALLBACK = re.compile(r"'([^']+)' is not implemented for TPU\. Falling back to CPU")
_CATEGORY = re.compile(r"^<(TorchTpu/[^>]*)>")
_COUNTED = (r".*Falling back to CPU", r"<TorchTpu/")


class WarningCounter:
    def __init__(self) -> None:
        self.fallbacks: Counter[str] = Counter()
        self.categories: Counter[str] = Counter()
        self._before: list[Any] = []
        self._shown: set[tuple[Any, ...]] = set()
        self._show: Any = None

    def install(self) -> None:
        if self._show is not None:
            return
        self._before = list(warnings.filters)
        self._show = warnings.showwarning
        for pattern in _COUNTED:
            warnings.filterwarnings("always", message=pattern)
        warnings.showwarning = self._count

    def _count(self, message: Any, category: type[Warning], filename: str, lineno: int,
               file: Any = None, line: str | None = None) -> None:
        text = str(message)
        counted = self.note(text)
        if not counted or self._visible(text, category, filename, lineno):
            self._show(message, category, filename, lineno, file, line)

    def note(self, text: str) -> bool:
        fallback, prefix = _FALLBACK.search(text), _CATEGORY.match(text)
        if fallback:
            self.fallbacks[fallback[1]] += 1
        if prefix:
            self.categories[prefix[1]] += 1
        return bool(fallback or prefix)

    def _visible(self, text: str, category: type[Warning], filename: str, lineno: int) -> bool:
        """Whether the filters in place before the counter would have shown this occurrence."""
        action = "default"
        for kind, pattern, klass, module, at in self._before:
            if ((pattern is None or pattern.match(text)) and issubclass(category, klass)
                    and (module is None or module.match(filename.removesuffix(".py")))
                    and at in (0, lineno)):
                action = kind
                break
        if action == "ignore":
            return False
        key = (text, category) if action in ("once", "module") else (text, category, filename, lineno)
        if action != "always" and key in self._shown:
            return False
        self._shown.add(key)
        return True


WARNINGS = WarningCounter()


def collect() -> dict[str, Any]:
    stats = _compat.tpu_cache_stats()
    return dict(compiles=stats.compiles if stats else None,
                compile_seconds=stats.compile_seconds if stats else None,
                cache_hits=stats.hits if stats else None,
                cpu_fallbacks=dict(WARNINGS.fallbacks), tpu_warnings=dict(WARNINGS.categories))
