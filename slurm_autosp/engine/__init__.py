"""The engine that owns parameters, gradients and the optimizer step: DeepSpeed ZeRO-1 when
every GPU can hold the whole model, FSDP2 parameter sharding (`parallel.zero_stage=3`) when
none can."""

from __future__ import annotations

import torch

from slurm_autosp.config import JobConfig
from slurm_autosp.engine.base import TrainEngine
from slurm_autosp.engine.deepspeed_zero1 import ZeRO1Engine, deepspeed_config
from slurm_autosp.engine.fsdp2 import FSDP2Engine
from slurm_autosp.model import build_model

__all__ = ["FSDP2Engine", "TrainEngine", "ZeRO1Engine", "build_engine", "deepspeed_config"]


def build_engine(cfg: JobConfig, device: torch.device, zero_stage: int) -> TrainEngine:
    """Build the model and hand it to the engine for `zero_stage`.

    Under parameter sharding a model from a config is built on the meta device and only its
    shards are ever allocated: no rank holds the whole model.
    """
    if zero_stage == 3:
        meta = not (cfg.model.builder or cfg.model.pretrained_path)
        with torch.device("meta" if meta else "cpu"):
            model = build_model(cfg.model)
        return FSDP2Engine(model, cfg, device)
    return ZeRO1Engine(build_model(cfg.model), cfg)
