"""The probe as a job: the training job's whole path (environment, process group, run lock,
topology check, layout) with the probe's measurements where training would run."""

from __future__ import annotations

from typing import TYPE_CHECKING

from slurm_autosp.job import TrainingJob

if TYPE_CHECKING:  # the measuring modules import the compiler: only after the environment
    from slurm_autosp.checkpoint.signals import StopRequest
    from slurm_autosp.launch.distributed import DistContext
    from slurm_autosp.launch.placement import Parallel
    from slurm_autosp.probe.report import ProbeReport


class ProbeJob(TrainingJob):
    def work(self, ctx: DistContext, parallel: Parallel, stop: StopRequest) -> ProbeReport | None:
        # imported after the environment is set: inductor reads its cache dir on import
        from slurm_autosp.probe.run import run_probe

        return run_probe(self.cfg, ctx, parallel)
