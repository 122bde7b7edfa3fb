"""What happened on each rank: the launch report, and the warnings that say what to do.

What costs TPU users most is not starting processes but what happens inside them: graphs compiled
again at every step, ops that silently run on the CPU, a rank near the machine's memory. Each
worker measures itself when its function ends (or fails) and leaves a small record; the launcher
gathers them into a `LaunchReport`, whose warnings name the usual cause and the fix.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from html import escape

from xlaunch.names import PathName

RECOMPILE_DOCS = "https://docs.pytorch.org/xla/release/r{release}/perf/recompilation.html"
RECOMPILE_DOCS_NEWEST = "https://docs.pytorch.org/xla/master/perf/recompilation.html"
DYNAMO_DOCS = "https://docs.pytorch.org/docs/stable/torch.compiler_troubleshooting.html"
DYNAMO_RECOMPILES = 4  # dynamo recompiles once for a new shape (then marks it dynamic); more is a loop
MEMORY_NEAR = 0.8  # a rank whose peak passes this share of the machine's memory is warned about
STEADY_COMPILES = 4  # a training loop compiles a handful of graphs (a warm-up), then reuses them
LATE_COMPILES = 3  # graphs compiled in a run's later half beyond what a final evaluation adds
TPU_PATHS = ("xla", "torch_tpu")  # where the report is always worth showing


@dataclass(frozen=True)
class RankReport:
    """One rank (one process: replicas sharing a process on v2/v3 chips share one entry)."""

    rank: int
    wall_seconds: float
    peak_rss_bytes: int
    compiles: int | None = None  # XLA only, from torch_xla.debug.metrics
    compile_seconds: float | None = None
    executions: int | None = None
    transfers_to_device: int | None = None
    transfers_from_device: int | None = None
    cpu_fallbacks: Mapping[str, int] = field(default_factory=dict)  # aten op -> times run on CPU
    steps: int | None = None  # graph cuts (torch_xla.sync / mark_step) the rank made
    compile_sources: tuple[tuple[str, int], ...] = ()  # XLAUNCH_XLA_DEBUG=1: line -> compiles
    cache_hits: int | None = None  # TorchTPU only: compiled graphs found in its cache
    tpu_warnings: Mapping[str, int] = field(default_factory=dict)  # TorchTPU category -> count
    late_compiles: int | None = None  # XLA: graphs compiled in the later half of the executions
    # torch.compile (dynamo's counters), on every path; None where the rank never used it
    dynamo_graphs: int | None = None
    dynamo_graph_breaks: int | None = None
    dynamo_recompiles: int | None = None
    # SPMD: the devices the one process drove, the global mesh set (shape and axis names), and
    # each device's memory (name, bytes used, bytes in all) where the runtime gives it
    devices: int | None = None
    mesh: str | None = None
    device_memory: tuple[tuple[str, int, int], ...] = ()

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> RankReport:
        data = json.loads(text)
        data["compile_sources"] = tuple(tuple(item) for item in data.get("compile_sources", ()))
        data["device_memory"] = tuple(tuple(item) for item in data.get("device_memory", ()))
        known = set(cls.__dataclass_fields__)
        return cls(**{key: value for key, value in data.items() if key in known})


@dataclass(frozen=True)
class LaunchReport:
    """What the last launch did, per rank; ``str()`` and ``repr()`` are the text summary."""

    path: PathName
    wall_seconds: float
    ranks: tuple[RankReport, ...] = ()
    warnings: tuple[str, ...] = ()
    memory_total: int | None = None  # this machine's memory (the memory bars' scale)
    # A failed launch: what its error leads with (rank, node and host, exception), wherever the
    # failure happened: another machine's when this one's ranks were only stopped for it
    root_cause: str | None = None

    def __str__(self) -> str:
        lines = [f"xlaunch report: {self.path} launch, {len(self.ranks)} rank(s) reported, "
                 f"{self.wall_seconds:.2f} s"]
        if self.root_cause:
            lines.append(f"root cause: {self.root_cause}")
        lines += [f"  {_rank_line(rank)}" for rank in self.ranks]
        lines += [f"warning: {text}" for text in self.warnings]
        return "\n".join(lines)

    def __repr__(self) -> str:
        # What a notebook's text/plain and a debugger show: the summary, not the dataclass's
        # fields (about 1 KB for two ranks). The fields stay attributes.
        return self.__str__()

    @property
    def has_compile_counters(self) -> bool:
        """Whether some rank used ``torch.compile`` (dynamo's counters were read there)."""
        return any(rank.dynamo_graphs is not None for rank in self.ranks)

    def _repr_html_(self) -> str:
        """A notebook's view: warnings above, highlighted, then a table with a row per rank."""
        return render(self)


def report_shown(report: LaunchReport) -> bool:
    """Whether a launch shows its report (the rule README, the docs and ``report=`` describe).

    Shown when it has something to say: always on the TPU paths (``xla``, ``torch_tpu``), where
    compilations and CPU fallbacks are what TPU users lose most time to; on the other paths only
    when it has a warning or torch.compile counters. Never when no rank reported (a timeout before
    any rank's function ended): an empty table says nothing. `notebook_launcher` displays it as a
    table in a notebook, as text on stderr elsewhere; ``report=False`` shows nothing.
    """
    if not report.ranks:
        return False
    return report.path in TPU_PATHS or bool(report.warnings) or report.has_compile_counters


def _rank_line(rank: RankReport) -> str:
    text = f"rank {rank.rank}: {rank.wall_seconds:.2f} s, peak memory {_size(rank.peak_rss_bytes)}"
    if rank.compiles is not None and rank.cache_hits is not None:  # TorchTPU
        text += f", {rank.compiles} graph(s) compiled, {rank.cache_hits} cache hit(s)"
    elif rank.compiles is not None:
        text += (f", {rank.compiles} graph(s) compiled in {rank.compile_seconds or 0:.2f} s, "
                 f"{rank.executions} run(s), {rank.transfers_to_device} transfer(s) to and "
                 f"{rank.transfers_from_device} from the device")
    if rank.devices:
        text += f"; SPMD over {rank.devices} devices, mesh {rank.mesh or '(none set)'}"
        text += "".join(f"; {name} {used / 2**20:.0f} of {total / 2**20:.0f} MiB"
                        for name, used, total in rank.device_memory)
    if rank.tpu_warnings:
        text += ", TorchTPU warnings: " + ", ".join(f"{c} x{n}" for c, n in rank.tpu_warnings.items())
    if rank.dynamo_graphs is not None:
        text += (f", torch.compile: {rank.dynamo_graphs} graph(s), {rank.dynamo_graph_breaks} "
                 f"graph break(s), {rank.dynamo_recompiles} recompilation(s)")
    if rank.cpu_fallbacks:
        text += ", on the CPU: " + ", ".join(f"{op} x{n}" for op, n in rank.cpu_fallbacks.items())
    return text


def _size(count: int) -> str:
    return f"{count / 2**30:.2f} GiB" if count >= 2**30 else f"{count / 2**20:.0f} MiB"


def make_report(path: PathName, wall_seconds: float, ranks: Sequence[RankReport],
                memory_total: int | None) -> LaunchReport:
    ordered = tuple(sorted(ranks, key=lambda rank: rank.rank))
    return LaunchReport(path, wall_seconds, ordered,
                        tuple(warnings_for(ordered, memory_total, path)), memory_total)


def warnings_for(ranks: Sequence[RankReport], memory_total: int | None,
                 path: PathName = "xla") -> list[str]:
    warnings = []
    recompiling = [rank for rank in ranks if recompiles(rank)]
    if recompiling:
        worst = max(recompiling, key=lambda r: r.compiles or 0)
        warnings.append(
            f"recompilation: rank {worst.rank} compiled {worst.compiles} graphs "
            + (f"in {worst.steps} steps{_late(worst)}, " if worst.steps
               else f"and found {worst.cache_hits} in its cache, ")
            + "so graphs are still being compiled step after step. Usual causes: input "
            "shapes that change (pad batches to a fixed size, drop_last=True), Python values "
            "read from tensors inside the loop (.item(), print, if on a tensor)"
            + (". Run with XLAUNCH_XLA_DEBUG=1 to see which lines trigger compilations; more: "
               f"{recompile_docs()}" if path == "xla" else "."))
        warnings += _sources(worst)
    warnings += _dynamo_warnings(ranks)
    fallbacks: dict[str, int] = {}
    for rank in ranks:
        for op, count in rank.cpu_fallbacks.items():
            fallbacks[op] = fallbacks.get(op, 0) + count
    if fallbacks:
        ops = ", ".join(f"{op} ({count} time(s))" for op, count in sorted(fallbacks.items()))
        lacking = "TorchTPU has no TPU kernel" if path == "torch_tpu" else "XLA has no lowering"
        warnings.append(
            f"CPU fallbacks: {ops} ran on the CPU because {lacking} for them; each "
            "call copies its tensors to the host and back and cuts the graph. Replace the op, "
            "or move it out of the training step.")
    warnings += _performance(ranks)
    if memory_total:
        for rank in ranks:
            if rank.peak_rss_bytes >= MEMORY_NEAR * memory_total:
                warnings.append(
                    f"host memory: rank {rank.rank} peaked at {_size(rank.peak_rss_bytes)} of "
                    f"this machine's {_size(memory_total)}. Near the limit the out-of-memory "
                    "killer ends a process with SIGKILL; load data lazily, lower the batch size "
                    "or the number of data-loader workers.")
    return warnings


def _performance(ranks: Sequence[RankReport]) -> list[str]:
    """TorchTPU's own performance warnings (``<TorchTpu/Performance/...>``), counted."""
    counts: dict[str, int] = {}
    for rank in ranks:
        for category, count in rank.tpu_warnings.items():
            if category.startswith("TorchTpu/Performance/"):
                counts[category] = counts.get(category, 0) + count
    if not counts:
        return []
    seen = ", ".join(f"<{category}> ({count} time(s))" for category, count in sorted(counts.items()))
    return [f"TorchTPU performance warnings: {seen}; each says what it costs and how to fix it "
            "in the ranks' output above."]


def recompiles(rank: RankReport) -> bool:
    """Still compiling step after step, judged on the run's later half.

    A loop warms up: it compiles its graphs in its first steps (a short run compiles most of its
    graphs there: 12 in 15 steps is a warm-up, not recompilation), then only runs them. So what
    counts is the graphs compiled after half the run's executions: a new graph for every other
    execution or more there (and more than the couple a final evaluation adds) means the loop
    keeps compiling. Without the metrics' samples (an older release), the whole run's count, and
    only where the run was long enough to have warmed up.
    """
    compiles = rank.compiles or 0
    if compiles <= STEADY_COMPILES:
        return False
    if rank.cache_hits is not None:  # TorchTPU: new graphs against graphs found in its cache
        lookups = compiles + rank.cache_hits
        return lookups >= 4 * STEADY_COMPILES and compiles * 2 >= lookups
    if rank.late_compiles is not None:
        late_executions = (rank.executions or 0) // 2
        return rank.late_compiles >= LATE_COMPILES and rank.late_compiles * 2 >= late_executions
    if not rank.steps or rank.steps < 4 * STEADY_COMPILES:
        return False
    return compiles * 2 >= rank.steps


def recompile_docs() -> str:
    """torch_xla's recompilation guide for the installed release (the newest docs without one)."""
    from importlib import metadata

    try:
        major, minor = metadata.version("torch_xla").split(".")[:2]
    except (metadata.PackageNotFoundError, ValueError):
        return RECOMPILE_DOCS_NEWEST
    return RECOMPILE_DOCS.format(release=f"{major}.{minor}")


def _late(rank: RankReport) -> str:
    return "" if rank.late_compiles is None else f", {rank.late_compiles} of them in its later half"


def _dynamo_warnings(ranks: Sequence[RankReport]) -> list[str]:
    looping = [rank for rank in ranks if (rank.dynamo_recompiles or 0) > DYNAMO_RECOMPILES]
    if not looping:
        return []
    worst = max(looping, key=lambda rank: rank.dynamo_recompiles or 0)
    return [
        f"torch.compile recompilation: rank {worst.rank} recompiled {worst.dynamo_recompiles} "
        f"times ({worst.dynamo_graphs} graphs, {worst.dynamo_graph_breaks} graph breaks), so "
        "the compiled code keeps being recompiled. Usual causes: input shapes that change (pad "
        "batches, drop_last=True, or torch._dynamo.mark_dynamic), Python values or globals that "
        "change each step, a new model object per step. TORCH_LOGS=recompiles prints why each "
        f"recompilation happened; more: {DYNAMO_DOCS}"]


def _sources(rank: RankReport) -> list[str]:
    if not rank.compile_sources:
        return []
    lines = ", ".join(f"{where} ({count}x)" for where, count in rank.compile_sources[:5])
    return [f"compilations were triggered most often at: {lines}"]


# --- in a notebook ------------------------------------------------------------------------------

WARNING_STYLE = ("background:#fff3cd;color:#664d03;border-left:4px solid #e0a800;"
                 "padding:4px 8px;margin:4px 0")
BAR_WIDTH_PX = 120
COLUMNS = ("rank", "wall time", "compile time", "compilations", "CPU fallbacks", "torch.compile",
           "peak memory")


def render(report: LaunchReport) -> str:
    """The report as a notebook shows it: warnings above, highlighted, then a row per rank.
    Plain HTML with inline styles: notebooks strip ``<style>`` and scripts from outputs they did
    not trust, and these render the same in Jupyter, Colab and Kaggle, light theme or dark."""
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
    if not total:
        return _size(peak)
    share = min(1.0, peak / total)
    colour = "#d9534f" if share >= MEMORY_NEAR else "#4a90d9"
    bar = (f'<span style="display:inline-block;vertical-align:middle;width:{BAR_WIDTH_PX}px;'
           f'height:10px;background:#ddd;margin-right:6px">'
           f'<span class="xlaunch-memory-bar" style="display:block;height:10px;'
           f'width:{share * 100:.1f}%;background:{colour}"></span></span>')
    return f"{bar}{_size(peak)} ({share * 100:.0f}%)"
