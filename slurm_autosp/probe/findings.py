"""The probe's findings, from every rank's measurements: a table for the log, `probe.json` in
the run directory and TensorBoard text and scalars, with one verdict: the attention kernels
exact on every rank, the plan within ±10%, bandwidth within 70% of nominal, and the slowest
rank.

A probe that ran out of memory, or was stopped by a signal, reports what it measured up to
then: an out-of-memory error is a finding (where, and the memory when it struck), and a rank
may have no timed step at all."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tensorboardX import SummaryWriter

from slurm_autosp.config import JobConfig
from slurm_autosp.lifecycle.run_dir import RunDir
from slurm_autosp.lifecycle.save_time import StepTime
from slurm_autosp.memory_plan import TrainingChoices
from slurm_autosp.memory_plan.policies import spec_label
from slurm_autosp.metrics.outside_allocator import OutsideAllocator
from slurm_autosp.probe.collectives import CollectiveTiming
from slurm_autosp.probe.kernels import KernelCheck, KernelSummary, kernels_verdict, summarise
from slurm_autosp.probe.prediction import PlanPrediction
from slurm_autosp.probe.steps import StepMeasurement
from slurm_autosp.probe.timing import CALLS, SAMPLES, WARMUP

PLAN_TOLERANCE = 0.10
BANDWIDTH_FLOOR = 0.70
MIB = 2**20


@dataclass(frozen=True)
class RankResult:
    rank: int
    host: str
    kernels: list[KernelCheck]
    collectives: list[CollectiveTiming]
    steps: StepMeasurement


@dataclass(frozen=True)
class MemoryRow:
    """One term, measured (the highest rank) beside the plan; `judged` rows decide the verdict."""

    term: str
    measured: float
    predicted: float
    judged: bool
    note: str

    @property
    def error(self) -> float:
        return (self.measured - self.predicted) / self.predicted


@dataclass(frozen=True)
class Verdict:
    kernels_exact: bool | None  # None: some check did not run (kernels.py)
    plan_within: bool | None  # None: no term could be judged
    bandwidth_within: bool | None  # None: no nominal figure to hold any collective to
    slowest_rank: int | None  # None: no rank completed a step
    slowest_host: str | None
    oom_ranks: list[int]  # the ranks that ran out of memory
    stopped: str  # why the probe stopped early on a signal; empty when it ran to the end
    text: str


@dataclass(frozen=True)
class ProbeReport:
    cfg: JobConfig
    choices: TrainingChoices
    ranks: list[RankResult]
    kernels: list[KernelSummary]  # per check, its worst status over the ranks
    collectives: list[CollectiveTiming]  # per message, the slowest rank of the slowest group
    prediction: PlanPrediction | None
    memory: list[MemoryRow]
    verdict: Verdict

    @property
    def step_seconds(self) -> float | None:
        """The job's step time: the slowest rank's; None when no rank completed a step."""
        timed = [r.steps.step_seconds for r in self.ranks if r.steps.step_seconds is not None]
        return max(timed) if timed else None

    def step_time(self) -> StepTime | None:
        """The slowest rank's step as the run's record (RunDir.step_time), which the real
        run's admission reads from the probe's run directory; None when no rank timed one."""
        timed = [(s, r.steps) for r in self.ranks if (s := r.steps.step_seconds) is not None]
        if not timed:
            return None
        seconds, slowest = max(timed, key=lambda pair: pair[0])
        return StepTime(
            seconds,
            len(slowest.seconds[1:] or slowest.seconds),
            slowest.flops_per_step,
            len(self.ranks),
            "the probe",
        )

    def outside_allocator(self) -> OutsideAllocator | None:
        """The busiest rank's GPU memory outside torch's allocator after its first step, as
        the run's record (RunDir.outside_allocator), which the real run's plan reads from the
        probe's run directory; None on CPU ranks or when no rank completed a step."""
        read = [b for r in self.ranks if (b := r.steps.outside_allocator_bytes) is not None]
        if not read:
            return None
        ulysses, ring = self.cfg.parallel.ulysses_ring
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "?"
        return OutsideAllocator(
            max(read), len(self.ranks), ulysses * ring, ring, self.choices.zero_stage, device, 1
        )

    @property
    def tokens_per_s(self) -> float | None:
        seconds = self.step_seconds
        return None if seconds is None else self.cfg.global_batch * self.cfg.data.seq_len / seconds

    def tflops(self, steps: StepMeasurement) -> float | None:
        """Model TFLOP/s per device at this rank's step time."""
        seconds = steps.step_seconds
        return None if seconds is None else steps.flops_per_step / seconds / len(self.ranks) / 1e12

    def mfu(self, steps: StepMeasurement) -> float | None:
        tflops = self.tflops(steps)
        return None if tflops is None or steps.peak_tflops is None else tflops / steps.peak_tflops


