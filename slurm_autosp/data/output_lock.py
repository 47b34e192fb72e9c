"""One prepare writes an output at a time. The lock is `.<output>.lock` beside the output, a
file naming its holder ("process PID on HOST") that appears whole or not at all: a hard link to
a complete file, which fails where the lock exists, from any node of a shared file system.

It is not an flock: where flock is node-local (Lustre's localflock, BeeGFS, NFS mounted with
local_lock=flock) two prepares on two nodes both held one, and the second deleted the first's
partial output; and the worker processes a prepare forks shared its locked file, so a killed
prepare's lock stayed held, naming the dead prepare, until its last worker had exited.

A lock whose holder is gone (a process of this host that no longer runs, however it ended) is
taken over, with the partial directory it left. A holder on another host cannot be checked
from here: the lock is refused, naming it, until the user removes it.
"""

from __future__ import annotations

import os
import re
import socket
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

HOLDER = re.compile(r"process (\d+) on (\S+)")


class OutputBusy(Exception):
    """The output is another prepare's; the message names it and what to do."""


@dataclass(frozen=True)
class Found:
    """A lock as read, with its file's identity: a takeover removes only the file it read."""

    holder: str
    inode: int
    mtime_ns: int


def lock_path(output: Path) -> Path:
    return output.with_name(f".{output.name}.lock")


@contextmanager
def output_lock(output: Path) -> Iterator[None]:
    """Hold `output`'s lock for the block; OutputBusy names the prepare holding it."""
    path = lock_path(output)
    path.parent.mkdir(parents=True, exist_ok=True)
    inode = _take(path)
    try:
        yield
    finally:
        found = _read(path)
        if found is not None and found.inode == inode:
            path.unlink()


def _take(path: Path) -> int:
    """The inode of the lock, once this process's."""
    mine = path.with_name(f"{path.name}.{uuid.uuid4().hex}")
    mine.write_text(f"process {os.getpid()} on {socket.gethostname()}")
    try:
        while True:
            try:
                os.link(mine, path)
                return os.stat(mine).st_ino
            except FileExistsError:
                pass
            found = _read(path)
            if found is not None:
                _take_over(path, found)  # or OutputBusy
    finally:
        mine.unlink()


def _read(path: Path) -> Found | None:
    try:
        with open(path) as f:
            info = os.fstat(f.fileno())
            return Found(f.read(), info.st_ino, info.st_mtime_ns)
    except FileNotFoundError:
        return None


def _take_over(path: Path, found: Found) -> None:
    """Remove the lock `found` if its holder is gone; OutputBusy otherwise. Of the prepares
    that found it gone, the one that creates the claim named by its file's identity removes
    it, and only if it is still in place; the others are refused."""
    held = HOLDER.fullmatch(found.holder)
    if held is None:
        raise OutputBusy(
            f"{path} does not name a prepare ({found.holder!r}); if no prepare is writing the "
            "output, remove it"
        )
    pid, host, here = int(held[1]), held[2], socket.gethostname()
    if host != here:
        raise OutputBusy(
            f"another prepare ({found.holder}) is writing it, or was until its node failed: a "
            f"process on {host} cannot be checked from {here}; wait for it to finish or choose "
            f"another directory, or, if no prepare runs there, remove {path}"
        )
    if _alive(pid):
        raise OutputBusy(
            f"another prepare ({found.holder}) is writing it; wait for it to finish or choose "
            "another directory"
        )
    claim = path.with_name(f"{path.name}.{found.inode}.{found.mtime_ns}")
    try:
        os.close(os.open(claim, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
    except FileExistsError:
        raise OutputBusy(
            f"another prepare is taking over the lock that the gone {found.holder} left; try "
            f"again (if this repeats while no prepare runs, remove {claim})"
        ) from None
    try:
        if _read(path) == found:
            path.unlink()
    finally:
        claim.unlink()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True
