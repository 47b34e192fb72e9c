"""Processes forked for `prepare --workers N` die with it. `datasets.map(num_proc=N)` forks a
pool of workers and a manager process (multiprocess, the fork start method); a prepare killed
with SIGKILL runs no cleanup, and those processes, reparented, would go on (in practice they
block forever). Each child forked while `children_die_with_this_process` is active asks Linux
to send it SIGKILL when its parent dies (prctl PR_SET_PDEATHSIG), and so does every process it
forks in turn. Linux only; elsewhere nothing changes.

PR_SET_PDEATHSIG follows the thread that forked: the pool's workers and manager are forked by
the thread that calls map, which lives as long as the process.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from slurm_autosp.lifecycle.parent_death import LINUX, die_with

_parent: int | None = None  # while set, a child forked from process `_parent` dies with it


def _arm_in_child() -> None:
    global _parent
    parent = _parent
    if parent is None:
        return
    _parent = os.getpid()  # what this child forks dies with it in turn
    die_with(parent)


if LINUX:
    os.register_at_fork(after_in_child=_arm_in_child)


@contextmanager
def children_die_with_this_process() -> Iterator[None]:
    global _parent
    previous, _parent = _parent, os.getpid()
    try:
        yield
    finally:
        _parent = previous
