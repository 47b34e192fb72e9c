"""A section of the GPU check's share of its time, asked between units of work (a length's
steps, one try of the search). Cooperative: a CUDA kernel cannot be stopped safely midway, so
a unit that overruns finishes, and what was measured before the share ran out is kept."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Budget:
    seconds: float  # the share, for the rows that say where they stopped
    deadline: float  # on `clock`
    clock: Callable[[], float] = field(default=time.perf_counter, repr=False, compare=False)

    def spent(self) -> bool:
        return self.clock() >= self.deadline

    def left(self) -> float:
        return self.deadline - self.clock()
