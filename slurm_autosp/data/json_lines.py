"""Unparseable lines of JSON Lines files: the datasets json loader fails a whole file on one
bad line, so when it fails, the files are read line by line and each line that is not a JSON
object is replaced by an empty object (a row with no fields) in a copy, and remembered by its
row: prepare counts it as skipped and names its file and line.
"""

from __future__ import annotations

import codecs
import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class MarkedLines:
    files: list[str]  # the inputs, a copy in place of each file that has a bad line
    rows: int  # rows the files hold (lines that are not blank)
    bad: dict[int, str]  # row index: "file:line: why"


def mark_unparseable(files: list[str], directory: Path, errors: str) -> MarkedLines:
    """`errors`: the codec error handler the loader decodes with."""
    directory.mkdir(parents=True, exist_ok=True)
    marked, bad, rows = [], {}, 0
    for number, file in enumerate(files):
        copy, found = directory / f"{number}{Path(file).suffix}", False
        with open(file, "rb") as source, open(copy, "wb") as target:
            for line_number, line in enumerate(source, 1):
                if not line.strip():
                    target.write(line)
                    continue
                why = _not_an_object(line, errors, first=line_number == 1)
                if why is not None:
                    bad[rows], found = f"{file}:{line_number}: {why}", True
                    line = b"{}\n"
                target.write(line)
                rows += 1
        if not found:
            copy.unlink()
        marked.append(str(copy) if found else file)
    return MarkedLines(marked, rows, bad)


def _not_an_object(line: bytes, errors: str, first: bool) -> str | None:
    if first and line.startswith(codecs.BOM_UTF8):
        line = line[len(codecs.BOM_UTF8) :]
    try:
        value = json.loads(line.decode("utf-8", errors), parse_constant=_no_constant)
    except ValueError as err:
        return f"not JSON ({err})"
    return None if isinstance(value, dict) else f"a JSON {type(value).__name__}, not an object"


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")
