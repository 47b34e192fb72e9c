"""What the config leaves to the plan, decided from the memory: `parallel.zero_stage` null is
ZeRO-1 when the job fits under it, else ZeRO-3; `compile.activation_checkpointing=auto` is the
first rung of the ladder (least recomputation first, then sequence tiling, then activation
offload, then optimizer offload) that fits; a `sac` budget left null is the largest that fits;
`compile.tile_tokens`, `compile.offload_activations` and `parallel.offload_optimizer` left null
are the ladder's. Training asks here for what it runs with.
"""

from __future__ import annotations

from dataclasses import dataclass

from slurm_autosp.compile.activation_checkpointing import ActivationCheckpointSpec
from slurm_autosp.compile.tiled_layer import tiles_whole_layers
from slurm_autosp.config import ActivationCheckpointing, CompileConfig, JobConfig, StopAt
from slurm_autosp.lifecycle.save_time import rank0_checkpoint_bytes
from slurm_autosp.memory_plan.layer_graph import tiled_layer_trace, trace_decoder_layer
from slurm_autosp.memory_plan.policies import (
    Rung,
    activation_checkpoint_candidates,
    ladder,
    policy_from_plan,
    traced_specs,
)
from slurm_autosp.memory_plan.staging import checkpoint_staging
from slurm_autosp.memory_plan.step_time import step_time
from slurm_autosp.memory_plan.stopping import configured_stopping, stopping_for
from slurm_autosp.memory_plan.terms import (
    GB,
    MemoryPlan,
    PolicyMemory,
    model_size,
    policy_memory,
)
from slurm_autosp.model import compute_dtype


def _choose_rung(
    cfg: JobConfig, memories: dict[Rung, PolicyMemory], gpu_bytes: float
) -> tuple[Rung, str]:
    """The first rung of the ladder that fits (the last, the least memory, when none does), and how it was chosen."""
    rungs = ladder(cfg)
    if len(rungs) == 1:
        return rungs[0], ""
    fitting = [r for r in rungs if memories[r].fits(gpu_bytes)]
    if cfg.compile.activation_checkpointing is ActivationCheckpointing.auto:
        how, best = "chosen by auto", "the least recomputation"
    elif policy_from_plan(cfg.compile):
        how, best = "budget chosen by the plan", "the largest"
    else:
        how, best = "tiling and offloads chosen by the plan", "the least traffic"
    if fitting:
        return fitting[0], f"{how}: {best} that fits"
    return rungs[-1], f"{how}: nothing fits, the least memory"


def whole_model_graph(compile: CompileConfig) -> bool:
    """A whole-model compile rules ZeRO-3 out: FSDP2 is wired for one graph per decoder layer."""
    return compile.enabled and not compile.per_layer


def _choose_stage(cfg: JobConfig, fits_under_zero1: bool) -> tuple[int, str]:
    """The configured stage; else ZeRO-1 when the job fits under it, else ZeRO-3."""
    if cfg.parallel.zero_stage is not None:
        return cfg.parallel.zero_stage, ""
    if fits_under_zero1:
        return 1, "chosen: fits without parameter sharding"
    if whole_model_graph(cfg.compile):
        return 1, "chosen: ZeRO-3 needs compile.per_layer=true"
    return 3, "chosen: does not fit under ZeRO-1"


