"""The plan as printed, by `python -m slurm_autosp plan` and by submit (plan.decision)."""

from __future__ import annotations

from slurm_autosp.cluster.placement import layout_for, layout_summary
from slurm_autosp.compile.tiled_layer import tiles_whole_layers
from slurm_autosp.memory_plan.compute_time import REFERENCE_MFU, compute_seconds, peak_tflops
from slurm_autosp.memory_plan.offload_cost import optimizer_offload_cost
from slurm_autosp.memory_plan.staging import checkpoint_staging
from slurm_autosp.memory_plan.terms import (
    FRAGMENTATION,
    GB,
    RING_GRADIENT_BYTES,
    MemoryPlan,
    bytes_per_element,
    kv_block_per_token,
    trained_summary,
)
from slurm_autosp.memory_plan.verdict import verdict
from slurm_autosp.model import hf_config

ENGINES = {1: "DeepSpeed", 3: "FSDP2"}
# per GPU, each way, across NVLink domains: one 400 Gb/s NDR InfiniBand NIC a GPU, as on a DGX
# H100 (not measured; the probe times the collectives on the job's own nodes)
FABRIC_GB_PER_S = 50.0


def _gb(value: float) -> str:
    return f"{value / GB:8.2f} GB"


def _engine(plan: MemoryPlan) -> str:
    """e.g. "ZeRO-3 (FSDP2; chosen: does not fit under ZeRO-1)"."""
    note = f"; {plan.stage_note}" if plan.stage_note else ""
    return f"ZeRO-{plan.zero_stage} ({ENGINES[plan.zero_stage]}{note})"


def render(plan: MemoryPlan) -> str:
    cfg, memory = plan.cfg, plan.configured
    c = cfg.cluster
    hf = hf_config(cfg.model)
    policy_note = f", {plan.policy_note}" if plan.policy_note else ""
    ulysses, ring = cfg.parallel.ulysses_ring
    split = f" = Ulysses {ulysses} x ring {ring}" if ring > 1 else ""
    lines = [
        f"memory plan: {hf.model_type} {plan.parameters / 1e9:.2f}B parameters, {hf.num_hidden_layers} layers, "
        f"seq {cfg.data.seq_len} x micro_batch {cfg.train.micro_batch}, SP={cfg.parallel.sp_size}{split} "
        f"({memory.trace.local_seq} tokens per rank), world {c.world_size}, {cfg.precision.value}",
        f"  {_engine(plan)}; checkpointing {memory.label}{policy_note}",
        *([f"  {trained_summary(plan)}"] if plan.cfg.model.lora else []),
        f"per GPU ({c.gpu_memory_gb:g} GB):",
    ]
    for name, value in memory.terms.items():
        lines.append(f"  {name:<26}{_gb(value)}")
    lines.append(
        f"  {'fragmentation_margin':<26}{_gb(memory.margin)}   ({FRAGMENTATION:.0%} of the above: expandable segments)"
    )
    for name, value in memory.outside.items():
        lines.append(f"  {name:<26}{_gb(value)}   (outside torch's allocator)")
    if memory.outside:
        lines.append(f"  {'':<26}outside torch's allocator: {memory.outside_source}")
    lines.append(f"  {'total':<26}{_gb(memory.total)}   of {c.gpu_memory_gb:g} GB")
    t = memory.trace
    lines.append(
        f"  one layer saves {t.activation_bytes / t.tokens:,.0f} bytes per token; O(S^2) tensors saved: "
        f"{len(t.quadratic_saved)}; attention recomputed: {t.recomputed_attention}; all-to-alls in backward: "
        f"{t.all_to_all_backward}"
    )
    if memory.tile_tokens:
        what = (
            "the layer outside attention runs in tiles of {:,} tokens, all-to-alls in chunks of "
            "a tile"
            if tiles_whole_layers(memory.spec)
            else "the MLP runs in tiles of {:,} tokens"
        )
        lines.append(
            f"  sequence tiling: {what.format(memory.tile_tokens)} (recomputed tile by tile)"
        )
    if ring > 1:
        lines.append("  " + ring_line(plan))
    if memory.rung.offload:
        lines.append("  " + offload_line(plan))
    if memory.rung.offload_optimizer:
        lines.append("  " + optimizer_offload_line(plan))
    lines.append(checkpoint_staging(plan).line())
    lines.append(
        f"longest sequence that fits (this cluster shape, per policy; GB per GPU under ZeRO-{plan.zero_stage} "
        f"at seq {cfg.data.seq_len}):"
    )
    width = max(len(p.label) for p in plan.policies)
    for rung, p in plan.memories[plan.zero_stage].items():
        chosen = "   <- chosen" if rung == memory.rung else ""
        lines.append(
            f"  {p.label:<{width}} ZeRO-1: {plan.longest_seq(plan.memories[1][rung]):>10,}   "
            f"ZeRO-3: {plan.longest_seq(plan.memories[3][rung]):>10,}   needs {p.total / GB:6.1f} GB{chosen}"
        )
    text, _, _ = verdict(plan)
    lines.append(text)
    return "\n".join(lines)


