"""The factor that makes a token-weighted SP loss survive an engine's gradient averaging."""


def loss_scale(world_size: int, grad_accum: int) -> float:
    """Multiply each rank's loss (its summed token loss / the step's global valid-label count)
    by this before backward, under an engine that averages over every rank and micro-batch.

    The sum of those per-rank losses over all ranks and micro-batches is the single-device
    loss of the whole step. DeepSpeed ZeRO-1 configured WITHOUT `sequence_parallel_size` treats
    every rank as data parallel: it averages gradients over all `world_size` ranks and divides
    by `grad_accum`, so the sum is recovered by scaling by world_size * grad_accum. (FSDP2
    divides by its mesh size only and sums micro-batches: its factor is the mesh size; see
    `slurm_autosp.engine.fsdp2`.)
    """
    if world_size < 1 or grad_accum < 1:
        raise ValueError(f"world_size={world_size} and grad_accum={grad_accum} must both be >= 1")
    return float(world_size * grad_accum)
