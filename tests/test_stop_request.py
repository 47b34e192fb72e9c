"""A stop signal is seen at once on any thread: on CUDA the backward, and the layer boundaries
in it, run on autograd's device threads while the main thread waits in C++, where Python runs
no signal handler. A process started after `install` (a compiler, a compile worker) outlives
the stop signals SLURM sends every process of the job step. Other signals are no stop and keep
their handlers; `close` gives back the signal mask, the handlers and the wakeup fd `install`
replaced, and leaves no file descriptor open."""

import os
import signal
import socket
import subprocess
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


@pytest.mark.parametrize("signum", STOP_SIGNALS, ids=lambda s: s.name)
def test_a_process_started_after_install_outlives_a_stop_signal_the_rank_acts_on(stop, signum):
    """As SLURM signals a job step: the rank and the compiler it runs get the signal alike."""
    child = subprocess.Popen(["sleep", str(BOUND_S)])
    try:
        for pid in (child.pid, os.getpid()):
            os.kill(pid, signum)
        deadline = time.monotonic() + BOUND_S / 2
        while not stop.requested and time.monotonic() < deadline:
            time.sleep(0.001)
        assert stop.signal_name == signum.name
        with pytest.raises(subprocess.TimeoutExpired):  # one the signal kills is gone long before
            status = child.wait(timeout=2)
            pytest.fail(f"the child died of {signal.Signals(-status).name}")
    finally:
        child.kill()
        child.wait()


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
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
        for _ in range(3):
            StopRequest.install().close()
        assert sorted(os.listdir("/proc/self/fd")) == open_fds
        assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == mask
        assert all(signal.getsignal(signum) is handler for signum in STOP_SIGNALS)
        assert signal.set_wakeup_fd(outer_wakeup) == theirs.fileno()
    finally:
        signal.set_wakeup_fd(outer_wakeup)
        for signum, outer in outer_handlers.items():
            signal.signal(signum, outer)
        theirs.close()
        other_end.close()


def test_the_time_left_counts_down_from_when_the_stop_was_first_seen(stop):
    assert stop.time_left(120) is None  # no stop yet: no kill is coming
    os.kill(os.getpid(), signal.SIGUSR2)
    deadline = time.monotonic() + BOUND_S
    while not stop.requested:
        assert time.monotonic() < deadline
    first = stop.time_left(120)
    time.sleep(0.2)
    assert stop.requested  # seen again: the count does not start over
    later = stop.time_left(120)
    assert first is not None and later is not None
    assert 119 < first <= 120
    assert 0.2 <= first - later < 1.0
