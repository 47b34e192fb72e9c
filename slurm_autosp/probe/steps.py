"""A few real training steps per rank, built and compiled by training's own pieces (engine,
AutoSP compile, optimizer step): step and compile time, FLOPs, and the memory the plan predicts.

Memory per rank: what the forward keeps for backward (distinct storages reaching autograd's
saved-tensor hooks, parameters excluded: the plan's activations and loss inputs), and the
allocated (GPU) or resident (CPU) memory at the start of the timed steps and its peak over them.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from slurm_autosp.compile import decoder_layers
from slurm_autosp.compile.offload import ActivationOffload
from slurm_autosp.config import JobConfig, Precision
from slurm_autosp.data import build_source
from slurm_autosp.engine import build_engine
from slurm_autosp.launch.distributed import DistContext
from slurm_autosp.launch.placement import Parallel
from slurm_autosp.metrics.flops import count_flops, peak_tflops
from slurm_autosp.metrics.memory import MemoryReader
from slurm_autosp.model import model_vocab_size
from slurm_autosp.plan import TrainingChoices
from slurm_autosp.train import compile_for_sp, optimizer_step


@dataclass(frozen=True)
class StepMeasurement:
    """One rank's steps. Step 1 compiles; the others are timed (median)."""

    seconds: list[float]  # every step, in order
    losses: list[float]
    held_bytes: int | None  # kept for backward per micro-batch; None when offloaded (host)
    start_bytes: int  # allocated (GPU) or resident (CPU) as the timed steps start
    peak_bytes: int  # the allocated or resident peak over the timed steps
    peak_reserved_bytes: int  # GPU: the caching allocator's reserved peak; 0 on CPU
    flops_per_step: float  # model FLOPs of one optimizer step, all ranks together
    peak_tflops: float | None  # per device, for MFU; None on CPU
    peak_source: str
    oom: str  # the out-of-memory error; empty when every step ran

    @property
    def step_seconds(self) -> float:
        timed = self.seconds[1:] or self.seconds
        return statistics.median(timed)

    @property
    def compile_seconds(self) -> float:
        """The first step's excess over a timed step: compilation and first-touch allocation."""
        return self.seconds[0] - self.step_seconds if len(self.seconds) > 1 else 0.0


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


def measure_steps(
    cfg: JobConfig, ctx: DistContext, parallel: Parallel, choices: TrainingChoices
) -> StepMeasurement:
    """`probe.steps` optimizer steps as training runs them; an out-of-memory error ends them."""
    torch.manual_seed(cfg.train.seed)
    engine = build_engine(cfg, ctx.device, choices.zero_stage, choices.offload_optimizer)
    backend = compile_for_sp(
        engine.module, cfg, parallel, choices.checkpointing, choices.tile_tokens
    )
    offload = (
        ActivationOffload(ctx.device, layers=len(decoder_layers(engine.module)))
        if choices.offload_activations
        else None
    )
    source = build_source(cfg, model_vocab_size(cfg.model))
    flops = count_flops(engine.module, cfg.data.seq_len, cfg.global_batch)
    peak, peak_source = peak_tflops(
        cfg.trace.peak_tflops_per_gpu, ctx.device, cfg.precision is Precision.bf16
    )
    memory = MemoryReader(ctx.device)
    held = SavedBytes({p.untyped_storage().data_ptr() for p in engine.module.parameters()})
    seconds: list[float] = []
    losses: list[float] = []
    start_bytes, oom = memory.read()[0], ""
    try:
        for step in range(cfg.probe.steps):
            if step == 1:
                start_bytes = memory.read()[0]
                memory.reset_peak()
            _synchronize(ctx.device)
            begin = time.perf_counter()
            with held.counting():
                loss = optimizer_step(engine, cfg, ctx, parallel, source, step, offload=offload)
            _synchronize(ctx.device)
            seconds.append(time.perf_counter() - begin)
            losses.append(loss)
            if backend is not None and step == 0:
                backend.require_sdpa_found()
    except torch.OutOfMemoryError as err:
        oom = str(err).splitlines()[0]
    _, peak_bytes, peak_reserved = memory.read()
    engine.close()
    return StepMeasurement(
        seconds=seconds,
        losses=losses,
        held_bytes=None if offload else held.total // cfg.train.grad_accum,
        start_bytes=start_bytes,
        peak_bytes=peak_bytes,
        peak_reserved_bytes=peak_reserved,
        flops_per_step=flops.per_step,
        peak_tflops=peak,
        peak_source=peak_source,
        oom=oom,
    )
