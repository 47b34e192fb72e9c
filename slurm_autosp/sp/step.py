"""One sequence-parallel step, written once: each micro-batch sharded for this rank, the step's
count of valid labels over the world, and each micro-batch's loss (an MoE's router share
included) times the factor that undoes the engine's gradient reduction, then backward.
Training, verify, the GPU check and the benches run it through `slurm_autosp.run_step` (which
pairs a model with its backward and factor), evaluation shards with `shard_for_rank`, so the
arithmetic that makes SP equal one device (verify's exactness, the equivalence tests) lives in
one place; what differs between callers (the engine's backward and factor, timing, offload) is
passed in."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from slurm_autosp.cluster.parallel_dims import ParallelDims
from slurm_autosp.sp.chunked_loss import causal_lm_forward
from slurm_autosp.sp.inputs import SPBatch, prepare_sp_inputs
from slurm_autosp.sp.router_loss import RouterTokens


def shard_for_rank(
    dims: ParallelDims,
    input_ids: torch.Tensor,
    labels: torch.Tensor | None = None,
    document_ids: torch.Tensor | None = None,
) -> SPBatch:
    """This rank's shard, on its device, of a micro-batch that every rank of its SP group reads
    whole (its place in the group, and the ring's zigzag under a ring, from `dims`)."""
    return prepare_sp_inputs(
        input_ids.to(dims.device),
        None if labels is None else labels.to(dims.device),
        sp_rank=dims.sp_rank,
        sp_size=dims.sp_size,
        document_ids=None if document_ids is None else document_ids.to(dims.device),
        ring_size=dims.ring_size,
    )


def step_label_count(batches: Sequence[SPBatch], device: torch.device) -> torch.Tensor:
    """The step's loss normaliser: the valid labels of these micro-batches summed over every
    rank of the world (one all-reduce), at least 1 so a step without labels divides by 1."""
    count = torch.tensor(sum(b.valid_labels for b in batches), device=device)
    dist.all_reduce(count)
    return count.clamp(min=1)


PhaseTimer = Callable[[str], AbstractContextManager[None]]  # `with phases("forward"): ...`


def untimed(name: str) -> AbstractContextManager[None]:
    """Phases nobody times (a step outside the training loop)."""
    return nullcontext()


@dataclass(frozen=True)
class MicroBatchLoss:
    """One micro-batch's loss before the engine factor (this rank's summed token loss over the
    step's count, plus its router share) and its logits (None when computed in chunks)."""

    loss: torch.Tensor
    logits: torch.Tensor | None


@dataclass(frozen=True)
class StepLosses:
    """A step's micro-batch losses in order, and the label count over the world they share."""

    micro_batches: list[MicroBatchLoss]
    num_items: torch.Tensor


@dataclass(frozen=True)
class SPStep:
    """How a step runs each of its micro-batches on this rank.

    `model` runs the forward (the engine, so its backward hooks are set on the outputs, or the
    module); `backward` takes the scaled loss (`engine.backward`, or `torch.Tensor.backward`);
    `loss_scale` undoes the engine's gradient reduction (`engine.loss_scale`, `loss_scale`);
    `micro_batches` is the step's over all DP replicas (dp_size x grad_accum), which an MoE's
    router share is divided by (`RouterTokens`); `chunk_tokens` the loss's chunks (0:
    unchunked); `keep_logits` returns an unchunked loss's logits (otherwise they are not held
    through backward: the step's largest tensor); `saving` wraps each forward (activation
    offload's `saving`)."""

    model: Any
    backward: Callable[[torch.Tensor], object]
    loss_scale: float
    sp_size: int
    micro_batches: int
    chunk_tokens: int = 0
    keep_logits: bool = False
    saving: Callable[[], AbstractContextManager[object]] = nullcontext

    def run(
        self,
        batch: SPBatch,
        num_items: torch.Tensor | int,
        phases: PhaseTimer = untimed,
    ) -> MicroBatchLoss:
        """Forward and backward of one micro-batch, the step's label count `num_items`
        (`step_label_count`); `phases` times "forward" and "backward" (metrics.Phases)."""
        with phases("forward"), self.saving():
            loss, logits = causal_lm_forward(
                self.model,
                batch.model_kwargs(num_items),
                chunk_tokens=self.chunk_tokens,
                router=RouterTokens(batch.real_tokens, self.sp_size, self.micro_batches),
            )
        if not self.keep_logits:
            logits = None
        with phases("backward"):
            self.backward(loss * self.loss_scale)
        return MicroBatchLoss(loss, logits)

    def step(
        self,
        batches: Sequence[SPBatch],
        after_each: Callable[[], object] | None = None,
        phases: PhaseTimer = untimed,
    ) -> StepLosses:
        """Every micro-batch of a step: their label count over the world (`step_label_count`,
        timed as "data": it waits for the slowest rank's batch), then each one's forward and
        backward, and `after_each` after it if given (timed as "optimizer": an engine's step,
        which updates the weights at the accumulation boundary)."""
        with phases("data"):
            num_items = step_label_count(batches, batches[0].input_ids.device)
        losses = []
        for batch in batches:
            losses.append(self.run(batch, num_items, phases))
            if after_each is not None:
                with phases("optimizer"):
                    after_each()
        return StepLosses(losses, num_items)
