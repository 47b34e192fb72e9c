"""Collective bandwidth and latency on the job's own groups (the all-to-all in its Ulysses
group, a ring's pass in its ring group, the gradient reduction over the world as the engines
send it), at the message sizes its training step sends, beside the link's nominal bandwidth
where one is published; timed and reckoned as nccl-tests does (probe/timing.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from slurm_autosp.cluster.parallel_dims import ParallelDims
from slurm_autosp.config import JobConfig, ParallelConfig, Precision
from slurm_autosp.memory_plan import model_size
from slurm_autosp.memory_plan.terms import REDUCE_BYTES, ZERO_BUCKET_ELEMENTS
from slurm_autosp.model import hf_config
from slurm_autosp.probe.stop import AgreedStop
from slurm_autosp.probe.timing import CALLS, Message, bus_factor, nvlink_bandwidth, time_message


@dataclass(frozen=True)
class CollectiveTiming:
    """One rank's time per call of one message, and of the one-element latency probe."""

    collective: str
    what: str
    group: str
    group_index: int  # which Ulysses (the SP group without a ring) or ring group it is (world: 0)
    group_size: int
    nbytes: int
    seconds: float  # per call: the median sample of CALLS back-to-back calls, over CALLS
    latency_s: float
    calls: int  # back-to-back calls per sample
    nominal_gb_per_s: float | None
    nominal_source: str

    @property
    def algbw_gb_per_s(self) -> float:
        return self.nbytes / self.seconds / 1e9

    @property
    def busbw_gb_per_s(self) -> float:
        return self.algbw_gb_per_s * bus_factor(self.collective, self.group_size)


def _element_bytes(precision: Precision) -> tuple[torch.dtype, int]:
    return (torch.bfloat16, 2) if precision is Precision.bf16 else (torch.float32, 4)


def step_messages(cfg: JobConfig, zero_stage: int) -> list[Message]:
    """The Ulysses all-to-alls of one attention call over the Ulysses group of U ranks (the SP
    group without a ring: q and the output [B, H, S/P, D]; k and v with their heads repeated up
    to U when fewer) and the gradient reduction (`gradient_reduction`). Under a ring of R, also ring
    attention's pass of one K/V block to the next ring rank (its Ulysses rank's KV heads over
    S/R tokens; each is sent R-1 times forward and backward) and of its fp32 dK/dV (R times)."""
    hf = hf_config(cfg.model)
    dtype, b = _element_bytes(cfg.precision)
    sp, micro = cfg.parallel.sp_size, cfg.train.micro_batch
    ulysses, ring = cfg.parallel.ulysses_ring
    local = -(-cfg.data.seq_len // sp)
    heads = hf.num_attention_heads
    kv_heads = getattr(hf, "num_key_value_heads", None) or heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
    sent_kv = kv_heads if kv_heads % ulysses == 0 else ulysses
    messages = []
    if ulysses > 1:
        messages.append(
            Message(
                "all_to_all", "q / attention out", "sp", micro * heads * local * head_dim * b, dtype
            )
        )
        messages.append(
            Message("all_to_all", "k / v", "sp", micro * sent_kv * local * head_dim * b, dtype)
        )
    if ring > 1:  # K and V travel packed; a rank holds sent_kv / U of them over S / R tokens
        block = micro * 2 * max(1, sent_kv // ulysses) * local * ulysses * head_dim
        messages += [
            Message("send_recv", "ring k / v block", "ring", block * b, dtype),
            Message("send_recv", "ring dk / dv (fp32)", "ring", block * 4, torch.float32),
        ]
    if cfg.cluster.world_size > 1:
        messages.append(gradient_reduction(cfg, zero_stage))
    return messages


def gradient_reduction(cfg: JobConfig, zero_stage: int) -> Message:
    """The gradients' reduction as the engine sends it: over the whole world (SP ranks hold
    partial gradients of the same weights, and neither engine is told of SP: `loss_scale` undoes
    the average), in fp32 either way (REDUCE_BYTES). FSDP2 reduce-scatters each layer over its
    1-D mesh; DeepSpeed's BF16_Optimizer all-reduces its flat fp32 gradient (one parameter
    group: one tensor, past reduce_bucket_size, so sent whole, in place); ZeRO-1's fp32
    optimizer reduce-scatters buckets of reduce_bucket_size. Only the trained parameters' (a LoRA
    run's adapters)."""
    size = model_size(cfg.model)
    if zero_stage == 3:
        what, collective = "layer gradient (fp32)", "reduce_scatter"
        elements = size.trained_layer
    elif cfg.precision is Precision.bf16:
        what, collective, elements = "flat gradient (fp32)", "all_reduce", size.trained
    else:
        what, collective = "gradient bucket (fp32)", "reduce_scatter"
        elements = int(min(size.trained, ZERO_BUCKET_ELEMENTS))
    return Message(collective, what, "world", elements * REDUCE_BYTES, torch.float32)


def nominal_bandwidth(
    parallel: ParallelConfig, group: str, device: torch.device
) -> tuple[float | None, str]:
    """The published per-link bandwidth this group's busbw is held to, and where it came from."""
    if device.type != "cuda":
        return None, "no nominal: gloo on CPU"
    if group != "sp" or parallel.allow_cross_domain:
        return None, "no nominal: between nodes it depends on the NICs per GPU"
    return nvlink_bandwidth(device)


def time_collectives(
    cfg: JobConfig,
    dims: ParallelDims,
    zero_stage: int,
    stop: AgreedStop | None = None,
) -> list[CollectiveTiming]:
    """Time every message of `step_messages` on this rank's group (every rank takes part); an
    agreed stop request ends the timing between two messages."""
    world = dist.group.WORLD
    assert world is not None  # the job's process group is up
    groups = {
        # the all-to-alls' ranks: the Ulysses group, ring_size of them in each SP group
        "sp": (
            dims.ulysses_group,
            dims.dp_rank * dims.ring_size + dims.ring_rank,
            dims.ulysses_size,
        ),
        "world": (world, 0, dist.get_world_size()),
    }
    if dims.ring_group is not None:  # ring ranks: the same Ulysses position, ulysses_size rings
        groups["ring"] = (
            dims.ring_group,
            dims.dp_rank * dims.ulysses_size + dims.ulysses_rank,
            dims.ring_size,
        )
    timings: list[CollectiveTiming] = []
    for m in step_messages(cfg, zero_stage):
        if stop is not None and stop.requested(f"{len(timings)} collectives timed"):
            break
        group, index, size = groups[m.group]
        nbytes, seconds, latency = time_message(m, group, dims.device)
        nominal, source = nominal_bandwidth(cfg.parallel, m.group, dims.device)
        timings.append(
            CollectiveTiming(
                m.collective,
                m.what,
                m.group,
                index,
                size,
                nbytes,
                seconds,
                latency,
                CALLS,
                nominal,
                source,
            )
        )
    return timings
