"""The GPU check's measured rows, per checkpointing policy, in this one process at SP=1: the plan
against the measured peak and the step time, tokens/s and MFU at two lengths, then the longest
sequence that fits, searched by memory through the same compiled model (a new length after the
first recompiles once, with a symbolic length; an out-of-memory try rebuilds the engine on the
same compiled graphs, the cache emptied). The policy's budget is asked before each length and
each try: what it did not reach is an out-of-time row, what it measured before is kept.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from slurm_autosp.cluster.parallel_dims import ParallelDims
from slurm_autosp.config import JobConfig, load_config
from slurm_autosp.gpu_check.budget import Budget
from slurm_autosp.gpu_check.rows import OUT_OF_TIME, Row, out_of_time_row
from slurm_autosp.gpu_check.search import Search, longest_fitting
from slurm_autosp.memory_plan import TrainingChoices, training_choices
from slurm_autosp.memory_plan.terms import GB
from slurm_autosp.probe.prediction import PlanPrediction, predict_memory
from slurm_autosp.probe.steps import ProbeSteps, StepMeasurement

log = logging.getLogger(__name__)
PLAN_GOAL = 0.10  # the plan within ±10% of the measured peak
POLICIES = {
    "none": ("compile.activation_checkpointing=none",),
    "sac_budget_0": ("compile.activation_checkpointing=sac", "compile.activation_memory_budget=0"),
    "full": ("compile.activation_checkpointing=full",),
}


@dataclass(frozen=True)
class Scale:
    """The shapes the check runs at: the GPU's, or the CPU self-test's."""

    config: str
    layers: int
    lengths: tuple[int, int]  # the plan's and the step's two lengths, shorter first
    steps: int  # per length: the first (re)compiles, the others are timed
    granule: int  # the search's lengths are multiples of it
    ceiling: int  # and never above it
    resolution: float  # the search stops once the gap is within this fraction


GPU_SCALE = Scale("configs/llama8b_32k.yaml", 4, (32768, 131072), 3, 8192, 1 << 20, 0.125)
TINY_SCALE = Scale("configs/tiny_cpu.yaml", 2, (256, 512), 2, 64, 1024, 0.125)


@dataclass(frozen=True)
class Target:
    """Where the check runs: the device, and what the configs say about it."""

    device: torch.device
    vendor: str  # nvidia | amd | none
    memory_gb: float  # the GPU's memory, for the plan; 0 on CPU
    compiled: bool  # False: eager, the CPU self-test of this code
    out: Path


def check_config(scale: Scale, target: Target, policy: str, seq_len: int) -> JobConfig:
    """One GPU (or CPU rank) at SP=1, ZeRO-1, one sequence per step, tiling and offloads off."""
    on_gpu = target.device.type == "cuda"
    overrides = [
        f"cfg={scale.config}",
        "cluster.backend=local",
        "cluster.nodes=1",
        f"cluster.gpus_per_node={int(on_gpu)}",
        "cluster.tasks_per_node=1",
        *(
            (
                "cluster.nvlink_domain_size=1",
                f"cluster.vendor={target.vendor}",
                f"cluster.gpu_memory_gb={target.memory_gb}",
            )
            if on_gpu
            else ()
        ),
        f"model.num_hidden_layers={scale.layers}",
        "parallel.sp_size=1",
        "parallel.zero_stage=1",
        "parallel.offload_optimizer=false",
        "train.micro_batch=1",
        "train.grad_accum=1",
        f"data.seq_len={seq_len}",
        f"compile.enabled={str(target.compiled).lower()}",
        "compile.tile_tokens=0",
        "compile.offload_activations=false",
        *POLICIES[policy],
        f"run.output_root={target.out}",
        "run.name=gpu_check",
        "trace.tensorboard=false",
    ]
    return load_config(overrides)


def predictions(scale: Scale, target: Target) -> dict[tuple[str, int], PlanPrediction | None]:
    """The plan of every policy at both lengths. Before anything compiles: the plan's layer
    tracing resets Dynamo."""
    found = {}
    for policy in POLICIES:
        for length in scale.lengths:
            cfg = check_config(scale, target, policy, length)
            found[policy, length] = predict_memory(cfg, training_choices(cfg))
    return found


def _gb(value: float) -> str:
    """GB (1e9, as the plan counts), MB below one."""
    return f"{value / GB:,.2f} GB" if abs(value) >= GB else f"{value / 1e6:,.2f} MB"


def plan_row(
    policy: str,
    length: int,
    m: StepMeasurement,
    prediction: PlanPrediction | None,
    gpu_bytes: float,
) -> Row:
    """GPU (`gpu_bytes` > 0): the allocated peak against every term of the plan (no margin), as
    the probe judges it, and whether the step fits as the plan's verdict says (its `fits`, the
    one submit refuses a job by: memory outside the allocator included). CPU: the resident peak
    above the steps' start against the step's transient terms, reported only (RSS counts the
    allocator's slack); no GPU to fit, so no `fits`."""
    case = f"{policy} @ {length:,}"
    if prediction is None:
        return Row("plan vs peak", case, "no plan", _gb(m.peak_bytes), "-")
    on_gpu = gpu_bytes > 0
    fits = prediction.fits if on_gpu else None
    said = (
        f"plan with margin {_gb(prediction.allocator_total)} and {_gb(prediction.outside)} "
        f"outside the allocator, of the GPU's {_gb(gpu_bytes)}: "
        + ("fits" if prediction.fits else "does not fit")
    )
    planned = prediction.subtotal if on_gpu else prediction.transient
    measured = m.peak_bytes if on_gpu else m.peak_bytes - m.start_bytes
    error = measured / planned - 1
    expected = f"{_gb(planned)} ±{PLAN_GOAL:.0%}"
    if m.oom:
        return Row(
            "plan vs peak",
            case,
            expected,
            f">= {_gb(measured)}",
            "ran out of memory",
            detail=f"{said}; {m.oom.describe()}" if on_gpu else m.oom.describe(),
            fits=fits,
        )
    if not on_gpu:
        return Row(
            "plan vs peak", case, expected, f"{_gb(measured)} ({error:+.1%})", "reported (CPU: RSS)"
        )
    within = abs(error) <= PLAN_GOAL
    return Row(
        "plan vs peak",
        case,
        expected,
        f"{_gb(measured)} ({error:+.1%})",
        f"within {PLAN_GOAL:.0%}" if within else f"off by {error:+.1%}",
        detail=f"reserved peak {_gb(m.peak_reserved_bytes)}; {said}",
        fits=fits,
    )


def step_row(policy: str, length: int, m: StepMeasurement, world: int) -> Row:
    case = f"{policy} @ {length:,}"
    seconds = m.step_seconds
    if m.oom or seconds is None:
        return Row("step", case, "-", "-", "ran out of memory" if m.oom else "no step timed")
    tflops = m.flops_per_step / seconds / world / 1e12
    mfu = "-" if m.peak_tflops is None else f"MFU {tflops / m.peak_tflops:.1%}"
    return Row(
        "step",
        case,
        "-" if m.peak_tflops is None else f"peak {m.peak_tflops:g} TFLOP/s",
        f"{seconds:.3f} s, {length / seconds:,.0f} tokens/s, {tflops:.3g} TFLOP/s, {mfu}",
        "measured",
        detail=f"the median of the {len(m.seconds) - 1} step(s) after the first; {m.peak_source}",
    )


def longest_row(policy: str, search: Search, scale: Scale) -> Row:
    tried = ", ".join(f"{n:,} {'fits' if ok else 'OOM'}" for n, ok in search.tries)
    if search.stopped_at_s is not None:
        result, untried = OUT_OF_TIME, "no try: the budget was spent before the first"
    else:
        result = "found" if search.longest is not None else "nothing fits"
        untried = "no try beyond the two lengths"
    return Row(
        "longest",
        policy,
        f"to {scale.resolution:.1%}, multiples of {scale.granule:,}, at most {scale.ceiling:,}",
        search.describe(),
        result,
        detail=f"tries: {tried}" if tried else untried,
    )


class _Model:
    """The policy's model, compiled once; rebuilt on the same graphs after running out of memory."""

    def __init__(self, cfg: JobConfig, dims: ParallelDims):
        self.cfg, self.dims = cfg, dims
        self.choices: TrainingChoices = training_choices(cfg)
        self.steps = ProbeSteps(cfg, dims, self.choices)

    def measure(self, cfg: JobConfig, steps: int) -> StepMeasurement:
        m = self.steps.measure(cfg, steps)
        if m.oom:
            backend = self.steps.backend
            self.steps.close()
            self.steps = ProbeSteps(self.cfg, self.dims, self.choices, backend)
        return m

    def close(self) -> None:
        self.steps.close()


def policy_rows(
    scale: Scale,
    target: Target,
    policy: str,
    dims: ParallelDims,
    planned: dict[tuple[str, int], PlanPrediction | None],
    budget: Budget,
) -> list[Row]:
    gpu_bytes = target.memory_gb * GB
    model = _Model(check_config(scale, target, policy, scale.lengths[0]), dims)
    rows: list[Row] = []
    fit: list[int] = []
    oom: list[int] = []
    try:
        for length in scale.lengths:
            if budget.spent():
                case = f"{policy} @ {length:,}"
                rows += [out_of_time_row(c, case, budget) for c in ("plan vs peak", "step")]
                continue
            m = model.measure(check_config(scale, target, policy, length), scale.steps)
            rows += [
                plan_row(policy, length, m, planned[policy, length], gpu_bytes),
                step_row(policy, length, m, dims.world_size),
            ]
            (oom if m.oom else fit).append(length)
        if not fit and not oom:  # no length measured: nothing to search from
            return [*rows, out_of_time_row("longest", policy, budget)]

        def fits(length: int) -> bool:
            log.info("gpu_check: %s: one step at %s tokens", policy, f"{length:,}")
            return model.measure(check_config(scale, target, policy, length), 1).oom is None

        search = longest_fitting(
            fits,
            max(fit, default=None),
            min(oom, default=None),
            granule=scale.granule,
            ceiling=scale.ceiling,
            resolution=scale.resolution,
            budget=budget,
        )
    finally:
        model.close()
    return [*rows, longest_row(policy, search, scale)]
