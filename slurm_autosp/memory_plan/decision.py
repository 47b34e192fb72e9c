"""What submit (and `run`) decide on: the plan as printed, whether the job fits, why not, and
the choices the job will train with."""

from __future__ import annotations

from typing import NamedTuple

from slurm_autosp.config import JobConfig
from slurm_autosp.lifecycle.save_time import signal_delay_warning
from slurm_autosp.memory_plan.choose import (
    TrainingChoices,
    build_plan,
    choices_from_plan,
    training_choices,
)
from slurm_autosp.memory_plan.render import render
from slurm_autosp.memory_plan.verdict import verdict


class PlanVerdict(NamedTuple):
    text: str  # the plan as printed
    fits: bool
    reason: (
        str  # why not, naming what overflows (the GPUs, the nodes' host memory); empty when it fits
    )
    choices: TrainingChoices  # what the job will train with


def plan_verdict(cfg: JobConfig) -> PlanVerdict:
    """What submit prints and decides on. CPU jobs have no GPU memory to plan against: they
    always fit."""
    if not cfg.cluster.uses_gpus:
        return PlanVerdict(
            "memory plan: CPU ranks, no GPU memory to plan against", True, "", training_choices(cfg)
        )
    if cfg.model.builder:
        return PlanVerdict(
            "memory plan: not available for model.builder models (the plan traces a Hugging Face "
            "decoder layer); nothing checked",
            True,
            "",
            training_choices(cfg),
        )
    plan = build_plan(cfg)
    text = render(plan)
    _, fits, reason = verdict(plan)
    warning = signal_delay_warning(cfg, plan.parameters, plan.zero_stage)
    if warning:
        text += f"\nwarning: {warning}"
    return PlanVerdict(text, fits, reason, choices_from_plan(plan))
