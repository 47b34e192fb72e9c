"""The optimizer step that SLURM's pre-timeout signal must leave time for (lifecycle.save_time):
measured on the job's own nodes when a run has recorded one, else estimated from its FLOPs.

Where a measured step comes from, in order: this run's directory (rank 0 of training records
its first timed steps at every start), then its probe's (`<run.name>_probe`): the probe runs the
real job's steps on the same nodes before the long job, so a run that has not started yet is
held to what its probe measured. A record of another shape (the probe at `probe.layers` < the
model's, another batch or world) is scaled by the FLOPs per rank of a step.

Without a record, the estimate is the step's model FLOPs (metrics.flops.count_flops, recompute
not counted) over the world's peak at ASSUMED_MFU: lower than the 40% the plan's offload model
assumes, since recomputation, offload and exposed collectives cost time that model FLOPs do
not count, so that the step, and the signal delay it asks for, is not underestimated.
"""

from __future__ import annotations

from slurm_autosp.config import JobConfig
from slurm_autosp.lifecycle.run_dir import RunDir
from slurm_autosp.lifecycle.save_time import StepTime
from slurm_autosp.metrics.flops import assumed_peak_tflops, count_flops
from slurm_autosp.model import build_skeleton

ASSUMED_MFU = 0.25


def step_time(cfg: JobConfig) -> tuple[float, str]:
    """Seconds per optimizer step of the configured job, and where the figure comes from."""
    world = cfg.cluster.world_size
    flops = count_flops(build_skeleton(cfg.model), cfg.data.seq_len, cfg.global_batch).per_step
    run = RunDir(cfg.run.dir)
    for path in (run.step_time, run.probe_run.step_time):
        recorded = StepTime.read(path)
        if recorded is None:
            continue
        seconds = recorded.scaled_to(flops, world)
        ratio = seconds / recorded.seconds
        scaled = (
            f", x{ratio:.3g} for this job's FLOPs per GPU ({recorded.flops_per_step:.3g} FLOPs "
            f"over {recorded.world_size} ranks measured, {flops:.3g} over {world} here)"
            if abs(ratio - 1) > 1e-3
            else ""
        )
        return seconds, (
            f"measured by {recorded.measured_by}: {recorded.seconds:,.3g} s, the median of "
            f"{recorded.steps} timed steps ({path}){scaled}"
        )
    peak, source = assumed_peak_tflops(cfg)
    seconds = flops / (world * peak * 1e12 * ASSUMED_MFU)
    return seconds, (
        f"estimated: {flops:.4g} model FLOPs per step over {world} GPUs at an assumed "
        f"{ASSUMED_MFU:.0%} MFU of {peak:g} TFLOP/s ({source}); no step measured yet in "
        f"{run.step_time} or {run.probe_run.step_time} (the probe records one)"
    )
