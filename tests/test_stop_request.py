"""A stop signal is seen at once on any thread: on CUDA the backward, and the layer boundaries
in it, run on autograd's device threads while the main thread waits in C++, where Python runs
no signal handler. Other signals are no stop and keep their handlers; `close` gives back the
handlers and the wakeup fd `install` replaced, and leaves no file descriptor open."""

import os
import signal
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from slurm_autosp.lifecycle.signals import STOP_SIGNALS, StopRequest

BOUND_S = 10.0  # how long anything here waits for a signal: makes a hang a failure


@pytest.fixture
def stop() -> Iterator[StopRequest]:
    request = StopRequest.install()
    yield request
    request.close()


def test_usr2_is_seen_on_another_thread_while_the_main_thread_waits_in_cpp(stop):
    seen: list[tuple[bool, str | None, float]] = []
    watched: torch.futures.Future[None] = torch.futures.Future()

    def watch() -> None:
        time.sleep(0.2)  # the main thread is in its wait by then
        sent = time.monotonic()
        os.kill(os.getpid(), signal.SIGUSR2)
        while not stop.requested and time.monotonic() < sent + BOUND_S:
            time.sleep(0.001)
        seen.append((stop.requested, stop.signal_name, time.monotonic() - sent))
        watched.set_result(None)

    threading.Thread(target=watch).start()
    watched.wait()  # in C++, as the main thread waits on CUDA during a backward
    [(requested, name, after_s)] = seen
    assert requested, f"not seen on the other thread within {BOUND_S} s"
    assert name == "SIGUSR2"
    assert after_s < BOUND_S / 2


def test_another_signal_is_no_stop_and_keeps_its_handler(stop):
    got: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, _frame: got.append(signum))
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        deadline = time.monotonic() + BOUND_S
        while not got and time.monotonic() < deadline:
            time.sleep(0.001)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert got == [signal.SIGUSR1]
    assert not stop.requested
    assert stop.signal_name is None


def test_close_gives_back_the_handlers_and_the_wakeup_fd_and_leaves_no_fd_open():
    theirs, other_end = socket.socketpair()
    theirs.setblocking(False)

    def handler(signum, frame):
        return None

    outer_wakeup = signal.set_wakeup_fd(theirs.fileno())
    outer_handlers = {signum: signal.signal(signum, handler) for signum in STOP_SIGNALS}
    try:
        open_fds = sorted(os.listdir("/proc/self/fd"))
        for _ in range(3):
            StopRequest.install().close()
        assert sorted(os.listdir("/proc/self/fd")) == open_fds
        assert all(signal.getsignal(signum) is handler for signum in STOP_SIGNALS)
        assert signal.set_wakeup_fd(outer_wakeup) == theirs.fileno()
    finally:
        signal.set_wakeup_fd(outer_wakeup)
        for signum, outer in outer_handlers.items():
            signal.signal(signum, outer)
        theirs.close()
        other_end.close()
