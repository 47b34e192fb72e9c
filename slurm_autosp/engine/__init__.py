"""The engine that owns parameters, gradients and the optimizer step: DeepSpeed ZeRO-1 when
every GPU can hold the whole model, FSDP2 parameter sharding (`parallel.zero_stage=3`) when
none can."""

from __future__ import annotations

import torch
import torch.distributed as dist

from slurm_autosp.config import JobConfig
from slurm_autosp.engine.base import TrainEngine
from slurm_autosp.engine.deepspeed_zero1 import ZeRO1Engine
from slurm_autosp.engine.fsdp2 import FSDP2Engine
from slurm_autosp.model import build_model, build_skeleton, compute_dtype

__all__ = ["FSDP2Engine", "TrainEngine", "ZeRO1Engine", "build_engine"]


def build_engine(
    cfg: JobConfig, device: torch.device, zero_stage: int, offload_optimizer: bool = False
) -> TrainEngine:
    """Build the model and hand it to the engine for `zero_stage`, its optimizer state in host
    memory when `offload_optimizer`.

    Under parameter sharding an HF model is built on the meta device and only its shards are
    ever allocated; a pretrained one, or one with LoRA adapters (whose B starts at zero, which
    the model's own init of a sharded skeleton would not give), is built whole by rank 0 alone
    and scattered into the shards. A `model.builder` model is built whole on every rank's CPU,
    then sharded.
    """
    if zero_stage != 3:
        model = build_model(cfg.model, compute_dtype(cfg.precision), device)
        return ZeRO1Engine(model, cfg, offload_optimizer)
    if cfg.model.builder:
        return FSDP2Engine(build_model(cfg.model), cfg, device, offload_optimizer)
    whole = cfg.model.pretrained_path or cfg.model.lora
    weights = build_model(cfg.model).state_dict() if whole and dist.get_rank() == 0 else {}
    engine = FSDP2Engine(build_skeleton(cfg.model), cfg, device, offload_optimizer)
    if whole:
        engine.load_full_weights(weights)
    return engine
