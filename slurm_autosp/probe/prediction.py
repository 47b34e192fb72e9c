"""What the memory plan predicts for the rung the probe trains with, split the way a rank's
memory can be measured.

The plan is built for CPU ranks too: it has no GPU to fit them to (submit does not plan them),
but its terms come from the traced layer at the configured width and sequence, so what the
forward keeps for backward is predicted on every device. The split of `logits_and_loss` and
`communication` into their parts follows `policy_memory` in memory_plan/terms.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from slurm_autosp.config import JobConfig, Precision
from slurm_autosp.memory_plan import TrainingChoices, build_plan
from slurm_autosp.memory_plan.policies import Rung
from slurm_autosp.model import hf_config


@dataclass(frozen=True)
class PlanPrediction:
    label: str  # the rung, as the plan prints it
    terms: dict[str, float]  # the plan's terms, bytes per rank
    held: float  # kept for backward: activations, the loss's saved inputs (and one chunk's
    # fp32 log-probabilities when the rank's tokens fit one loss chunk, which is not checkpointed)
    transient: float  # what one step allocates and frees: held, one logits chunk, the
    # all-to-all buffers and the recompute working set (no state, no ZeRO-1 buckets)
    subtotal: float  # every term, no margin
    allocator_total: float  # what the allocator reserves: with the plan's fragmentation margin
    outside: float  # what the GPU holds outside the allocator: the CUDA context, NCCL's buffers
    fits: bool  # the plan's verdict on this rung (PolicyMemory.fits, as submit decides it)


def predict_memory(cfg: JobConfig, choices: TrainingChoices) -> PlanPrediction | None:
    """None for `model.builder` models: the plan traces a Hugging Face decoder layer."""
    if cfg.model.builder:
        return None
    plan = build_plan(cfg)
    rung = Rung(
        choices.checkpointing,
        bool(choices.tile_tokens),
        choices.offload_activations,
        choices.offload_optimizer,
    )
    memory = plan.memories[choices.zero_stage][rung]
    t = memory.terms
    b = 2 if cfg.precision is Precision.bf16 else 4
    tokens = memory.trace.tokens
    chunk = min(tokens, cfg.compile.loss_chunk_tokens or tokens)
    vocab = hf_config(cfg.model).vocab_size
    logits_chunk = chunk * vocab * (b + 4 + 4)  # in the model's dtype, fp32, fp32 gradient
    one_chunk_kept = tokens * vocab * 4 if chunk == tokens else 0
    held = t["activations"] + t["logits_and_loss"] - logits_chunk + one_chunk_kept
    transient = (
        t["activations"]
        + t["logits_and_loss"]
        + t["communication"]
        + t["recompute_working"]
        + t["attention_backward"]
    )
    return PlanPrediction(
        memory.label,
        dict(t),
        held,
        transient,
        memory.subtotal,
        memory.allocator_total,
        sum(memory.outside.values()),
        memory.fits(plan.gpu_bytes),
    )
