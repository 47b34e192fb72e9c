"""The plan's choices written into the run's config before the job starts: every rank, every
start and every requeue trains with what was planned at submission, even if the code, torch or
the plan's figures changed in between (the engines' checkpoints differ by ZeRO stage, and a
different policy, tiling or offload would change the memory the job was admitted with)."""

from __future__ import annotations

from dataclasses import replace

from slurm_autosp.config import ActivationCheckpointing, JobConfig
from slurm_autosp.memory_plan.choose import TrainingChoices

# The keys the plan (and, for the ring size, the config's loading) decided; `adopt_frozen_choices`
# copies exactly these.
FROZEN_KEYS = (
    ("parallel", "ring_size"),
    ("parallel", "zero_stage"),
    ("compile", "activation_checkpointing"),
    ("compile", "activation_memory_budget"),
    ("compile", "recompute_all_to_all"),
    ("compile", "tile_tokens"),
    ("compile", "offload_activations"),
    ("parallel", "offload_optimizer"),
    ("checkpoint", "async_save"),
    ("cluster", "stop_at"),
    ("checkpoint", "every_steps"),
)


def freeze_choices(cfg: JobConfig, choices: TrainingChoices) -> JobConfig:
    """`cfg` with every key the plan may decide set to what it decided, so no later start
    plans again (the ring size was resolved as the config was loaded, and is recorded with
    them; cluster.stop_at stays null where training decides it from its measured step). A new
    config: the loaded one is never edited."""
    spec = choices.checkpointing
    return replace(
        cfg,
        parallel=replace(
            cfg.parallel,
            zero_stage=choices.zero_stage,
            offload_optimizer=choices.offload_optimizer,
        ),
        compile=replace(
            cfg.compile,
            activation_checkpointing=spec.policy,
            activation_memory_budget=(
                spec.budget if spec.policy is ActivationCheckpointing.sac else None
            ),
            recompute_all_to_all=spec.recompute_all_to_all,
            tile_tokens=choices.tile_tokens,
            offload_activations=choices.offload_activations,
        ),
        checkpoint=replace(
            cfg.checkpoint,
            async_save=choices.async_save,
            every_steps=choices.save_every_steps,
        ),
        cluster=replace(cfg.cluster, stop_at=choices.stop_at),
    )


def adopt_frozen_choices(cfg: JobConfig, recorded: JobConfig) -> JobConfig:
    """`cfg` with the choices frozen into `recorded` (the config the run's first start wrote);
    a new config."""
    sections = {section for section, _ in FROZEN_KEYS}
    return replace(
        cfg,
        **{
            section: replace(
                getattr(cfg, section),
                **{
                    k: getattr(getattr(recorded, section), k)
                    for s, k in FROZEN_KEYS
                    if s == section
                },
            )
            for section in sections
        },
    )
