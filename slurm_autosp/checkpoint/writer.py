"""The background checkpoint writer: a process of its own per rank, so that serialising and
persisting a save shares neither the training loop's GIL nor its time.

Each request names the rank's staged save in node memory (a directory of the files a collective
wrote, FSDP2's distributed checkpoint, with the save's other files as trees whose tensors lie in
the rank's staging buffer: checkpoint/staging_buffer.py), that buffer, and the checkpoint's
`.partial` directory on shared storage. The writer copies every staged file there and writes
every tree with torch.save, hashing each as it goes (the manifest's records, so no file is read
twice), forces it to stable storage and frees each staged file once it is written; then it
answers with the records, or with the error that stopped it. It runs as `python -m
slurm_autosp.checkpoint.writer <rank's pid>`, dies with that rank (a killed rank leaves no writer
adding files to a run no job holds) and with nothing else: it ignores the signals Slurm may send
a job's whole process group (USR2, TERM, INT), which are its rank's to act on (commit the save
or abandon it). Its rank starts it with them blocked, and it ignores them before it unblocks
them: one sent while it starts (importing torch takes seconds on a cold shared file system)
waits, and is then dropped. It takes one JSON line per request on stdin and answers one per
request on stdout; it imports torch for torch.save and holds no GPU context.

`handle` is the writing itself: the rank runs it too, where its writer was killed by a signal
anyway (the save is then made synchronously). A staged save records each file written
(WRITTEN) before it frees the staged copy, so a run of `handle` after a writer that died
part-way writes what is left and still answers every file's record.
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
import time
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
WRITTEN = "written.jsonl"  # in a staged save: the record of each staged file already written


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


def persist(staged: Path, partial: Path, buffer: Path) -> dict[str, FileRecord]:
    """Write the save staged in `staged` and `buffer` to the same relative paths below
    `partial`, durably; each file's size and sha256. Each staged file is freed once written,
    its record kept in WRITTEN: run again after a writer died part-way, it writes what is left.
    The staged trees and the records stay until the rank removes the staged save."""
    journal = staged / WRITTEN
    records = _written(journal)
    trees = staged / STAGED_FILES
    for source in sorted(p for p in staged.rglob("*") if p.is_file() and p not in (trees, journal)):
        name = str(source.relative_to(staged))
        with open(source, "rb") as src:
            records[name] = _write_hashed(
                partial / name, lambda dst: shutil.copyfileobj(src, dst, _CHUNK)
            )
        with open(journal, "a") as f:
            f.write(json.dumps({name: asdict(records[name])}) + "\n")
        source.unlink()  # the staged copy holds node memory: free it as soon as it is written
    if trees.is_file():
        records.update(_write_trees(trees, buffer, partial))
    for directory in {partial / Path(name).parent for name in records} | {partial}:
        fsync_path(directory)
    return records


def _written(journal: Path) -> dict[str, FileRecord]:
    """The staged files an earlier run wrote; a line cut short by its death is skipped (that
    file's staged copy is still there: it is written again)."""
    records: dict[str, FileRecord] = {}
    try:
        lines = journal.read_text().splitlines()
    except FileNotFoundError:
        return records
    for line in lines:
        try:
            records.update({name: FileRecord(**r) for name, r in json.loads(line).items()})
        except (ValueError, TypeError):
            continue
    return records


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


def handle(request: dict[str, str]) -> dict[str, object]:
    """Write one request's save (`persist`); the answer: its records and how long it took, or
    the storage error that stopped it."""
    started = time.monotonic()
    try:
        records = persist(
            Path(request["staged"]), Path(request["partial"]), Path(request["buffer"])
        )
    except OSError as err:
        return {"error": f"{err.filename or request['partial']}: {err.strerror or err}"}
    except RuntimeError as err:  # torch.save's stream errors
        return {"error": f"{request['partial']}: {err}"}
    return {
        "records": {name: asdict(r) for name, r in records.items()},
        "seconds": time.monotonic() - started,
    }


def main() -> None:
    for signum in PROCESS_GROUP_SIGNALS:  # before unblocking them: one sent meanwhile is dropped
        signal.signal(signum, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, PROCESS_GROUP_SIGNALS)
    die_with(int(sys.argv[1]))
    for line in sys.stdin:
        print(json.dumps(handle(json.loads(line))), flush=True)


if __name__ == "__main__":
    main()
