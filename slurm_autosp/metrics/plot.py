"""A memory trace as people read it: a chart (the curve over the step, phases shaded, the peak
marked) and a short markdown text (the peak, where it happened, each phase's numbers)."""

from __future__ import annotations

from typing import TypeVar

import numpy as np

from slurm_autosp.metrics.png import Canvas, text_width
from slurm_autosp.metrics.rank_memory import MemoryTrace

PHASE_COLORS = {
    "data": (228, 228, 228),
    "forward": (214, 232, 250),
    "backward": (253, 226, 200),
    "optimizer": (214, 240, 212),
}
CURRENT = (31, 78, 160)
PEAK = (230, 120, 40)
PEAK_MARK = (200, 20, 20)
AXIS = (90, 90, 90)
MIB = 2**20

# One time or byte count, or an array of them: the chart maps both to pixels the same way.
ScalarOrArray = TypeVar("ScalarOrArray", float, np.ndarray)


def render_memory_trace(
    trace: MemoryTrace, role: str = "", width: int = 960, height: int = 380
) -> np.ndarray:
    """The trace as an [H, W, 3] uint8 image."""
    canvas = Canvas(width, height)
    left, right, top, bottom = 84, width - 16, 44, height - 58
    end = max(trace.times[-1] if trace.times else 0.0, 1e-6)
    low = min(trace.current, default=0) / MIB
    high = max(trace.peak_bytes, max(trace.current, default=0)) / MIB
    pad = max((high - low) * 0.08, 0.5)
    low, high = max(low - pad, 0.0), high + pad

    def x(t: ScalarOrArray) -> ScalarOrArray:
        return left + (right - left) * t / end

    def y(nbytes: ScalarOrArray) -> ScalarOrArray:
        return bottom - (bottom - top) * (nbytes / MIB - low) / (high - low)

    for name, start, stop in trace.phases:
        canvas.fill(
            int(x(start)),
            top,
            max(int(x(stop)), int(x(start)) + 1),
            bottom,
            PHASE_COLORS.get(name, (240, 240, 240)),
        )
    for name, start, stop in trace.phases:
        label = (
            name
            if text_width(name) < x(stop) - x(start) - 4
            else name[0]
            if x(stop) - x(start) > 12
            else ""
        )
        canvas.text(int(x(start)) + 3, top + 4, label, AXIS)

    canvas.line(left, top, left, bottom, AXIS)
    canvas.line(left, bottom, right, bottom, AXIS)
    decimals = 0 if high - low >= 20 else 1 if high - low >= 2 else 2
    for frac in (0.0, 0.5, 1.0):
        value = low + (high - low) * frac
        ty = int(bottom - (bottom - top) * frac)
        canvas.line(left - 4, ty, left, ty, AXIS)
        canvas.text(4, ty - 5, f"{value:.{decimals}f}", AXIS)
    canvas.text(4, top - 22, "MIB", AXIS)
    for frac in (0.0, 0.25, 0.5, 0.75, 1.0):
        tx = int(left + (right - left) * frac)
        canvas.line(tx, bottom, tx, bottom + 4, AXIS)
        label = f"{end * frac * 1e3:.0f}"
        canvas.text(tx - text_width(label) // 2, bottom + 8, label, AXIS)
    canvas.text(right - text_width("MS"), bottom + 22, "MS", AXIS)

    xs, cur, pk = (
        x(np.asarray(trace.times)),
        y(np.asarray(trace.current, float)),
        y(np.asarray(trace.peak, float)),
    )
    above = pk < cur  # an interval's peak above where it ends, drawn where the interval ends
    canvas.segments(xs[above], cur[above], xs[above], pk[above], PEAK)
    canvas.segments(xs[:-1], cur[:-1], xs[1:], cur[1:], CURRENT, width=2)
    if trace.times:
        i = trace.peak_index
        px = x(trace.times[i])
        canvas.line(px, top, px, bottom, PEAK_MARK)
        canvas.fill(
            int(px) - 3,
            int(y(trace.peak[i])) - 3,
            int(px) + 4,
            int(y(trace.peak[i])) + 4,
            PEAK_MARK,
        )

    name, _ = trace.phase_at(trace.times[trace.peak_index] if trace.times else 0.0)
    title = f"RANK {trace.rank}{f' ({role})' if role else ''}  STEP {trace.step}  PEAK {trace.peak_bytes / MIB:.1f} MIB {trace.measure} IN {name}"
    canvas.text(left, 10, title, (0, 0, 0))
    lx, legend_y = left, height - 22
    for color, label in (
        (CURRENT, f"{trace.measure} at samples"),
        (PEAK, "peak between samples"),
        (PEAK_MARK, "step peak"),
    ):
        canvas.fill(lx, legend_y + 2, lx + 14, legend_y + 8, color)
        lx = canvas.text(lx + 20, legend_y, label, (0, 0, 0)) + 24
    return canvas.pixels


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
