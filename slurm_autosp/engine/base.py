"""What the training loop asks of an engine, whichever one owns the parameters."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from slurm_autosp.checkpoint.export import every_name
from slurm_autosp.checkpoint.state_files import StateFiles


class TrainEngine(Protocol):
    """Forward, backward, optimizer step, and the engine's own checkpoint format.

    `loss_scale` is the factor on each rank's loss (its summed token loss over the step's
    global valid-label count) that makes the engine's gradient reduction return the
    single-device gradient of the whole step: it depends on how the engine reduces.
    """

    name: str  # recorded in checkpoints: a checkpoint resumes only under the engine that wrote it
    module: nn.Module  # the model itself, for the loss, traces and export
    loss_scale: float

    def __call__(self, **kwargs: Any) -> Any: ...

    def backward(self, loss: torch.Tensor) -> None: ...

    def step(self) -> None:
        """Called after every micro-batch; the optimizer steps at the accumulation boundary."""

    def abandon_step(self) -> None:
        """After a step stopped between layers (lifecycle.layer_stops): drop its gradients and
        whatever its forward or backward left gathered, so the state saved next is the previous
        step's. The job stops after it; the step is never resumed."""

    def lr(self) -> float: ...

    def grad_norm(self) -> float:
        """Global gradient norm of the last optimizer step, before clipping."""

    def state_files(self) -> StateFiles:
        """Collective: this rank's part of the engine state, as files for the checkpoint to
        write (at once, or staged and written in the background)."""

    def load(self, path: Path) -> None:
        """Collective: restore what `save` wrote."""

    def full_state_dict(
        self, keep: Callable[[str], bool] = every_name
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Collective, tensor by tensor: every rank takes it to the end. Rank 0 gets the whole
        model's weights one at a time (those whose names `keep` keeps: the same on every rank),
        each on its host and in the compute dtype, a tied tensor once (as
        checkpoint.export.distinct_tensors names it); the other ranks get nothing. Never the
        whole model at once: the export writes each as it comes."""

    def close(self) -> None:
        """Release what the engine holds beyond the job's process group."""
