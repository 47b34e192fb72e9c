"""Optimizer and learning-rate schedule, handed to DeepSpeed as client objects so the update
is plain torch AdamW on every accelerator (DeepSpeed's fused Adam does not exist on CPU)."""

from __future__ import annotations

import math

import torch
from torch import nn

from slurm_autosp.config import LrSchedule, TrainConfig


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(
        model.parameters(),
        lr=cfg.lr,
        betas=(cfg.betas[0], cfg.betas[1]),
        weight_decay=cfg.weight_decay,
    )


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Multiplier on `train.lr` for optimizer step `step` (0-based): linear warmup, then decay
    to `min_lr_ratio` at the last step."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule is LrSchedule.constant:
        return 1.0
    decay_steps = max(cfg.steps - cfg.warmup_steps - 1, 1)
    progress = min((step - cfg.warmup_steps) / decay_steps, 1.0)
    if cfg.lr_schedule is LrSchedule.linear:
        shape = 1.0 - progress
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, cfg))
