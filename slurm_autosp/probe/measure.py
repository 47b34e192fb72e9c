"""What every rank of a probe runs: the attention kernels' exactness check on its own device
(kernels.py), the collectives, then the compiled steps; rank 0 gathers
every rank's numbers, compares them with the plan and writes the report. A stop signal ends
the measurements at the next boundary every rank agrees on; the report of what was measured
is still written, and the job ends, so the probe never holds its GPUs past `scancel`, a time
limit or `timeout`."""

from __future__ import annotations

import socket

import torch.distributed as dist

from slurm_autosp.cluster.distributed import DistContext
from slurm_autosp.cluster.placement import Parallel
from slurm_autosp.config import JobConfig
from slurm_autosp.lifecycle.signals import StopRequest
from slurm_autosp.plan import training_choices
from slurm_autosp.probe.collectives import time_collectives
from slurm_autosp.probe.findings import ProbeReport, RankResult, build_report, write_report
from slurm_autosp.probe.kernels import check_kernels
from slurm_autosp.probe.prediction import predict_memory
from slurm_autosp.probe.steps import StepMeasurement, measure_steps
from slurm_autosp.probe.stop import AgreedStop


def run_probe(
    cfg: JobConfig, ctx: DistContext, parallel: Parallel, request: StopRequest
) -> ProbeReport | None:
    """The report on rank 0, None on the others. Rank 0 takes the plan's prediction first (it
    traces a layer: seconds), so that a stopped probe exits without it; the collectives run
    before the model holds any memory."""
    choices = training_choices(cfg)
    prediction = predict_memory(cfg, choices) if ctx.rank == 0 else None
    stop = AgreedStop(request, ctx.device)
    kernels = check_kernels(ctx.device)
    collectives = time_collectives(cfg, parallel, ctx.device, ctx.rank, choices.zero_stage, stop)
    steps = (
        StepMeasurement.not_run(stop.reason)
        if stop.reason
        else measure_steps(cfg, ctx, parallel, choices, stop)
    )
    mine = RankResult(ctx.rank, socket.gethostname(), kernels, collectives, steps)
    gathered: list[RankResult | None] = [None] * ctx.world_size
    dist.all_gather_object(gathered, mine)
    if ctx.rank != 0:
        return None
    ranks = [r for r in gathered if r is not None]
    report = build_report(cfg, choices, ranks, prediction, ctx.device.type == "cuda")
    print(write_report(report, cfg.run.dir, cfg.trace.tensorboard), flush=True)
    return report
