"""What a training step records, and the one writer that puts it on shared storage.

Every rank times its step's phases and reads its memory peaks; once per step one small
all-gather brings every rank's numbers to every rank (so all agree which rank is the worst);
rank 0 alone writes TensorBoard events (with tensorboardX: a compute node needs no
TensorBoard). On traced steps (`trace.memory_steps`) every rank also records a memory
timeline; the chosen ranks' timelines go to rank 0, which writes them as images (where
matplotlib is installed) and text, plus the raw timeline as JSON under `tensorboard/memory/`.
Untraced steps pay for a few clock readings and that one collective, nothing else.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import socket
import statistics
import sys
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from tensorboardX import SummaryWriter
from tensorboardX.proto.summary_pb2 import Summary

from slurm_autosp.config import JobConfig, Precision, to_yaml
from slurm_autosp.lifecycle.run_dir import RunDir
from slurm_autosp.lifecycle.save_time import StepTime
from slurm_autosp.metrics.flops import count_flops, peak_tflops
from slurm_autosp.metrics.plot import (
    CAN_DRAW,
    INSTALL_VIEW,
    memory_trace_figure,
    memory_trace_markdown,
)
from slurm_autosp.metrics.rank_memory import (
    MemoryReader,
    MemoryTimeline,
    MemoryTrace,
    dump_memory_snapshot,
    start_memory_history,
)

log = logging.getLogger(__name__)
MIB = 2**20
_STATS = ("peak", "peak_reserved", "data", "forward_backward", "optimizer")
STEP_TIME_SAMPLES = 3  # timed steps whose median a job records as the run's step time
FLUSH_S = 10  # at most this late, a step's events are in the file a reader sees


class Phases(Protocol):
    """What the training loop times its phases with: `with phases("forward"): ...`."""

    def __call__(self, name: str) -> AbstractContextManager[None]: ...


class PhaseClock:
    """Times the phases of one step: `with phases("forward"): ...`. Phases do not nest; the
    same name may repeat (one forward per micro-batch) and its times add up. On GPU the
    boundaries are CUDA events, read once the step has synchronised, so a phase's time is
    the device's, not the time it took to launch its kernels."""

    def __init__(self, device: torch.device, timeline: MemoryTimeline | None = None):
        self.on_gpu = device.type == "cuda"
        self.timeline = timeline
        self._name = ""
        self._start: Any = 0.0
        self._spans: list[tuple] = []

    def __call__(self, name: str) -> PhaseClock:
        self._name = name
        return self

    def __enter__(self) -> None:
        if self.timeline is not None:
            self.timeline.phase_start(self._name)
        self._start = self._now()

    def __exit__(self, *exc) -> None:
        self._spans.append((self._name, self._start, self._now()))
        if self.timeline is not None:
            self.timeline.phase_end(self._name)

    def _now(self) -> Any:
        if self.on_gpu:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(self) -> dict[str, float]:
        totals: dict[str, float] = {}
        for name, start, end in self._spans:
            if self.on_gpu:
                end.synchronize()
                elapsed = start.elapsed_time(end) / 1e3
            else:
                elapsed = end - start
            totals[name] = totals.get(name, 0.0) + elapsed
        return totals


class _Untimed:
    """Phases of a step nobody traces (callers outside the training loop)."""

    def __call__(self, name: str) -> _Untimed:
        return self

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


UNTIMED = _Untimed()


@dataclass
class _StepRecord:
    step: int
    seconds: float
    phases: dict[str, float]
    peak: int
    peak_reserved: int
    trace: MemoryTrace | None


