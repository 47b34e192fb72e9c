"""The DeepSpeed engine that owns the optimizer step: ZeRO-1 shards optimizer state over all
ranks, sequence-parallel ones included."""

from __future__ import annotations

from typing import Any, Dict

from torch import nn

from slurm_autosp.config import JobConfig, Precision
from slurm_autosp.optim import build_lr_scheduler, build_optimizer


def deepspeed_config(cfg: JobConfig) -> Dict[str, Any]:
    """DeepSpeed's config for this job.

    `sequence_parallel_size` is deliberately absent: DeepSpeed then treats every rank as
    data-parallel and averages gradients over the whole world, a reduction the loss scaling
    in `slurm_autosp.loss` is derived from.
    """
    t = cfg.train
    return {
        "train_micro_batch_size_per_gpu": t.micro_batch,
        "gradient_accumulation_steps": t.grad_accum,
        "train_batch_size": t.micro_batch * t.grad_accum * cfg.cluster.world_size,
        "gradient_clipping": t.grad_clip,
        "zero_optimization": {"stage": cfg.parallel.zero_stage},
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": cfg.precision is Precision.bf16},
        "steps_per_print": 2**62,
        "wall_clock_breakdown": False,
    }


def build_engine(model: nn.Module, cfg: JobConfig) -> Any:
    import deepspeed

    optimizer = build_optimizer(model, cfg.train)
    engine, *_ = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        lr_scheduler=build_lr_scheduler(optimizer, cfg.train),
        config=deepspeed_config(cfg),
    )
    return engine
