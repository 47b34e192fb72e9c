"""How long a save takes, so submit can say when SLURM's warning comes too late for it.

After the pre-timeout signal a job has `cluster.signal_delay_s` to finish its step and save;
a save that takes longer is killed half-way and the run loses everything since the previous
checkpoint. Under ZeRO-1 rank 0 writes the most: the full model states plus its optimizer
shard; under parameter sharding every rank writes an equal part of the fp32 weights and Adam's
moments, all ranks at once.
"""

from __future__ import annotations

from slurm_autosp.config import JobConfig, Precision

_ADAM_BYTES = 12  # fp32 master weights, first and second moments, per parameter


def rank0_checkpoint_bytes(cfg: JobConfig, parameters: int, zero_stage: int) -> float:
    if zero_stage == 3:
        return parameters * _ADAM_BYTES / cfg.cluster.world_size
    weights = parameters * (2 if cfg.precision is Precision.bf16 else 4)
    return weights + parameters * _ADAM_BYTES / cfg.cluster.world_size


def signal_delay_warning(cfg: JobConfig, parameters: int, zero_stage: int) -> str | None:
    """A warning when the signal delay cannot cover one save (plus a step), else None."""
    size = rank0_checkpoint_bytes(cfg, parameters, zero_stage)
    seconds = size / (cfg.checkpoint.write_gb_per_s * 1e9)
    if cfg.cluster.signal_delay_s >= seconds * 1.5 + 30:
        return None
    return (
        f"cluster.signal_delay_s={cfg.cluster.signal_delay_s} may not cover one step plus one save: "
        f"rank 0 writes {size / 1e9:.1f} GB, about {seconds:.0f} s at checkpoint.write_gb_per_s="
        f"{cfg.checkpoint.write_gb_per_s}; raise cluster.signal_delay_s to at least {seconds * 1.5 + 30:.0f}"
    )
