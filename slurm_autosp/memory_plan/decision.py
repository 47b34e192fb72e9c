"""What submit (and `run`) decide on: the plan as printed, whether the job fits, why not, the
choices the job will train with, and whether SLURM's pre-timeout signal leaves it time to
finish a step and save."""

from __future__ import annotations

from typing import NamedTuple

from slurm_autosp.config import JobConfig
from slurm_autosp.data import eval_data_path
from slurm_autosp.lifecycle.save_time import signal_delay
from slurm_autosp.memory_plan.choose import (
    TrainingChoices,
    build_plan,
    choices_from_plan,
    training_choices,
)
from slurm_autosp.memory_plan.render import render
from slurm_autosp.memory_plan.step_time import step_time
from slurm_autosp.memory_plan.terms import MemoryPlan
from slurm_autosp.memory_plan.verdict import verdict
from slurm_autosp.model import hf_config


class PlanVerdict(NamedTuple):
    text: str  # the plan as printed
    fits: bool
    reason: (
        str  # why not, naming what overflows (the GPUs, the nodes' host memory); empty when it fits
    )
    choices: TrainingChoices  # what the job will train with
    # why cluster.signal_delay_s cannot cover one step plus one synchronous save; empty when it
    # can, and for jobs without a plan (CPU ranks, model.builder), which are not checked
    late: str = ""


def plan_verdict(cfg: JobConfig) -> PlanVerdict:
    """What submit prints and decides on. CPU jobs have no GPU memory to plan against: they
    always fit, and their signal delay is not checked (no checkpoint size or step time is
    planned for them), nor is a model.builder job's."""
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
    choices = choices_from_plan(plan)
    layers = hf_config(cfg.model).num_hidden_layers
    delay = signal_delay(
        cfg,
        plan.trained,
        plan.zero_stage,
        *step_time(cfg),
        layers,
        choices.stop_at,
        _forward_share(plan) if eval_data_path(cfg) else 0.0,
    )
    text += f"\n{delay.line()}\n{_saves_line(choices)}"
    late = "" if delay.covered else delay.refusal()
    return PlanVerdict(text, fits, reason, choices, late)


def _forward_share(plan: MemoryPlan) -> float:
    """The share of a micro-batch's step its forward takes, by the traced layer's FLOPs: what an
    evaluation batch costs beside a step."""
    t = plan.configured.trace
    return t.forward_flops / (t.forward_flops + t.backward_flops + t.recompute_flops)


def _saves_line(choices: TrainingChoices) -> str:
    every = choices.save_every_steps
    return "periodic saves: " + (
        f"every {'step' if every == 1 else f'{every} steps'} (checkpoint.every_steps={every}): "
        "a signal loses "
        f"at most {'the step in flight' if every == 1 else f'{every} steps'}"
        if every
        else "none (checkpoint.every_steps=0): a signal saves, a kill loses the run's progress "
        "since its start"
    )
