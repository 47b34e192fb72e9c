"""One rank's error ends every rank of the job within seconds, each naming that rank and error.

A rank that raises between or inside collectives leaves the others waiting in their next one
until `cluster.collective_timeout_min` (on NCCL, which does not notice that a peer has exited:
the whole allocation for 10-30 minutes), and their logs never say why. So every rank watches the job's rendezvous store, the TCPStore that
rank 0 holds at MASTER_ADDR:MASTER_PORT (torch.distributed's env:// rendezvous), through a
client of its own, so the watcher never waits on the lock of the client the process group uses.
A rank whose work raises writes "rank R (host H) failed: Type: message" there. The first
failure is kept: a rank that fails after it (in a gloo collective whose peer has gone, say)
logs it beside its own error. Every other rank's watcher reads it within POLL_S, logs it and
ends its process. A store that stops answering (its connection reset, or no reply for
STORE_TIMEOUT_S) means rank 0 is gone: the watcher ends its rank too.

The watcher ends its process with os._exit: a blocked collective cannot be cut short. gloo's
abort does nothing (ProcessGroupGloo keeps Backend::abort, which is empty), and after NCCL's
the main thread would go on from a collective that returned nothing until its next one raised.

A rank gets GRACE_S after learning of a failure to end by itself: one that raises the same
agreed error (a refused start, a check every rank fails) runs its own cleanup, and one that
has just finished its last collective leaves normally. Only a rank still working or waiting
after that is ended.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar

import torch.distributed as dist

log = logging.getLogger(__name__)

FAILURE_KEY = "slurm_autosp/rank_failure"  # the first failure's line
SEEN_KEY = "slurm_autosp/rank_failure_seen"  # how many ranks know of it
POLL_S = 1.0  # how often a rank looks for another's failure
GRACE_S = 5.0  # how long a rank that learned of one has to end by itself
SEEN_WAIT_S = 3 * POLL_S  # how long rank 0 keeps its store up for the others to read its failure
STORE_TIMEOUT_S = 30.0  # a store that answers nothing for this long is gone with its host
EXIT_STATUS = 1

T = TypeVar("T")


def describe_failure(rank: int, err: BaseException) -> str:
    """The line every rank logs: "rank R (host H) failed: Type: the message's first line"."""
    lines = str(err).strip().splitlines()
    return f"rank {rank} ({socket.gethostname()}) failed: {type(err).__name__}: " + (
        lines[0] if lines else ""
    )


class FailureWatch:
    """This rank's part: nothing until `start`, then watching for another rank's failure until
    `stop` (this rank ends normally) or `failed` (this rank's own error, published)."""

    def __init__(self) -> None:
        self._store: dist.TCPStore | None = None
        self._address = ""
        self._rank = -1
        self._world_size = 0
        self._stopped = threading.Event()
        self._ending = threading.Lock()  # a stop and the watcher's exit: one wins
        self._seen = threading.Lock()  # held once this rank has counted itself in SEEN_KEY

    def start(self, rank: int, world_size: int) -> None:
        """Once the process group is up: connect to its store and watch it."""
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        self._store = dist.TCPStore(
            host, port, is_master=False, timeout=timedelta(seconds=STORE_TIMEOUT_S)
        )
        self._address = f"{host}:{port}"
        self._rank, self._world_size = rank, world_size
        threading.Thread(target=self._watch, name="rank_failure", daemon=True).start()

    def stop(self) -> None:
        """This rank is leaving (normally, or by its own error): neither another rank's failure
        nor rank 0's store going away with rank 0 ends it from here on."""
        with self._ending:
            self._stopped.set()

    def failed(self, err: BaseException) -> None:
        """This rank's work raised `err`: tell the other ranks, which would otherwise wait for
        it. Never raises; the caller goes on to raise `err`."""
        self.stop()
        if self._store is None:  # before the process group: no rank waits for this one yet
            return
        line = describe_failure(self._rank, err)
        log.error("%s", line)
        try:
            first = _within(STORE_TIMEOUT_S, lambda: self._publish(line))
        except (dist.DistError, TimeoutError) as store_err:
            log.warning(
                "could not tell the other ranks through the job's store on %s: %s",
                self._address,
                _first_line(store_err),
            )
            return
        if first != line:  # this error follows another rank's (e.g. gloo's closed peer)
            log.error("the job's first failure: %s", first)

    def _publish(self, line: str) -> str:
        """Write this rank's failure unless another's is there; return the one kept. Rank 0's
        store goes with its process: it stays until every rank has read the failure (or
        SEEN_WAIT_S), so that none finds only the store gone, without the error."""
        assert self._store is not None
        first = self._store.compare_set(FAILURE_KEY, "", line).decode()
        self._count_seen()
        deadline = time.monotonic() + SEEN_WAIT_S
        while self._rank == 0 and time.monotonic() < deadline:
            if self._store.add(SEEN_KEY, 0) >= self._world_size:
                break
            time.sleep(0.1)
        return first

    def _poll(self) -> str:
        """Another rank's failure, empty if none."""
        assert self._store is not None
        if not self._store.check([FAILURE_KEY]):
            return ""
        failure = self._store.get(FAILURE_KEY).decode()
        self._count_seen()
        return failure

    def _count_seen(self) -> None:
        """Count this rank, once, among those that know of the failure."""
        assert self._store is not None
        if self._seen.acquire(blocking=False):
            self._store.add(SEEN_KEY, 1)

    def _watch(self) -> None:
        while not self._stopped.wait(POLL_S):
            try:
                failure = _within(STORE_TIMEOUT_S, self._poll)
            except (dist.DistError, TimeoutError) as err:
                failure = (
                    f"the job's store on {self._address}, which rank 0 holds, stopped answering "
                    f"({_first_line(err)}): rank 0 or its node is gone"
                )
            if failure:
                if not self._stopped.wait(GRACE_S):
                    self._end(failure)
                return

    def _end(self, failure: str) -> None:
        with self._ending:
            if self._stopped.is_set():
                return
            log.error(
                "%s; ending rank %d too, which would otherwise wait for it in a collective until "
                "cluster.collective_timeout_min",
                failure,
                self._rank,
            )
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(EXIT_STATUS)


def _within(seconds: float, call: Callable[[], T]) -> T:
    """`call()` on a thread of its own, waited for at most `seconds` (TimeoutError past them):
    a store client waits for a reply without end, and a store whose host has gone (powered
    off, cut off: no connection reset) never replies."""
    outcome: list[T] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            outcome.append(call())
        except BaseException as err:  # handed to the waiting thread
            error.append(err)

    thread = threading.Thread(target=run, name="rank_failure_store", daemon=True)
    thread.start()
    thread.join(seconds)
    if error:
        raise error[0]
    if not outcome:
        raise TimeoutError(f"no answer within {seconds:.0f} s")
    return outcome[0]


def _first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return lines[0] if lines else type(err).__name__
