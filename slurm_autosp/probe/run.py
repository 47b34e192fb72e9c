"""What every rank of a probe runs: the collectives, then the compiled steps; rank 0 gathers
every rank's numbers, compares them with the plan and writes the report."""

from __future__ import annotations

import socket

import torch.distributed as dist

from slurm_autosp.config import JobConfig
from slurm_autosp.launch.distributed import DistContext
from slurm_autosp.launch.placement import Parallel
from slurm_autosp.plan import training_choices
from slurm_autosp.probe.collectives import time_collectives
from slurm_autosp.probe.prediction import predict_memory
from slurm_autosp.probe.report import ProbeReport, RankResult, build_report, write_report
from slurm_autosp.probe.steps import measure_steps


def run_probe(cfg: JobConfig, ctx: DistContext, parallel: Parallel) -> ProbeReport | None:
    """The report on rank 0, None on the others. Collectives run first, before the model
    holds any memory."""
    choices = training_choices(cfg)
    collectives = time_collectives(cfg, parallel, ctx.device, ctx.rank, choices.zero_stage)
    steps = measure_steps(cfg, ctx, parallel, choices)
    mine = RankResult(ctx.rank, socket.gethostname(), collectives, steps)
    gathered: list[RankResult | None] = [None] * ctx.world_size
    dist.all_gather_object(gathered, mine)
    if ctx.rank != 0:
        return None
    ranks = [r for r in gathered if r is not None]
    report = build_report(
        cfg, choices, ranks, predict_memory(cfg, choices), ctx.device.type == "cuda"
    )
    print(write_report(report, cfg.run.dir, cfg.trace.tensorboard), flush=True)
    return report
