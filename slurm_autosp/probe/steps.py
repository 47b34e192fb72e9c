"""A few real training steps per rank, built and compiled by training's own pieces (engine,
AutoSP compile, optimizer step): step and compile time, FLOPs, and the memory the plan predicts.

Memory per rank: what the forward keeps for backward (distinct storages reaching autograd's
saved-tensor hooks, parameters excluded: the plan's activations and loss inputs), and the
allocated (GPU) or resident (CPU) memory at the start of the timed steps and its peak over them.

On one rank (the GPU check) an out-of-memory error is a result, not a crash: the steps end,
and the measurement records at which step and the memory when it struck (the peak then is a
lower bound of what the step needs). Among several ranks the others may be waiting for this one
inside the step's collectives, where nothing can reach them: the rank logs the same finding
and raises, and the job's failure agreement (cluster/rank_failure.py) ends every rank naming
it. A stop request ends the steps at the next step boundary, with what they measured.
"""

from __future__ import annotations

import gc
import logging
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from slurm_autosp.cluster.parallel_dims import ParallelDims
from slurm_autosp.compile import AutoSPBackend, decoder_layers
from slurm_autosp.config import JobConfig, Precision
from slurm_autosp.data import build_source
from slurm_autosp.engine import build_engine
from slurm_autosp.memory_plan import TrainingChoices
from slurm_autosp.metrics.flops import count_flops, peak_tflops
from slurm_autosp.metrics.outside_allocator import used_outside_allocator
from slurm_autosp.metrics.rank_memory import MemoryReader
from slurm_autosp.model import model_vocab_size
from slurm_autosp.probe.stop import AgreedStop
from slurm_autosp.sp.offload import ActivationOffload
from slurm_autosp.train import compile_for_sp, optimizer_step

log = logging.getLogger(__name__)
MIB = 2**20


@dataclass(frozen=True)
class OutOfMemory:
    """Where a rank ran out of memory, and its memory when it did."""

    step: int  # 1-based, as the steps are logged
    message: str  # the error's first line (CUDA's names the allocation that failed)
    allocated_bytes: int  # allocated (GPU) or resident (CPU) when the error was caught
    peak_bytes: int  # the allocated or resident peak up to the failure
    peak_reserved_bytes: int  # GPU: the caching allocator's reserved peak; 0 on CPU

    def describe(self) -> str:
        return (
            f"out of memory at step {self.step}: {self.message} (allocated "
            f"{self.allocated_bytes / MIB:,.0f} MiB, peak {self.peak_bytes / MIB:,.0f} MiB, "
            f"reserved peak {self.peak_reserved_bytes / MIB:,.0f} MiB)"
        )


class RankOutOfMemory(RuntimeError):
    """A rank of several ran out of memory in a step; the message is its finding."""


@dataclass(frozen=True)
class StepMeasurement:
    """One rank's steps. Step 1 compiles; the others are timed (median)."""

    seconds: list[float]  # every step that completed, in order
    losses: list[float]
    held_bytes: int | None  # kept for backward per micro-batch; None when offloaded (host)
    # or when no step completed
    start_bytes: int  # allocated (GPU) or resident (CPU) as the timed steps start
    peak_bytes: int  # the allocated or resident peak over the timed steps
    peak_reserved_bytes: int  # GPU: the caching allocator's reserved peak; 0 on CPU
    flops_per_step: float  # model FLOPs of one optimizer step, all ranks together
    peak_tflops: float | None  # per device, for MFU; None on CPU
    peak_source: str
    oom: OutOfMemory | None  # the out-of-memory error that ended the steps
    stopped: str  # why the steps ended early on a stop request; empty otherwise
    # GPU: the device's memory outside torch's allocator after the first step (the CUDA
    # context, NCCL's buffers as NCCL sized them); None on CPU or before a step completed
    outside_allocator_bytes: float | None = None

    @classmethod
    def not_run(cls, stopped: str) -> StepMeasurement:
        """The steps of a probe stopped before them: the engine is not even built."""
        return cls([], [], None, 0, 0, 0, 0.0, None, "no step ran", None, stopped)

    @property
    def step_seconds(self) -> float | None:
        """The median timed step; None when no step completed."""
        timed = self.seconds[1:] or self.seconds
        return statistics.median(timed) if timed else None

    @property
    def compile_seconds(self) -> float | None:
        """The first step's excess over a timed step: compilation and first-touch allocation."""
        if len(self.seconds) < 2:
            return None
        return self.seconds[0] - statistics.median(self.seconds[1:])