class StepTracer:
    """Times, measures and writes each step. Every rank calls every method (the per-step
    all-gather is collective); only rank 0 writes."""

    def __init__(
        self,
        cfg: JobConfig,
        rank: int,
        world_size: int,
        device: torch.device,
        model: torch.nn.Module,
        first_step: int,
        layout: Any,
    ):
        self.cfg, self.rank, self.world_size, self.device = cfg, rank, world_size, device
        self.model = model
        self.memory = MemoryReader(device)
        self.flops = count_flops(model, cfg.data.seq_len, cfg.global_batch)
        self.peak_tflops, self.peak_source = peak_tflops(
            cfg.trace.peak_tflops_per_gpu, device, cfg.precision is Precision.bf16
        )
        self.tokens_per_step = cfg.global_batch * cfg.data.seq_len
        self.memory_dir = RunDir(cfg.run.dir).memory_traces
        self.worst_rank = 0  # by peak memory, as of the last step: all ranks agree
        self._last: _StepRecord | None = None
        self.first_step = first_step
        self._timed: list[float] = []  # this job's first steps after the one that compiles
        self._record_after = min(STEP_TIME_SAMPLES, cfg.train.steps - first_step - 1)
        self.writer: SummaryWriter | None = None
        self._said_no_pictures = False
        if rank == 0 and cfg.trace.tensorboard:
            # A resumed run may have logged steps past its checkpoint before it stopped:
            # purge_step makes TensorBoard drop those, so curves have no duplicate steps.
            purge = first_step + 1 if first_step else None
            # tensorboardX's writer thread reaches the file every flush_secs (its flush() does
            # not wait for the events queued before it); close() writes them all
            self.writer = SummaryWriter(
                str(RunDir(cfg.run.dir).tensorboard), purge_step=purge, flush_secs=FLUSH_S
            )
            self._write_run_text(self.writer, first_step, layout)

    def note(self, tag: str, markdown: str, step: int) -> None:
        """A text of the run (rank 0, when TensorBoard is on): what a reader of the curves
        must know about this start, e.g. the checkpoints it skipped."""
        if self.writer is not None:
            self.writer.add_text(tag, markdown, step)

    # ------------------------------------------------------------------ the step

    def traced(self, step: int) -> bool:
        return self.cfg.trace.tensorboard and step in self.cfg.trace.memory_steps

    def step(self, step: int) -> _StepScope:
        """`with tracer.step(n) as phases:` around the whole optimizer step (1-based n)."""
        return _StepScope(self, step)

    @property
    def step_s(self) -> float:
        """This rank's last step, in seconds; 0 for this job's first, which compiles."""
        record = self._last
        return 0.0 if record is None or record.step == self.first_step + 1 else record.seconds

    def log_step(self, step: int, loss: float, lr: float, grad_norm: float) -> None:
        record = self._last
        assert record is not None and record.step == step, "log_step follows the step it logs"
        local = [record.peak, record.peak_reserved] + [
            record.phases.get(p, 0.0) for p in ("data", "forward_backward", "optimizer")
        ]
        ranks = self._all_gather(local)
        peaks = ranks[:, 0]
        self.worst_rank = int(peaks.argmax())
        traces = self._gather_traces(record.trace) if record.trace is not None else []
        if self.rank != 0:
            return
        self._record_step_time(step, record.seconds)
        scalars = self._scalars(record, loss, lr, grad_norm, ranks)
        if self.writer is not None:
            # One event per step holding every scalar: a fifteenth of the writer's work.
            values = [Summary.Value(tag=tag, simple_value=value) for tag, value in scalars.items()]
            self.writer._get_file_writer().add_summary(Summary(value=values), step)
            if traces:
                self._write_traces(self.writer, step, traces, peaks)
        if step % self.cfg.train.log_every == 0 or step == self.cfg.train.steps:
            mfu = (
                f" | MFU {scalars['throughput/mfu_pct']:.1f}%"
                if "throughput/mfu_pct" in scalars
                else ""
            )
            log.info(
                "step %d/%d | loss %.4f | lr %.2e | grad norm %.3f | %.0f tok/s | %.3f s/step | peak mem %.0f MiB%s",
                step,
                self.cfg.train.steps,
                loss,
                lr,
                grad_norm,
                scalars["throughput/tokens_per_s"],
                record.seconds,
                scalars["memory/peak_mib"],
                mfu,
            )

    def _record_step_time(self, step: int, seconds: float) -> None:
        """Rank 0 records the median of this job's first timed steps (its first step compiles)
        in the run directory, atomically: a later submission of the run holds its signal
        delay to the step measured here (memory_plan.step_time)."""
        if step == self.first_step + 1 or len(self._timed) >= self._record_after:
            return
        self._timed.append(seconds)
        if len(self._timed) == self._record_after:
            StepTime(
                statistics.median(self._timed),
                len(self._timed),
                self.flops.per_step,
                self.world_size,
                "training",
            ).write(RunDir(self.cfg.run.dir).step_time)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    # ------------------------------------------------------------------ gathering

    def _all_gather(self, values: list[float]) -> torch.Tensor:
        comm_device = self.device if self.device.type == "cuda" else torch.device("cpu")
        local = torch.tensor(values, dtype=torch.float64, device=comm_device)
        out = torch.empty(self.world_size * len(values), dtype=torch.float64, device=comm_device)
        # torch < 2.13
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out, local)
        return out.cpu().view(self.world_size, len(values))

    def _trace_roles(self, worst: int) -> dict[int, list[str]]:
        roles: dict[int, list[str]] = {}
        for r in self.cfg.trace.memory_ranks:
            if 0 <= r < self.world_size:
                roles.setdefault(r, []).append(f"rank_{r}")
        if self.cfg.trace.memory_worst_rank:
            roles.setdefault(worst, []).append("worst_rank")
        return roles

    def _gather_traces(self, trace: MemoryTrace) -> list[tuple]:
        """The chosen ranks' timelines, at rank 0: [(roles, trace)]."""
        roles = self._trace_roles(self.worst_rank)
        mine = trace.to_dict() if self.rank in roles else None
        gathered: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(mine, gathered, dst=0)
        if gathered is None:  # not rank 0
            return []
        return [
            (roles[r], MemoryTrace.from_dict(d)) for r, d in enumerate(gathered) if d is not None
        ]

    # ------------------------------------------------------------------ writing (rank 0)

    def _scalars(
        self, record: _StepRecord, loss: float, lr: float, grad_norm: float, ranks: torch.Tensor
    ) -> dict[str, float]:
        tokens_per_s = self.tokens_per_step / record.seconds
        tflops = self.flops.per_step / record.seconds / self.world_size / 1e12
        scalars = {
            "train/loss": loss,
            "train/lr": lr,
            "train/grad_norm": grad_norm,
            "throughput/tokens_per_s": tokens_per_s,
            "throughput/tokens_per_s_per_device": tokens_per_s / self.world_size,
            "throughput/tflops_per_device": tflops,
            "time/step_s": record.seconds,  # rank 0's wall time; the split is the mean over ranks
            "time/data_wait_s": float(ranks[:, 2].mean()),
            "time/forward_backward_s": float(ranks[:, 3].mean()),
            "time/optimizer_s": float(ranks[:, 4].mean()),
            "memory/peak_mib": float(ranks[:, 0].max()) / MIB,
            "memory/worst_rank": float(self.worst_rank),
        }
        if self.peak_tflops:
            scalars["throughput/mfu_pct"] = 100.0 * tflops / self.peak_tflops
        columns = (
            {"peak_allocated_mib": 0, "peak_reserved_mib": 1}
            if self.memory.on_gpu
            else {"peak_rss_mib": 0}
        )
        for name, column in columns.items():
            values = ranks[:, column] / MIB
            scalars[f"memory/{name}/min"] = float(values.min())
            scalars[f"memory/{name}/max"] = float(values.max())
            scalars[f"memory/{name}/mean"] = float(values.mean())
        return scalars

    def _write_traces(
        self, writer: SummaryWriter, step: int, traces: list[tuple], peaks: torch.Tensor
    ) -> None:
        by_rank = {r: int(b) for r, b in enumerate(peaks.tolist())}
        self.memory_dir.mkdir(parents=True, exist_ok=True)
        if not CAN_DRAW and not self._said_no_pictures:
            log.warning(
                "matplotlib is not installed: memory traces are written as text and JSON, "
                "without pictures (%s)",
                INSTALL_VIEW,
            )
            self._said_no_pictures = True
        for roles, trace in traces:
            figure = memory_trace_figure(trace, role=", ".join(roles)) if CAN_DRAW else None
            if figure is not None:
                png = self.memory_dir / f"step_{step:08d}_rank{trace.rank}.png"
                figure.savefig(png, format="png")
            for role in roles:
                tag = f"memory_trace/{role}"
                if figure is not None:  # close=False: not pyplot's, nothing to close
                    writer.add_figure(tag, figure, step, close=False)
                writer.add_text(tag, memory_trace_markdown(trace, ", ".join(roles), by_rank), step)
        sidecar = {
            "step": step,
            "measure": traces[0][1].measure,
            "peak_bytes_by_rank": by_rank,
            "traces": [dict(trace.to_dict(), roles=roles) for roles, trace in traces],
        }
        (self.memory_dir / f"step_{step:08d}.json").write_text(json.dumps(sidecar))

    def _write_run_text(self, w: SummaryWriter, first_step: int, layout: Any) -> None:
        w.add_text("run/config", "```\n" + to_yaml(self.cfg) + "\n```", first_step)
        w.add_text("run/layout", "```\n" + repr(layout) + "\n```", first_step)
        w.add_text(
            "run/environment", _environment_markdown(self.device, self.world_size), first_step
        )
        w.add_text(
            "run/throughput_accounting",
            f"{self.flops.describe()}.\n\nPeak per device: "
            + (
                f"{self.peak_tflops:g} TFLOP/s ({self.peak_source})."
                if self.peak_tflops
                else f"none: {self.peak_source}."
            ),
            first_step,
        )
        layout_spec = {
            "memory": {
                f"peak {self.memory.measure} MiB over ranks (mean, min..max)": [
                    "Margin",
                    [
                        f"memory/peak_{'allocated' if self.memory.on_gpu else 'rss'}_mib/{s}"
                        for s in ("mean", "min", "max")
                    ],
                ],
            },
            "time": {
                "step split (s)": [
                    "Multiline",
                    [
                        "time/step_s",
                        "time/data_wait_s",
                        "time/forward_backward_s",
                        "time/optimizer_s",
                    ],
                ]
            },
        }
        w.add_custom_scalars(layout_spec)


