"""Finding the decoder layers of an HF model: what per-layer compilation compiles, MLP tiling
tiles and FSDP2 shards."""

import torch

from slurm_autosp.compile.backend import AutoSPCompileError


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of an HF model: the modules its `_no_split_modules` names.

    A class is matched along its MRO, so layers FSDP2's `fully_shard` has already wrapped
    (it swaps in a subclass named FSDP<Layer>) are still found.
    """
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if any(c.__name__ in names for c in type(m).__mro__)]
    if not layers:
        raise AutoSPCompileError(
            f"cannot find the decoder layers of {type(model).__name__} for per-layer compilation "
            f"(looked for modules named in _no_split_modules={sorted(names)}); compile the whole "
            "model instead (per_layer=False)"
        )
    return layers
