"""The job's stop request (SLURM's pre-timeout USR2, SIGTERM from scancel, `timeout` or a
preemption) as the probe acts on it: between two measurements, every rank at the same one.

The signal handler only records the request (lifecycle/signals.py); here all ranks agree on it
with one small all-reduce, the way training agrees at a step boundary, so that they stop
before the same measurement and still meet in the gather that writes what was measured.
A probe is never requeued: it has no checkpoint, and its numbers so far are its result.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from slurm_autosp.lifecycle.signals import StopRequest


class AgreedStop:
    """`requested(after)` at each boundary; `reason` says where the probe stopped ('' if not)."""

    def __init__(self, request: StopRequest, device: torch.device):
        self.request = request
        self.device = device  # the process group's device: CUDA for NCCL, CPU for gloo
        self.reason = ""

    def requested(self, after: str) -> bool:
        """Whether any rank was signalled; a collective, so every rank asks at the same point."""
        flag = torch.tensor([int(self.request.requested)], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() and not self.reason:
            by = self.request.signal_name or "another rank's signal"
            self.reason = f"stopped by {by} after {after}"
        return bool(flag.item())