class _StepScope:
    """The context of one step: starts the clock (and, on traced steps, the memory timeline
    and the GPU allocation history), and on leaving records what the step measured."""

    def __init__(self, tracer: StepTracer, step: int):
        self.tracer, self.step = tracer, step
        self.timeline: MemoryTimeline | None = None
        self.snapshot = False

    def __enter__(self) -> PhaseClock:
        t, cfg = self.tracer, self.tracer.cfg.trace
        if t.traced(self.step):
            self.timeline = MemoryTimeline(
                t.memory, t.rank, self.step, cfg.memory_sample_ms / 1e3, t.model
            )
            self.snapshot = (
                t.memory.on_gpu and cfg.memory_snapshot and t.rank in t._trace_roles(t.worst_rank)
            )
            if self.snapshot:
                start_memory_history()
            self.timeline.start()
        else:
            t.memory.reset_peak()
        self.clock = PhaseClock(t.device, self.timeline)
        self.start = time.perf_counter()
        return self.clock

    def __exit__(self, exc_type, exc, tb) -> None:
        t = self.tracer
        seconds = time.perf_counter() - self.start
        trace = self.timeline.stop() if self.timeline is not None else None
        out_of_memory = exc_type is not None and issubclass(exc_type, torch.OutOfMemoryError)
        if t.memory.on_gpu and (self.snapshot or (out_of_memory and t.cfg.trace.oom_snapshot)):
            name = f"{'oom_' if out_of_memory else ''}step_{self.step:08d}_rank{t.rank}.pickle"
            path = dump_memory_snapshot(t.memory_dir / name, stop=self.snapshot)
            if out_of_memory and path is not None:
                log.error(
                    "out of memory at step %d on rank %d: memory snapshot in %s",
                    self.step,
                    t.rank,
                    path,
                )
        if exc_type is not None:
            return
        if trace is not None:
            peak, peak_reserved = trace.peak_bytes, trace.peak_reserved_bytes
        else:
            _, peak, peak_reserved = t.memory.read()
        phases = self.clock.seconds()
        phases["forward_backward"] = phases.pop("forward", 0.0) + phases.pop("backward", 0.0)
        t._last = _StepRecord(self.step, seconds, phases, peak, peak_reserved, trace)


