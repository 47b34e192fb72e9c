"""The memory plan: whether a job fits its GPUs, per term, before any GPU time is spent."""

from slurm_autosp.plan.memory import MemoryPlan, PlanVerdict, build_plan, checkpoint_spec_for, plan_verdict, zero_stage_for
from slurm_autosp.plan.trace import LayerTrace, SavedTensor, trace_decoder_layer

__all__ = ["LayerTrace", "MemoryPlan", "PlanVerdict", "build_plan", "checkpoint_spec_for", "plan_verdict", "SavedTensor",
           "trace_decoder_layer", "zero_stage_for"]
