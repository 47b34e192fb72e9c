"""The distributed checkpoint of an asynchronous save (FSDP2's), written by a thread of the
rank: torch's distributed checkpoint is a collective, which the writer process cannot join.

The state it writes is a copy in the rank's staging buffer (checkpoint/staging_buffer.py), so
training goes on at once. The thread's collectives run on a gloo group of their own, so they
never interleave with training's; its file writes leave the interpreter to training, and its
planning (a few collectives and Python per tensor) is what it shares of the interpreter's time.
The writer process then persists the files the thread wrote into node memory.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from slurm_autosp.checkpoint.staging_buffer import StagingBuffer


class BackgroundWrite:
    """One rank's writing thread and its process group; one write at a time."""

    def __init__(self) -> None:
        """Collective: every rank makes the group."""
        self._group = dist.new_group(backend="gloo")
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-write")

    def start(self, buffer: StagingBuffer, staged: dict[str, Any], into: Path) -> Future[None]:
        """Collective: write each state dict `staged` in `buffer` into its directory below
        `into`; done, or failed naming why, when the returned future is."""
        return self._thread.submit(self._write, buffer, staged, into)

    def _write(self, buffer: StagingBuffer, staged: dict[str, Any], into: Path) -> None:
        for name, state in buffer.views(staged).items():
            dcp.save(state, storage_writer=host_writer(into / name), process_group=self._group)

    def close(self) -> None:
        """Let the thread end once its write does (the process's exit waits for it)."""
        self._thread.shutdown(wait=False)


def host_writer(path: Path) -> dcp.FileSystemWriter:
    """dcp.save's writer for tensors already in host memory, which touches no GPU: by default,
    where CUDA is available, it copies tensors ahead on the current stream and synchronizes it
    (torch/distributed/checkpoint/filesystem.py: _OverlappingCpuLoader, unless
    per_thread_copy_ahead is 0), and on this thread, never given a device, that is GPU 0's: a
    CUDA context there from every rank, or a failure where GPUs are exclusive to a process."""
    return dcp.FileSystemWriter(path, per_thread_copy_ahead=0)
