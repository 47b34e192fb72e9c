"""The GPU check's one table: a row per finding, the correctness rows deciding the exit status."""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from pathlib import Path

from slurm_autosp.gpu_check.budget import Budget
from slurm_autosp.probe.kernels import PASS, REFUSED, KernelCheck

COLUMNS = ("check", "case", "expected", "measured", "result")
ERROR = "ERROR"  # a section that raised: its row fails the check, the sections after it run
# A length, a search or a whole section its budget did not reach; only a whole section not run
# fails the check (its rows are missing), the others are measurement rows cut short.
OUT_OF_TIME = "out of time"


@dataclass(frozen=True)
class Row:
    check: str  # exactness | plan vs peak | step | longest | bandwidth
    case: str  # what was run: the comparison, or the policy and length
    expected: str  # what it is held to, or what the plan says
    measured: str
    result: str
    correctness: bool = False  # a correctness row must pass (or be refused) for exit 0
    detail: str = ""  # how it was measured: a line under the row
    # plan vs peak on a GPU: whether the step fits, the plan's verdict (as submit decides it)
    fits: bool | None = None

    @property
    def failed(self) -> bool:
        return self.correctness and self.result not in (PASS, REFUSED)


def exactness_row(check: KernelCheck) -> Row:
    measured = "-" if check.error is None else f"error {check.error:.2e}"
    expected = "-" if check.tolerance is None else f"error <= {check.tolerance:.2e}"
    return Row("exactness", check.name, expected, measured, check.status, True, check.detail)


def render(rows: list[Row]) -> str:
    """Aligned columns, each row's detail indented under it."""
    cells = [COLUMNS, *((r.check, r.case, r.expected, r.measured, r.result) for r in rows)]
    widths = [max(len(row[i]) for row in cells) for i in range(len(COLUMNS) - 1)]
    lines = []
    for cell, row in zip(cells, [None, *rows], strict=True):
        lines.append(
            "  ".join(c.ljust(w) for c, w in zip(cell, widths, strict=False)) + "  " + cell[-1]
        )
        if row is not None and row.detail:
            lines.append(f"    {row.detail}")
    return "\n".join(lines)


def error_row(name: str, error: Exception) -> Row:
    """A failed row naming the section, the error and the innermost frame it was raised in."""
    last = traceback.format_exception_only(error)[-1].strip()
    frame = traceback.extract_tb(error.__traceback__)[-1]
    where = f"raised in {frame.name} ({Path(frame.filename).name}:{frame.lineno})"
    return Row("section", name, "no error", last, ERROR, True, where)


def out_of_time_row(check: str, case: str, budget: Budget) -> Row:
    """A measurement its section's budget did not reach: reported, not failed."""
    return Row(
        check,
        case,
        "-",
        f"not reached: the section's budget of {budget.seconds:.1f} s was spent",
        OUT_OF_TIME,
    )
