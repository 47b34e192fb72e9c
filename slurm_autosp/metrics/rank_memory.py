"""Memory of one rank: peaks per step, and a timeline through one step on traced steps.

What is measured: on GPU the CUDA caching allocator's counters (bytes allocated to tensors,
and bytes reserved from the device); on CPU the process's resident set from
/proc/self/status (VmRSS now, VmHWM its high-water mark, reset by writing 5 to
/proc/self/clear_refs). Every reading also reads and resets the peak, so a timeline sampled
every few milliseconds still holds the exact peak of every interval between two samples.

A sample runs on a thread beside the step it measures, holding the GIL: it must be cheap. On
GPU it takes the allocator's nested statistics as they come from C++
(`memory_stats_as_nested_dict`); `memory_stats()`, and `memory_allocated()` which reads it,
flatten and sort all of them in Python on every call (torch/cuda/memory.py). On CPU it reads
/proc with bare system calls, without Python's file objects: 24 us a sample instead of 74 us
here.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

_STATUS = "/proc/self/status"
_STATUS_BYTES = 16384  # /proc/self/status is about 1.5 KB; one read takes it whole
_CLEAR_REFS = "/proc/self/clear_refs"


class MemoryReader:
    """This rank's memory counters: `read()` gives (current, peak, reserved peak) in bytes
    since the last `reset_peak()`; the reserved peak is 0 on CPU, where there is no allocator
    cache to tell apart from the resident set."""

    def __init__(self, device: torch.device):
        self.device = device
        self.on_gpu = device.type == "cuda"

    @property
    def measure(self) -> str:
        return "allocated" if self.on_gpu else "rss"

    @property
    def description(self) -> str:
        if self.on_gpu:
            return "bytes allocated to tensors by the CUDA caching allocator (reserved: held from the device)"
        return "resident set size of the rank's process (VmRSS; peak from VmHWM), from /proc/self/status"

    def reset_peak(self) -> None:
        if self.on_gpu:
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        try:
            fd = os.open(_CLEAR_REFS, os.O_WRONLY)
        except OSError:
            return
        try:
            os.write(fd, b"5")
        except OSError:
            pass
        finally:
            os.close(fd)

    def read(self) -> tuple[int, int, int]:
        if self.on_gpu:
            stats = torch.cuda.memory_stats_as_nested_dict(self.device)
            allocated = stats.get("allocated_bytes", {}).get("all", {})
            reserved = stats.get("reserved_bytes", {}).get("all", {})
            return allocated.get("current", 0), allocated.get("peak", 0), reserved.get("peak", 0)
        try:
            fd = os.open(_STATUS, os.O_RDONLY)
        except OSError:
            return 0, 0, 0
        try:
            status = os.read(fd, _STATUS_BYTES)
        finally:
            os.close(fd)
        return _kib_field(status, b"VmRSS:") * 1024, _kib_field(status, b"VmHWM:") * 1024, 0

    def read_and_reset(self) -> tuple[int, int, int]:
        sample = self.read()
        self.reset_peak()
        return sample


def _kib_field(status: bytes, key: bytes) -> int:
    start = status.find(key)
    if start < 0:
        return 0
    return int(status[start + len(key) : status.index(b"kB", start)])


@dataclass
class MemoryTrace:
    """One rank's memory through one step. Times are seconds since the step started;
    `peak[i]` is the highest value between samples i-1 and i (exact, not sampled)."""

    rank: int
    step: int
    measure: str  # "allocated" (GPU) or "rss" (CPU)
    description: str
    times: list[float] = field(default_factory=list)
    current: list[int] = field(default_factory=list)
    peak: list[int] = field(default_factory=list)
    reserved: list[int] = field(default_factory=list)
    marks: list[tuple[float, str]] = field(default_factory=list)  # phase boundaries, module hooks
    phases: list[tuple[str, float, float]] = field(default_factory=list)  # (name, start, end)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MemoryTrace:
        data = dict(data)
        data["marks"] = [tuple(m) for m in data.get("marks", [])]
        data["phases"] = [tuple(p) for p in data.get("phases", [])]
        return cls(**data)

    @property
    def peak_index(self) -> int:
        return max(range(len(self.peak)), key=self.peak.__getitem__) if self.peak else 0

    @property
    def peak_bytes(self) -> int:
        return max(self.peak, default=0)

    @property
    def peak_reserved_bytes(self) -> int:
        return max(self.reserved, default=0)

    def phase_at(self, t: float) -> tuple[str, int]:
        """The phase running at time t and which occurrence of it (micro-batch, from 0)."""
        seen: dict[str, int] = {}
        found = ("between phases", 0)
        for name, start, end in self.phases:
            index = seen.get(name, 0)
            seen[name] = index + 1
            if start <= t <= end:
                found = (name, index)
        return found

    def where_peak(self) -> str:
        """Where the peak happened, for people: phase, time and the marks around it."""
        if not self.peak:
            return "no samples"
        i = self.peak_index
        t0, t1 = (self.times[i - 1] if i else 0.0), self.times[i]
        name, index = self.phase_at(t1 if i else 0.0)
        before = [label for t, label in self.marks if t <= t0 + 1e-9]
        after = [label for t, label in self.marks if t >= t1 - 1e-9]
        where = f"in {name}" + (f" (micro-batch {index + 1})" if self._repeats(name) else "")
        span = f"between {t0 * 1e3:.1f} and {t1 * 1e3:.1f} ms"
        context = ""
        if before or after:
            context = f", after `{before[-1] if before else 'step start'}`, before `{after[0] if after else 'step end'}`"
        return f"{where}, {span}{context}"

    def _repeats(self, name: str) -> bool:
        return sum(1 for n, _, _ in self.phases if n == name) > 1


class MemoryTimeline:
    """Records a MemoryTrace through one step: a sampling thread reads the counters every
    `interval_s`; the step's phase boundaries and module hooks add labelled samples.

    Module hooks go only on modules outside compiled regions (hooks on a compiled module would
    make torch.compile recompile), to a depth of three below the model: with per-layer
    compilation that is the embeddings, each decoder layer as a whole, the final norm and the
    output head. A module's forward hooks label its start and end; a gradient hook on its
    output labels the start of its backward.
    """

    def __init__(
        self,
        reader: MemoryReader,
        rank: int,
        step: int,
        interval_s: float,
        model: torch.nn.Module | None,
    ):
        self.reader = reader
        self.trace = MemoryTrace(rank, step, reader.measure, reader.description)
        self.interval_s = interval_s
        self.model = model
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._handles: list[Any] = []
        self._t0 = 0.0
        self._open_phase: tuple[str, float] | None = None

    def start(self) -> None:
        self._t0 = time.perf_counter()
        self.reader.reset_peak()
        self.mark("step start")
        if self.model is not None:
            self._install_hooks(self.model)
        if self.interval_s > 0:
            self._thread = threading.Thread(
                target=self._sample_until_stopped, name="memory-trace", daemon=True
            )
            self._thread.start()

    def stop(self) -> MemoryTrace:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.mark("step end")
        return self.trace

    def mark(self, label: str | None = None) -> float:
        with self._lock:
            t = time.perf_counter() - self._t0
            current, peak, reserved = self.reader.read_and_reset()
            trace = self.trace
            trace.times.append(t)
            trace.current.append(current)
            trace.peak.append(max(peak, current))
            trace.reserved.append(reserved)
            if label is not None:
                trace.marks.append((t, label))
            return t

    def phase_start(self, name: str) -> None:
        self._open_phase = (name, self.mark(f"{name} start"))

    def phase_end(self, name: str) -> None:
        end = self.mark(f"{name} end")
        if self._open_phase is not None:
            self.trace.phases.append((name, self._open_phase[1], end))
            self._open_phase = None

    def _sample_until_stopped(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.mark()

    def _install_hooks(self, model: torch.nn.Module) -> None:
        for name, module in _hookable_modules(model):
            label = name or type(module).__name__
            self._handles.append(module.register_forward_pre_hook(self._forward_pre_hook(label)))
            self._handles.append(module.register_forward_hook(self._forward_hook(label)))

    def _forward_pre_hook(self, label: str):
        def hook(module, args):
            self.mark(f"{label} forward")

        return hook

    def _forward_hook(self, label: str):
        def hook(module, args, output):
            self.mark(f"{label} forward done")
            for tensor in _tensors(output):
                if tensor.requires_grad:
                    tensor.register_hook(self._backward_hook(label))
                    break

        return hook

    def _backward_hook(self, label: str):
        def hook(grad):  # returns None: the gradient is left unchanged
            self.mark(f"{label} backward")

        return hook


def _hookable_modules(model: torch.nn.Module, max_depth: int = 3):
    """(name, module) of the modules within `max_depth` of the root that run outside compiled
    regions; containers that are never called (ModuleList, ModuleDict) are skipped."""
    compiled = [
        name
        for name, m in model.named_modules()
        if getattr(m, "_compiled_call_impl", None) is not None
    ]
    for name, module in model.named_modules():
        depth = name.count(".") + 1 if name else 0
        inside_compiled = any(name == c or name.startswith(c + ".") or c == "" for c in compiled)
        if (
            depth > max_depth
            or inside_compiled
            or isinstance(module, (torch.nn.ModuleList, torch.nn.ModuleDict))
        ):
            continue
        yield name, module


def _tensors(output: Any) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, dict):
        return [v for v in output.values() if isinstance(v, torch.Tensor)]
    if isinstance(output, (tuple, list)):
        return [v for v in output if isinstance(v, torch.Tensor)]
    return []


# ----------------------------------------------------------------------------- GPU snapshots


def start_memory_history() -> None:
    """Record every CUDA allocation with its Python stack (C++ stacks are slow to unwind), for
    PyTorch's memory snapshot; the newest 200,000 events are kept."""
    torch.cuda.memory._record_memory_history(enabled="all", stacks="python", max_entries=200_000)


def dump_memory_snapshot(path: Path, stop: bool = True) -> Path | None:
    """Write PyTorch's memory snapshot (what pytorch.org/memory_viz reads) to `path`."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.cuda.memory._dump_snapshot(str(path))
        return path
    except Exception:  # never let a diagnostic hide the real error
        return None
    finally:
        if stop:
            torch.cuda.memory._record_memory_history(enabled=None)
