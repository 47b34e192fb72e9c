"""A step of SP micro-batches as every caller runs it: the one place outside `sp/` that runs
`sp.step.SPStep`, so the factor that undoes a gradient reduction is chosen here, by whoever
reduces the gradients.

A training engine reduces them itself: its `backward`, its `loss_scale`, and its `step` after
every micro-batch (the optimizer steps at the accumulation boundary). A bare module (verify, the
GPU check, most benches) keeps each rank's gradients for its caller, who averages them over the
world: its factor is the world's (`loss_scale(world, 1)`), so the average is one device's
gradient of the whole step."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Protocol

import torch
from torch import nn

from slurm_autosp.sp.inputs import SPBatch
from slurm_autosp.sp.loss import loss_scale
from slurm_autosp.sp.step import PhaseTimer, SPStep, StepLosses, untimed


class StepEngine(Protocol):
    """What a step asks of an engine (engine.TrainEngine has it): the forward, the backward that
    reduces the gradients, the factor that undoes that reduction, the step after a micro-batch."""

    loss_scale: float

    def __call__(self, **kwargs: Any) -> Any: ...

    def backward(self, loss: torch.Tensor) -> None: ...

    def step(self) -> None: ...


def run_engine_step(
    engine: StepEngine,
    batches: Sequence[SPBatch],
    sp_size: int,
    dp_size: int,
    *,
    chunk_tokens: int = 0,
    saving: Callable[[], AbstractContextManager[object]] = nullcontext,
    phases: PhaseTimer = untimed,
) -> StepLosses:
    """One optimizer step of `batches` (this rank's shards of the step's micro-batches, one DP
    replica of `dp_size`) under `engine`; `chunk_tokens` cuts the loss, `saving` wraps each
    forward (activation offload), `phases` times the label count (as "data"), forward, backward
    and optimizer."""
    sp_step = SPStep(
        engine,
        engine.backward,
        engine.loss_scale,
        sp_size,
        micro_batches=dp_size * len(batches),
        chunk_tokens=chunk_tokens,
        saving=saving,
    )
    return sp_step.step(batches, after_each=engine.step, phases=phases)


def run_module_step(
    model: nn.Module,
    batches: Sequence[SPBatch],
    sp_size: int,
    dp_size: int = 1,
    *,
    chunk_tokens: int = 0,
    keep_logits: bool = False,
    saving: Callable[[], AbstractContextManager[object]] = nullcontext,
    phases: PhaseTimer = untimed,
) -> StepLosses:
    """Forward and backward of `batches` through a bare module over a world of sp_size x
    dp_size ranks; each rank's gradients stay its own, their average over the world is one
    device's. `keep_logits` returns an unchunked loss's logits (verify's per-token losses)."""
    sp_step = SPStep(
        model,
        torch.Tensor.backward,
        loss_scale(sp_size * dp_size, grad_accum=1),
        sp_size,
        micro_batches=dp_size * len(batches),
        chunk_tokens=chunk_tokens,
        keep_logits=keep_logits,
        saving=saving,
    )
    return sp_step.step(batches, phases=phases)
