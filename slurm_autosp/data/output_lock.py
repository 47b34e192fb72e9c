"""One prepare writes an output at a time. The lock is `.<output>.lock` beside the output,
held with flock: the kernel releases it when its holder exits, however it exits, so the
partial directory a killed prepare left is taken over by the next one, while a prepare that
finds the lock held is refused by name. Network file systems lock across hosts where they
support flock (NFS does; Lustre when mounted with -o flock); where the call fails, prepare
warns and goes on unguarded.

The lock file is removed while still held; a prepare that had opened it just before locks a
file no longer in place, sees that, and tries again on the new one.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger(__name__)


class OutputBusy(Exception):
    """Another live prepare is writing the output."""


def lock_path(output: Path) -> Path:
    return output.with_name(f".{output.name}.lock")


@contextmanager
def output_lock(output: Path) -> Iterator[None]:
    """Hold `output`'s lock for the block; OutputBusy names the prepare holding it."""
    path = lock_path(output)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = _take(path)
    try:
        yield
    finally:
        path.unlink(missing_ok=True)
        os.close(fd)


def _take(path: Path) -> int:
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 200).decode(errors="replace") or "a process starting"
            os.close(fd)
            raise OutputBusy(holder) from None
        except OSError as err:
            if err.errno not in (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP):
                os.close(fd)
                raise
            log.warning(
                "%s: cannot be locked (%s); concurrent prepares are not detected", path, err
            )
        if _is_in_place(fd, path):
            os.ftruncate(fd, 0)
            os.write(fd, f"process {os.getpid()} on {socket.gethostname()}".encode())
            return fd
        os.close(fd)


def _is_in_place(fd: int, path: Path) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False
