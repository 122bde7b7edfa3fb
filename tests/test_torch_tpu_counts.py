"""TorchTPU's report inputs, as data: its warnings counted, and shown only as the filters say."""

from __future__ import annotations

import io
import warnings

import pytest

from xlaunch import _compat
from xlaunch.backends.torch_tpu.measure import WarningCounter
from xlaunch.result.report import RankReport, make_report


def test_every_occurrence_is_counted_and_shown_as_python_would() -> None:
    shown = io.StringIO()
    with warnings.catch_warnings():
        warnings.simplefilter("default")
        warnings.filterwarnings("ignore", message="<TorchTpu/Performance/TcMalloc/")
        warnings.showwarning = lambda m, c, f, n, file=None, line=None: shown.write(f"{m}\n")
        counter = WarningCounter()
        counter.install()
        for _ in range(4):
            warnings.warn("Operator 'aten::median' is not implemented for TPU. Falling back to CPU",
                          stacklevel=1)
        warnings.warn("<TorchTpu/Performance/TcMalloc/> tcmalloc is not loaded", stacklevel=1)
        warnings.warn("an unrelated warning", stacklevel=1)
    assert counter.fallbacks == {"aten::median": 4}
    assert counter.categories == {"TorchTpu/Performance/TcMalloc/": 1}
    lines = shown.getvalue().splitlines()
    assert lines.count("Operator 'aten::median' is not implemented for TPU. Falling back to CPU") == 1
    assert "<TorchTpu/Performance/TcMalloc/> tcmalloc is not loaded" not in lines  # ignored
    assert "an unrelated warning" in lines


class Entry:
    def __init__(self, compilations: int, hits: int) -> None:
        self.num_compilations, self.num_cache_hits, self.num_cache_reqs = compilations, hits, hits


class FakeTpu:
    def _get_cache_stats(self):
        return {"graph-a": Entry(1, 40), "graph-b": Entry(2, 8)}


def test_cache_counters_are_summed_over_the_entries() -> None:
    assert _compat._cache_stats(FakeTpu()) == _compat.CacheStats(compiles=3, hits=48)


def test_the_report_shows_torch_tpu_counters() -> None:
    rank = RankReport(0, 1.0, 2**20, compiles=12, cache_hits=6,
                      tpu_warnings={"TorchTpu/Performance/TcMalloc/": 1},
                      cpu_fallbacks={"aten::median": 4})
    report = make_report("torch_tpu", 1.0, [rank], None)
    text = str(report)
    assert "12 graph(s) compiled, 6 cache hit(s)" in text
    assert "recompilation: rank 0 compiled 12 graphs and found 6 in its cache" in text
    assert "XLAUNCH_XLA_DEBUG" not in text  # a torch_xla setting
    assert "TorchTPU has no TPU kernel" in text and "<TorchTpu/Performance/TcMalloc/> (1 time(s))" in text


@pytest.mark.parametrize(("compiles", "hits", "warned"), [
    (12, 6, True),  # a new graph for every other look-up, in a run long enough to judge
    (5, 200, False),  # a warm-up's graphs, then found in the cache step after step
    (10, 2, False),  # a short run: mostly its warm-up, too short to call recompiling
    (3, 0, False),  # a handful of graphs is a warm-up whatever the run
])
def test_torch_tpu_recompilation_is_judged_against_the_cache_hits(compiles, hits, warned) -> None:
    rank = RankReport(0, 1.0, 2**20, compiles=compiles, cache_hits=hits)
    warnings = make_report("torch_tpu", 1.0, [rank], None).warnings
    assert any(text.startswith("recompilation") for text in warnings) == warned
