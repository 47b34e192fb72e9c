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

SLURM signals every process of the job step, not only the ranks: the compilers inductor runs
(g++, Triton's compile workers) would die of USR2's or TERM's default action, failing a step
that compiles, and whatever else a rank starts with them. So the rank blocks both signals from
`install` on: every thread and process it starts afterwards inherits them blocked (a process
keeps its mask across exec), and they wait, pending, until `requested` takes them
(sigtimedwait), on any thread; a thread started before `install` may still take one with the
handler, as above.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

STOP_SIGNALS = (signal.SIGUSR2, signal.SIGTERM)

Handler = Callable[[int, FrameType | None], Any] | int | None


class StopRequest:
    """Whether a stop signal came (`requested`, on any thread), and which (`signal_name`)."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._seen_at: float | None = None  # time.monotonic() when `requested` first said so
        self._pipe: tuple[int, int] | None = None  # the wakeup fd's pipe, while installed
        self._lock = threading.Lock()  # one reader of the pipe at a time, none once closed
        self._previous_wakeup = -1
        self._previous_handlers: dict[int, Handler] = {}
        self._previous_mask: set[int | signal.Signals] = set()

    @classmethod
    def install(cls) -> StopRequest:
        """On the main thread: replace submitit's handlers, which would checkpoint from inside
        the handler on rank 0 only, and the wakeup fd, and block the stop signals. `close` puts
        all three back."""
        request = cls()
        read, write = os.pipe()
        os.set_blocking(read, False)
        os.set_blocking(write, False)  # the C handler must never block
        request._pipe = (read, write)
        request._previous_wakeup = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        for signum in STOP_SIGNALS:
            request._previous_handlers[signum] = signal.signal(signum, request._handle)
        request._previous_mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        return request

    def close(self) -> None:
        """On the main thread: put back the mask, the handlers and the wakeup fd `install`
        replaced; a stop signal pending is taken first, not left to the handlers put back."""
        with self._lock:
            self._take_pending()
        signal.pthread_sigmask(signal.SIG_SETMASK, self._previous_mask)
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
                self._take_pending()
            if self.signal_name is not None and self._seen_at is None:
                self._seen_at = time.monotonic()
        return self.signal_name is not None

    def time_left(self, delay_s: float) -> float | None:
        """Seconds before the kill, where one follows the signal by `delay_s` (Slurm's
        --signal, or GraceTime after a preemption's SIGTERM); None before any stop signal."""
        if self._seen_at is None:
            return None
        return delay_s - (time.monotonic() - self._seen_at)

    def _take_pending(self) -> None:
        """Take the stop signals pending for the process or this thread, blocked on every
        thread started since `install`."""
        while taken := signal.sigtimedwait(STOP_SIGNALS, 0):
            self.signal_name = signal.Signals(taken.si_signo).name

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
