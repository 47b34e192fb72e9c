"""Stopping inside a step: on a stop signal every rank leaves the step at the same decoder-layer
boundary, forward or backward, instead of finishing a step that may last hours.

Every rank passes the same boundaries in the same order (each layer's call in forward, the
gradient of its output in backward), so each boundary carries a small collective: a rank
starts an all-reduce (MAX) of its stop flag there and, at the next boundary, waits for the
previous one's result, by then long done. That result is the same on every rank, so all raise
`StepInterrupted` at the same boundary, at most two boundaries after the signal, and no rank is
left waiting in a collective the others never join. The agreement runs on a gloo group of its
own: on GPU ranks it never waits for the device. On CUDA the backward's boundaries run on
autograd's device threads while the main thread waits in C++, where Python runs no signal
handler; `StopRequest.requested` sees a signal there all the same (lifecycle/signals.py).

An optimizer step has no boundary: a stop lands before the update or after it, never inside.
So a step left this way leaves the parameters and optimizer state of the step before; its
gradients are the engine's to drop (`TrainEngine.abandon_step`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from slurm_autosp.compat.torch_api import wrap_module_call
from slurm_autosp.lifecycle.signals import StopRequest

# where cluster.stop_at is null, a step taking this share of cluster.signal_delay_s (the time
# from a stop signal to the kill: a preemption's GraceTime) or more stops at layer boundaries,
# since ending it leaves too little of that time for the save: 30 s at the default 120 s
LONG_STEP_SHARE = 0.25


def long_step_s(signal_delay_s: float) -> float:
    """The step time from which a stop under cluster.stop_at null ends a step at layers."""
    return LONG_STEP_SHARE * signal_delay_s


class StepInterrupted(Exception):
    """Every rank agreed, at the same layer boundary, to abandon the step in flight."""


class LayerStops:
    """The agreement at layer boundaries; inactive outside `armed` (evaluation, checks).
    Unarmed, a boundary costs a Python call and no collective."""

    def __init__(self, stop: StopRequest, group: dist.ProcessGroup | None, every_step: bool):
        self._stop = stop
        self._group = group
        self._in_flight: tuple[torch.Tensor, dist.Work] | None = None
        self._armed = False
        self.boundaries = 0  # passed since the process started: every rank the same
        # whether training's steps are armed (`step`); set on every rank alike, or none
        self.every_step = every_step

    @classmethod
    def install(
        cls,
        layers: Sequence[nn.Module],
        stop: StopRequest,
        group: dist.ProcessGroup | None = None,
        every_step: bool = True,
    ) -> LayerStops:
        """Collective. Put a boundary before every call of each of `layers` and on the gradient
        of its output; `group`: where ranks agree (None: a new gloo group of every rank).
        `every_step` on any rank arms every rank's steps."""
        group = group if group is not None else dist.new_group(backend="gloo")
        flag = torch.tensor([int(every_step)], dtype=torch.int32, device="cpu")  # gloo
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        stops = cls(stop, group, bool(flag.item()))
        for layer in layers:
            wrap_module_call(layer, stops._around)
        return stops

    def step(self) -> AbstractContextManager[None]:
        """Around a training step: `armed` if `every_step`, else nothing."""
        return self.armed() if self.every_step else nullcontext()

    @contextmanager
    def armed(self) -> Iterator[None]:
        """Boundaries in here may raise StepInterrupted. On a normal exit the last agreement is
        waited for and dropped: a stop it carried is acted on at the step boundary, where the
        ranks agree on stops anyway."""
        self._armed = True
        try:
            yield
            self._settle()
        finally:
            self._armed = False

    def boundary(self) -> None:
        """Collective: raise StepInterrupted on every rank if the previous boundary's agreement
        found a stop on any rank; else start this boundary's."""
        if not self._armed:
            return
        self.boundaries += 1
        if self._settle():
            raise StepInterrupted(f"stopped at layer boundary {self.boundaries}")
        flag = torch.tensor([int(self._stop.requested)], dtype=torch.int32, device="cpu")
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        assert work is not None
        self._in_flight = (flag, work)

    def _settle(self) -> bool:
        """Wait for the agreement in flight, if any: whether it found a stop."""
        if self._in_flight is None:
            return False
        flag, work = self._in_flight
        self._in_flight = None
        work.wait()
        return bool(flag.item())

    def _around(self, call: Callable[..., Any]) -> Callable[..., Any]:
        def layer_call(*args: Any, **kwargs: Any) -> Any:
            self.boundary()
            output = call(*args, **kwargs)
            hidden = output[0] if isinstance(output, tuple) else output
            if self._armed and isinstance(hidden, torch.Tensor) and hidden.requires_grad:
                hidden.register_hook(self._backward_boundary)
            return output

        return layer_call

    def _backward_boundary(self, grad: torch.Tensor) -> None:
        self.boundary()
