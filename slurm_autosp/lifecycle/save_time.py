"""Whether SLURM's signals come early enough for a job to stop and save.

After the pre-timeout signal (USR2, `--signal=USR2@cluster.signal_delay_s`), or SIGTERM on
preemption (SIGKILL follows after the partition's GraceTime), a job stops stepping, then
every rank saves synchronously what is not on storage yet; a job still stepping or saving
when the kill comes loses everything since the previous checkpoint. Where it stops: at the
end of the step in flight (`cluster.stop_at=step`), or at the next decoder-layer boundary
(`layer`, lifecycle/layer_stops.py: the ranks agree within two boundaries, so within two
layers' share of a step); during an evaluation, at the end of the batch in flight (a forward
alone). So the delay, and GraceTime, must cover the longer of those plus one save, with a
margin: both are estimates.

The save: under ZeRO-1 rank 0 writes the most, the full model states plus its optimizer
shard; under parameter sharding every rank writes an equal part of the fp32 weights and Adam's
moments, all ranks at once. The step: measured on the job's own nodes when a run has recorded
one (`StepTime`, written by training and by the probe), else estimated by the caller.

At run time the same margin decides how long a stopping job may wait for an asynchronous save
still being written (`can_wait`): as long as what is left before the kill still covers the
synchronous save that follows it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from slurm_autosp.config import MAX_SIGNAL_DELAY_S, ConfigError, JobConfig, Precision, StopAt
from slurm_autosp.lifecycle.layer_stops import long_step_s
from slurm_autosp.lifecycle.run_record import read_record, write_record

_ADAM_BYTES = 12  # fp32 master weights, first and second moments, per parameter
# needed delay = MARGIN x (stop + save) + SLACK_S: the step and the save are estimates (a slower
# step, a busier file system), and the slack covers the signal reaching every rank, their
# agreement and the checkpoint's checksums, manifest and rename
MARGIN = 1.25
SLACK_S = 30


class SignalDelayTooShort(ConfigError):
    """cluster.signal_delay_s cannot cover one step plus one synchronous save."""


def rank0_checkpoint_bytes(cfg: JobConfig, parameters: int, zero_stage: int) -> float:
    """What the rank writing the most saves: `parameters` are those a checkpoint holds, every
    one, or a LoRA run's adapters (its frozen base is never saved)."""
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
        write_record(self, path)

    @classmethod
    def read(cls, path: Path) -> StepTime | None:
        return read_record(
            cls,
            path,
            "a measured step",
            lambda r: r.seconds > 0 and r.flops_per_step > 0 and r.world_size > 0,
        )

    def scaled_to(self, flops_per_step: float, world_size: int) -> float:
        """The step of a job doing `flops_per_step` over `world_size` ranks at the throughput
        per rank this one measured."""
        return (
            self.seconds * (flops_per_step / world_size) / (self.flops_per_step / self.world_size)
        )


