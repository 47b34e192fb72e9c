"""A pool rank's dims over its world, built once per split for the life of the pool.

Each gloo group keeps a thread polling its sockets until the process ends: a pool that built
new groups for each of its hundreds of cases spent most of its CPU time in those threads."""

import torch

from slurm_autosp.cluster.parallel_dims import ParallelDims, contiguous_parallel_dims

_built: dict[tuple[int, int], ParallelDims] = {}


def pool_dims(sp_size: int, ring_size: int = 1) -> ParallelDims:
    """`contiguous_parallel_dims` on CPU, the first time for this split; every rank calls it."""
    if (sp_size, ring_size) not in _built:
        _built[sp_size, ring_size] = contiguous_parallel_dims(
            sp_size, ring_size, torch.device("cpu")
        )
    return _built[sp_size, ring_size]
