"""DeepSpeed's private names that slurm_autosp uses (imported by the DeepSpeed engine only)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import deepspeed.ops
import torch
from deepspeed.accelerator import get_accelerator

SHARED_MEMORY_COMM_BUILDER = "ShareMemCommBuilder"
SHARED_MEMORY_COMM_OP = "deepspeed_shm_comm"
# the optimizer files of DeepSpeed's own checkpoint (save_checkpoint), one a rank, fp32 or bf16
OWN_FORMAT_OPTIMIZER_FILES = "*zero_pp_rank_*_optim_states.pt"


def skip_shared_memory_comm_build() -> None:
    """Keep DeepSpeed from JIT-building its shared-memory collective op when its communication
    backend starts on CPU ranks: about 50 s of C++ compilation on every fresh node (and a
    compiler on its image) for `inference_all_reduce`, which training never calls. DeepSpeed
    builds the op only where its per-process table of compatible ops says it may. Accelerators
    without the op (CUDA, ROCm) are left alone: reading that table probes every op's toolchain,
    which DeepSpeed itself never does there."""
    if get_accelerator().create_op_builder(SHARED_MEMORY_COMM_BUILDER) is not None:
        deepspeed.ops.__compatible_ops__[SHARED_MEMORY_COMM_OP] = False


@dataclass(frozen=True)
class Fragment:
    """The piece of one parameter this rank's ZeRO partition holds: `numel` elements from
    `start` of the flattened parameter, at `offset` in param group `group`'s flat partition."""

    group: int
    start: int
    numel: int
    offset: int


class ZeroPartition:
    """One rank's share of ZeRO-1's optimizer: DeepSpeedZeroOptimizer's (fp32, or bf16 with the
    optimizer offloaded) or BF16_Optimizer's (bf16). Both flatten each param group, cut the flat tensor into
    one equal slice a rank, keep that slice's fp32 master weights as the one parameter of the
    group the wrapped torch optimizer steps (its state, Adam's moments, shaped alike), and link
    each model parameter to its piece of the slice (`_hp_mapping`, deepspeed/utils/
    tensor_fragment.py). The same links serve DeepSpeed's universal checkpoint."""

    def __init__(self, zero_optimizer: Any):
        self._zero = zero_optimizer

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The wrapped torch optimizer, which steps the flat partitions."""
        optimizer: torch.optim.Optimizer = self._zero.optimizer
        return optimizer

    def flat_partitions(self) -> list[torch.Tensor]:
        """Each param group's flat fp32 master weights on this rank (in host memory when the
        optimizer is offloaded)."""
        return [group["params"][0] for group in self.optimizer.param_groups]

    @staticmethod
    def fragment(param: torch.nn.Parameter) -> Fragment | None:
        """What this rank's partition holds of `param`; None when nothing."""
        mapping = getattr(param, "_hp_mapping", None)
        if mapping is None:
            return None
        return Fragment(
            group=mapping.param_group_index,
            start=mapping.lp_fragment_address.start,
            numel=mapping.lp_fragment_address.numel,
            offset=mapping.hp_fragment_address.start,
        )

    @staticmethod
    def own_format_ranks(checkpoint: Path) -> int:
        """How many ranks' partitions DeepSpeed's own checkpoint (its save_checkpoint's tag
        directory) holds."""
        return len(list(checkpoint.glob(OWN_FORMAT_OPTIMIZER_FILES)))

    def update_lp_params(self) -> None:
        """Collective: the model's weights from the fp32 masters, as after every step: each
        rank casts its slice into the module's flat weights, then they are all-gathered."""
        self._zero.update_lp_params()
