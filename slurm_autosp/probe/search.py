"""The longest sequence that fits, found by memory alone: double from the longest known to fit
until a length runs out of memory, then halve the gap between the two until it is within
`resolution` of the longer fitting one. No time budget cuts it short: a search that stopped
for time would report the clock, not the memory.

`fits(length)` runs one step at that length and says whether it ran without running out of
memory; lengths are multiples of `granule`, and never above `ceiling`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Search:
    """What the search found: `longest` fits (None: not even `granule` tokens), `first_oom` ran
    out of memory (None: nothing up to `ceiling` did); every try in order."""

    longest: int | None
    first_oom: int | None
    tries: list[tuple[int, bool]] = field(default_factory=list)

    def describe(self) -> str:
        if self.longest is None:
            return f"nothing fits: {self.first_oom:,} tokens ran out of memory"
        if self.first_oom is None:
            return f"{self.longest:,} tokens fit, the ceiling: no length tried ran out of memory"
        return f"{self.longest:,} tokens fit, {self.first_oom:,} ran out of memory"


def longest_fitting(
    fits: Callable[[int], bool],
    known_fit: int | None,
    known_oom: int | None,
    *,
    granule: int,
    ceiling: int,
    resolution: float,
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

    def tried(length: int) -> None:
        ok = fits(length)
        found.tries.append((length, ok))
        if ok:
            found.longest = length
        else:
            found.first_oom = length

    while found.longest is None:  # even the shortest length known ran out of memory: halve
        assert found.first_oom is not None
        if found.first_oom <= granule:
            return found
        tried(max(granule, found.first_oom // 2 // granule * granule))
    while found.first_oom is None and found.longest < ceiling:
        tried(min(2 * found.longest, ceiling))
    while found.first_oom is not None and found.first_oom - found.longest > max(
        granule, resolution * found.longest
    ):
        tried((found.longest + found.first_oom) // 2 // granule * granule)
    return found
