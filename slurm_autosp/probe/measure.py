"""What every rank of a probe runs: the attention kernels' exactness check on its own device
(kernels.py), the collectives, then the compiled steps; rank 0 gathers
every rank's numbers, compares them with the plan and writes the report. A stop signal ends
the measurements at the next boundary every rank agrees on; the report of what was measured
is still written, and the job ends, so the probe never holds its GPUs past `scancel`, a time
limit or `timeout`."""

from __future__ import annotations

import socket

import torch.distributed as dist

from slurm_autosp.cluster.parallel_dims import ParallelDims
from slurm_autosp.config import JobConfig
from slurm_autosp.lifecycle.signals import StopRequest
from slurm_autosp.memory_plan import training_choices
from slurm_autosp.probe.collectives import time_collectives
from slurm_autosp.probe.findings import ProbeReport, RankResult, build_report, write_report
from slurm_autosp.probe.kernels import check_kernels
from slurm_autosp.probe.prediction import predict_memory
from slurm_autosp.probe.steps import StepMeasurement, measure_steps
from slurm_autosp.probe.stop import AgreedStop


def run_probe(cfg: JobConfig, dims: ParallelDims, request: StopRequest) -> ProbeReport | None:
    """The report on rank 0, None on the others. Rank 0 takes the plan's prediction first (it
    traces a layer: seconds), so that a stopped probe exits without it; the collectives run
    before the model holds any memory."""
    choices = training_choices(cfg)
    prediction = predict_memory(cfg, choices) if dims.rank == 0 else None
    stop = AgreedStop(request, dims.device)
    kernels = check_kernels(dims.device)
    collectives = time_collectives(cfg, dims, choices.zero_stage, stop)
    steps = (
        StepMeasurement.not_run(stop.reason)
        if stop.reason
        else measure_steps(cfg, dims, choices, stop)
    )
    mine = RankResult(dims.rank, socket.gethostname(), kernels, collectives, steps)
    gathered: list[RankResult | None] = [None] * dims.world_size
    dist.all_gather_object(gathered, mine)
    if dims.rank != 0:
        return None
    ranks = [r for r in gathered if r is not None]
    report = build_report(cfg, choices, ranks, prediction, dims.device.type == "cuda")
    print(write_report(report, cfg.run.dir, cfg.trace.tensorboard), flush=True)
    return report
