"""Optimizer and learning-rate schedule, handed to DeepSpeed as client objects so the update
is plain torch AdamW on every accelerator (DeepSpeed's fused Adam does not exist on CPU)."""

from __future__ import annotations

import math

import torch
from torch import nn

from slurm_autosp.config import ClusterConfig, LrSchedule, TrainConfig


def fused_kernel(cluster: ClusterConfig, offload_optimizer: bool) -> bool:
    """Whether AdamW runs torch's one-pass kernel: where it steps in host memory (offloaded
    state: on CPU ~10x the default per-op loop, engine.deepspeed_zero1) and on GPUs, where the
    default foreach loop allocates parameter-sized temporaries (its sqrt of the second
    moments) that the memory plan does not count (torchtitan's default kernel too). A CPU
    run without offload keeps the default loop."""
    return offload_optimizer or cluster.uses_gpus


def build_optimizer(
    model: nn.Module, cfg: TrainConfig, fused: bool = False
) -> torch.optim.Optimizer:
    """AdamW over the parameters that train (a LoRA model's adapters); `fused`: torch's
    one-pass kernel (`fused_kernel`)."""
    return torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=cfg.lr,
        betas=(cfg.betas[0], cfg.betas[1]),
        weight_decay=cfg.weight_decay,
        fused=_fused_option(fused),
    )


def _fused_option(fused: bool) -> bool | None:
    """AdamW's `fused`: None, not False, where it is off: False turns off foreach on CUDA."""
    return True if fused else None


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


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, cfg: TrainConfig
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, cfg))


def apply_hyperparameters(
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LambdaLR,
    cfg: TrainConfig,
    fused: bool,
) -> None:
    """Loading a checkpoint restores the lr, betas and weight decay it was written with, and
    its kernel (`fused`: build_optimizer's); a resumed job trains with its own config's and
    kernel (unchanged ones give the same floats: an exact resume stays exact)."""
    scheduler.base_lrs = [cfg.lr for _ in optimizer.param_groups]
    lr = cfg.lr * lr_factor(scheduler.last_epoch, cfg)
    for group in optimizer.param_groups:
        group.update(
            lr=lr,
            initial_lr=cfg.lr,
            betas=(cfg.betas[0], cfg.betas[1]),
            weight_decay=cfg.weight_decay,
            fused=_fused_option(fused),
            foreach=None,
        )
    scheduler._last_lr = [
        lr for _ in optimizer.param_groups
    ]  # what get_last_lr() reports until the next step
