"""The launch report as a notebook shows it: warnings above, highlighted, then a row per rank.

`LaunchReport._repr_html_` calls `render`; IPython shows it wherever a report is displayed (the
launch itself displays it when it runs in a kernel). Plain HTML with inline styles: notebooks
strip ``<style>`` and scripts from outputs they did not trust, and these render the same in
Jupyter, Colab and Kaggle, light theme or dark.
"""

from __future__ import annotations

from html import escape
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from xlaunch.result.report import LaunchReport, RankReport

WARNING_STYLE = ("background:#fff3cd;color:#664d03;border-left:4px solid #e0a800;"
                 "padding:4px 8px;margin:4px 0")
BAR_WIDTH_PX = 120
COLUMNS = ("rank", "wall time", "compile time", "compilations", "CPU fallbacks", "torch.compile",
           "peak memory")


def render(report: LaunchReport) -> str:
    from xlaunch.result.report import _size

    title = (f"xlaunch report: {escape(report.path)} launch, {len(report.ranks)} rank(s) "
             f"reported, {report.wall_seconds:.2f} s")
    parts = [f'<div class="xlaunch-report"><div><b>{title}</b></div>']
    if report.root_cause:
        parts.append(f'<div class="xlaunch-root-cause" style="{WARNING_STYLE}"><b>root cause'
                     f"</b>: {escape(report.root_cause)}</div>")
    parts += [f'<div class="xlaunch-warning" style="{WARNING_STYLE}"><b>warning</b>: '
              f"{escape(text)}</div>" for text in report.warnings]
    if report.memory_total:
        parts.append(f"<div>this machine's memory: {_size(report.memory_total)}</div>")
    head = "".join(f'<th style="text-align:left">{name}</th>' for name in COLUMNS)
    rows = "".join(_row(rank, report.memory_total) for rank in report.ranks)
    parts.append(f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table></div>")
    return "".join(parts)


def _row(rank: RankReport, memory_total: int | None) -> str:
    compile_time = "-" if rank.compile_seconds is None else f"{rank.compile_seconds:.2f} s"
    compiles = "-" if rank.compiles is None else str(rank.compiles)
    fallbacks = ", ".join(f"{op} x{count}" for op, count in rank.cpu_fallbacks.items()) or "none"
    cells = (str(rank.rank), f"{rank.wall_seconds:.2f} s", compile_time, compiles,
             escape(fallbacks), escape(_dynamo(rank)), _memory(rank.peak_rss_bytes, memory_total))
    return '<tr class="xlaunch-rank">' + "".join(f"<td>{cell}</td>" for cell in cells) + "</tr>"


def _dynamo(rank: RankReport) -> str:
    if rank.dynamo_graphs is None:
        return "-"
    return (f"{rank.dynamo_graphs} graph(s), {rank.dynamo_graph_breaks} break(s), "
            f"{rank.dynamo_recompiles} recompilation(s)")


def _memory(peak: int, total: int | None) -> str:
    """The peak as a figure, and as a bar against the machine's memory where that is known."""
    from xlaunch.result.report import MEMORY_NEAR, _size

    if not total:
        return _size(peak)
    share = min(1.0, peak / total)
    colour = "#d9534f" if share >= MEMORY_NEAR else "#4a90d9"
    bar = (f'<span style="display:inline-block;vertical-align:middle;width:{BAR_WIDTH_PX}px;'
           f'height:10px;background:#ddd;margin-right:6px">'
           f'<span class="xlaunch-memory-bar" style="display:block;height:10px;'
           f'width:{share * 100:.1f}%;background:{colour}"></span></span>')
    return f"{bar}{_size(peak)} ({share * 100:.0f}%)"
