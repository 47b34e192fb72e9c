"""The longest sequence that fits, found by memory alone: double from the longest known to fit
until a length runs out of memory, then halve the gap between the two until it is within
`resolution` of the longer fitting one. Its section's budget is asked before each try: past it,
or where the try would not end within it (the last try's time scaled by the square of the
lengths: attention's share of a step grows so), the search stops and says so, what it found a
lower bound (the clock's answer, not the memory's), so that the sections after it still get
their time.

`fits(length)` runs one step at that length and says whether it ran without running out of
memory; lengths are multiples of `granule`, and never above `ceiling`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from slurm_autosp.gpu_check.budget import Budget


@dataclass
class Search:
    """What the search found: `longest` fits (None: not even `granule` tokens), `first_oom` ran
    out of memory (None: nothing up to `ceiling` did); every try in order; `stopped_at_s` the
    budget it stopped at before it was done (None: it finished)."""

    longest: int | None
    first_oom: int | None
    tries: list[tuple[int, bool]] = field(default_factory=list)
    stopped_at_s: float | None = None
    skipped: str = ""  # the try not started because it would overrun the budget, and why

    def describe(self) -> str:
        if self.stopped_at_s is not None:
            return (
                f"{self._so_far()}; search stopped at its budget of {self.stopped_at_s:.1f} s"
                + (f" ({self.skipped})" if self.skipped else "")
            )
        if self.longest is None:
            return f"nothing fits: {self.first_oom:,} tokens ran out of memory"
        if self.first_oom is None:
            return f"{self.longest:,} tokens fit, the ceiling: no length tried ran out of memory"
        return f"{self.longest:,} tokens fit, {self.first_oom:,} ran out of memory"

    def _so_far(self) -> str:
        oom = "" if self.first_oom is None else f", {self.first_oom:,} ran out of memory"
        if self.longest is None:
            return f"none found to fit yet{oom}"
        return f"longest >= {self.longest:,} tokens{oom}"


def longest_fitting(
    fits: Callable[[int], bool],
    known_fit: int | None,
    known_oom: int | None,
    *,
    granule: int,
    ceiling: int,
    resolution: float,
    budget: Budget,
) -> Search:
    """Search from what earlier steps showed: `known_fit` ran, `known_oom` ran out of memory
    (at least one of them known; all lengths multiples of `granule`)."""
    known = [n for n in (known_fit, known_oom, ceiling) if n is not None]
    if len(known) < 2 or any(n % granule for n in known):
        raise ValueError(
            f"search from a known length, all multiples of granule={granule}: "
            f"known_fit={known_fit}, known_oom={known_oom}, ceiling={ceiling}"
        )
    found = Search(known_fit, known_oom)
    last: tuple[int, float] | None = None  # the last try's length and seconds
    while (length := _next_length(found, granule, ceiling, resolution)) is not None:
        expected = last[1] * (length / last[0]) ** 2 if last else 0.0
        if budget.spent() or expected > budget.left():
            found.stopped_at_s = budget.seconds
            if not budget.spent():
                found.skipped = (
                    f"{length:,} tokens would take about {expected:.0f} s, "
                    f"{budget.left():.0f} s were left"
                )
            break
        start = budget.clock()
        ok = fits(length)
        last = (length, budget.clock() - start)
        found.tries.append((length, ok))
        if ok:
            found.longest = length
        else:
            found.first_oom = length
    return found


def _next_length(found: Search, granule: int, ceiling: int, resolution: float) -> int | None:
    """The next length to try; None once the search is done. While nothing fits, halve the
    shortest that ran out of memory; while nothing ran out, double the longest that fits (to the
    ceiling); then halve the gap between the two."""
    if found.longest is None:
        assert found.first_oom is not None
        if found.first_oom <= granule:
            return None
        return max(granule, found.first_oom // 2 // granule * granule)
    if found.first_oom is None:
        return None if found.longest >= ceiling else min(2 * found.longest, ceiling)
    if found.first_oom - found.longest <= max(granule, resolution * found.longest):
        return None
    return (found.longest + found.first_oom) // 2 // granule * granule
