"""DeepSpeed's private names that slurm_autosp uses (imported by the DeepSpeed engine only)."""

from __future__ import annotations

import deepspeed.ops
from deepspeed.accelerator import get_accelerator

SHARED_MEMORY_COMM_BUILDER = "ShareMemCommBuilder"
SHARED_MEMORY_COMM_OP = "deepspeed_shm_comm"


def skip_shared_memory_comm_build() -> None:
    """Keep DeepSpeed from JIT-building its shared-memory collective op when its communication
    backend starts on CPU ranks: about 50 s of C++ compilation on every fresh node (and a
    compiler on its image) for `inference_all_reduce`, which training never calls. DeepSpeed
    builds the op only where its per-process table of compatible ops says it may. Accelerators
    without the op (CUDA, ROCm) are left alone: reading that table probes every op's toolchain,
    which DeepSpeed itself never does there."""
    if get_accelerator().create_op_builder(SHARED_MEMORY_COMM_BUILDER) is not None:
        deepspeed.ops.__compatible_ops__[SHARED_MEMORY_COMM_OP] = False