def slowest_per_message(ranks: list[RankResult]) -> list[CollectiveTiming]:
    """Each message as its slowest rank saw it: a collective ends when its last rank does."""
    worst: dict[tuple[str, str, str], CollectiveTiming] = {}
    for result in ranks:
        for timing in result.collectives:
            key = (timing.collective, timing.what, timing.group)
            if key not in worst or timing.seconds > worst[key].seconds:
                worst[key] = timing
    return list(worst.values())


def memory_rows(
    ranks: list[RankResult], prediction: PlanPrediction | None, on_gpu: bool
) -> list[MemoryRow]:
    steps = [r.steps for r in ranks]
    if prediction is None or not any(s.seconds or s.oom for s in steps):
        return []
    # After an out-of-memory error the peak is the one at the failure: a lower bound.
    judged = not any(s.oom for s in steps)
    lower = "" if judged else " (ran out of memory: the peak at the failure, a lower bound)"
    rows = []
    held = [s.held_bytes for s in steps if s.held_bytes is not None]
    if held:
        rows.append(
            MemoryRow(
                "held for backward",
                max(held),
                prediction.held,
                True,
                "saved-tensor hooks vs activations + loss inputs",
            )
        )
    if on_gpu:
        rows.append(
            MemoryRow(
                "peak allocated",
                max(s.peak_bytes for s in steps),
                prediction.subtotal,
                judged,
                "max_memory_allocated vs every term, no margin" + lower,
            )
        )
        rows.append(
            MemoryRow(
                "peak reserved",
                max(s.peak_reserved_bytes for s in steps),
                prediction.allocator_total,
                False,
                "max_memory_reserved vs the plan's total with margin" + lower,
            )
        )
    else:
        rows.append(
            MemoryRow(
                "peak working",
                max(s.peak_bytes - s.start_bytes for s in steps),
                prediction.transient,
                False,
                "RSS peak above the timed steps' start (allocator slack included) vs "
                "activations, loss, all-to-all and recompute buffers" + lower,
            )
        )
    return rows


def decide(
    ranks: list[RankResult],
    kernels: list[KernelSummary],
    collectives: list[CollectiveTiming],
    memory: list[MemoryRow],
) -> Verdict:
    kernels_exact, exactness = kernels_verdict(kernels)
    judged = [row for row in memory if row.judged]
    plan_within = all(abs(r.error) <= PLAN_TOLERANCE for r in judged) if judged else None
    held_to = [c for c in collectives if c.nominal_gb_per_s]
    bandwidth_within = (
        all(c.busbw_gb_per_s >= BANDWIDTH_FLOOR * (c.nominal_gb_per_s or 0) for c in held_to)
        if held_to
        else None
    )
    if plan_within is None:
        plan = "plan: nothing to compare (no plan for model.builder models)"
    else:
        errors = ", ".join(f"{r.term} {r.error:+.1%}" for r in judged)
        plan = f"plan within ±{PLAN_TOLERANCE:.0%}: {'yes' if plan_within else 'NO'} ({errors})"
    if bandwidth_within is None:
        reasons = sorted({c.nominal_source for c in collectives}) or ["no collective to time"]
        bandwidth = f"bandwidth: {'; '.join(reasons)}"
    else:
        bandwidth = (
            f"bandwidth within {BANDWIDTH_FLOOR:.0%} of nominal: "
            f"{'yes' if bandwidth_within else 'NO'}"
        )
    timed = [(r.steps.step_seconds, r) for r in ranks if r.steps.step_seconds is not None]
    slowest = max(timed, key=lambda pair: pair[0])[1] if timed else None
    slow = (
        f"slowest rank: {slowest.rank} on {slowest.host} ({slowest.steps.step_seconds:.3f} s/step)"
        if slowest is not None
        else "slowest rank: none completed a step"
    )
    oom = [r for r in ranks if r.steps.oom]
    stopped = next((r.steps.stopped for r in ranks if r.steps.stopped), "")
    text = f"verdict: {exactness}; {plan}; {bandwidth}; {slow}"
    if oom:
        first = oom[0].steps.oom
        assert first is not None
        text += f"; OUT OF MEMORY on rank(s) {[r.rank for r in oom]}: rank {oom[0].rank} {first.describe()}"
    if stopped:
        text += f"; STOPPED EARLY, {stopped}: the numbers are what was measured until then"
    return Verdict(
        kernels_exact,
        plan_within,
        bandwidth_within,
        None if slowest is None else slowest.rank,
        None if slowest is None else slowest.host,
        [r.rank for r in oom],
        stopped,
        text,
    )


