"""A model builder whose forward runs out of memory on every rank, standing in for a GPU too
small for the step: a CPU never raises CUDA's error by itself, so the model's forward raises
that very class (torch.OutOfMemoryError, what the caching allocator raises) in the first step.
Run the job with `model.builder=oom_model:build` and the environment `job_env()` returns."""

from dataclasses import replace

import torch
from broken_model import job_env as job_env

from slurm_autosp.model import build_model

BUILDER = "model.builder=oom_model:build"
MESSAGE = "CUDA out of memory. Tried to allocate 20.00 GiB (tests/oom_model.py, for the GPU)"


def build(cfg):
    model = build_model(replace(cfg, builder=None))
    model.register_forward_pre_hook(_out_of_memory)
    return model


def _out_of_memory(module, args):
    raise torch.OutOfMemoryError(MESSAGE)
