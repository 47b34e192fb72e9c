"""The AutoSP compiler: a torch.compile backend that makes an unchanged single-device
transformer DeepSpeed-Ulysses sequence parallel, with sequence-aware activation checkpointing
and sequence tiling. The ops its graphs call live in `slurm_autosp.sp`."""

from slurm_autosp.compile.backend import (
    AutoSPBackend,
    AutoSPCompileError,
    compile_with_inductor,
    rewrite_sdpa_for_sp,
)
from slurm_autosp.compile.compile_model import compile_model
from slurm_autosp.compile.hf_attention import SP_ATTENTION, use_sp_attention
from slurm_autosp.compile.layers import decoder_layers
from slurm_autosp.compile.tiled_layer import tile_layers
from slurm_autosp.compile.tiling import tile_mlps

__all__ = [
    "SP_ATTENTION",
    "AutoSPBackend",
    "AutoSPCompileError",
    "compile_model",
    "compile_with_inductor",
    "decoder_layers",
    "rewrite_sdpa_for_sp",
    "tile_layers",
    "tile_mlps",
    "use_sp_attention",
]
