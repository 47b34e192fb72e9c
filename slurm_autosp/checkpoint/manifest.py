"""What a complete checkpoint holds: every file's size and checksum, written last.

A checkpoint directory without a manifest, or whose files disagree with it, is incomplete or
corrupt and is never resumed from. Hashing is split across ranks so that verifying a large
checkpoint takes the time of its largest share, not of the whole.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypedDict

MANIFEST = "manifest.json"
_CHUNK = 8 * 2**20


@dataclass(frozen=True)
class FileRecord:
    size: int
    sha256: str


class Manifest(TypedDict):
    """manifest.json as read back: the save's metadata and each file's FileRecord fields."""

    meta: dict[str, Any]
    files: dict[str, dict[str, Any]]


def list_files(directory: Path) -> list[str]:
    """Every regular file below `directory`, as sorted relative paths (the manifest excluded)."""
    return sorted(
        str(p.relative_to(directory))
        for p in directory.rglob("*")
        if p.is_file() and p.name != MANIFEST
    )


def my_share(files: list[str], rank: int, world_size: int) -> list[str]:
    return files[rank::world_size]


def hash_files(directory: Path, files: list[str], fsync: bool) -> dict[str, FileRecord]:
    """Size and sha256 of each file; with `fsync`, also force it to stable storage."""
    records = {}
    for name in files:
        digest = hashlib.sha256()
        path = directory / name
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                digest.update(chunk)
            if fsync:
                os.fsync(f.fileno())
        records[name] = FileRecord(size=path.stat().st_size, sha256=digest.hexdigest())
    return records


def write_manifest(
    directory: Path, records: dict[str, FileRecord], meta: dict[str, object]
) -> None:
    body = {"meta": meta, "files": {name: asdict(r) for name, r in sorted(records.items())}}
    path = directory / MANIFEST
    with open(path, "w") as f:
        json.dump(body, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def read_manifest(directory: Path) -> Manifest:
    """The manifest's contents; raises ValueError when it is missing or unreadable."""
    path = directory / MANIFEST
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as err:
        raise ValueError(f"{directory}: no {MANIFEST} (the save did not finish)") from err
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: unreadable ({err})") from err


def verify_share(directory: Path, manifest: Manifest, rank: int, world_size: int) -> list[str]:
    """Problems found in this rank's share of the manifest's files (empty: all good)."""
    files = manifest["files"]
    problems = []
    present = set(list_files(directory))
    missing = sorted(set(files) - present)
    if rank == 0 and missing:
        problems.append(f"missing files: {', '.join(missing)}")
    share = [f for f in my_share(sorted(files), rank, world_size) if f in present]
    actual = hash_files(directory, share, fsync=False)
    for name in share:
        expected = FileRecord(**files[name])
        if actual[name] != expected:
            problems.append(
                f"{name}: size {actual[name].size} sha256 {actual[name].sha256[:12]}… but the manifest "
                f"says size {expected.size} sha256 {expected.sha256[:12]}…"
            )
    return problems
