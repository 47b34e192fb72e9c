"""Activation offload: the tensors autograd saves for backward wait in host memory, not on the
accelerator, and come back about one layer ahead of the backward that reads them.

At long sequence lengths activations, not weights, fill the GPU. A pair of saved-tensor hooks
sees every tensor a forward saves, those of compiled graphs included (AOTAutograd saves through
autograd), so offload needs no change to the model or its compiled code. Parameters and their
views stay where they are (they are alive anyway, and the engine owns them), and so do tensors
under `min_bytes` (a copy would cost more than they free).

The prefetch cannot follow the decoder layers: a module hook inside compiled code would make
Dynamo specialise each layer. The backward reads saved tensors roughly in reverse pack order,
so it walks them down from the last one packed, keeping one layer's worth of bytes (all packed
bytes over the number of layers) fetched ahead of the backward.

On CUDA both copies run on a side stream, to and from pinned host memory; on CPU they are plain
copies, which gain nothing but run the same bookkeeping and are exact alike. Every device copy
is allocated on the compute stream, as every other activation is: the caching allocator keeps
one pool per stream, and blocks a side stream allocated could serve only that stream (two more
layers' worth reserved beside the compute stream's, freed to it only on an out-of-memory retry). The host memory
comes from a `HostArena`: exactly the bytes offloaded (plus at most one slab's tail per
micro-batch), reused by every micro-batch, as the memory plan counts it.
"""

import weakref
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass

import torch

from slurm_autosp.sp.host_arena import ArenaSession, HostArena


@dataclass
class OffloadStats:
    """Bytes moved and held, summed over every forward since the offload was made."""

    to_host_bytes: int = 0
    to_device_bytes: int = 0
    # saved non-parameter tensors left in place: small, not dense, or on another device
    kept_bytes: int = 0
    # device copies of offloaded tensors alive now: prefetched, or in the backward's hands
    resident_bytes: int = 0
    peak_resident_bytes: int = 0


@dataclass(frozen=True, eq=False)
class _Version:
    """A saved tensor's version when saved, checked when the backward reads it, as autograd
    checks it without hooks (saved-tensor hooks turn its check off: saved_variable.cpp). On
    CUDA a write after the save could otherwise reach the host copy, made later on the side
    stream, silently. `base` is the tensor's base (or itself): every tensor that can write
    into it keeps its base alive, and shares its version counter."""

    base: weakref.ref[torch.Tensor]
    version: int
    what: str  # as autograd names a tensor: [torch.cuda.FloatTensor [2, 8]]

    @classmethod
    def of(cls, tensor: torch.Tensor) -> "_Version":
        base = tensor if tensor._base is None else tensor._base
        return cls(weakref.ref(base), tensor._version, f"[{tensor.type()} {list(tensor.shape)}]")

    def check(self) -> None:
        base = self.base()
        if base is not None and base._version != self.version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an "
                f"inplace operation: {self.what} is at version {base._version}; expected version "
                f"{self.version} instead. Activation offload saved it, whose hooks stand in for "
                "autograd's own check: make that operation out of place (x = x.mul(2) for "
                "x.mul_(2)), or clone the tensor before it"
            )


@dataclass(frozen=True, eq=False)
class _Kept:
    """What autograd holds for a saved tensor left where it is."""

    tensor: torch.Tensor
    saved: _Version


@dataclass(eq=False)
class _Offloaded:
    """What autograd holds for one offloaded tensor: its host copy until fetched, then its device
    copy (and, on CUDA, the event that copy ends with) until handed back."""

    nbytes: int
    host: torch.Tensor | None
    saved: _Version
    device_copy: torch.Tensor | None = None
    ready: torch.cuda.Event | None = None


def _is_parameter(tensor: torch.Tensor) -> bool:
    return isinstance(tensor, torch.nn.Parameter) or isinstance(tensor._base, torch.nn.Parameter)


def _dense(tensor: torch.Tensor) -> bool:
    """Whether the elements fill their memory exactly, in some order of dimensions: then a copy
    with the same strides is the same size, and the compiled backward, which may assert the
    strides of what it reads, gets them unchanged."""
    expected = 1
    dims = sorted(
        (stride, size)
        for size, stride in zip(tensor.shape, tensor.stride(), strict=True)
        if size != 1
    )
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def _on(stream: torch.cuda.Stream | None) -> AbstractContextManager:
    """`stream` made current; nothing without one (torch.cuda.stream(None) would still ask CUDA
    for its current device, starting CUDA in a CPU run on a GPU machine)."""
    return torch.cuda.stream(stream) if stream is not None else nullcontext()


