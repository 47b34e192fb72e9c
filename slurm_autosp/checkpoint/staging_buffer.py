"""A rank's staging buffer: an asynchronous save stalls training only while its tensors are
copied here, one copy per tensor storage (from an accelerator, an asynchronous copy into pinned
memory), and the rank's writer process serialises them from here to shared storage.

The buffer is one file in the rank's staging directory (node memory, /dev/shm by default),
mapped into the rank and into its writer. It is allocated at the first save and reused by the
next ones, so a save's copy touches memory already mapped (a fresh file's first write costs its
page faults, more than the copy itself); it grows when a save needs more. A save's trees go to
the writer with each tensor replaced by a `StagedTensor`, where its storage's bytes lie in the
buffer; the writer rebuilds the tensors as views of its own mapping (`unstage`) and writes the
trees with torch.save: the same files a synchronous save writes. A distributed state dict
(FSDP2's) is staged the same way, each DTensor's local shard, and written from views of the
buffer by a thread of the rank (checkpoint/background_write.py): a collective, which the
writer process cannot join.
"""

from __future__ import annotations

import gc
import logging
import mmap
import os
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from slurm_autosp.checkpoint.state_files import StateFiles
from slurm_autosp.compat.torch_api import dtensor_over, register_pinned, unregister_pinned

log = logging.getLogger(__name__)

ALIGN = 4096  # each storage's bytes start on a page of their own


@dataclass(frozen=True)
class StagedTensor:
    """A tensor of a staged tree: its storage's bytes at `offset` in the buffer, and the view
    of them it is."""

    offset: int
    nbytes: int  # of its storage
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    requires_grad: bool
    parameter: bool