def build_report(
    cfg: JobConfig,
    choices: TrainingChoices,
    ranks: list[RankResult],
    prediction: PlanPrediction | None,
    on_gpu: bool,
) -> ProbeReport:
    kernels = summarise({r.rank: r.kernels for r in ranks})
    collectives = slowest_per_message(ranks)
    memory = memory_rows(ranks, prediction, on_gpu)
    verdict = decide(ranks, kernels, collectives, memory)
    return ProbeReport(cfg, choices, ranks, kernels, collectives, prediction, memory, verdict)


def _num(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _mib(value: float) -> str:
    return f"{value / MIB:,.2f} MiB"


def _bytes(value: float) -> str:
    return f"{value / 1024:,.1f} KiB" if value < MIB else _mib(value)


def describe_job(report: ProbeReport) -> str:
    cfg, choices = report.cfg, report.choices
    m = cfg.model
    return (
        f"probe: {m.model_type}, {m.num_hidden_layers} layers, hidden {m.hidden_size}, seq "
        f"{cfg.data.seq_len} x micro_batch {cfg.train.micro_batch} x grad_accum {cfg.train.grad_accum}, "
        f"SP={cfg.parallel.sp_size} x DP={cfg.dp_size}, {cfg.precision.value}, ZeRO-{choices.zero_stage}, "
        f"{spec_label(choices.checkpointing)}"
        + (f", MLP tiles of {choices.tile_tokens}" if choices.tile_tokens else "")
        + (", activations offloaded" if choices.offload_activations else "")
        + (", optimizer state offloaded" if choices.offload_optimizer else "")
        + f"; {cfg.probe.steps} steps, the first compiles"
    )


def render_table(report: ProbeReport) -> str:
    lines = [describe_job(report)]
    lines.append("kernels (exactness on every rank's own device, the worst rank):")
    lines += [
        f"  {k.name:<42}{k.status:<9}"
        + ("" if k.error is None else f"error {k.error:.2e} <= {k.tolerance:.2e}  ")
        + f"rank(s) {k.ranks}: {k.detail}"
        for k in report.kernels
    ]
    lines.append(
        f"collectives (the slowest rank of the slowest group; per call: the median of {SAMPLES} "
        f"samples of {CALLS} back-to-back calls, after {WARMUP}):"
    )
    if not report.collectives:
        lines.append("  none: SP=1 and DP=1")
    lines += [
        f"  {c.collective:<15}{c.what:<24}{c.group} x{c.group_size:<4}{_bytes(c.nbytes):>14}  "
        f"{c.seconds * 1e3:9.3f} ms  latency {c.latency_s * 1e3:7.3f} ms  algbw {c.algbw_gb_per_s:8.3f} GB/s  "
        f"busbw {c.busbw_gb_per_s:8.3f} GB/s  "
        + (
            f"{c.busbw_gb_per_s / c.nominal_gb_per_s:.0%} of {c.nominal_gb_per_s:g} ({c.nominal_source})"
            if c.nominal_gb_per_s
            else c.nominal_source
        )
        for c in report.collectives
    ]
    measure = "allocated" if report.ranks[0].steps.peak_reserved_bytes else "resident (RSS)"
    lines.append(f"steps per rank (memory: {measure}):")
    lines.append(
        f"  {'rank':<6}{'host':<20}{'step s':>9}{'compile s':>11}{'tokens/s':>12}{'TFLOP/s':>10}{'MFU':>8}"
        f"{'start':>14}{'peak':>14}{'held for bw':>16}"
    )
    tokens = report.cfg.global_batch * report.cfg.data.seq_len
    for r in report.ranks:
        s = r.steps
        seconds, tflops, mfu = s.step_seconds, report.tflops(s), report.mfu(s)
        held = "offloaded" if report.choices.offload_activations else "-"
        lines.append(
            f"  {r.rank:<6}{r.host[:19]:<20}{_num(seconds, '.3f'):>9}{_num(s.compile_seconds, '.1f'):>11}"
            f"{_num(None if seconds is None else tokens / seconds, ',.0f'):>12}"
            f"{_num(tflops, '.4f'):>10}{_num(mfu, '.1%'):>8}{_mib(s.start_bytes):>14}{_mib(s.peak_bytes):>14}"
            f"{held if s.held_bytes is None else _mib(s.held_bytes):>16}"
            + (f"  {s.oom.describe()}" if s.oom else "")
        )
    if report.ranks[0].steps.peak_tflops is None:
        lines.append(f"  MFU: {report.ranks[0].steps.peak_source}")
    if report.prediction is not None:
        lines.append(f"memory, plan ({report.prediction.label}) vs measured (the highest rank):")
        lines += [
            f"  {row.term:<20}{_mib(row.measured):>14}  plan {_mib(row.predicted):>14}  {row.error:+7.1%}  "
            f"{'judged' if row.judged else 'reported'}: {row.note}"
            for row in report.memory
        ]
    lines.append(report.verdict.text)
    return "\n".join(lines)


def to_json(report: ProbeReport) -> dict[str, Any]:
    cfg = report.cfg
    return {
        "job": describe_job(report),
        "world_size": len(report.ranks),
        "sp_size": cfg.parallel.sp_size,
        "dp_size": cfg.dp_size,
        "seq_len": cfg.data.seq_len,
        "layers": cfg.model.num_hidden_layers,
        "zero_stage": report.choices.zero_stage,
        "checkpointing": spec_label(report.choices.checkpointing),
        "step_s": report.step_seconds,
        "tokens_per_s": report.tokens_per_s,
        "kernels": [asdict(k) for k in report.kernels],
        "collectives": [
            {
                **asdict(c),
                "algbw_gb_per_s": c.algbw_gb_per_s,
                "busbw_gb_per_s": c.busbw_gb_per_s,
            }
            for c in report.collectives
        ],
        "ranks": [
            {
                "rank": r.rank,
                "host": r.host,
                **asdict(r.steps),
                "step_s": r.steps.step_seconds,
                "compile_s": r.steps.compile_seconds,
                "tflops": report.tflops(r.steps),
                "mfu": report.mfu(r.steps),
            }
            for r in report.ranks
        ],
        "plan": asdict(report.prediction) if report.prediction else None,
        "memory": [{**asdict(row), "error": row.error} for row in report.memory],
        "verdict": asdict(report.verdict),
    }


def write_report(report: ProbeReport, run_dir: Path, tensorboard: bool) -> str:
    """Write probe.json (and TensorBoard when enabled); return the table for the log."""
    table = render_table(report)
    RunDir(run_dir).probe_report.write_text(json.dumps(to_json(report), indent=1))
    if (step := report.step_time()) is not None:
        step.write(RunDir(run_dir).step_time)
    if (outside := report.outside_allocator()) is not None:
        outside.write(RunDir(run_dir).outside_allocator)
    if tensorboard:
        writer = SummaryWriter(str(RunDir(run_dir).tensorboard))
        writer.add_text("probe/report", "```\n" + table + "\n```")
        if report.step_seconds is not None and report.tokens_per_s is not None:
            writer.add_scalar("probe/step_s", report.step_seconds)
            writer.add_scalar("probe/tokens_per_s", report.tokens_per_s)
        for r in report.ranks:
            by_rank = {
                "step_s": r.steps.step_seconds,
                "compile_s": r.steps.compile_seconds,
                "mfu_pct": None if (mfu := report.mfu(r.steps)) is None else 100 * mfu,
            }
            for name, value in by_rank.items():
                if value is not None:
                    writer.add_scalar(f"probe/{name}_by_rank", value, r.rank)
        for c in report.collectives:
            name = f"{c.collective} {c.what}".replace(" / ", "_").replace(" ", "_")
            writer.add_scalar(f"probe/busbw_gb_per_s/{name}", c.busbw_gb_per_s)
            writer.add_scalar(f"probe/latency_ms/{name}", c.latency_s * 1e3)
        for row in report.memory:
            writer.add_scalar(f"probe/plan_error_pct/{row.term.replace(' ', '_')}", 100 * row.error)
        writer.close()
    return table
