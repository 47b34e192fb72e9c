"""Per-step numbers for people: one log line per step and TensorBoard scalars, from rank 0."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Dict, Optional

import torch

from slurm_autosp.config import JobConfig, to_yaml

log = logging.getLogger(__name__)


def tensorboard_dir(run_dir: Path) -> Path:
    return run_dir / "tensorboard"


class MetricsLogger:
    """Rank 0 writes; the other ranks' calls are no-ops, so the loop needs no rank checks."""

    def __init__(self, cfg: JobConfig, is_writer: bool, first_step: int = 0):
        self.cfg = cfg
        self.is_writer = is_writer
        self.writer: Optional[object] = None
        if is_writer and cfg.trace.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # A resumed run may have logged steps past its checkpoint before it stopped:
            # purge_step makes TensorBoard drop those, so curves have no duplicate steps.
            purge = first_step + 1 if first_step else None
            self.writer = SummaryWriter(str(tensorboard_dir(cfg.run.dir)), purge_step=purge)
            if not first_step:
                self.writer.add_text("config", f"```\n{to_yaml(cfg)}\n```", 0)

    def log_step(self, step: int, scalars: Dict[str, float]) -> None:
        if not self.is_writer:
            return
        if self.writer is not None:
            for tag, value in scalars.items():
                self.writer.add_scalar(tag, value, step)
        if step % self.cfg.train.log_every == 0 or step == self.cfg.train.steps:
            log.info(
                "step %d/%d | loss %.4f | lr %.2e | grad norm %.3f | %.0f tok/s | %.3f s/step | peak mem %.0f MiB",
                step,
                self.cfg.train.steps,
                scalars["train/loss"],
                scalars["train/lr"],
                scalars["train/grad_norm"],
                scalars["throughput/tokens_per_s"],
                scalars["time/step_s"],
                scalars["memory/peak_mib"],
            )

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak-memory window (on CPU: reset the process's resident high-water mark)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated bytes since the last reset (on CPU: the resident high-water mark)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
