"""What a complete checkpoint holds: every file's size and checksum, written last.

A checkpoint directory without a manifest, or whose files disagree with it, is incomplete or
damaged and is never resumed from. A file that cannot be read (an I/O or permission error)
is neither: it says nothing about the checkpoint, so it is reported apart. Hashing is split
across ranks so that verifying a large checkpoint takes the time of its largest share, not of
the whole.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
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
    """The manifest's contents. Raises ValueError when it is missing or not a manifest (the
    checkpoint is damaged), OSError when it cannot be read (the storage failed)."""
    path = directory / MANIFEST
    try:
        text = path.read_bytes()
    except OSError as err:
        if is_missing(err):
            raise ValueError(f"{directory}: no {MANIFEST} (the save did not finish)") from err
        raise
    try:
        manifest: Manifest = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: not a manifest ({err})") from err
    if not (isinstance(manifest, dict) and isinstance(manifest.get("files"), dict)):
        raise ValueError(f"{path}: not a manifest (no files listed)")
    return manifest


def is_missing(err: OSError) -> bool:
    """A file that is not there (damage), as opposed to one that is there but unreadable."""
    return err.errno in (errno.ENOENT, errno.ENOTDIR)


@dataclass
class ShareCheck:
    """What verifying one rank's share of a checkpoint found."""

    damage: list[str] = field(default_factory=list)  # missing or changed files
    unreadable: list[str] = field(default_factory=list)  # files the storage would not give


def verify_share(directory: Path, manifest: Manifest, rank: int, world_size: int) -> ShareCheck:
    """Check this rank's share of the manifest's files: each present, of its recorded size and
    checksum. A file name that leaves the directory is damage, never read."""
    check = ShareCheck()
    files = manifest["files"]
    for name in my_share(sorted(files), rank, world_size):
        if Path(name).is_absolute() or ".." in Path(name).parts:
            check.damage.append(f"{name}: not a path inside the checkpoint")
            continue
        try:
            expected = FileRecord(**files[name])
            actual = hash_files(directory, [name], fsync=False)[name]
        except TypeError:
            check.damage.append(f"{name}: the manifest's record of it is malformed")
            continue
        except OSError as err:
            if is_missing(err):
                check.damage.append(f"{name}: missing")
            else:
                check.unreadable.append(f"{directory / name}: {err.strerror or err}")
            continue
        if actual != expected:
            check.damage.append(
                f"{name}: size {actual.size} sha256 {actual.sha256[:12]}… but the manifest "
                f"says size {expected.size} sha256 {expected.sha256[:12]}…"
            )
    return check