def _strided_like(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    return torch.empty_strided(tensor.size(), tensor.stride(), dtype=tensor.dtype, device=device)


class ActivationOffload:
    """Offloads what the forwards run under `saving()` keep for backward, on `device`.

    `layers` (the model's decoder layers) sets how far the backward's prefetch runs ahead: one
    layer's worth of bytes. Each `saving()` block is independent: one per micro-batch, its
    backward run whenever the caller likes, once (retain_graph is not supported).
    """

    def __init__(
        self, device: torch.device | str, *, layers: int, min_bytes: int = 1 << 20
    ) -> None:
        if layers < 1:
            raise ValueError(
                f"layers={layers}: pass the model's number of decoder layers (at least 1)"
            )
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device(
                "cuda", torch.cuda.current_device()
            )  # saved tensors name their GPU's index
        self.device = device
        self.layers = layers
        self.min_bytes = min_bytes
        self.stats = OffloadStats()
        self._side = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.arena = HostArena(pin=self._side is not None)

    @contextmanager
    def saving(self) -> Iterator[None]:
        """Offload what the forward inside this block saves for backward."""
        session = _Session(self)
        with torch.autograd.graph.saved_tensors_hooks(session.pack, session.unpack):
            yield

    def movable(self, tensor: torch.Tensor) -> bool:
        """A plain tensor (no parameter, no subclass such as DTensor), dense, big enough, on the device."""
        return (
            type(tensor) is torch.Tensor
            and tensor.device == self.device
            and tensor.nbytes >= self.min_bytes
            and _dense(tensor)
        )

    def to_host(self, tensor: torch.Tensor, host: torch.Tensor) -> torch.Tensor:
        """`tensor` copied into `host`; on CUDA issued on the side stream once the compute stream
        has produced `tensor`, whose memory the allocator then keeps until the copy is done. The
        side stream also orders a later copy into the same host memory after every earlier one."""
        if self._side is not None:
            self._side.wait_stream(torch.cuda.current_stream(self.device))
            tensor.record_stream(self._side)
        with _on(self._side):
            host.copy_(tensor, non_blocking=True)
        self.stats.to_host_bytes += tensor.nbytes
        return host

    def to_device(self, host: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """A device copy of `host`, and on CUDA the side-stream event it is ready at. Its bytes
        count as resident until the copy is freed, by the backward or with its session.

        On CUDA the memory comes from the compute stream's pool, so the side stream first waits
        for the work queued there (a block the compute stream freed may still be read by it):
        the copy starts as the compute stream reaches the layer whose backward asked for it, one
        layer ahead of the backward that reads it. The allocator keeps the memory from the
        compute stream until the copy is done, should the tensor be freed before it is read."""
        tensor = _strided_like(host, self.device)
        if self._side is not None:
            self._side.wait_stream(torch.cuda.current_stream(self.device))
            tensor.record_stream(self._side)
        with _on(self._side):
            tensor.copy_(host, non_blocking=True)
        ready = self._side.record_event() if self._side is not None else None
        stats = self.stats
        stats.to_device_bytes += tensor.nbytes
        stats.resident_bytes += tensor.nbytes
        stats.peak_resident_bytes = max(stats.peak_resident_bytes, stats.resident_bytes)
        weakref.finalize(tensor, self._freed, tensor.nbytes)
        return tensor, ready

    def hand_over(self, ready: torch.cuda.Event | None) -> None:
        """On CUDA: the compute stream waits for the copy before it reads the tensor."""
        if ready is not None:
            torch.cuda.current_stream(self.device).wait_event(ready)

    def _freed(self, nbytes: int) -> None:
        self.stats.resident_bytes -= nbytes


class _Session:
    """One forward's offloaded tensors in pack order, and its backward's walk down through them."""

    def __init__(self, offload: ActivationOffload) -> None:
        self._offload = offload
        self._host: ArenaSession = offload.arena.session()
        self._records: list[_Offloaded] = []
        self._on_host = 0  # records whose host copy is not fetched yet
        self._packed_bytes = 0
        self._ahead_bytes = 0  # fetched, not yet handed to the backward
        # the next record the prefetch looks at; None before the backward
        self._cursor: int | None = None

    def pack(self, tensor: torch.Tensor) -> torch.Tensor | _Kept | _Offloaded:
        if _is_parameter(tensor):
            return tensor
        if not self._offload.movable(tensor):
            self._offload.stats.kept_bytes += tensor.nbytes
            return _Kept(tensor, _Version.of(tensor))
        saved = _Version.of(tensor)
        host = self._offload.to_host(tensor, self._host.empty_like(tensor))
        record = _Offloaded(tensor.nbytes, host, saved)
        self._records.append(record)
        self._on_host += 1
        self._packed_bytes += record.nbytes
        return record

    def unpack(self, packed: torch.Tensor | _Kept | _Offloaded) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        packed.saved.check()
        if isinstance(packed, _Kept):
            return packed.tensor
        if packed.device_copy is None:
            self._fetch(packed)
        tensor, ready = packed.device_copy, packed.ready
        assert tensor is not None, "_fetch leaves the device copy in the record"
        packed.device_copy = packed.ready = None
        self._ahead_bytes -= packed.nbytes
        self._offload.hand_over(ready)
        self._prefetch()
        return tensor

    def _fetch(self, record: _Offloaded) -> None:
        if record.host is None:
            raise RuntimeError(
                "an offloaded activation was read twice: ActivationOffload serves one backward per "
                "forward and drops each tensor once handed back (backward(retain_graph=True) is not supported)"
            )
        record.device_copy, record.ready = self._offload.to_device(record.host)
        record.host = None
        self._ahead_bytes += record.nbytes
        self._on_host -= 1
        if self._on_host == 0:  # every copy back is issued, on the stream the next forward's use
            self._host.release()

    def _prefetch(self) -> None:
        """Fetch down from the last tensor packed, never skipping one, until one layer's worth of
        bytes waits ahead: a compiled layer's backward reads all it saved at once, lowest first,
        so jumping down to the tensor just read would leave the rest of its layer behind."""
        if self._cursor is None:
            self._cursor = len(self._records) - 1
        window = self._packed_bytes / self._offload.layers
        while self._cursor >= 0 and self._ahead_bytes < window:
            record = self._records[self._cursor]
            if record.host is not None:
                self._fetch(record)
            self._cursor -= 1