@dataclass(frozen=True)
class SignalDelay:
    """cluster.signal_delay_s against the stop (the step in flight, or two of its layers, or an
    evaluation's batch in flight, whichever is longer) plus one synchronous save, with the
    margin."""

    delay_s: int  # cluster.signal_delay_s
    step_s: float
    step_source: str  # how the step time was measured or estimated
    save_bytes: float  # what the rank writing the most writes
    write_gb_per_s: float  # checkpoint.write_gb_per_s
    layers: int  # decoder layers
    stop_at: StopAt | None  # cluster.stop_at; None: at step ends until a measured step is long
    # a micro-batch's share of the step that its forward takes, when the job evaluates (an
    # evaluation batch is that forward); 0: it evaluates nothing
    forward_share: float
    micro_batches: int  # train.grad_accum

    @property
    def stop_at_layers(self) -> bool:
        return self.stop_at is StopAt.layer

    @property
    def save_s(self) -> float:
        return self.save_bytes / (self.write_gb_per_s * 1e9)

    @property
    def stop_s(self) -> float:
        """From the signal to every rank stopped: the step in flight, or two layer boundaries."""
        return 2 * self.step_s / self.layers if self.stop_at_layers else self.step_s

    @property
    def eval_batch_s(self) -> float:
        """An evaluation batch: one micro-batch's forward, no backward."""
        return self.step_s / self.micro_batches * self.forward_share

    @property
    def wait_s(self) -> float:
        """From the signal to every rank stopped, in a step or in an evaluation."""
        return max(self.stop_s, self.eval_batch_s)

    @property
    def needed_s(self) -> int:
        return math.ceil(MARGIN * (self.wait_s + self.save_s) + SLACK_S)

    @property
    def covered(self) -> bool:
        return self.delay_s >= self.needed_s

    @property
    def what(self) -> str:
        if self.eval_batch_s > self.stop_s:
            return "one evaluation batch"
        return "two layers of a step" if self.stop_at_layers else "one step"

    def describe(self) -> str:
        """The figures, as the plan prints them and a refusal names them."""
        stop = (
            f"  stop: at the next layer boundary (cluster.stop_at=layer), within 2 of "
            f"{self.layers} layers' share of the step: {self.stop_s:,.1f} s\n"
            if self.stop_at_layers
            else "  stop: at the end of the step in flight (cluster.stop_at=step)\n"
            if self.stop_at is StopAt.step
            else "  stop: at the end of the step in flight (cluster.stop_at=null), at the next "
            f"layer boundary once a step measures {long_step_s(self.delay_s):g} s or more\n"
        )
        evaluation = (
            f"  evaluation: a stop waits for the batch in flight, one micro-batch's forward: "
            f"estimated as its share of the step, the plan's forward FLOPs over forward, "
            f"backward and recompute ({self.forward_share:.0%}): {self.eval_batch_s:,.1f} s\n"
            if self.forward_share
            else ""
        )
        return (
            f"  step: {self.step_s:,.1f} s, {self.step_source}\n{stop}{evaluation}"
            f"  save: rank 0 writes {self.save_bytes / 1e9:.1f} GB, {self.save_s:,.1f} s at "
            f"checkpoint.write_gb_per_s={self.write_gb_per_s:g}\n"
            f"  needed: {MARGIN:g} x ({'the longer wait' if self.forward_share else 'stop'} + "
            f"save) + {SLACK_S} s = {self.needed_s:,} s; a "
            f"preempted job needs as much GraceTime after SIGTERM"
        )

    def line(self) -> str:
        verdict = "covers" if self.covered else "CANNOT cover"
        return (
            f"signal delay: cluster.signal_delay_s={self.delay_s} {verdict} {self.what} plus one "
            f"synchronous save after SLURM's pre-timeout signal\n{self.describe()}"
        )

    def refusal(self) -> str:
        fix = (
            f"set cluster.signal_delay_s={self.needed_s} or more"
            if self.needed_s <= MAX_SIGNAL_DELAY_S
            else (
                f"it would need cluster.signal_delay_s={self.needed_s}, more than SLURM sends its "
                f"signal ahead ({MAX_SIGNAL_DELAY_S} s): "
                + ("" if self.stop_at_layers else "stop within the step (cluster.stop_at=layer), ")
                + "shorten the step (each sequence over more GPUs: parallel.sp_size and "
                "cluster.nodes), or measure it with the probe if the estimate is too slow"
            )
        )
        return (
            f"cluster.signal_delay_s={self.delay_s} cannot cover {self.what} plus one "
            f"synchronous save after SLURM's pre-timeout signal (USR2): {fix}\n{self.describe()}"
        )


def signal_delay(
    cfg: JobConfig,
    parameters: int,
    zero_stage: int,
    step_s: float,
    step_source: str,
    layers: int,
    stop_at: StopAt | None,
    forward_share: float,
) -> SignalDelay:
    """`forward_share`: a micro-batch's forward over its step, where the job evaluates; else 0."""
    return SignalDelay(
        cfg.cluster.signal_delay_s,
        step_s,
        step_source,
        rank0_checkpoint_bytes(cfg, parameters, zero_stage),
        cfg.checkpoint.write_gb_per_s,
        layers,
        stop_at,
        forward_share,
        cfg.train.grad_accum,
    )


def can_wait(left_s: float | None, save_s: float) -> bool:
    """Whether a stopping job may go on waiting for a save in flight: the time left before the
    kill (`left_s`; None: not known, and the save in flight is waited for) still covers a
    synchronous save of `save_s` after it, with admission's margin and slack."""
    return left_s is None or left_s >= MARGIN * save_s + SLACK_S