class StagingBuffer:
    """One rank's buffer, at `path` (a file in its staging directory)."""

    def __init__(self, path: Path):
        self.path = path
        self._memory: torch.Tensor | None = None  # uint8, mapped shared from the file
        self._pinned = False
        self.staged_bytes = 0  # what the last save copied here

    def place(self, files: StateFiles) -> Placement:
        """Where each tensor of `files` will lie in the buffer (a storage that several tensors
        view, once), before anything is copied: what the save needs of node memory is known
        before the ranks agree to stage it."""
        places: dict[tuple[str, int, int], int] = {}
        storages: list[tuple[int, torch.UntypedStorage]] = []
        end = 0
        shard_bytes = 0

        def place(tensor: torch.Tensor) -> StagedTensor:
            nonlocal end
            storage = tensor.untyped_storage()
            # empty storages all start at address 0; torch keeps one Python object per
            # storage (alive in `storages`), so its id tells them apart
            at = storage.data_ptr() if storage.nbytes() else id(storage)
            key = (str(tensor.device), at, storage.nbytes())
            if key not in places:
                places[key] = end
                storages.append((end, storage))
                end += max(1, -(-storage.nbytes() // ALIGN)) * ALIGN  # every storage its own offset
            return StagedTensor(
                places[key],
                storage.nbytes(),
                tensor.dtype,
                tuple(tensor.size()),
                tuple(tensor.stride()),
                int(tensor.storage_offset()),
                tensor.requires_grad,
                isinstance(tensor, nn.Parameter),
            )

        def place_shard(tensor: torch.Tensor) -> StagedTensor | _StagedShard:
            nonlocal shard_bytes
            local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
            placed = len(storages)
            staged = place(local)
            if len(storages) > placed:
                shard_bytes += local.untyped_storage().nbytes()
            return _StagedShard(staged, tensor) if isinstance(tensor, DTensor) else staged

        trees = {
            name: _map_tensors(tree, _is_plain_tensor, place) for name, tree in files.trees.items()
        }
        distributed = {
            name: _map_tensors(state, _is_tensor, place_shard)
            for name, state in files.distributed.items()
        }
        return Placement(
            StateFiles(trees, dict(files.texts), distributed), storages, end, shard_bytes
        )

    def room_needed(self, placement: Placement) -> int:
        """The node memory a save `placement` describes takes beyond what this buffer holds
        already: the buffer's growth, and the files its distributed state dicts are written
        to (FSDP2's distributed checkpoint, about their shards' bytes)."""
        held = self._memory.numel() if self._memory is not None else 0
        return max(0, placement.nbytes - held) + placement.distributed_bytes

    @torch.no_grad()
    def stage(self, placement: Placement) -> StateFiles:
        """Copy every storage `placement` placed into the buffer. Returns the files with the
        place of each tensor (a StagedTensor; a DTensor's, of its local shard) where the
        tensor was: the trees for the writer process, the distributed state dicts for `views`.
        An OSError (no room for the buffer) leaves nothing half staged to write."""
        memory = self._reserve(placement.nbytes)
        for offset, storage in placement.storages:
            source = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
            memory[offset : offset + source.numel()].copy_(source, non_blocking=self._pinned)
        if self._pinned:
            torch.cuda.synchronize()  # the writers read the buffer as soon as it is handed over
        self.staged_bytes = sum(storage.nbytes() for _, storage in placement.storages)
        return placement.files

    def restore(self, staged: StateFiles) -> StateFiles:
        """The staged save as files to write, each tensor a view of the buffer (trees as the
        writer rebuilds them): written by the rank itself when its asynchronous write failed."""
        assert self._memory is not None
        trees = unstage(staged, self._memory.numpy())
        return StateFiles(trees.trees, trees.texts, self.views(staged.distributed))

    def views(self, distributed: dict[str, Any]) -> dict[str, Any]:
        """The staged distributed state dicts with each tensor, or DTensor's local shard, a
        view of the buffer: for the thread that writes them (made there: making a DTensor
        costs Python time the stall need not spend)."""
        memory = self._memory
        assert memory is not None

        def view(staged: StagedTensor | _StagedShard) -> torch.Tensor:
            return (
                staged.view(memory) if isinstance(staged, _StagedShard) else _view(memory, staged)
            )

        return {
            name: _map_tensors(state, lambda x: isinstance(x, StagedTensor | _StagedShard), view)
            for name, state in distributed.items()
        }

    def _reserve(self, nbytes: int) -> torch.Tensor:
        """The buffer, grown to `nbytes` if smaller. The file's memory is reserved first
        (posix_fallocate): a full staging file system is an OSError here, not a SIGBUS when
        the copy touches a page that cannot exist."""
        if self._memory is not None and self._memory.numel() >= nbytes:
            return self._memory
        self.close()
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.posix_fallocate(fd, 0, max(nbytes, 1))
        finally:
            os.close(fd)
        memory = torch.from_file(
            str(self.path), shared=True, size=max(nbytes, 1), dtype=torch.uint8
        )
        if torch.cuda.is_available():  # device-to-host copies straight in, asynchronously
            try:
                register_pinned(memory.data_ptr(), memory.numel())
            except RuntimeError as err:  # cudaHostRegister refused the pages: saves go synchronous
                raise OSError(
                    f"pinning the staging buffer {self.path} ({nbytes / 2**20:.1f} MiB) for the "
                    f"GPU's copies failed: {err}"
                ) from err
            self._pinned = True
        self._memory = memory
        return memory

    def close(self) -> None:
        """Unmap the buffer (its file is removed with the staging directory). A failed
        background write leaves views of it in reference cycles (its exception's frames); they
        are collected here, so the node's memory is freed now, not at some later collection."""
        if self._memory is not None and self._pinned:
            try:
                unregister_pinned(self._memory.data_ptr())
            except AssertionError as err:  # after a sticky CUDA error: unmap it all the same
                log.warning("unpinning the staging buffer %s: %s", self.path, err)
        self._memory, self._pinned = None, False
        gc.collect()


@dataclass(frozen=True)
class Placement:
    """A save placed in the buffer (`StagingBuffer.place`), not yet copied."""

    files: StateFiles  # each tensor replaced by its StagedTensor (a DTensor's: _StagedShard)
    storages: list[tuple[int, torch.UntypedStorage]]  # each storage to copy, at its offset
    nbytes: int  # the buffer it needs
    distributed_bytes: int  # of the distributed state dicts' shards


@dataclass(frozen=True)
class _StagedShard:
    """A DTensor of a distributed state dict: its local shard staged, the rest as it was."""

    local: StagedTensor
    like: DTensor

    def view(self, memory: torch.Tensor) -> DTensor:
        return dtensor_over(_view(memory, self.local), self.like)


def _view(memory: torch.Tensor, staged: StagedTensor) -> torch.Tensor:
    """The tensor `staged` describes, viewing the rank's buffer `memory` (offsets are
    page-aligned, so every element size divides them)."""
    itemsize = staged.dtype.itemsize
    return torch.empty(0, dtype=staged.dtype).set_(
        memory.untyped_storage(),
        staged.offset // itemsize + staged.storage_offset,
        staged.size,
        staged.stride,
    )


def unstage(files: StateFiles, buffer: mmap.mmap | np.ndarray) -> StateFiles:
    """The writer's side: `files` with each StagedTensor rebuilt as a view of `buffer`, the
    writer's mapping of the staging buffer (or the rank's own); tensors that viewed one storage
    view one again, a storage of its own each (torch.save writes a tensor's whole storage)."""
    storages: dict[int, torch.UntypedStorage] = {}

    def rebuild(staged: StagedTensor) -> torch.Tensor:
        if staged.offset not in storages:
            storages[staged.offset] = (
                torch.frombuffer(
                    buffer, dtype=torch.uint8, count=staged.nbytes, offset=staged.offset
                )
                if staged.nbytes
                else torch.empty(0, dtype=torch.uint8)
            ).untyped_storage()
        tensor = torch.empty(0, dtype=staged.dtype).set_(
            storages[staged.offset], staged.storage_offset, staged.size, staged.stride
        )
        if staged.parameter:
            return nn.Parameter(tensor, requires_grad=staged.requires_grad)
        return tensor.requires_grad_(staged.requires_grad)

    return StateFiles(
        {
            name: _map_tensors(tree, lambda x: isinstance(x, StagedTensor), rebuild)
            for name, tree in files.trees.items()
        },
        dict(files.texts),
    )


def _is_plain_tensor(value: Any) -> bool:
    """A tensor whose bytes are all it holds (a subclass, e.g. a DTensor, is pickled whole)."""
    return type(value) in (torch.Tensor, nn.Parameter)


def _is_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor)


def _map_tensors(tree: Any, matches: Callable[[Any], bool], replace: Callable[[Any], Any]) -> Any:
    """`tree` with every leaf that `matches` replaced, through dicts (an OrderedDict keeps its
    attributes: a module's state dict carries its `_metadata`), lists and tuples."""
    if matches(tree):
        return replace(tree)
    if isinstance(tree, dict):
        mapped = {key: _map_tensors(value, matches, replace) for key, value in tree.items()}
        if type(tree) is OrderedDict:
            ordered = OrderedDict(mapped)
            ordered.__dict__.update(tree.__dict__)
            return ordered
        return mapped if type(tree) is dict else tree
    if type(tree) is list:
        return [_map_tensors(value, matches, replace) for value in tree]
    if type(tree) is tuple:
        return tuple(_map_tensors(value, matches, replace) for value in tree)
    return tree
