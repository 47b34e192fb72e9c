"""What the config leaves to the plan, decided from the memory: `parallel.zero_stage` null is
ZeRO-1 when the job fits under it, else ZeRO-3; `compile.activation_checkpointing=auto` is the
first of `AUTO_CANDIDATES` (least recomputation first) that fits; a `sac` budget left null is
the largest that fits. Training asks here for the stage and policy it runs with.
"""

from __future__ import annotations

import torch

from slurm_autosp.compile.checkpointing import CheckpointSpec, Policy
from slurm_autosp.config import ActivationCheckpointing, JobConfig, Precision
from slurm_autosp.plan.memory import GB, MemoryPlan, PolicyMemory, model_size, policy_memory
from slurm_autosp.plan.policies import checkpoint_candidates, policy_from_plan, traced_specs
from slurm_autosp.plan.trace import trace_decoder_layer


def _choose_policy(
    cfg: JobConfig, memories: dict[CheckpointSpec, PolicyMemory], gpu_bytes: float
) -> tuple[CheckpointSpec, str]:
    """The first candidate that fits (the last, the least memory, when none does), and how it was chosen."""
    candidates = checkpoint_candidates(cfg)
    if not policy_from_plan(cfg):
        return candidates[0], ""
    fitting = [s for s in candidates if memories[s].total <= gpu_bytes]
    if cfg.compile.activation_checkpointing is ActivationCheckpointing.auto:
        how, best = "chosen by auto", "the least recomputation"
    else:
        how, best = "budget chosen by the plan", "the largest"
    if fitting:
        return fitting[0], f"{how}: {best} that fits"
    return candidates[-1], f"{how}: nothing fits, the least memory"


def whole_model_graph(cfg: JobConfig) -> bool:
    """A whole-model compile rules ZeRO-3 out: FSDP2 is wired for one graph per decoder layer."""
    return cfg.compile.enabled and not cfg.compile.per_layer


def _choose_stage(cfg: JobConfig, fits_under_zero1: bool) -> tuple[int, str]:
    """The configured stage; else ZeRO-1 when the job fits under it, else ZeRO-3."""
    if cfg.parallel.zero_stage is not None:
        return cfg.parallel.zero_stage, ""
    if fits_under_zero1:
        return 1, "chosen: fits without parameter sharding"
    if whole_model_graph(cfg):
        return 1, "chosen: ZeRO-3 needs compile.per_layer=true"
    return 3, "chosen: does not fit under ZeRO-1"


def build_plan(cfg: JobConfig) -> MemoryPlan:
    """Trace one decoder layer under every policy, lay out the per-GPU memory under ZeRO-1 and
    ZeRO-3, and choose the stage and policy the config leaves open."""
    sp = cfg.parallel.sp_size
    local_seq = -(-cfg.data.seq_len // sp)
    dtype = torch.bfloat16 if cfg.precision is Precision.bf16 else torch.float32
    traces = trace_decoder_layer(
        cfg.model, local_seq=local_seq, sp_size=sp, specs=traced_specs(cfg), micro_batch=cfg.train.micro_batch,
        dtype=dtype,
    )
    size = model_size(cfg)
    gpu_bytes = cfg.cluster.gpu_memory_gb * GB
    memories = {stage: {t.spec: policy_memory(cfg, t, size, stage) for t in traces} for stage in (1, 3)}
    zero1_spec, _ = _choose_policy(cfg, memories[1], gpu_bytes)
    stage, stage_note = _choose_stage(cfg, memories[1][zero1_spec].total <= gpu_bytes)
    spec, policy_note = _choose_policy(cfg, memories[stage], gpu_bytes)
    return MemoryPlan(cfg, size.total, gpu_bytes, stage, memories[stage][spec], memories, stage_note, policy_note)


def _has_plan(cfg: JobConfig) -> bool:
    """Only GPU jobs with a Hugging Face model are planned (the plan traces an HF decoder layer)."""
    return cfg.cluster.uses_gpus and not cfg.model.builder


def zero_stage_for(cfg: JobConfig) -> int:
    """The ZeRO stage training runs: the configured one; without a plan (CPU ranks, builder
    models) ZeRO-1; else the plan's (ZeRO-1 when the job fits under it, else ZeRO-3)."""
    if cfg.parallel.zero_stage is not None:
        return cfg.parallel.zero_stage
    return build_plan(cfg).zero_stage if _has_plan(cfg) else 1


def training_choices(cfg: JobConfig) -> tuple[int, CheckpointSpec]:
    """The ZeRO stage and checkpointing policy training runs with, from at most one plan:
    tracing a large layer takes seconds, on every rank."""
    if _has_plan(cfg) and (cfg.parallel.zero_stage is None or policy_from_plan(cfg)):
        plan = build_plan(cfg)
        return plan.zero_stage, plan.configured.spec
    return zero_stage_for(cfg), checkpoint_spec_for(cfg)


def checkpoint_spec_for(cfg: JobConfig) -> CheckpointSpec:
    """The checkpointing policy training compiles with: the configured one, or, for `auto` and
    a null `sac` budget, the plan's choice. Without a plan: CPU ranks have no GPU to fit, so
    they keep everything (sac budget 1); builder models keep the least (sac budget 0)."""
    if not policy_from_plan(cfg):
        return checkpoint_candidates(cfg)[0]
    if _has_plan(cfg):
        return build_plan(cfg).configured.spec
    budget = 1.0 if not cfg.cluster.uses_gpus else 0.0
    return CheckpointSpec(Policy.sac, budget=budget, recompute_all_to_all=cfg.compile.recompute_all_to_all)
