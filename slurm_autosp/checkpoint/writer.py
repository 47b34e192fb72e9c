"""The background checkpoint writer: a process of its own per rank, so that persisting a save
shares neither the training loop's GIL nor its time.

Each request names a staging directory (the rank's save, written to node-local memory at the
step boundary) and the checkpoint's `.partial` directory on shared storage. The writer copies
every staged file there, hashing it as it goes (the manifest's records, so no file is read
twice), forces it to stable storage and frees its staged copy; then it answers with the
records, or with the error that stopped it. It runs as `python -m slurm_autosp.checkpoint.writer
<rank's pid>`, dies with that rank (a killed rank leaves no writer adding files to a run no job
holds) and with nothing else: it ignores the signals Slurm may send a job's whole process group
(USR2, TERM, INT), which are its rank's to act on (commit the save or abandon it); it takes one JSON line per request on stdin and answers one per request on stdout, and
imports neither torch nor the rest of the package: it starts in a fraction of a second and
holds no GPU context.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import sys
from dataclasses import asdict
from pathlib import Path

from slurm_autosp.checkpoint.manifest import FileRecord
from slurm_autosp.lifecycle.durable import fsync_path
from slurm_autosp.lifecycle.parent_death import die_with

_CHUNK = 16 * 2**20


def persist(staged: Path, partial: Path) -> dict[str, FileRecord]:
    """Move every file below `staged` to the same relative path below `partial`, durably,
    with its size and sha256; `staged` is gone afterwards."""
    records: dict[str, FileRecord] = {}
    for source in sorted(p for p in staged.rglob("*") if p.is_file()):
        name = str(source.relative_to(staged))
        target = partial / name
        target.parent.mkdir(parents=True, exist_ok=True)
        digest = hashlib.sha256()
        size = 0
        with open(source, "rb") as src, open(target, "wb") as dst:
            while chunk := src.read(_CHUNK):
                digest.update(chunk)
                dst.write(chunk)
                size += len(chunk)
            dst.flush()
            os.fsync(dst.fileno())
        source.unlink()  # the staged copy holds node memory: free it as soon as it is written
        records[name] = FileRecord(size=size, sha256=digest.hexdigest())
    for directory in {partial / Path(name).parent for name in records} | {partial}:
        fsync_path(directory)
    shutil.rmtree(staged, ignore_errors=True)
    return records


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
            records = persist(Path(request["staged"]), Path(request["partial"]))
            answer = {"records": {name: asdict(r) for name, r in records.items()}}
        except OSError as err:
            answer = {"error": f"{err.filename or request['partial']}: {err.strerror or err}"}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
