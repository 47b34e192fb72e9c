"""Host memory for offloaded activations, allocated at its exact size and reused step after step.

torch's pinned-memory allocator rounds every request up to a power of two and caches what is
freed: offloading a step's activations through it could hold up to twice the bytes the memory
plan counts, and a node sized to the plan runs out of host memory. The arena instead takes
plain host memory of the size asked (slabs of `slab_bytes`, or one slab per tensor larger than
that), pins it on CUDA by registering it (as torch's own checkpoint stager does: exact, and not
cached by torch), and hands it out by bumping an offset. A session (one forward's offload)
returns its slabs when its backward has read everything back; the next micro-batch, which saves
the same tensors, reuses them. What it holds beyond the bytes offloaded is the unused tail of a
session's slabs: at most one slab per session, and 512-byte alignment per tensor.
"""

from __future__ import annotations

import weakref

import torch

from slurm_autosp.compat import torch_api

SLAB_BYTES = 64 << 20
ALIGNMENT = 512  # bytes between tensors in a slab: more than any dtype needs


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


class HostArena:
    """Slabs of host memory, pinned when `pin` (a CUDA device's copies need it)."""

    def __init__(self, pin: bool, slab_bytes: int = SLAB_BYTES) -> None:
        self.pin = pin
        self.slab_bytes = slab_bytes
        self.reserved_bytes = 0  # every slab, in use or free
        self._free: list[torch.Tensor] = []

    def session(self) -> ArenaSession:
        return ArenaSession(self)

    def take_slab(self, nbytes: int) -> torch.Tensor:
        """A free slab of at least `nbytes` (the smallest that fits), or a new one."""
        fitting = [s for s in self._free if s.numel() >= nbytes]
        if fitting:
            slab = min(fitting, key=torch.Tensor.numel)
            self._free.remove(slab)
            return slab
        size = max(self.slab_bytes, _aligned(nbytes))
        slab = torch.empty(size, dtype=torch.uint8, device="cpu")
        if self.pin:
            torch_api.register_pinned(slab.data_ptr(), size)
            unpin = weakref.finalize(slab, torch_api.unregister_pinned, slab.data_ptr())
            # not at interpreter exit, when the CUDA context may be gone: the process's end
            # unpins its memory anyway (torch's own checkpoint stager does the same)
            unpin.atexit = False
        self.reserved_bytes += size
        return slab

    def give_back(self, slabs: list[torch.Tensor]) -> None:
        self._free.extend(slabs)


class ArenaSession:
    """One forward's host tensors: carved from the session's slabs in order, all returned at once."""

    def __init__(self, arena: HostArena) -> None:
        self._arena = arena
        self._slabs: list[torch.Tensor] = []
        self._offset = 0
        # a session dropped without release (its graph freed unread) still returns its slabs
        self._finalizer = weakref.finalize(self, arena.give_back, self._slabs)

    def empty_like(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host tensor of `tensor`'s shape, strides and dtype (dense: its bytes are numel x size)."""
        nbytes = tensor.nbytes
        if not self._slabs or self._offset + nbytes > self._slabs[-1].numel():
            self._slabs.append(self._arena.take_slab(nbytes))
            self._offset = 0
        flat = self._slabs[-1][self._offset : self._offset + nbytes].view(tensor.dtype)
        self._offset = _aligned(self._offset + nbytes)
        return flat.as_strided(tensor.size(), tensor.stride())

    def release(self) -> None:
        """Every tensor of the session is read back: its slabs serve the next forward."""
        self._finalizer()