def build_plan(cfg: JobConfig) -> MemoryPlan:
    """Trace one decoder layer under every policy (and, for the MLP-tiled rungs, without its MLP;
    whole tiled layers are derived from the layer traced under `none`) at the Ulysses size,
    lay out the per-GPU memory under ZeRO-1 and ZeRO-3, and choose the stage and rung the
    config leaves open."""
    sp = cfg.parallel.sp_size
    ulysses, ring = cfg.parallel.ulysses_ring
    local_seq = -(-cfg.data.seq_len // sp)
    dtype = compute_dtype(cfg.precision)
    rungs = [*(Rung(spec) for spec in traced_specs(cfg.compile)), *ladder(cfg)]
    traces = {}
    for tiled in sorted({r.tiled for r in rungs}):
        specs = list(
            dict.fromkeys(
                r.spec
                for r in rungs
                if r.tiled == tiled and not (tiled and tiles_whole_layers(r.spec))
            )
        )
        if not specs:
            continue
        layer_traces = trace_decoder_layer(
            cfg.model,
            local_seq=local_seq,
            sp_size=ulysses,
            specs=specs,
            micro_batch=cfg.train.micro_batch,
            dtype=dtype,
            tiled=tiled,
            ring_size=ring,
        )
        traces.update({(spec, tiled): t for spec, t in zip(specs, layer_traces, strict=True)})
    keep_all = next(
        t for (spec, tiled), t in traces.items() if spec.policy is ActivationCheckpointing.none
    )
    for rung in rungs:
        if rung.tiled and tiles_whole_layers(rung.spec):
            traces[rung.spec, True] = tiled_layer_trace(
                cfg.model, rung.spec, keep_all, traces[rung.spec, False], dtype
            )
    size = model_size(cfg.model)
    gpu_bytes = cfg.cluster.gpu_memory_gb * GB
    memories = {
        stage: {
            r: policy_memory(cfg, traces[r.spec, r.tiled], size, stage, r)
            for r in dict.fromkeys(rungs)
        }
        for stage in (1, 3)
    }
    zero1_rung, _ = _choose_rung(cfg, memories[1], gpu_bytes)
    stage, stage_note = _choose_stage(cfg, memories[1][zero1_rung].fits(gpu_bytes))
    rung, policy_note = _choose_rung(cfg, memories[stage], gpu_bytes)
    return MemoryPlan(
        cfg,
        size.total,
        size.trained,
        gpu_bytes,
        stage,
        memories[stage][rung],
        memories,
        stage_note,
        policy_note,
    )


def _has_plan(cfg: JobConfig) -> bool:
    """Only GPU jobs with a Hugging Face model are planned (the plan traces an HF decoder layer)."""
    return cfg.cluster.uses_gpus and not cfg.model.builder


def zero_stage_for(cfg: JobConfig) -> int:
    """The ZeRO stage training runs: the configured one; without a plan (CPU ranks, builder
    models) ZeRO-1; else the plan's (ZeRO-1 when the job fits under it, else ZeRO-3)."""
    if cfg.parallel.zero_stage is not None:
        return cfg.parallel.zero_stage
    return build_plan(cfg).zero_stage if _has_plan(cfg) else 1


@dataclass(frozen=True)
class TrainingChoices:
    """How training runs what the config may leave to the plan."""

    zero_stage: int
    checkpointing: ActivationCheckpointSpec
    tile_tokens: int  # tokens per MLP tile; 0: untiled
    offload_activations: bool
    offload_optimizer: bool
    async_save: bool  # saves staged in node memory, persisted in the background
    # where a stop signal ends the step in flight: `layer`, `step`, or None: at its end until a
    # measured step is long, at a layer boundary from then on (memory_plan/stopping.py)
    stop_at: StopAt | None
    save_every_steps: int  # 0: no periodic saves


def choices_from_plan(plan: MemoryPlan) -> TrainingChoices:
    memory = plan.configured
    asynchronous = checkpoint_staging(plan).asynchronous
    step_s, _ = step_time(plan.cfg)
    save_bytes = rank0_checkpoint_bytes(plan.cfg, plan.trained, plan.zero_stage)
    stopping = stopping_for(plan.cfg, step_s, save_bytes, asynchronous)
    return TrainingChoices(
        plan.zero_stage,
        memory.spec,
        memory.tile_tokens,
        memory.rung.offload,
        memory.rung.offload_optimizer,
        asynchronous,
        stopping.stop_at,
        stopping.save_every_steps,
    )


def _plan_decides(cfg: JobConfig) -> bool:
    c = cfg.compile
    open_choice = cfg.parallel.zero_stage is None or policy_from_plan(cfg.compile)
    return _has_plan(cfg) and (
        open_choice
        or c.tile_tokens is None
        or c.offload_activations is None
        or cfg.parallel.offload_optimizer is None
        or cfg.checkpoint.async_save is None
        or cfg.checkpoint.every_steps is None
    )


def training_choices(cfg: JobConfig) -> TrainingChoices:
    """The ZeRO stage, checkpointing policy, tiling and offloads training runs with, from at
    most one plan: tracing a large layer takes seconds, on every rank. Without a plan (CPU
    ranks, builder models) tiling and offloads are off unless configured."""
    if _plan_decides(cfg):
        return choices_from_plan(build_plan(cfg))
    stopping = configured_stopping(cfg)
    return TrainingChoices(
        zero_stage_for(cfg),
        activation_checkpoint_spec_for(cfg),
        cfg.compile.tile_tokens or 0,
        bool(cfg.compile.offload_activations),
        bool(cfg.parallel.offload_optimizer),
        cfg.checkpoint.async_save is not False,
        stopping.stop_at,
        stopping.save_every_steps,
    )


def activation_checkpoint_spec_for(cfg: JobConfig) -> ActivationCheckpointSpec:
    """The checkpointing policy training compiles with: the configured one, or, for `auto` and
    a null `sac` budget, the plan's choice. Without a plan: CPU ranks have no GPU to fit, so
    they keep everything (sac budget 1); builder models keep the least (sac budget 0)."""
    if not policy_from_plan(cfg.compile):
        return activation_checkpoint_candidates(cfg.compile)[0]
    if _has_plan(cfg):
        return build_plan(cfg).configured.spec
    budget = 1.0 if not cfg.cluster.uses_gpus else 0.0
    return ActivationCheckpointSpec(
        ActivationCheckpointing.sac,
        budget=budget,
        recompute_all_to_all=cfg.compile.recompute_all_to_all,
    )
