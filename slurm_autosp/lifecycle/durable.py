"""Renames into place that survive the node: what a directory holds is forced to stable
storage before it takes its final name, and the name after. A rename alone is atomic, not
durable: after a lost node, shared storage may show the new name over files or directories
whose data never reached it."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_path(path: Path | str) -> None:
    """Force one file, or one directory's entries, to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path, files: bool = True) -> None:
    """Every directory below `root` and `root` itself, and with `files` every file too (off
    where each file was forced as it was written)."""
    for directory, _, names in os.walk(root):
        if files:
            for name in names:
                fsync_path(os.path.join(directory, name))
        fsync_path(directory)


def rename_durably(source: Path, target: Path, files: bool = True) -> None:
    """`source` (a file or a directory tree) renamed to `target`, on stable storage before
    and after."""
    if source.is_dir():
        fsync_tree(source, files)
    elif files:
        fsync_path(source)
    os.rename(source, target)
    fsync_path(target.parent)
