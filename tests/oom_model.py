"""Model builders that run out of memory, standing in for a GPU too small for the step: a CPU
never raises CUDA's error by itself, so the model's forward raises that very class
(torch.OutOfMemoryError, what the caching allocator raises). `build` runs out in the first step
of any length; `build_short` on sequences longer than SHORT_FIT tokens, as a GPU of that
capacity would. Run a job with `model.builder=oom_model:build` and the environment `job_env()`
returns."""

from dataclasses import replace

import torch
from broken_model import job_env as job_env

from slurm_autosp.model import build_model

BUILDER = "model.builder=oom_model:build"
MESSAGE = "CUDA out of memory. Tried to allocate 20.00 GiB (tests/oom_model.py, for the GPU)"
SHORT_FIT = 700  # tokens: build_short's longest sequence


def build(cfg):
    model = build_model(replace(cfg, builder=None))
    model.register_forward_pre_hook(_out_of_memory)
    return model


def build_short(cfg):
    model = build_model(replace(cfg, builder=None))
    model.register_forward_pre_hook(_out_of_memory_when_long, with_kwargs=True)
    return model


def _out_of_memory(module, args):
    raise torch.OutOfMemoryError(MESSAGE)


def _out_of_memory_when_long(module, args, kwargs):
    tokens = kwargs["input_ids"].shape[1]
    if tokens > SHORT_FIT:
        raise torch.OutOfMemoryError(f"CUDA out of memory at {tokens} tokens (tests/oom_model.py)")
