"""A memory trace as people read it: a chart (the curve over the step, phases shaded, the peak
marked) and a short markdown text (the peak, where it happened, each phase's numbers).

The chart needs matplotlib, of the `view` extra (CAN_DRAW): a compute node without it still
gets the text."""

from __future__ import annotations

import numpy as np

from slurm_autosp.metrics.rank_memory import MemoryTrace

try:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.layout_engine import ConstrainedLayoutEngine
except ImportError:
    CAN_DRAW = False
else:
    CAN_DRAW = True
INSTALL_VIEW = "pip install 'slurm_autosp[view]'"

PHASE_COLORS = {
    "data": "#e4e4e4",
    "forward": "#d6e8fa",
    "backward": "#fde2c8",
    "optimizer": "#d6f0d4",
}
OTHER_PHASE = "#f0f0f0"
CURRENT = "#1f4ea0"
PEAK = "#e67828"
PEAK_MARK = "#c81414"
MIB = 2**20


def memory_trace_figure(trace: MemoryTrace, role: str = "") -> Figure:
    """The trace as a 960 x 380 pixel figure on its own Agg canvas: no pyplot, so nothing is
    shared between calls or threads, and the caller may save or log it as it likes. Only
    where CAN_DRAW."""
    layout = ConstrainedLayoutEngine()
    figure = Figure(figsize=(9.6, 3.8), dpi=100, layout=layout)
    FigureCanvasAgg(figure)
    ax = figure.add_subplot()
    times = np.asarray(trace.times) * 1e3
    current = np.asarray(trace.current, float) / MIB
    peak = np.asarray(trace.peak, float) / MIB
    named: set[str] = set()
    for name, start, stop in trace.phases:
        ax.axvspan(
            start * 1e3,
            stop * 1e3,
            color=PHASE_COLORS.get(name, OTHER_PHASE),
            linewidth=0,
            label=None if name in named else name,
        )
        named.add(name)
    above = peak > current  # an interval's peak above where it ends, drawn where the interval ends
    ax.vlines(times[above], current[above], peak[above], color=PEAK, label="peak between samples")
    ax.plot(times, current, color=CURRENT, linewidth=1.5, label=f"{trace.measure} at samples")
    where = ", no samples"
    if trace.times:
        i = trace.peak_index
        ax.axvline(times[i], color=PEAK_MARK, linewidth=1)
        ax.plot(times[i], peak[i], "s", color=PEAK_MARK, label="step peak")
        ax.annotate(
            f"{peak[i]:.1f} MiB",
            (times[i], peak[i]),
            xytext=(6, -4),
            textcoords="offset points",
            va="top",
            color=PEAK_MARK,
        )
        where = f" in {trace.phase_at(trace.times[i])[0]}"
    low = min(trace.current, default=0) / MIB
    high = max(trace.peak_bytes, max(trace.current, default=0)) / MIB
    pad = max((high - low) * 0.08, 0.5)
    ax.set_ylim(max(low - pad, 0.0), high + pad)
    ax.set_xlim(0, max(times[-1] if trace.times else 0.0, 1e-3))
    ax.set_xlabel("ms since step start")
    ax.set_ylabel(f"MiB {trace.measure}")
    ax.set_title(
        f"rank {trace.rank}{f' ({role})' if role else ''}, step {trace.step}: "
        f"peak {trace.peak_bytes / MIB:.1f} MiB {trace.measure}{where}",
        loc="left",
    )
    figure.legend(loc="outside lower center", ncols=7, fontsize="small", frameon=False)
    layout.execute(figure)  # once, not on every draw: it is half of a draw's time
    figure.set_layout_engine("none")
    return figure


def phase_table(trace: MemoryTrace) -> list[tuple[str, float, float, float, float]]:
    """(phase, start ms, end ms, peak MiB, MiB at its end) per phase occurrence."""
    rows = []
    times = np.asarray(trace.times)
    for name, start, stop in trace.phases:
        inside = [i for i in range(len(times)) if start < times[i] <= stop]
        peak = max((trace.peak[i] for i in inside), default=0)
        at_end = trace.current[inside[-1]] if inside else 0
        rows.append((name, start * 1e3, stop * 1e3, peak / MIB, at_end / MIB))
    return rows


def memory_trace_markdown(
    trace: MemoryTrace, role: str = "", peaks_by_rank: dict[int, int] | None = None
) -> str:
    measure = "allocated" if trace.measure == "allocated" else "resident (RSS)"
    lines = [
        f"**rank {trace.rank}, step {trace.step}**{f' (traced as {role})' if role else ''}: peak "
        f"**{trace.peak_bytes / MIB:.1f} MiB {measure}** {trace.where_peak()}.",
        "",
        f"At step start {trace.current[0] / MIB:.1f} MiB, at step end {trace.current[-1] / MIB:.1f} MiB"
        + (
            f"; reserved peak {trace.peak_reserved_bytes / MIB:.1f} MiB"
            if trace.peak_reserved_bytes
            else ""
        )
        + f"; {len(trace.times)} samples. Measured: {trace.description}.",
        "",
        "| phase | start ms | end ms | peak MiB | MiB at end |",
        "|---|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {n} | {s:.1f} | {e:.1f} | {p:.1f} | {c:.1f} |" for n, s, e, p, c in phase_table(trace)
    ]
    if peaks_by_rank:
        worst = sorted(peaks_by_rank.items(), key=lambda kv: -kv[1])[:8]
        lines += [
            "",
            "Step peak by rank (highest first): "
            + ", ".join(f"rank {r}: {b / MIB:.1f} MiB" for r, b in worst),
        ]
    return "\n".join(lines)
