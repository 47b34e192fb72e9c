"""Signals as SLURM sends them, turned into a request the training loop acts on.

SLURM sends the pre-timeout signal (USR2, from submitit's `--signal`) and, on preemption,
SIGTERM and then SIGKILL after GraceTime. A handler may run in the middle of a collective or
a file write, so it only records the request; all ranks agree on it at the next step
boundary, save together and requeue.
"""

from __future__ import annotations

import signal

STOP_SIGNALS = (signal.SIGUSR2, signal.SIGTERM)


class StopRequest:
    def __init__(self) -> None:
        self.signal_name: str | None = None

    @classmethod
    def install(cls) -> StopRequest:
        """Replace submitit's handlers, which would checkpoint from inside the handler on rank 0 only."""
        request = cls()
        for signum in STOP_SIGNALS:
            signal.signal(signum, request._handle)
        return request

    def _handle(self, signum: int, frame: object) -> None:
        self.signal_name = signal.Signals(signum).name

    @property
    def requested(self) -> bool:
        return self.signal_name is not None
