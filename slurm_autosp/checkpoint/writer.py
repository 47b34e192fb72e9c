"""The background checkpoint writer: a process of its own per rank, so that serialising and
persisting a save shares neither the training loop's GIL nor its time.

Each request names the rank's staged save in node memory (a directory of the files a collective
wrote, FSDP2's distributed checkpoint, with the save's other files as trees whose tensors lie in
the rank's staging buffer: checkpoint/staging_buffer.py), that buffer, and the checkpoint's
`.partial` directory on shared storage. The writer copies every staged file there and writes
every tree with torch.save, hashing each as it goes (the manifest's records, so no file is read
twice), forces it to stable storage and frees the staged files; then it answers with the
records, or with the error that stopped it. It runs as `python -m slurm_autosp.checkpoint.writer
<rank's pid>`, dies with that rank (a killed rank leaves no writer adding files to a run no job
holds) and with nothing else: it ignores the signals Slurm may send a job's whole process group
(USR2, TERM, INT), which are its rank's to act on (commit the save or abandon it). It takes one
JSON line per request on stdin and answers one per request on stdout; it imports torch for
torch.save and holds no GPU context.
"""

from __future__ import annotations

import functools
import hashlib
import json
import mmap
import os
import pickle
import shutil
import signal
import sys
from collections.abc import Callable
from dataclasses import asdict
from operator import methodcaller
from pathlib import Path
from typing import Any, BinaryIO

import torch

from slurm_autosp.checkpoint.manifest import FileRecord
from slurm_autosp.checkpoint.staging_buffer import unstage
from slurm_autosp.checkpoint.state_files import StateFiles
from slurm_autosp.lifecycle.durable import fsync_path
from slurm_autosp.lifecycle.parent_death import die_with

_CHUNK = 16 * 2**20
STAGED_FILES = "state_files.pkl"  # in a staged save: its trees, their tensors in the buffer


class _HashedFile:
    """A file being written, its size and sha256 taken from the bytes as they pass."""

    def __init__(self, file: BinaryIO):
        self._file = file
        self.digest = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> int:
        self.digest.update(data)
        self.size += len(data)
        return self._file.write(data)

    def flush(self) -> None:
        self._file.flush()

    def record(self) -> FileRecord:
        return FileRecord(size=self.size, sha256=self.digest.hexdigest())


def persist(staged: Path, partial: Path, buffer: Path) -> tuple[dict[str, FileRecord], int]:
    """Write the save staged in `staged` and `buffer` to the same relative paths below
    `partial`, durably; each file's size and sha256, and the bytes copied from `staged`, which
    is gone afterwards (the buffer stays for the next save)."""
    records: dict[str, FileRecord] = {}
    trees = staged / STAGED_FILES
    for source in sorted(p for p in staged.rglob("*") if p.is_file() and p != trees):
        name = str(source.relative_to(staged))
        with open(source, "rb") as src:
            records[name] = _write_hashed(
                partial / name, lambda dst: shutil.copyfileobj(src, dst, _CHUNK)
            )
        source.unlink()  # the staged copy holds node memory: free it as soon as it is written
    copied = sum(record.size for record in records.values())
    if trees.is_file():
        records.update(_write_trees(trees, buffer, partial))
    for directory in {partial / Path(name).parent for name in records} | {partial}:
        fsync_path(directory)
    shutil.rmtree(staged, ignore_errors=True)
    return records, copied


def _write_trees(trees: Path, buffer: Path, partial: Path) -> dict[str, FileRecord]:
    """Every tree of the staged save written with torch.save, every text as it is."""
    with open(trees, "rb") as f:
        staged: StateFiles = pickle.load(f)  # written by this job's own rank, in its 0700 directory
    with open(buffer, "r+b") as mapped, mmap.mmap(mapped.fileno(), 0) as memory:
        # the rebuilt tensors view the mapping: they are gone when _write_files returns
        return _write_files(unstage(staged, memory), partial)


def _write_files(files: StateFiles, partial: Path) -> dict[str, FileRecord]:
    records: dict[str, FileRecord] = {}
    for name, tree in files.trees.items():  # torch.save only writes and flushes
        records[name] = _write_hashed(partial / name, functools.partial(torch.save, tree))
    for name, text in files.texts.items():
        records[name] = _write_hashed(partial / name, methodcaller("write", text.encode()))
    return records


def _write_hashed(target: Path, write: Callable[[Any], object]) -> FileRecord:
    """`write` the file at `target` through a hash, then force it to stable storage."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target, "wb") as file:
        hashed = _HashedFile(file)
        write(hashed)
        file.flush()
        os.fsync(file.fileno())
    return hashed.record()


# what Slurm sends every process of a job step (proctrack/pgid, `scancel --signal`): the rank's
PROCESS_GROUP_SIGNALS = (signal.SIGUSR2, signal.SIGTERM, signal.SIGINT)


def main() -> None:
    for signum in PROCESS_GROUP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    die_with(int(sys.argv[1]))
    for line in sys.stdin:
        request = json.loads(line)
        answer: dict[str, object]
        try:
            records, copied = persist(
                Path(request["staged"]), Path(request["partial"]), Path(request["buffer"])
            )
            answer = {"records": {name: asdict(r) for name, r in records.items()}, "copied": copied}
        except OSError as err:
            answer = {"error": f"{err.filename or request['partial']}: {err.strerror or err}"}
        except RuntimeError as err:  # torch.save's stream errors
            answer = {"error": f"{request['partial']}: {err}"}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
