"""Whether SLURM's pre-timeout signal comes early enough for a job to finish its step and save.

After the signal (USR2, `--signal=USR2@cluster.signal_delay_s`) a job finishes the optimizer
step it is in, then every rank saves synchronously; a job still stepping or saving when the
time limit strikes is killed, and the run loses everything since the previous checkpoint. So
the delay must cover one whole step plus one save, with a margin: both are estimates.

The save: under ZeRO-1 rank 0 writes the most, the full model states plus its optimizer
shard; under parameter sharding every rank writes an equal part of the fp32 weights and Adam's
moments, all ranks at once. The step: measured on the job's own nodes when a run has recorded
one (`StepTime`, written by training and by the probe), else estimated by the caller.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from slurm_autosp.config import MAX_SIGNAL_DELAY_S, ConfigError, JobConfig, Precision

_ADAM_BYTES = 12  # fp32 master weights, first and second moments, per parameter
# needed delay = MARGIN x (step + save) + SLACK_S: the step and the save are estimates (a slower
# step, a busier file system), and the slack covers the signal reaching every rank, their
# agreement at the step boundary and the checkpoint's checksums, manifest and rename
MARGIN = 1.25
SLACK_S = 30


class SignalDelayTooShort(ConfigError):
    """cluster.signal_delay_s cannot cover one step plus one synchronous save."""


def rank0_checkpoint_bytes(cfg: JobConfig, parameters: int, zero_stage: int) -> float:
    if zero_stage == 3:
        return parameters * _ADAM_BYTES / cfg.cluster.world_size
    weights = parameters * (2 if cfg.precision is Precision.bf16 else 4)
    return weights + parameters * _ADAM_BYTES / cfg.cluster.world_size


@dataclass(frozen=True)
class StepTime:
    """An optimizer step measured on a job's own nodes, as a run directory records it
    (RunDir.step_time). A job of another shape (the probe at fewer layers, another batch)
    scales it by its FLOPs per rank (`scaled_to`)."""

    seconds: float  # the median of the timed steps (a job's first step, which compiles, excluded)
    steps: int  # how many timed steps the median is of
    flops_per_step: float  # model FLOPs of the step measured, all ranks together (metrics.flops)
    world_size: int
    measured_by: str  # "training" or "the probe"

    def write(self, path: Path) -> None:
        """Atomically: a reader sees the previous record or this one, never half of one."""
        partial = path.with_name(f".{path.name}.{os.getpid()}")
        partial.write_text(json.dumps(asdict(self), indent=1) + "\n")
        os.replace(partial, path)

    @classmethod
    def read(cls, path: Path) -> StepTime | None:
        """The record at `path`; None when there is none. One that does not read as a record
        is refused by name rather than ignored: the check it feeds would silently change."""
        try:
            fields = json.loads(path.read_text())
            record = cls(**fields)
            valid = record.seconds > 0 and record.flops_per_step > 0 and record.world_size > 0
        except FileNotFoundError:
            return None
        except (OSError, ValueError, TypeError) as err:
            raise ConfigError(f"{path}: not a step-time record ({err}); delete it") from err
        if not valid:
            raise ConfigError(f"{path}: not a step-time record ({fields}); delete it")
        return record

    def scaled_to(self, flops_per_step: float, world_size: int) -> float:
        """The step of a job doing `flops_per_step` over `world_size` ranks at the throughput
        per rank this one measured."""
        return (
            self.seconds * (flops_per_step / world_size) / (self.flops_per_step / self.world_size)
        )


@dataclass(frozen=True)
class SignalDelay:
    """cluster.signal_delay_s against one step plus one synchronous save, with the margin."""

    delay_s: int  # cluster.signal_delay_s
    step_s: float
    step_source: str  # how the step time was measured or estimated
    save_bytes: float  # what the rank writing the most writes
    write_gb_per_s: float  # checkpoint.write_gb_per_s

    @property
    def save_s(self) -> float:
        return self.save_bytes / (self.write_gb_per_s * 1e9)

    @property
    def needed_s(self) -> int:
        return math.ceil(MARGIN * (self.step_s + self.save_s) + SLACK_S)

    @property
    def covered(self) -> bool:
        return self.delay_s >= self.needed_s

    def describe(self) -> str:
        """The figures, as the plan prints them and a refusal names them."""
        return (
            f"  step: {self.step_s:,.1f} s, {self.step_source}\n"
            f"  save: rank 0 writes {self.save_bytes / 1e9:.1f} GB, {self.save_s:,.1f} s at "
            f"checkpoint.write_gb_per_s={self.write_gb_per_s:g}\n"
            f"  needed: {MARGIN:g} x (step + save) + {SLACK_S} s = {self.needed_s:,} s"
        )

    def line(self) -> str:
        verdict = "covers" if self.covered else "CANNOT cover"
        return (
            f"signal delay: cluster.signal_delay_s={self.delay_s} {verdict} one step plus one "
            f"synchronous save after SLURM's pre-timeout signal\n{self.describe()}"
        )

    def refusal(self) -> str:
        fix = (
            f"set cluster.signal_delay_s={self.needed_s} or more"
            if self.needed_s <= MAX_SIGNAL_DELAY_S
            else (
                f"it would need cluster.signal_delay_s={self.needed_s}, more than SLURM sends its "
                f"signal ahead ({MAX_SIGNAL_DELAY_S} s): shorten the step (each sequence over "
                "more GPUs: parallel.sp_size and cluster.nodes), or measure it with the probe "
                "if the estimate is too slow"
            )
        )
        return (
            f"cluster.signal_delay_s={self.delay_s} cannot cover one step plus one synchronous "
            f"save after SLURM's pre-timeout signal (USR2): {fix}\n{self.describe()}"
        )


def signal_delay(
    cfg: JobConfig, parameters: int, zero_stage: int, step_s: float, step_source: str
) -> SignalDelay:
    return SignalDelay(
        cfg.cluster.signal_delay_s,
        step_s,
        step_source,
        rank0_checkpoint_bytes(cfg, parameters, zero_stage),
        cfg.checkpoint.write_gb_per_s,
    )