def _environment_markdown(device: torch.device, world_size: int) -> str:
    import importlib.metadata as md

    def version(pkg: str) -> str:
        try:
            return md.version(pkg)
        except md.PackageNotFoundError:
            return "not installed"

    accel = (
        f"{torch.cuda.get_device_name(device)} (CUDA {torch.version.cuda or torch.version.hip})"
        if device.type == "cuda"
        else f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    )
    rows = [
        ("host (rank 0)", socket.gethostname()),
        ("ranks", str(world_size)),
        ("device", accel),
        ("python", sys.version.split()[0]),
        *((pkg, version(pkg)) for pkg in ("torch", "deepspeed", "transformers", "submitit")),
    ]
    prefixes = (
        "SLURM_JOB_ID",
        "SLURM_JOB_NODELIST",
        "SLURM_NNODES",
        "NCCL_",
        "RCCL_",
        "FI_",
        "UCX_",
        "GLOO_",
        "TORCH_NCCL",
        "TORCHINDUCTOR_",
        "CUDA_VISIBLE",
        "HIP_VISIBLE",
        "OMP_NUM_THREADS",
    )
    env = sorted((k, v) for k, v in os.environ.items() if k.startswith(prefixes))
    table = "\n".join(f"| {k} | `{v}` |" for k, v in rows + env)
    return "| | |\n|---|---|\n" + table
