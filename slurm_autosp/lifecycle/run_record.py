"""The small JSON records a job leaves in its run directory for the run's next submission to
read (the step it measured, the GPU memory outside torch's allocator): written whole or not at
all, and refused by name, never ignored, when one does not read as what it claims to be (the
check it feeds would silently change)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any, TypeVar

from slurm_autosp.config import ConfigError

Record = TypeVar("Record")


def write_record(record: Any, path: Path) -> None:
    """Atomically: a reader sees the previous record or this one, never half of one."""
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    partial.write_text(json.dumps(asdict(record), indent=1) + "\n")
    os.replace(partial, path)


def read_record(
    kind: Callable[..., Record], path: Path, what: str, valid: Callable[[Record], bool]
) -> Record | None:
    """The record of `kind` at `path`; None when there is none."""
    try:
        fields = json.loads(path.read_text())
        record = kind(**fields)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError) as err:
        raise ConfigError(f"{path}: not a record of {what} ({err}); delete it") from err
    if not valid(record):
        raise ConfigError(f"{path}: not a record of {what} ({fields}); delete it")
    return record
