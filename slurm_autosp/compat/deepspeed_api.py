"""DeepSpeed's private names that slurm_autosp uses (imported by the DeepSpeed engine only)."""

from __future__ import annotations

import deepspeed.ops

SHARED_MEMORY_COMM_OP = "deepspeed_shm_comm"


def skip_shared_memory_comm_build() -> None:
    """Keep DeepSpeed from JIT-building its shared-memory collective op when its communication
    backend starts on CPU ranks: about 50 s of C++ compilation on every fresh node (and a
    compiler on its image) for `inference_all_reduce`, which training never calls. DeepSpeed
    builds the op only where its per-process table of compatible ops says it may."""
    deepspeed.ops.__compatible_ops__[SHARED_MEMORY_COMM_OP] = False
