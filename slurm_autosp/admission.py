"""Admission: every check a job passes before it is queued or started, composed once, in one
order, for every command. Each check lives with what it is about (the attention refusal with
the model, the token-file check with the data, the layout with the cluster, the verdict with
the plan); here they are only put together, so submit, the probe (through submit), a
hand-submitted rank (`run`), `plan` and `verify` cannot drift apart in what they refuse.

Stages, for the commands that need only a part:
  admit_model: the model computes exactly under AutoSP (plan, verify, and everything below);
  admit_data:  the token data reads and fits the model's vocabulary;
  admit:       both, the layout, then the plan's verdict with its choices (and the layout's
               Ulysses x ring split) frozen into the
               config (or, on a requeue, the choices the run's first start froze, adopted),
               the signal delay that must leave a checkpointing job time for a step and a
               save, and the checkpoint the job would resume from is this run's.
"""

from __future__ import annotations

from dataclasses import dataclass

from slurm_autosp.checkpoint.identity import run_settings
from slurm_autosp.checkpoint.store import refuse_another_runs_checkpoint
from slurm_autosp.cluster.layout import ParallelLayout
from slurm_autosp.cluster.placement import layout_for
from slurm_autosp.config import ConfigError, JobConfig
from slurm_autosp.data import check_token_file
from slurm_autosp.lifecycle.run_dir import RunDir
from slurm_autosp.lifecycle.save_time import SignalDelayTooShort
from slurm_autosp.memory_plan import PlanVerdict, plan_verdict, training_choices
from slurm_autosp.memory_plan.freeze import adopt_frozen_choices, freeze_choices
from slurm_autosp.model import model_vocab_size
from slurm_autosp.model_refusals import refuse_tiled_router_loss, refuse_unsupported_attention

ADOPTED = (
    "memory plan: not planned again: a requeued start trains with the choices its first start "
    "froze into the run's config"
)


@dataclass(frozen=True)
class Admission:
    """A config that passed every check before queueing: `cfg` with the plan's choices frozen
    into it (every rank and every requeue trains with them), the layout it gets, and the plan's
    verdict. Whether it fits stays a verdict, not a refusal, so a dry run can print a plan that
    does not fit; `refuse_unless_fits` is the refusal."""

    cfg: JobConfig
    layout: ParallelLayout
    plan: PlanVerdict

    def refuse_unless_fits(self) -> None:
        """Refuse a job that does not fit, with why and the plan as printed."""
        if not self.plan.fits:
            raise ConfigError(f"{self.plan.reason}\n{self.plan.text}")


def admit_model(cfg: JobConfig, seq_len: int | None = None) -> None:
    """The model trains exactly under AutoSP at `seq_len` (default data.seq_len): what every
    command refuses first, since no other answer means anything for a model computed wrongly."""
    refuse_unsupported_attention(cfg, seq_len)


def admit_data(cfg: JobConfig) -> None:
    """The data the job reads is there and fits the vocabulary of the model actually trained,
    checked here rather than after the job's wait in the queue."""
    check_token_file(cfg, model_vocab_size(cfg.model))


def admit(
    cfg: JobConfig, recorded: JobConfig | None = None, saves_checkpoints: bool = True
) -> Admission:
    """Every check before a job is queued or started, each once, in order: the model, the
    data, the layout, the plan, whose choices are frozen into `cfg`, the signal delay, then the
    checkpoint the job would resume from (another run's is refused here, not after the wait in
    the queue). Raises ConfigError.

    The signal delay: a GPU job whose `cluster.signal_delay_s` cannot cover one step (measured,
    or estimated from its FLOPs: memory_plan.step_time) plus one synchronous save is refused
    with SignalDelayTooShort, naming the delay that would, and the plan. Not checked: CPU jobs
    and model.builder jobs (no plan), a job that `saves_checkpoints=False` (the probe, which
    measures the step this check holds the run to and saves nothing), a requeue, and a job
    that does not fit its GPUs (`refuse_unless_fits` refuses it for that).

    `recorded` is the config the run's first start wrote (a requeued hand-submitted start):
    its frozen choices are adopted and nothing is planned, so a requeue is never refused by a
    plan that changed since (code, torch or the plan's figures, or the step its first start
    measured)."""
    if recorded is not None:
        cfg = adopt_frozen_choices(cfg, recorded)
    admit_model(cfg)
    admit_data(cfg)
    layout = layout_for(cfg)
    if recorded is not None:
        # the adopted choices are concrete, so reading them back plans nothing
        plan = PlanVerdict(ADOPTED, True, "", training_choices(cfg))
    else:
        plan = plan_verdict(cfg)
        cfg = freeze_choices(cfg, plan.choices)
    refuse_tiled_router_loss(cfg.model, plan.choices.tile_tokens)
    if plan.late and plan.fits and saves_checkpoints:  # not fitting is refused first, by name
        raise SignalDelayTooShort(f"{plan.late}\n{plan.text}")
    refuse_another_runs_checkpoint(
        RunDir(cfg.run.dir).checkpoints, run_settings(cfg, layout, plan.choices.zero_stage)
    )
    return Admission(cfg, layout, plan)
