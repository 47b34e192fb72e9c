"""What optimizer offload costs a step, modelled: the traffic over the host link and the AdamW
step on the host's CPU, against the step's compute.

- ZeRO-1 (DeepSpeed's ZeRO-Offload): at the accumulation boundary each rank copies its b-byte
  gradient partition to the host and, after the step, its updated b-byte parameter partition
  back; nothing runs beside them, so both copies and the step are exposed.
- ZeRO-3 (FSDP2's CPUOffloadPolicy): every micro-batch copies each layer's fp32 shards to the
  GPU for its all-gathers (forward and backward) and its fp32 reduced gradient back; FSDP2
  runs these a layer ahead, so they hide when they take less time than the compute. The step
  is exposed.
- The host AdamW step (torch's fused kernel) streams 28 bytes per parameter (fp32 weight,
  gradient and two moments read; weight and moments written) and is bound by the node's memory
  bandwidth, shared by its ranks: HOST_MEMORY_GB_PER_S, a dual-socket server's order of
  magnitude (not measured on a GPU node; 2 cores here stream 32 GB/s through it).
"""

from __future__ import annotations

from dataclasses import dataclass

from slurm_autosp.memory_plan.compute_time import compute_seconds
from slurm_autosp.memory_plan.terms import GB, MemoryPlan, bytes_per_element
from slurm_autosp.model import hf_config

HOST_MEMORY_GB_PER_S = 200.0
ADAM_BYTES_PER_PARAMETER = 28


@dataclass(frozen=True)
class OptimizerOffloadCost:
    """Per rank and optimizer step."""

    link_seconds: float  # the copies over the host link, both ways
    hidden: bool  # the copies run behind the layers' compute
    adam_seconds: float  # the host AdamW step
    compute_seconds: float  # the step's modelled compute (forward, backward, recompute)

    @property
    def exposed_seconds(self) -> float:
        return self.adam_seconds + (0.0 if self.hidden else self.link_seconds)


def optimizer_offload_cost(plan: MemoryPlan) -> OptimizerOffloadCost:
    cfg, t = plan.cfg, plan.configured.trace
    c, accum = cfg.cluster, cfg.train.grad_accum
    shard = plan.trained / c.world_size  # trained parameters per rank
    link = c.host_link_gb_per_s * GB
    flops = (t.forward_flops + t.backward_flops + t.recompute_flops) * accum
    compute = compute_seconds(cfg.trace, flops * hf_config(cfg.model).num_hidden_layers)
    if plan.zero_stage == 1:  # gradients out, then parameters in: one after the other
        seconds, hidden = 2 * bytes_per_element(cfg.precision) * shard / link, False
    else:  # shards in twice per micro-batch while gradients go out: both ways at once
        seconds = 2 * 4 * shard * accum / link
        hidden = seconds <= compute
    adam = ADAM_BYTES_PER_PARAMETER * shard * c.ranks_per_node / (HOST_MEMORY_GB_PER_S * GB)
    return OptimizerOffloadCost(seconds, hidden, adam, compute)
