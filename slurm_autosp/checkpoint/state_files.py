"""The files a rank writes for a save, before they are written: a synchronous save writes them
at once, an asynchronous one copies their tensors into its staging buffer
(checkpoint/staging_buffer.py) and leaves the writing to the rank's writer process and, for a
distributed checkpoint, to a thread (checkpoint/background_write.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp


@dataclass
class StateFiles:
    """By path relative to the checkpoint's directory: `trees` are written by torch.save (any
    nesting of dicts, lists and tuples around tensors), `texts` as they are, and `distributed`
    state dicts (DTensors among their tensors) by torch's distributed checkpoint, a collective,
    each into the directory it is named by ("": the checkpoint's own)."""

    trees: dict[str, Any] = field(default_factory=dict)
    texts: dict[str, str] = field(default_factory=dict)
    distributed: dict[str, dict[str, Any]] = field(default_factory=dict)

    def under(self, directory: str) -> StateFiles:
        """The same files, one directory down."""
        return StateFiles(
            {_join(directory, name): tree for name, tree in self.trees.items()},
            {_join(directory, name): text for name, text in self.texts.items()},
            {_join(directory, name): state for name, state in self.distributed.items()},
        )

    def write(self, into: Path) -> None:
        """Write every file below `into`. torch.save writes to an open file, as the writer
        process does (to a path it would name the archive inside after the file): an
        asynchronous save writes the same bytes."""
        for name, tree in self.trees.items():
            (into / name).parent.mkdir(parents=True, exist_ok=True)
            with open(into / name, "wb") as f:
                torch.save(tree, f)
        for name, text in self.texts.items():
            (into / name).parent.mkdir(parents=True, exist_ok=True)
            (into / name).write_bytes(text.encode())
        for name, state in self.distributed.items():
            dcp.save(state, checkpoint_id=str(into / name))


def _join(directory: str, name: str) -> str:
    return f"{directory}/{name}" if name else directory
