"""When to save: every N steps and/or every M minutes, whichever comes first."""

from __future__ import annotations

import time


class SaveSchedule:
    def __init__(self, every_steps: int, every_minutes: float, clock=time.monotonic):
        """`every_steps`, `every_minutes`: 0 for never."""
        self.every_steps = every_steps
        self.every_minutes = every_minutes
        self.clock = clock
        self.last_save = clock()

    def due(self, step: int) -> bool:
        by_steps = self.every_steps > 0 and step % self.every_steps == 0
        by_time = (
            self.every_minutes > 0 and self.clock() - self.last_save >= 60 * self.every_minutes
        )
        return by_steps or by_time

    def saved(self) -> None:
        self.last_save = self.clock()
