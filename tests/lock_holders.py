"""Prepares holding an output's lock, run in processes of their own (spawned) by
`test_output_lock.py`; they import the lock, not the test modules (which load transformers)."""

import os
import signal
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event
from pathlib import Path

from slurm_autosp.data.output_lock import OutputBusy, output_lock


def write_partial(output: Path) -> Path:
    """What a prepare writes under the lock: its partial directory, named by its process."""
    partial = output.with_name(f".{output.name}.partial")
    partial.mkdir()
    (partial / "train.tokens").write_text(f"written by process {os.getpid()}")
    return partial


def hold_or_refuse(output: Path, go: Event, release: Event, results: Queue) -> None:
    """A prepare racing for `output` once `go` is set: it takes the lock and writes until
    `release` is set, reporting ("held", its pid), or reports ("refused", why)."""
    go.wait()
    try:
        with output_lock(output):
            write_partial(output)
            results.put(("held", os.getpid()))
            release.wait()
    except OutputBusy as busy:
        results.put(("refused", str(busy)))


def hold_with_a_worker(output: Path, done: Event, results: Queue) -> None:
    """A prepare that takes the lock, writes, and forks a worker that lives until `done` is
    set (as `datasets.map` forks its pool); it reports (its pid, the worker's) and waits to be
    killed (not on `done`: a process killed while waiting on an Event leaves it unsettable)."""
    with output_lock(output):
        write_partial(output)
        worker = os.fork()
        if worker == 0:
            done.wait()
            os._exit(0)
        results.put((os.getpid(), worker))
        signal.pause()
