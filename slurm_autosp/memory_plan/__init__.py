"""The memory plan: whether a job fits its GPUs, per term, before any GPU time is spent."""

from slurm_autosp.memory_plan.choose import (
    TrainingChoices,
    activation_checkpoint_spec_for,
    build_plan,
    training_choices,
    zero_stage_for,
)
from slurm_autosp.memory_plan.decision import PlanVerdict, plan_verdict
from slurm_autosp.memory_plan.layer_graph import LayerTrace, SavedTensor, trace_decoder_layer
from slurm_autosp.memory_plan.policies import AUTO_CANDIDATES
from slurm_autosp.memory_plan.render import render
from slurm_autosp.memory_plan.terms import MemoryPlan, ModelSize, PolicyMemory, model_size
from slurm_autosp.memory_plan.verdict import verdict

__all__ = [
    "AUTO_CANDIDATES",
    "LayerTrace",
    "MemoryPlan",
    "ModelSize",
    "PlanVerdict",
    "PolicyMemory",
    "build_plan",
    "activation_checkpoint_spec_for",
    "model_size",
    "plan_verdict",
    "render",
    "SavedTensor",
    "trace_decoder_layer",
    "TrainingChoices",
    "training_choices",
    "verdict",
    "zero_stage_for",
]
