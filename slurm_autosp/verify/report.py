"""What rank 0 measured, which figures fail the tolerance and why, and the printed table."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class Report:
    """What rank 0 measured; `format_report` and `failures` read it."""

    description: str
    sp_size: int
    seq_len: int
    shard_len: int
    loss: float
    ref_loss: float
    token_error: float
    mismatched_positions: list[int]  # sequence positions whose per-token loss differs
    grad_errors: dict[str, float] = field(default_factory=dict)  # parameter -> relative error
    # an AutoSP step in bf16: the worst figure of the unmodified model in bf16 on one device
    baseline_error: float | None = None

    @property
    def worst_error(self) -> float:
        """The largest of the loss's relative error, the per-token loss difference and the
        worst parameter's gradient error."""
        return max([self.loss_error, self.token_error, *self.grad_errors.values()])

    @property
    def loss_error(self) -> float:
        return abs(self.loss - self.ref_loss) / max(abs(self.ref_loss), 1e-30)


def failures(report: Report, tolerance: float) -> list[str]:
    """One line per figure above the tolerance, naming what differs and, where the pattern
    shows it, the likely cause."""
    problems = []
    if not math.isfinite(report.loss) or report.loss_error > tolerance:
        problems.append(
            f"loss {report.loss:.6f} vs single-device {report.ref_loss:.6f} (relative error {report.loss_error:.1e})"
        )
    if not report.token_error <= tolerance:
        positions = report.mismatched_positions
        line = (
            f"per-token loss differs by up to {report.token_error:.1e} at {len(positions)} sequence "
            f"position(s) {_short(positions)}"
        )
        if positions and all(p % report.shard_len == report.shard_len - 1 for p in positions):
            line += (
                f": all are the last token of an SP shard (shard length {report.shard_len}), so the label "
                "pair crossing each shard boundary is lost; labels must be shifted once over the whole "
                "sequence before sharding (prepare_sp_inputs), not inside each shard"
            )
        problems.append(line)
    bad = {name: e for name, e in report.grad_errors.items() if not e <= tolerance}
    if bad:
        worst = sorted(bad, key=lambda n: -bad[n] if math.isfinite(bad[n]) else -math.inf)[:3]
        named = ", ".join(f"{n} ({bad[n]:.1e})" for n in worst)
        problems.append(
            f"gradients of {len(bad)} of {len(report.grad_errors)} parameters differ, worst: {named}"
        )
    return problems


def _short(values: list[int], limit: int = 8) -> str:
    shown = ", ".join(str(v) for v in values[:limit])
    return f"[{shown}{', ...' if len(values) > limit else ''}]"


def format_report(report: Report, tolerance: float, worst: int = 5) -> str:
    def row(what: str, value: str, error: float) -> str:
        verdict = "ok" if error <= tolerance else "MISMATCH"
        return f"  {what:<48} {value:>12} {error:>12.2e}  {verdict}"

    ranked = sorted(
        report.grad_errors.items(),
        key=lambda item: -item[1] if math.isfinite(item[1]) else -math.inf,
    )
    worst_grad = ranked[0][1] if ranked else 0.0
    lines = [
        report.description,
        f"  {'':<48} {'value':>12} {'error':>12}  (limit {tolerance:.0e})",
        f"  {'loss, single device fp32':<48} {report.ref_loss:>12.6f}",
        row(
            f"loss, AutoSP sp_size={report.sp_size} (relative error)",
            f"{report.loss:.6f}",
            report.loss_error,
        ),
        row("per-token loss, max |l - l_ref|", "", report.token_error),
        row(f"gradients, worst of {len(ranked)} parameters", "", worst_grad),
        "    max|g - g_ref| / max|g_ref|, worst parameters:",
    ]
    lines += [f"      {name:<58} {error:.2e}" for name, error in ranked[:worst]]
    problems = failures(report, tolerance)
    if problems:
        lines.append(f"FAIL: AutoSP does not match single-device training within {tolerance:.0e}:")
        lines += [f"  - {p}" for p in problems]
    else:
        lines.append(
            f"PASS: AutoSP sp_size={report.sp_size} matches single-device fp32 training within {tolerance:.0e}"
        )
    return "\n".join(lines)
