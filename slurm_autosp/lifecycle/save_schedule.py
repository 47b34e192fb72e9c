"""When to save: every N steps and/or every M minutes, whichever comes first."""

from __future__ import annotations

import time

from slurm_autosp.config import CheckpointConfig


class SaveSchedule:
    def __init__(self, cfg: CheckpointConfig, clock=time.monotonic):
        self.cfg = cfg
        self.clock = clock
        self.last_save = clock()

    def due(self, step: int) -> bool:
        by_steps = self.cfg.every_steps > 0 and step % self.cfg.every_steps == 0
        by_time = (
            self.cfg.every_minutes > 0
            and self.clock() - self.last_save >= 60 * self.cfg.every_minutes
        )
        return by_steps or by_time

    def saved(self) -> None:
        self.last_save = self.clock()
