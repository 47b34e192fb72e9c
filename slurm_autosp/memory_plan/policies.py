"""The memory ladder a config lets training run with and the plan traces, and the names it
prints them by: one vocabulary shared by the memory terms, the choice and the text.

A rung is a checkpointing policy, optionally with sequence tiling (under `full` of whole layers:
no full-sequence tensor outside attention; under the others of the MLP: none of its width),
activation offload to host memory, and optimizer-state offload to host memory (the Adam step
on the host's CPU: a cost every optimizer step pays, so the last rungs); `auto` climbs the
ladder from the least recomputation and traffic to the least memory.
"""

from __future__ import annotations

from dataclasses import dataclass

from slurm_autosp.compile.activation_checkpointing import ActivationCheckpointSpec
from slurm_autosp.compile.tiled_layer import tiles_whole_layers
from slurm_autosp.config import ActivationCheckpointing, CompileConfig, JobConfig

SAC_BUDGETS = (1.0, 0.75, 0.5, 0.25, 0.0)
TILE_BYTES = (
    2**28
)  # the plan's tile: the most tokens whose MLP intermediate fits in 256 MiB (a power of two)


@dataclass(frozen=True)
class Rung:
    """One step of the memory ladder."""

    spec: ActivationCheckpointSpec
    tiled: bool = False  # the MLP runs in sequence tiles, recomputed tile by tile
    offload: bool = False  # what backward keeps waits in host memory
    offload_optimizer: bool = False  # optimizer state in host memory, stepped there


def _sac_candidates(recompute_all_to_all: bool) -> tuple[ActivationCheckpointSpec, ...]:
    return tuple(
        ActivationCheckpointSpec(
            ActivationCheckpointing.sac, budget=x, recompute_all_to_all=recompute_all_to_all
        )
        for x in SAC_BUDGETS
    )


# What `auto` chooses from, least recomputation first.
AUTO_CANDIDATES = (
    *_sac_candidates(False),
    ActivationCheckpointSpec(ActivationCheckpointing.sac, budget=0.0, recompute_all_to_all=True),
    ActivationCheckpointSpec(ActivationCheckpointing.full),
    ActivationCheckpointSpec(ActivationCheckpointing.full, recompute_all_to_all=True),
)


_LEAST_MEMORY = (
    ActivationCheckpointSpec(ActivationCheckpointing.sac, budget=0.0, recompute_all_to_all=True),
    ActivationCheckpointSpec(ActivationCheckpointing.full, recompute_all_to_all=True),
)


def ladder(cfg: JobConfig) -> tuple[Rung, ...]:
    """The rungs training may run with, in order of preference: each checkpointing candidate
    as is, then the least-memory policies tiled, tiled with activation offload, tiled with
    optimizer offload (where host memory, not the GPU, bounds activation offload), then both. `compile.tile_tokens`, `compile.offload_activations` and
    `parallel.offload_optimizer` set to a value fix that dimension for every rung."""
    candidates = activation_checkpoint_candidates(cfg.compile)
    tiling, offload = cfg.compile.tile_tokens, cfg.compile.offload_activations
    optimizer = cfg.parallel.offload_optimizer
    rungs = [Rung(spec) for spec in candidates]
    if tiling is None or offload is None or optimizer is None:
        tail = [spec for spec in candidates if spec in _LEAST_MEMORY] or [candidates[-1]]
        rungs += (
            [Rung(spec, tiled=True) for spec in tail]
            + [Rung(spec, tiled=True, offload=True) for spec in tail]
            + [Rung(spec, tiled=True, offload_optimizer=True) for spec in tail]
            + [Rung(spec, tiled=True, offload=True, offload_optimizer=True) for spec in tail]
        )
    fixed = [
        Rung(
            r.spec,
            r.tiled if tiling is None else tiling > 0,
            r.offload if offload is None else offload,
            r.offload_optimizer if optimizer is None else optimizer,
        )
        for r in rungs
    ]
    return tuple(dict.fromkeys(fixed))


def tile_tokens_for(
    compile: CompileConfig, intermediate_size: int, bytes_per_element: int, local_tokens: int
) -> int:
    """The configured tile, or the plan's: a power of two whose MLP intermediate fits TILE_BYTES,
    at most the local sequence."""
    if compile.tile_tokens:
        return compile.tile_tokens
    tile = 1 << max(0, (TILE_BYTES // (intermediate_size * bytes_per_element)).bit_length() - 1)
    return max(1, min(tile, local_tokens))


def rung_label(rung: Rung) -> str:
    """e.g. "full (all-to-all recomputed) + tiled layers + offload + optimizer offload": under
    `full` tiling tiles whole layers, under the other policies the MLPs (compile.tiled_layer);
    "offload" alone is the activations'."""
    tiling = " + tiled layers" if tiles_whole_layers(rung.spec) else " + tiled MLPs"
    return (
        spec_label(rung.spec)
        + (tiling if rung.tiled else "")
        + (" + offload" if rung.offload else "")
        + (" + optimizer offload" if rung.offload_optimizer else "")
    )


def policy_from_plan(compile: CompileConfig) -> bool:
    """Whether the plan chooses the checkpointing: `auto`, or `sac` with its budget left null."""
    return compile.activation_checkpointing is ActivationCheckpointing.auto or (
        compile.activation_checkpointing is ActivationCheckpointing.sac
        and compile.activation_memory_budget is None
    )


def activation_checkpoint_candidates(
    compile: CompileConfig,
) -> tuple[ActivationCheckpointSpec, ...]:
    """The specs training may compile with, in order of preference (least recomputation
    first): auto's candidates, a null sac budget's, or the one configured."""
    if compile.activation_checkpointing is ActivationCheckpointing.auto:
        return AUTO_CANDIDATES
    if policy_from_plan(compile):
        return _sac_candidates(compile.recompute_all_to_all)
    policy = compile.activation_checkpointing
    budget = compile.activation_memory_budget if policy is ActivationCheckpointing.sac else 0.0
    assert budget is not None  # a null sac budget is the plan's to choose (policy_from_plan)
    return (
        ActivationCheckpointSpec(
            policy, budget=budget, recompute_all_to_all=compile.recompute_all_to_all
        ),
    )


def traced_specs(compile: CompileConfig) -> list[ActivationCheckpointSpec]:
    """Every policy of the plan's table, the candidates included, once each."""
    a2a = compile.recompute_all_to_all
    table = [
        ActivationCheckpointSpec(ActivationCheckpointing.none, recompute_all_to_all=a2a),
        ActivationCheckpointSpec(ActivationCheckpointing.torch_default),
        *_sac_candidates(a2a),
        *AUTO_CANDIDATES,
        ActivationCheckpointSpec(ActivationCheckpointing.full, recompute_all_to_all=a2a),
    ]
    return list(dict.fromkeys([*table, *activation_checkpoint_candidates(compile)]))


def spec_label(spec: ActivationCheckpointSpec) -> str:
    """e.g. "sac (budget 0.5, all-to-all recomputed)"."""
    a2a = (
        "all-to-all recomputed"
        if spec.recompute_all_to_all and spec.policy is not ActivationCheckpointing.torch_default
        else ""
    )
    if spec.policy is ActivationCheckpointing.sac:
        return f"sac (budget {spec.budget:g}{', ' + a2a if a2a else ''})"
    return f"{spec.policy.value} ({a2a})" if a2a else spec.policy.value
