"""The launch report as a notebook shows it (`LaunchReport._repr_html_`), as data."""

from __future__ import annotations

import re

from xlaunch.result.report import RankReport, make_report

GIB = 2**30


def report(memory_total=16 * GIB, **xla):
    ranks = [RankReport(rank=1, wall_seconds=2.5, peak_rss_bytes=14 * GIB, **xla),
             RankReport(rank=0, wall_seconds=2.0, peak_rss_bytes=2 * GIB, **xla)]
    return make_report("xla", 3.0, ranks, memory_total)


def test_a_row_per_rank_in_rank_order_with_its_figures():
    html = report(compiles=3, compile_seconds=1.25, cpu_fallbacks={"aten::histc": 4})._repr_html_()
    rows = re.findall(r'<tr class="xlaunch-rank">(.*?)</tr>', html)
    assert len(rows) == 2
    assert rows[0].startswith("<td>0</td><td>2.00 s</td><td>1.25 s</td><td>3</td>")
    assert "<td>aten::histc x4</td>" in rows[1]


def test_warnings_come_first_highlighted_and_escaped():
    html = report(cpu_fallbacks={"aten::<op>": 1})._repr_html_()
    warnings = re.findall(r'<div class="xlaunch-warning" style="([^"]*)"><b>warning</b>: (.*?)</div>',
                          html)
    assert len(warnings) == 2  # the fallback, and rank 1's memory near the machine's
    assert all("background" in style for style, _ in warnings)
    assert html.index("xlaunch-warning") < html.index("<table>")
    assert "aten::&lt;op&gt;" in html and "aten::<op>" not in html


def test_peak_memory_is_a_bar_against_the_machines_memory():
    html = report()._repr_html_()
    bars = re.findall(r'class="xlaunch-memory-bar" style="[^"]*width:([\d.]+)%;background:(#\w+)', html)
    assert bars == [("12.5", "#4a90d9"), ("87.5", "#d9534f")]  # rank 1 near the limit: red
    assert "this machine's memory: 16.00 GiB" in html


def test_without_the_machines_memory_only_the_figure():
    html = report(memory_total=None)._repr_html_()
    assert "xlaunch-memory-bar" not in html and "<td>2.00 GiB</td>" in html


def test_the_text_form_is_unchanged_for_terminals():
    text = str(report(compiles=3, compile_seconds=1.25))
    assert text.startswith("xlaunch report: xla launch, 2 rank(s) reported, 3.00 s\n  rank 0:")
    assert "<" not in text
