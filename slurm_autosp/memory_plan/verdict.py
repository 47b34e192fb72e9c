"""Whether the plan fits, and when it does not, its biggest term and what would fit instead
(another policy, the other ZeRO stage, a larger SP group): what a refused job is told."""

from __future__ import annotations

from dataclasses import replace

from slurm_autosp.config import ActivationCheckpointing, JobConfig, resolve_ring_size
from slurm_autosp.heads import divisors
from slurm_autosp.memory_plan.choose import whole_model_graph
from slurm_autosp.memory_plan.terms import (
    FRAGMENTATION,
    GB,
    HOST_USABLE,
    MemoryPlan,
    PolicyMemory,
    ring_blocks_per_token,
    trained_summary,
)


def biggest_term(memory: PolicyMemory) -> tuple[str, float]:
    return max(memory.terms.items(), key=lambda item: item[1])


def _stage_setting(cfg: JobConfig, stage: int) -> str:
    """What to set for `stage`: the key when the config fixes another stage, and per_layer for ZeRO-3."""
    keys = [f"parallel.zero_stage={stage}"] if cfg.parallel.zero_stage not in (None, stage) else []
    if stage == 3 and whole_model_graph(cfg.compile):
        keys.append("compile.per_layer=true")
    return " and ".join(keys)


def _alternatives(plan: MemoryPlan) -> list[str]:
    """What would fit instead: another policy, the other ZeRO stage, more GPUs in SP (past the
    heads or a domain, as Ulysses x ring)."""
    cfg = plan.cfg
    options = []
    fitting = [p.label for p in plan.policies if p.fits(plan.gpu_bytes)]
    if fitting:
        options.append("another checkpointing policy: " + ", ".join(fitting))
    other = 3 if plan.zero_stage == 1 else 1
    fitting = [p.label for p in plan.memories[other].values() if p.fits(plan.gpu_bytes)]
    if fitting:
        what = (
            "parameter sharding (parallel.zero_stage=3"
            if other == 3
            else "ZeRO-1 (parallel.zero_stage=1"
        )
        per_layer = (
            ", compile.per_layer=true" if other == 3 and whole_model_graph(cfg.compile) else ""
        )
        options.append(f"{what}{per_layer}) with: " + ", ".join(fitting))
    ring_now = ring_blocks_per_token(cfg, *cfg.parallel.ulysses_ring)
    for sp in divisors(cfg.cluster.world_size):
        if sp <= cfg.parallel.sp_size:
            continue
        # past the head count or a domain: Ulysses x ring, as load_config would resolve it
        ring = resolve_ring_size(replace(cfg, parallel=replace(cfg.parallel, sp_size=sp)))
        ulysses = sp // ring
        extra_per_token = (ring_blocks_per_token(cfg, ulysses, ring) - ring_now) * (
            1 + FRAGMENTATION
        )
        scale = cfg.parallel.sp_size / sp
        fits = []
        for stage, memories in plan.memories.items():
            for memory in memories.values():
                tokens = memory.trace.tokens * scale
                total = memory.total_at(tokens) + extra_per_token * tokens
                host_fits = memory.host_at(tokens) <= memory.host_bytes_per_rank
                if total <= plan.gpu_bytes and host_fits:
                    # prefer no sharding, the least recomputation, no offload
                    rung = memory.rung
                    preference = (
                        stage,
                        memory.trace.recompute_flops,
                        rung.offload_optimizer,
                        rung.offload,
                    )
                    fits.append((preference, memory, stage))
        if fits:
            _, memory, stage = min(fits, key=lambda item: item[0])
            split = f" (Ulysses {ulysses} x ring {ring})" if ring > 1 else ""
            setting = _stage_setting(cfg, stage)
            options.append(
                f"parallel.sp_size={sp}{split} with {memory.label}"
                + (f" and {setting}" if setting else "")
            )
            break
    return options


def verdict(plan: MemoryPlan) -> tuple[str, bool, str]:
    memory = plan.configured
    if plan.fits:
        sac = plan.cfg.compile.activation_checkpointing is ActivationCheckpointing.sac
        budget = f" (compile.activation_memory_budget={memory.spec.budget:g})" if sac else ""
        trained = f"; {trained_summary(plan)}" if plan.cfg.model.lora else ""
        return (
            f"verdict: fits: {memory.total / GB:.1f} of {plan.gpu_bytes / GB:g} GB per GPU under "
            f"ZeRO-{plan.zero_stage} with {memory.label}{budget}{trained}",
            True,
            "",
        )
    over = {
        "its GPUs": _gpu_overflow(plan) if memory.total > plan.gpu_bytes else "",
        "its nodes' host memory": (
            _host_overflow(plan) if memory.host_bytes > memory.host_bytes_per_rank else ""
        ),
    }
    resources = " and ".join(name for name, why in over.items() if why)
    reason = "; and ".join(why for why in over.values() if why)
    options = _alternatives(plan)
    fix = (
        ("would fit: " + "; ".join(options))
        if options
        else (
            "nothing tried here fits (more GPUs in SP, other checkpointing policies, parameter sharding)"
        )
    )
    return (
        f"verdict: does not fit: {reason}\n  {fix}",
        False,
        f"the job does not fit {resources}: {reason}. {fix}",
    )


def _gpu_overflow(plan: MemoryPlan) -> str:
    """The GPU memory the configured rung needs beyond the GPU's, and its biggest term."""
    memory = plan.configured
    name, value = biggest_term(memory)
    reason = (
        f"needs {memory.total / GB:.1f} GB per GPU under ZeRO-{plan.zero_stage}, the GPU has "
        f"{plan.gpu_bytes / GB:g} GB; the biggest term is {name} ({value / GB:.1f} GB)"
    )
    if plan.zero_stage == 1 and name in ("parameters", "gradients"):
        reason += (
            ": under ZeRO-1 every GPU holds the full weights and gradients "
            f"({(memory.terms['parameters'] + memory.terms['gradients']) / GB:.0f} GB)"
        )
    return reason


def _host_overflow(plan: MemoryPlan) -> str:
    """The host memory per node the configured rung's offload needs beyond what the node has,
    its biggest term, and the keys that change either side."""
    memory, c = plan.configured, plan.cfg.cluster
    ranks = c.ranks_per_node
    terms = {
        "offloaded activations": (memory.host_bytes - memory.host_fixed) * ranks,
        "offloaded optimizer state": memory.host_fixed * ranks,
    }
    name, value = max(terms.items(), key=lambda item: item[1])
    offloads = [
        key
        for key, used in (
            ("compile.offload_activations=false", memory.rung.offload),
            ("parallel.offload_optimizer=false", memory.rung.offload_optimizer),
        )
        if used
    ]
    return (
        f"needs {memory.host_bytes * ranks / GB:,.0f} GB of host memory per node under "
        f"ZeRO-{plan.zero_stage} with {memory.label} ({ranks} ranks per node), the node has "
        f"{memory.host_bytes_per_rank * ranks / GB:,.0f} GB for offload ({HOST_USABLE:.0%} of "
        f"cluster.host_memory_gb={c.host_memory_gb:g}); the biggest term is {name} "
        f"({value / GB:,.0f} GB): set cluster.host_memory_gb to the nodes' memory if they have "
        f"more, or offload less ({' or '.join(offloads)})"
    )
