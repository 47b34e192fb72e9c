"""The factor that makes a token-weighted SP loss survive an engine's gradient reduction: one
place for every engine's, so the reductions the engines do are written down side by side."""


def loss_scale(world_size: int, grad_accum: int, *, averages_micro_batches: bool = True) -> float:
    """Multiply each rank's loss (its summed token loss / the step's global valid-label count)
    by this before backward; the sum of those per-rank losses over all ranks and micro-batches
    is the single-device loss of the whole step.

    DeepSpeed ZeRO-1 configured WITHOUT `sequence_parallel_size` treats every rank as data
    parallel: it averages gradients over all `world_size` ranks and divides by `grad_accum`, so
    the sum is recovered by scaling by world_size * grad_accum. FSDP2 divides the
    reduce-scattered gradient by its mesh size and sums micro-batches
    (`averages_micro_batches=False`): its factor is the mesh size.
    """
    if world_size < 1 or grad_accum < 1:
        raise ValueError(f"world_size={world_size} and grad_accum={grad_accum} must both be >= 1")
    return float(world_size * grad_accum if averages_micro_batches else world_size)
