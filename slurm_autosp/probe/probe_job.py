"""The probe as a job: the training job's whole path (environment, process group, run lock,
topology check, layout) with the probe's measurements where training would run, stopping on
the job's stop signals as training does (without the checkpoint and the requeue), and the
config it runs (probe_config)."""

from __future__ import annotations

from dataclasses import replace

from slurm_autosp.cluster.parallel_dims import ParallelDims
from slurm_autosp.config import JobConfig, validate
from slurm_autosp.launch.job import TrainingJob
from slurm_autosp.lifecycle.run_dir import probe_run_name
from slurm_autosp.lifecycle.signals import StopRequest
from slurm_autosp.probe.findings import ProbeReport
from slurm_autosp.probe.measure import run_probe


class ProbeJob(TrainingJob):
    saves_checkpoints = False

    def work(self, dims: ParallelDims, stop: StopRequest) -> ProbeReport | None:
        return run_probe(self.cfg, dims, stop)


def probe_config(cfg: JobConfig) -> JobConfig:
    """The probe's own run directory, and the depth it scales the model (and the plan) to.
    Values, not `key=value` text read again as YAML, which would cut `exp #1` to `exp` (a
    comment) and probe into another run's directory."""
    layers = cfg.model.num_hidden_layers if cfg.probe.layers is None else cfg.probe.layers
    probe = replace(
        cfg,
        run=replace(cfg.run, name=probe_run_name(cfg.run.name)),
        model=replace(cfg.model, num_hidden_layers=layers),
    )
    validate(probe)
    return probe