class SavedBytes:
    """Bytes of the distinct storages autograd saves for backward, parameters excluded."""

    def __init__(self, parameters: set[int]):
        self.parameters = parameters
        self.saved: dict[int, int] = {}

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self.parameters:
            self.saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    @contextmanager
    def counting(self) -> Iterator[None]:
        self.saved = {}
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor):
            yield

    @property
    def total(self) -> int:
        return sum(self.saved.values())


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class ProbeSteps:
    """The model as training builds and compiles it, once; `measure` runs optimizer steps at
    any sequence length through it, so a search over lengths reuses the compiled graphs."""

    def __init__(
        self,
        cfg: JobConfig,
        dims: ParallelDims,
        choices: TrainingChoices,
        backend: AutoSPBackend | None = None,
    ):
        """`backend`: an earlier ProbeSteps' (same config), whose compiled graphs it reuses."""
        self.dims = dims
        torch.manual_seed(cfg.train.seed)
        self.engine = build_engine(cfg, dims.device, choices.zero_stage, choices.offload_optimizer)
        self.backend = compile_for_sp(
            self.engine.module,
            cfg.compile,
            dims,
            choices.checkpointing,
            choices.tile_tokens,
            backend,
        )
        self.offload = (
            ActivationOffload(dims.device, layers=len(decoder_layers(self.engine.module)))
            if choices.offload_activations
            else None
        )
        self.peak, self.peak_source = peak_tflops(
            cfg.trace.peak_tflops_per_gpu, dims.device, cfg.precision is Precision.bf16
        )
        self.memory = MemoryReader(dims.device)
        self.held = SavedBytes(
            {p.untyped_storage().data_ptr() for p in self.engine.module.parameters()}
        )
        self.sdpa_checked = False

    def measure(
        self, cfg: JobConfig, steps: int, stop: AgreedStop | None = None
    ) -> StepMeasurement:
        """`steps` optimizer steps at `cfg.data.seq_len`; an out-of-memory error or an agreed
        stop request ends them (the error raised as RankOutOfMemory among several ranks)."""
        dims, memory = self.dims, self.memory
        source = build_source(cfg, model_vocab_size(cfg.model))
        flops = count_flops(self.engine.module, cfg.data.seq_len, cfg.global_batch)
        seconds: list[float] = []
        losses: list[float] = []
        held: int | None = None
        oom: OutOfMemory | None = None
        outside: float | None = None
        if dims.device.type == "cuda":  # cached blocks of another length: free, as a new job is
            torch.cuda.empty_cache()
        memory.reset_peak()
        start_bytes = memory.read()[0]
        for step in range(steps):
            if stop is not None and stop.requested(f"step {step} of {steps}"):
                log.info("probe: %s", stop.reason)
                break
            if step == 1:
                start_bytes = memory.read()[0]
                memory.reset_peak()
            _synchronize(dims.device)
            begin = time.perf_counter()
            try:
                with self.held.counting():
                    loss = optimizer_step(
                        self.engine, cfg, dims, source, step, offload=self.offload
                    )
                _synchronize(dims.device)
            except torch.OutOfMemoryError as err:
                oom = self._out_of_memory(step + 1, err)
                log.error("probe: rank %d ran %s", dims.rank, oom.describe())
                if dims.world_size > 1:
                    raise RankOutOfMemory(
                        f"probe: {oom.describe()}; compare it with `python -m slurm_autosp "
                        "plan`, and lower data.seq_len or train.micro_batch, or keep fewer "
                        "activations (compile.activation_checkpointing)"
                    ) from err
                break
            seconds.append(time.perf_counter() - begin)
            losses.append(loss)
            if step == 0:  # every collective of a training step has run once
                outside = used_outside_allocator(dims.device)
            held = self.held.total // cfg.train.grad_accum
            log.info("probe: step %d of %d: %.3f s", step + 1, steps, seconds[-1])
            if self.backend is not None and not self.sdpa_checked:
                self.backend.require_sdpa_found()
                self.sdpa_checked = True
        _, peak_bytes, peak_reserved = memory.read()
        return StepMeasurement(
            seconds=seconds,
            losses=losses,
            held_bytes=None if self.offload else held,
            start_bytes=start_bytes,
            peak_bytes=peak_bytes,
            peak_reserved_bytes=peak_reserved,
            flops_per_step=flops.per_step,
            peak_tflops=self.peak,
            peak_source=self.peak_source,
            oom=oom,
            stopped=stop.reason if stop is not None else "",
            outside_allocator_bytes=outside,
        )

    def _out_of_memory(self, step: int, err: torch.OutOfMemoryError) -> OutOfMemory:
        """The memory while the failed step's tensors are still held (by the traceback)."""
        allocated, peak, reserved = self.memory.read()
        message = (str(err).splitlines() or [type(err).__name__])[0]
        return OutOfMemory(step, message, allocated, max(peak, allocated), reserved)

    def close(self) -> None:
        """Close the engine and give its memory back (the GPU's to the device, for a next try)."""
        self.engine.close()
        del self.engine
        gc.collect()
        if self.dims.device.type == "cuda":
            torch.cuda.empty_cache()


def measure_steps(
    cfg: JobConfig,
    dims: ParallelDims,
    choices: TrainingChoices,
    stop: AgreedStop | None = None,
) -> StepMeasurement:
    """`probe.steps` optimizer steps as training runs them."""
    steps = ProbeSteps(cfg, dims, choices)
    try:
        return steps.measure(cfg, cfg.probe.steps, stop)
    finally:
        steps.close()
