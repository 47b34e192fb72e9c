"""The checkpointing specs a config lets training compile with and the plan traces, and the
names it prints them by: one vocabulary shared by the memory terms, the choice and the text."""

from __future__ import annotations

from slurm_autosp.compile.checkpointing import CheckpointSpec, Policy
from slurm_autosp.config import ActivationCheckpointing, JobConfig

SAC_BUDGETS = (1.0, 0.75, 0.5, 0.25, 0.0)


def _sac_candidates(recompute_all_to_all: bool) -> tuple[CheckpointSpec, ...]:
    return tuple(CheckpointSpec(Policy.sac, budget=x, recompute_all_to_all=recompute_all_to_all) for x in SAC_BUDGETS)


# What `auto` chooses from, least recomputation first.
AUTO_CANDIDATES = (
    *_sac_candidates(False),
    CheckpointSpec(Policy.sac, budget=0.0, recompute_all_to_all=True),
    CheckpointSpec(Policy.full),
    CheckpointSpec(Policy.full, recompute_all_to_all=True),
)


def policy_from_plan(cfg: JobConfig) -> bool:
    """Whether the plan chooses the checkpointing: `auto`, or `sac` with its budget left null."""
    c = cfg.compile
    return c.activation_checkpointing is ActivationCheckpointing.auto or (
        c.activation_checkpointing is ActivationCheckpointing.sac and c.activation_memory_budget is None
    )


def checkpoint_candidates(cfg: JobConfig) -> tuple[CheckpointSpec, ...]:
    """The specs training may compile with, in order of preference (least recomputation
    first): auto's candidates, a null sac budget's, or the one configured."""
    c = cfg.compile
    if c.activation_checkpointing is ActivationCheckpointing.auto:
        return AUTO_CANDIDATES
    if policy_from_plan(cfg):
        return _sac_candidates(c.recompute_all_to_all)
    policy = Policy(c.activation_checkpointing.value)
    budget = c.activation_memory_budget if policy is Policy.sac else 0.0
    return (CheckpointSpec(policy, budget=budget, recompute_all_to_all=c.recompute_all_to_all),)


def traced_specs(cfg: JobConfig) -> list[CheckpointSpec]:
    """Every policy of the plan's table, the candidates included, once each."""
    a2a = cfg.compile.recompute_all_to_all
    table = [
        CheckpointSpec(Policy.none, recompute_all_to_all=a2a),
        CheckpointSpec(Policy.torch_default),
        *_sac_candidates(a2a),
        *AUTO_CANDIDATES,
        CheckpointSpec(Policy.full, recompute_all_to_all=a2a),
    ]
    return list(dict.fromkeys([*table, *checkpoint_candidates(cfg)]))


def spec_label(spec: CheckpointSpec) -> str:
    """e.g. "sac (budget 0.5, all-to-all recomputed)"."""
    a2a = "all-to-all recomputed" if spec.recompute_all_to_all and spec.policy is not Policy.torch_default else ""
    if spec.policy is Policy.sac:
        return f"sac (budget {spec.budget:g}{', ' + a2a if a2a else ''})"
    return f"{spec.policy.value} ({a2a})" if a2a else spec.policy.value
