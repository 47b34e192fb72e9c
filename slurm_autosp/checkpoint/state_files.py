"""The files a rank writes for a save, before they are written: a synchronous save writes them
at once, an asynchronous one copies their tensors into its staging buffer
(checkpoint/staging_buffer.py) and leaves the writing to the rank's writer process and, for a
distributed checkpoint, to a thread (checkpoint/background_write.py)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

_writing = threading.local()  # `on` while this thread's StateFiles.write runs torch.save


def _host_location(storage: Any) -> str | None:
    """The location torch.save records of a storage StateFiles.write saves: "cpu", where
    torch.save copies a device storage to write it, one at a time, as the staged copy an
    asynchronous save writes is. torch.save would record the device ("cuda:3"), where a load
    without map_location puts the tensor back: on that GPU, from every rank that loads it."""
    return "cpu" if getattr(_writing, "on", False) else None


# priority 0: asked before torch's own taggers (cpu 10, cuda 20); None passes the storage on
torch.serialization.register_package(0, _host_location, lambda storage, location: None)


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
        process does (to a path it would name the archive inside after the file), and records
        every tensor as a host tensor (`_host_location`): an asynchronous save writes the same
        bytes."""
        _writing.on = True
        try:
            for name, tree in self.trees.items():
                (into / name).parent.mkdir(parents=True, exist_ok=True)
                with open(into / name, "wb") as f:
                    torch.save(tree, f)
        finally:
            _writing.on = False
        for name, text in self.texts.items():
            (into / name).parent.mkdir(parents=True, exist_ok=True)
            (into / name).write_bytes(text.encode())
        for name, state in self.distributed.items():
            dcp.save(state, checkpoint_id=str(into / name))


def _join(directory: str, name: str) -> str:
    return f"{directory}/{name}" if name else directory
