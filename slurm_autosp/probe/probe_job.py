"""The probe as a job: the training job's whole path (environment, process group, run lock,
topology check, layout) with the probe's measurements where training would run, stopping on
the job's stop signals as training does (without the checkpoint and the requeue)."""

from __future__ import annotations

from slurm_autosp.cluster.parallel_dims import ParallelDims
from slurm_autosp.launch.job import TrainingJob
from slurm_autosp.lifecycle.signals import StopRequest
from slurm_autosp.probe.findings import ProbeReport
from slurm_autosp.probe.measure import run_probe


class ProbeJob(TrainingJob):
    saves_checkpoints = False

    def work(self, dims: ParallelDims, stop: StopRequest) -> ProbeReport | None:
        return run_probe(self.cfg, dims, stop)
