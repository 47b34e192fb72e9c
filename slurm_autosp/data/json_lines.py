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
    """`errors`: the codec error handler the loader decodes with. Only a file with a bad line
    is copied."""
    directory.mkdir(parents=True, exist_ok=True)
    marked, bad, rows = [], {}, 0
    for number, file in enumerate(files):
        file_rows, bad_lines = _scan(file, errors)
        if bad_lines:
            marked.append(
                _copy_without(file, bad_lines, directory / f"{number}{Path(file).suffix}")
            )
            bad.update(
                {rows + row: f"{file}:{line}: {why}" for line, (row, why) in bad_lines.items()}
            )
        else:
            marked.append(file)
        rows += file_rows
    return MarkedLines(marked, rows, bad)


def _scan(file: str, errors: str) -> tuple[int, dict[int, tuple[int, str]]]:
    """The rows (lines that are not blank) of `file`, and its bad lines: line number: (its
    row in the file, why)."""
    rows, bad = 0, {}
    with open(file, "rb") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            why = _not_an_object(line, errors, first=number == 1)
            if why is not None:
                bad[number] = (rows, why)
            rows += 1
    return rows, bad


def _copy_without(file: str, bad_lines: dict[int, tuple[int, str]], copy: Path) -> str:
    """`file` with each bad line an empty object, a row with no fields."""
    with open(file, "rb") as source, open(copy, "wb") as target:
        for number, line in enumerate(source, 1):
            target.write(b"{}\n" if number in bad_lines else line)
    return str(copy)


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
