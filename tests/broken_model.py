"""A model builder that fails on rank 1 only, for the tests of a job whose rank fails while
the others wait in a collective: run the job with `model.builder=broken_model:build` and the
environment `job_env()` returns, which puts this directory on the ranks' PYTHONPATH."""

import os
from dataclasses import replace
from pathlib import Path

import submitit

from slurm_autosp.model import build_model

BUILDER = "model.builder=broken_model:build"
ERROR = "rank one cannot build its model"


def build(cfg):
    if submitit.JobEnvironment().global_rank == 1:
        raise RuntimeError(ERROR)
    return build_model(replace(cfg, builder=None))


def job_env() -> dict[str, str]:
    here = str(Path(__file__).resolve().parent)
    return {**os.environ, "PYTHONPATH": f"{here}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