def ring_line(plan: MemoryPlan) -> str:
    """What the ring sends per layer and whether it can hide behind the layer's compute: each
    rank sends its K/V block to the R - 1 other ring ranks in forward (again when backward
    recomputes attention) and again in backward, where each visited block's dK/dV go back, over
    the fabric between domains; the Ulysses all-to-alls stay inside the Ulysses group's domain.
    Without documents or a window, every block is read: a window shorter than the sequence
    sends fewer (sp/ring_plan.py), which this line does not count."""
    cfg, memory = plan.cfg, plan.configured
    t = memory.trace
    ulysses, ring = (
        cfg.parallel.ulysses_ring
    )  # the Ulysses all-to-alls: over the Ulysses group only
    kv = 2 * kv_block_per_token(cfg, ulysses) * t.tokens  # K and V blocks
    forward = (ring - 1) * kv
    backward = (ring - 1) * kv * (1 + RING_GRADIENT_BYTES / bytes_per_element(cfg.precision))
    sent = forward * (1 + bool(t.recomputed_attention)) + backward
    seconds = sent / (FABRIC_GB_PER_S * GB)
    peak = peak_tflops(cfg.trace)
    compute = compute_seconds(cfg.trace, t.forward_flops + t.backward_flops)
    hidden = "hidden behind" if seconds <= compute else "NOT hidden behind"
    return (
        f"ring attention: {layout_summary(cfg.cluster, layout_for(cfg))}; per layer each rank sends "
        f"{forward / GB:.2f} GB of K/V forward"
        f"{' (twice: attention recomputed)' if t.recomputed_attention else ''} and "
        f"{backward / GB:.2f} GB of K/V and dK/dV backward = {seconds * 1e3:,.0f} ms at "
        f"{FABRIC_GB_PER_S:g} GB/s between domains, {hidden} the layer's forward and backward "
        f"({compute * 1e3:,.0f} ms at {REFERENCE_MFU:.0%} of {peak:g} TFLOP/s)"
    )


def offload_line(plan: MemoryPlan) -> str:
    """Host memory the offload needs per node, and whether its traffic can hide behind compute:
    each layer's saved tensors cross the host link once each way per step."""
    cfg, memory = plan.cfg, plan.configured
    c, t = cfg.cluster, memory.trace
    node = memory.host_per_token * t.tokens * c.ranks_per_node
    seconds = t.activation_bytes / (c.host_link_gb_per_s * GB)
    peak = peak_tflops(cfg.trace)
    compute = compute_seconds(cfg.trace, t.forward_flops)
    hidden = "hidden behind" if seconds <= compute else "NOT hidden behind"
    return (
        f"activation offload: {node / GB:,.0f} GB of host memory per node (cluster.host_memory_gb="
        f"{c.host_memory_gb:g}, 80% usable); {t.activation_bytes / GB:.2f} GB per layer each way at "
        f"{c.host_link_gb_per_s:g} GB/s = {seconds * 1e3:.0f} ms, {hidden} the layer's forward "
        f"({compute * 1e3:.0f} ms at {REFERENCE_MFU:.0%} of {peak:g} TFLOP/s)"
    )


def optimizer_offload_line(plan: MemoryPlan) -> str:
    """Host memory the optimizer state takes per node, beside the offloaded activations, and
    what the offload adds to a step (plan.offload_cost)."""
    c, memory = plan.cfg.cluster, plan.configured
    cost = optimizer_offload_cost(plan)
    hidden = "hidden behind the layers" if cost.hidden else "exposed"
    return (
        f"optimizer offload: {memory.host_fixed * c.ranks_per_node / GB:,.0f} GB of host memory "
        f"per node ({memory.host_bytes * c.ranks_per_node / GB:,.0f} GB offloaded in all); per "
        f"step {cost.link_seconds * 1e3:,.0f} ms of copies at {c.host_link_gb_per_s:g} GB/s "
        f"({hidden}) and {cost.adam_seconds * 1e3:,.0f} ms of host AdamW: "
        f"+{cost.exposed_seconds / cost.compute_seconds:.1%} on the step's "
        f"{cost.compute_seconds:,.1f} s of compute"
    )
