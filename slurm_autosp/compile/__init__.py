"""AutoSP: a torch.compile backend that makes single-device transformer training
DeepSpeed-Ulysses sequence parallel."""

from slurm_autosp.compile.all_to_all import (
    current_sp_group,
    set_sp_group,
    sp_all_to_all,
    sp_group_context,
)
from slurm_autosp.compile.backend import (
    AutoSPBackend,
    AutoSPCompileError,
    compile_with_inductor,
    rewrite_sdpa_for_sp,
)
from slurm_autosp.compile.compile_model import compile_model
from slurm_autosp.compile.hf_attention import SP_ATTENTION, use_sp_attention
from slurm_autosp.compile.inputs import IGNORE_INDEX, SPBatch, prepare_sp_inputs
from slurm_autosp.compile.layers import decoder_layers
from slurm_autosp.compile.loss import loss_scale
from slurm_autosp.compile.tiled_layer import tile_layers
from slurm_autosp.compile.tiling import tile_mlps
from slurm_autosp.heads import valid_sp_sizes

__all__ = [
    "IGNORE_INDEX",
    "SP_ATTENTION",
    "AutoSPBackend",
    "AutoSPCompileError",
    "SPBatch",
    "compile_model",
    "compile_with_inductor",
    "current_sp_group",
    "decoder_layers",
    "loss_scale",
    "prepare_sp_inputs",
    "rewrite_sdpa_for_sp",
    "set_sp_group",
    "sp_all_to_all",
    "sp_group_context",
    "tile_layers",
    "tile_mlps",
    "use_sp_attention",
    "valid_sp_sizes",
]
