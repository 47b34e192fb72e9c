"""A child process that dies with its parent: Linux's prctl(PR_SET_PDEATHSIG). A rank killed
with SIGKILL runs no cleanup; the processes it started (data workers, the checkpoint writer)
would otherwise go on, reparented, writing into a run that no job holds any more.
Linux only; elsewhere nothing changes."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
LINUX = sys.platform.startswith("linux")
_libc = ctypes.CDLL(None, use_errno=True) if LINUX else None


def die_with(parent: int) -> None:
    """Called in a child: SIGKILL it when the thread that forked it ends; exit now if
    `parent` already died between the fork and this call."""
    if _libc is None or _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return
    if os.getppid() != parent:
        os._exit(1)
