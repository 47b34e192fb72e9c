"""Signals as SLURM sends them, turned into a request the training loop acts on.

SLURM sends the pre-timeout signal (USR2, from submitit's `--signal`) and, on preemption,
SIGTERM and then SIGKILL after GraceTime. A handler may run in the middle of a collective or
a file write, so it only records the request; all ranks agree on it at the next step or layer
boundary, save together and requeue.

Python runs a handler on the main thread only, between two bytecodes. On CUDA the backward,
and the layer boundaries in it, run on autograd's device threads while the main thread waits
in C++: the handler would run only after the step. So the request is also read from Python's
signal wakeup fd, to which CPython's own C handler writes the signal's number the moment it
arrives, on whatever thread: `requested` reads it on any thread.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

STOP_SIGNALS = (signal.SIGUSR2, signal.SIGTERM)

Handler = Callable[[int, FrameType | None], Any] | int | None


class StopRequest:
    """Whether a stop signal came (`requested`, on any thread), and which (`signal_name`)."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._pipe: tuple[int, int] | None = None  # the wakeup fd's pipe, while installed
        self._lock = threading.Lock()  # one reader of the pipe at a time, none once closed
        self._previous_wakeup = -1
        self._previous_handlers: dict[int, Handler] = {}

    @classmethod
    def install(cls) -> StopRequest:
        """On the main thread: replace submitit's handlers, which would checkpoint from inside
        the handler on rank 0 only, and the wakeup fd. `close` puts both back."""
        request = cls()
        read, write = os.pipe()
        os.set_blocking(read, False)
        os.set_blocking(write, False)  # the C handler must never block
        request._pipe = (read, write)
        request._previous_wakeup = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        for signum in STOP_SIGNALS:
            request._previous_handlers[signum] = signal.signal(signum, request._handle)
        return request

    def close(self) -> None:
        """On the main thread: put back the handlers and the wakeup fd `install` replaced."""
        for signum, handler in self._previous_handlers.items():
            # None: a handler not set from Python, which Python cannot set again
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)
        signal.set_wakeup_fd(self._previous_wakeup)
        with self._lock:
            if self._pipe is not None:
                self._drain(self._pipe[0])
                for fd in self._pipe:
                    os.close(fd)
                self._pipe = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.signal_name = signal.Signals(signum).name

    @property
    def requested(self) -> bool:
        with self._lock:
            if self._pipe is not None:
                self._drain(self._pipe[0])
        return self.signal_name is not None

    def _drain(self, read: int) -> None:
        """Read what the wakeup fd holds; other signals' numbers (SIGINT's) are dropped: their
        handlers run as before."""
        try:
            while numbers := os.read(read, 64):
                for signum in numbers:
                    if signum in STOP_SIGNALS:
                        self.signal_name = signal.Signals(signum).name
        except BlockingIOError:
            return  # empty
