"""The sequence-parallel runtime: what a compiled SP graph calls and what feeds it. The
Ulysses all-to-all and ring attention, the attention ops (packed documents, windows, their CUDA kernel's check),
a batch sharded over the SP ranks, the chunked loss and its engine factor, activation offload,
and one SP step over them (`step`: every caller's shard, label count, loss and backward)."""

from slurm_autosp.sp.all_to_all import (
    communication_counts,
    current_ring_group,
    current_sp_group,
    set_sp_group,
    set_sp_groups,
    sp_all_to_all,
    sp_group_context,
)
from slurm_autosp.sp.inputs import IGNORE_INDEX, SPBatch, prepare_sp_inputs, sp_token_positions
from slurm_autosp.sp.loss import loss_scale

__all__ = [
    "IGNORE_INDEX",
    "SPBatch",
    "communication_counts",
    "current_ring_group",
    "current_sp_group",
    "loss_scale",
    "prepare_sp_inputs",
    "set_sp_group",
    "set_sp_groups",
    "sp_all_to_all",
    "sp_group_context",
    "sp_token_positions",
]
