"""Sequence tiling of each decoder layer's MLP, so that no full-sequence tensor of the MLP's
width exists, in forward or backward.

The MLP widens every token to its intermediate size (14,336 for Llama-8B, 3.5x the hidden
size), and its forward and backward each hold several [B, S, intermediate] tensors: at 64k
tokens per rank one of them is 1.75 GiB in bf16. Each token's MLP is independent of the others,
so the MLP runs over tiles of `tile_tokens` tokens along the sequence instead: forward computes
tile by tile without autograd and keeps only the MLP's input; backward recomputes each tile
with autograd and back-propagates it at once. At most one tile's intermediates (and their
gradients) are alive, for one extra MLP forward per step. The parameter gradients accumulate
tile by tile through the ordinary AccumulateGrad path (`torch.autograd.backward`), so
DeepSpeed's and FSDP2's gradient handling sees plain accumulation into `.grad`; the input's
gradient is assembled tile by tile.

The tiled MLP runs outside the compiled graphs (`torch.compiler.disable`): Dynamo will not
trace `torch.autograd.backward` in the backward (it breaks the graph there, and would compile
the tile loop as a graph of its own). Each compiled decoder layer therefore becomes two
graphs, before and after the MLP, and one such pair serves every layer. Only the MLPs' class
is swapped, for a subclass: parameter names and state_dict keys are unchanged.
"""

import torch

from slurm_autosp.compile.backend import AutoSPCompileError
from slurm_autosp.compile.layers import decoder_layers

MLP_ATTRIBUTE = "mlp"


def sequence_tiles(length: int, tile_tokens: int) -> list[slice]:
    """Slices of the sequence dim (dim 1 of the MLP's [batch, sequence, hidden] input)."""
    return [
        slice(start, min(start + tile_tokens, length)) for start in range(0, length, tile_tokens)
    ]


def _untiled(mlp: "SequenceTiled", x: torch.Tensor) -> torch.Tensor:
    """The MLP's own forward, without its hooks: those ran once around the tiles."""
    return super(SequenceTiled, mlp).forward(x)


class _TiledMLP(torch.autograd.Function):
    """mlp(x), tile by tile. `params` are inputs only so that the output requires grad whenever
    they do: their gradients go into .grad by the tiles' own backward, never through this node."""

    @staticmethod
    def forward(
        ctx, x: torch.Tensor, mlp: "SequenceTiled", tile_tokens: int, *params: torch.Tensor
    ) -> torch.Tensor:
        ctx.mlp, ctx.tile_tokens = mlp, tile_tokens
        ctx.save_for_backward(x)
        out = None
        for tile in sequence_tiles(x.shape[1], tile_tokens):
            y = _untiled(mlp, x[:, tile])
            if out is None:
                out = y.new_empty((*x.shape[:2], *y.shape[2:]))
            out[:, tile] = y
        assert out is not None, "an empty sequence has no tiles"
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (x,) = ctx.saved_tensors
        grad_x = torch.empty_like(x) if ctx.needs_input_grad[0] else None
        for tile in sequence_tiles(x.shape[1], ctx.tile_tokens):
            x_tile = x[:, tile].detach().requires_grad_(grad_x is not None)
            with torch.enable_grad():
                y = _untiled(ctx.mlp, x_tile)
            torch.autograd.backward(y, grad_out[:, tile])
            if grad_x is not None:
                grad_x[:, tile] = x_tile.grad
        return grad_x, None, None, *(None for _ in ctx.needs_input_grad[3:])


class SequenceTiled(torch.nn.Module):
    """Mixed into an MLP's class by `tile_mlps`: its forward runs the class's own over tiles.

    A subclass rather than a `forward` set on the instance: Dynamo guards a compiled layer on
    its MLP's type, so a graph compiled around a tiled MLP never runs an untiled one nor the
    reverse, whereas it guards an instance's `forward` only where it inlines it.
    """

    tile_tokens: int

    @torch.compiler.disable
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 3:
            raise ValueError(
                f"a sequence-tiled MLP takes [batch, sequence, hidden] inputs, got shape {tuple(x.shape)}"
            )
        params = [p for p in self.parameters() if p.requires_grad]
        return _TiledMLP.apply(x, self, self.tile_tokens, *params)


_tiled_classes: dict[type, type] = {}


def _tiled_class(cls: type) -> type:
    """One subclass per MLP class, so that all layers' MLPs share a type and one guard."""
    if cls not in _tiled_classes:
        _tiled_classes[cls] = type(f"SequenceTiled{cls.__name__}", (SequenceTiled, cls), {})
    return _tiled_classes[cls]


def _mlps(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Every decoder layer's `mlp`; the error names what was looked for where one is missing."""
    try:
        layers = decoder_layers(model)
    except AutoSPCompileError as err:
        raise AutoSPCompileError(
            f"MLP tiling tiles each decoder layer's `{MLP_ATTRIBUTE}`, and no decoder layers were found in "
            f"{type(model).__name__}: give it a `_no_split_modules` list naming its layer class, or leave "
            "its MLPs untiled (tile_tokens=0)"
        ) from err
    mlps = [getattr(layer, MLP_ATTRIBUTE, None) for layer in layers]
    missing = sorted(
        {
            type(layer).__name__
            for layer, mlp in zip(layers, mlps, strict=True)
            if not isinstance(mlp, torch.nn.Module)
        }
    )
    if missing:
        raise AutoSPCompileError(
            f"cannot tile the MLPs of {type(model).__name__}: its decoder layers {missing} have no "
            f"`{MLP_ATTRIBUTE}` submodule; leave its MLPs untiled (tile_tokens=0)"
        )
    return [mlp for mlp in mlps if isinstance(mlp, torch.nn.Module)]  # all of them, typed


def refuse_tiled_router_loss(model: torch.nn.Module) -> None:
    """A tile's forward runs without autograd and again in backward, so an MoE router's
    logits, which the model records for its load-balancing loss, would be recorded once per
    tile and pass, and without their gradient: refused by name, never trained wrongly."""
    if getattr(getattr(model, "config", None), "output_router_logits", False):
        raise AutoSPCompileError(
            "sequence tiling (compile.tile_tokens, or the memory plan's tiled rungs) does not "
            "record an MoE router's logits for its load-balancing loss "
            "(output_router_logits=true); set model.extra.output_router_logits=false, or "
            "compile.tile_tokens=0 with a plan that fits without tiling"
        )


def tile_mlps(model: torch.nn.Module, tile_tokens: int) -> None:
    """Make every decoder layer's MLP run over tiles of `tile_tokens` tokens, in place;
    applied again, it changes the tile size."""
    if tile_tokens < 1:
        raise ValueError(f"tile_tokens must be >= 1, got {tile_tokens}")
    refuse_tiled_router_loss(model)
    for mlp in _mlps(model):
        if not isinstance(mlp, SequenceTiled):
            mlp.__class__ = _tiled_class(type(mlp))
        assert isinstance(mlp, SequenceTiled)
        mlp.tile_tokens = tile_tokens
