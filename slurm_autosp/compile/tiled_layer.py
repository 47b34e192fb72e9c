"""Sequence tiling of whole decoder layers: outside attention nothing spans the full sequence.

Under `full` checkpointing a layer keeps only its input and recomputes the rest in backward,
attention included; what still spans the whole local sequence is the recomputation's working
set: the norms in fp32, q, k, v, RoPE, the o projection, the residuals (about 120 KB per token
for Llama-8B in bf16, more than the layer's input and output together). All of it but attention
is token-wise, so a tiled layer runs it in tiles of `tile_tokens` tokens:

- forward: (1) the layer's own forward runs on each tile until it calls attention, which records
  the tile's q, k, v and stops it (`_AttentionReached`); (2) Ulysses attention (ring attention after the
  Ulysses all-to-all under a ring, whose output and log-sum-exp are kept for the backward, so
  the ring never runs again) runs once over the
  whole q, k, v (all-to-alls in chunks of a tile, so their buffers are a tile's, not the
  sequence's); (3) the layer's forward runs on each tile again, its attention call answered with
  that tile's slice of the attention output. Only the layer's input is kept for backward.
- backward: (1) and (2) again, attention with autograd; (3) with autograd tile by tile, giving
  the gradients of the tile's input and attention output; attention's backward once; then (1)
  with autograd tile by tile, back-propagating the q, k, v gradients. Parameter gradients
  accumulate tile by tile into `.grad` (as compile.tiling's MLP does), so DeepSpeed and FSDP2
  see plain accumulation.

At most one tile's intermediates live at a time; at full width there are only attention's
inputs, output and gradients (q, k, v, o, lse and their gradients) and the layer's input and
gradients. The price is the q, k, v projections run four times instead of twice per step.

The layer's tiles are compiled with the AutoSP backend (one function for all layers, its graphs
broken at the attention call); the layer itself runs outside compiled code. The model's
attention goes to `TILED_ATTENTION`, which only answers inside a tiled layer's pass. Only the
layers' class is swapped, for a subclass: parameter names and state_dict keys are unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import AttentionInterface, PreTrainedModel

from slurm_autosp.compile.activation_checkpointing import ActivationCheckpointSpec
from slurm_autosp.compile.backend import AutoSPBackend, AutoSPCompileError, HeadLayout
from slurm_autosp.compile.hf_attention import SP_ATTENTION, TILED_ATTENTION
from slurm_autosp.compile.layers import decoder_layers
from slurm_autosp.compile.tiling import refuse_tiled_router_loss, sequence_tiles
from slurm_autosp.config import ActivationCheckpointing
from slurm_autosp.sp.all_to_all import sp_all_to_all
from slurm_autosp.sp.attention_pattern import check_attention_call
from slurm_autosp.sp.ring_attention import ring_attention, ring_attention_backward

_HEADS, _SEQ = 1, 2  # of attention's [batch, heads, sequence, head_dim] tensors
_TOKEN_KWARGS = ("position_ids", "cache_position")  # per-token layer arguments, sliced per tile
# the loss's arguments, which HF passes down to every layer and no layer reads: passed whole
_LOSS_KWARGS = ("labels", "shift_labels", "num_items_in_batch")


def tiles_whole_layers(spec: ActivationCheckpointSpec) -> bool:
    """Whether sequence tiling under `spec` tiles whole layers: under `full`, which keeps only a
    layer's input anyway; the other policies keep attention's tensors, and tile only the MLPs."""
    return spec.policy is ActivationCheckpointing.full


class _AttentionReached(Exception):
    """Stops a tile's forward at its attention call, once its q, k, v are recorded."""


@dataclass
class _AttentionTap:
    """What the attention call of the running tile does: record q, k, v and stop the tile
    (`answer` None), or return `answer`, the tile's slice of the whole attention output."""

    answer: torch.Tensor | None = None
    qkv: tuple[torch.Tensor, ...] = ()
    scaling: float | None = None
    module: torch.nn.Module | None = None


_tap: _AttentionTap | None = None


@contextmanager
def _tapping(tap: _AttentionTap) -> Iterator[_AttentionTap]:
    global _tap
    previous, _tap = _tap, tap
    try:
        yield tap
    finally:
        _tap = previous


@torch.compiler.disable
def _tiled_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The attention function of a model whose layers are tiled: serves the running tile."""
    if _tap is None:
        raise AutoSPCompileError(
            f"{type(module).__name__} called attention outside a tiled decoder layer; a model whose "
            "layers are tiled (tile_layers) attends only through them"
        )
    check_attention_call(module, kwargs)
    if attention_mask is not None or dropout:
        raise AutoSPCompileError(
            f"{type(module).__name__} passed an attention mask or dropout={dropout} to a tiled layer: "
            "tiled layers attend causally without a mask, and recompute attention, which dropout "
            "would make differ from the forward (set attention_dropout=0)"
        )
    if kwargs.get("cu_seq_lens_q") is not None:
        raise AutoSPCompileError(
            f"{type(module).__name__} got packed documents or left padding in a tiled layer: tiled "
            "layers attend causally over the whole row only; train packed documents without tiled "
            "layers (compile.tile_tokens=0, or compile.activation_checkpointing other than full)"
        )
    if _tap.answer is not None:
        return _tap.answer, None
    _tap.qkv, _tap.scaling, _tap.module = (query, key, value), scaling, module
    raise _AttentionReached


AttentionInterface.register(TILED_ATTENTION, _tiled_attention)


def _heads_to_sequence(x: torch.Tensor, sp_size: int, chunk: int) -> torch.Tensor:
    """[B, H, S/P, D] -> [B, H/P, S, D] as sp_all_to_all(x, 1, 2), in chunks of `chunk` local
    tokens: chunk c of every rank's shard lands at its rank's block of the sequence."""
    if sp_size == 1:
        return x
    b, h, local, d = x.shape
    out = x.new_empty(b, h // sp_size, sp_size * local, d)
    blocks = out.view(b, h // sp_size, sp_size, local, d)
    for piece in sequence_tiles(local, chunk):
        part = sp_all_to_all(x[:, :, piece].contiguous(), _HEADS, _SEQ, sp_size)
        blocks[:, :, :, piece] = part.view(b, h // sp_size, sp_size, -1, d)
    return out


def _sequence_to_heads(x: torch.Tensor, sp_size: int, chunk: int) -> torch.Tensor:
    """[B, H/P, S, D] -> [B, H, S/P, D], the inverse of _heads_to_sequence, in the same chunks."""
    if sp_size == 1:
        return x
    b, local_heads, seq, d = x.shape
    local = seq // sp_size
    blocks = x.view(b, local_heads, sp_size, local, d)
    out = x.new_empty(b, local_heads * sp_size, local, d)
    for piece in sequence_tiles(local, chunk):
        part = blocks[:, :, :, piece].reshape(b, local_heads, -1, d)
        out[:, :, piece] = sp_all_to_all(part, _SEQ, _HEADS, sp_size)
    return out


@dataclass
class _Attention:
    """One layer's attention over the whole sequence: its inputs after the all-to-alls (leaves,
    with autograd when `grad`), its output there and on this rank's tokens.

    Under a ring (`ring_size` > 1) the all-to-alls span the Ulysses group and attention is ring
    attention over the ring's blocks; its (output, log-sum-exp) from the forward pass (`ring`)
    serve the backward pass, which never runs the ring's forward again: the backward's q, k, v
    are recomputed tile by tile as without a ring, and ring attention's backward reads them."""

    layout: HeadLayout
    chunk: int
    ring_size: int = 1
    ring: tuple[torch.Tensor, torch.Tensor] | None = None  # the ring's (output, log-sum-exp)
    scale: float = 1.0
    qkv: list[torch.Tensor] = field(default_factory=list)
    output: torch.Tensor | None = None  # [B, H/P, S, D]
    local_output: torch.Tensor | None = None  # [B, S/P, H, D], as HF's attention returns it

    def run(self, tap: _AttentionTap, grad: bool) -> None:
        """All-to-all the recorded q, k, v (KV heads repeated as the SDPA rewrite does), attend.
        Each tensor is dropped once used; without `grad` only the local output is kept."""
        sp, repeat = self.layout.sp_size, self.layout.kv_repeat
        pending = list(tap.qkv)
        tap.qkv = ()
        while pending:
            t = pending.pop(0)
            if repeat > 1 and self.qkv:  # key and value
                t = t.repeat_interleave(repeat, dim=_HEADS)
            self.qkv.append(_heads_to_sequence(t, sp, self.chunk).requires_grad_(grad))
            del t
        query, key, value = self.qkv
        self.scale = tap.scaling if tap.scaling is not None else query.shape[-1] ** -0.5
        if self.ring_size > 1:
            if self.ring is None:
                with torch.no_grad():
                    self.ring = ring_attention(query, key, value, self.scale, self.ring_size)
            output = self.ring[0]
        else:
            with torch.set_grad_enabled(grad):
                output = torch.nn.functional.scaled_dot_product_attention(
                    query,
                    key,
                    value,
                    is_causal=True,
                    scale=self.scale,
                    enable_gqa=self.layout.local_grouped,
                )
        del query, key, value
        if not grad:
            self.qkv = []
        self.local_output = _sequence_to_heads(output.detach(), sp, self.chunk).transpose(1, 2)
        self.output = output if grad else None

    def to_sequence(self, grad_local_output: torch.Tensor) -> torch.Tensor:
        """The local output's gradient [B, S/P, H, D] as the whole output's [B, H/P, S, D]."""
        return _heads_to_sequence(
            grad_local_output.transpose(1, 2), self.layout.sp_size, self.chunk
        )

    def backward(self, grad_output: torch.Tensor) -> list[torch.Tensor]:
        """The gradients of the recorded q, k, v on this rank's tokens, from the whole output's;
        frees attention's tensors as it goes."""
        sp, repeat = self.layout.sp_size, self.layout.kv_repeat
        assert self.output is not None, "attention ran without autograd"
        if self.ring is not None:
            output, logsumexp = self.ring
            self.ring = None
            for leaf, grad in zip(
                self.qkv,
                ring_attention_backward(
                    grad_output, *self.qkv, output, logsumexp, self.scale, self.ring_size
                ),
                strict=True,
            ):
                leaf.grad = grad
        else:
            torch.autograd.backward(self.output, grad_output)
        self.output = None
        grads: list[torch.Tensor] = []
        while self.qkv:
            leaf = self.qkv.pop(0)
            assert leaf.grad is not None
            grad = _sequence_to_heads(leaf.grad, sp, self.chunk)
            del leaf
            if repeat > 1 and grads:  # key and value: the repeated heads' gradients summed
                b, h, s, d = grad.shape
                grad = grad.view(b, h // repeat, repeat, s, d).sum(2)
            grads.append(grad)
        return grads


def _tile_kwargs(kwargs: dict[str, Any], tile: slice) -> dict[str, Any]:
    """The layer's keyword arguments for one tile: per-token tensors sliced along the sequence."""
    sliced = dict(kwargs)
    if kwargs.get("position_embeddings") is not None:
        sliced["position_embeddings"] = tuple(t[:, tile] for t in kwargs["position_embeddings"])
    for name in _TOKEN_KWARGS:
        value = kwargs.get(name)
        if isinstance(value, torch.Tensor):
            sliced[name] = value[..., tile]
    return sliced


def _check_kwargs(layer: torch.nn.Module, kwargs: dict[str, Any]) -> None:
    """Refuse arguments a tile could not be given its own part of."""
    for name, value in kwargs.items():
        known = name in (*_TOKEN_KWARGS, *_LOSS_KWARGS, "position_embeddings")
        if isinstance(value, torch.Tensor) and value.dim() > 0 and not known:
            raise AutoSPCompileError(
                f"{type(layer).__name__} received the tensor argument `{name}` of shape "
                f"{tuple(value.shape)}, which a sequence-tiled layer does not know how to split into "
                "tiles; train it untiled (compile.tile_tokens=0)"
            )
        if name == "position_embeddings" and any(t.requires_grad for t in value or ()):
            raise AutoSPCompileError(
                f"{type(layer).__name__}'s position embeddings require gradients, which a "
                "sequence-tiled layer does not return; train it untiled (compile.tile_tokens=0)"
            )


class _TiledLayer(torch.autograd.Function):
    """layer(hidden, **kwargs) in tiles (module docstring). `params` are inputs only so that the
    output requires grad whenever they do; their gradients go into .grad by the tiles' own
    backward."""

    @staticmethod
    def forward(
        ctx, hidden: torch.Tensor, layer: SequenceTiledLayer, kwargs: dict, *params: torch.Tensor
    ) -> torch.Tensor:
        ctx.layer, ctx.kwargs = layer, kwargs  # the kwargs (rotary cos/sin) are every layer's
        ctx.save_for_backward(hidden)
        attention = layer.attend(hidden, kwargs, grad=False)
        ctx.ring = attention.ring  # the ring's output and log-sum-exp, kept for the backward
        local_output = attention.local_output
        assert local_output is not None
        out = torch.empty_like(hidden)
        for tile in sequence_tiles(hidden.shape[1], layer.tile_tokens):
            out[:, tile] = layer.run_tile(hidden[:, tile], kwargs, tile, local_output[:, tile])
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (hidden,) = ctx.saved_tensors
        layer, kwargs = ctx.layer, ctx.kwargs
        attention = layer.attend(hidden, kwargs, grad=True, ring=ctx.ring)
        ctx.ring = None
        local_output = attention.local_output
        assert local_output is not None
        attention.local_output = None
        grad_hidden = torch.empty_like(hidden)
        grad_local_output = torch.empty_like(local_output)
        tiles = sequence_tiles(hidden.shape[1], layer.tile_tokens)
        for tile in tiles:
            h = hidden[:, tile].detach().requires_grad_()
            o = local_output[:, tile].detach().requires_grad_()
            with torch.enable_grad():
                y = layer.run_tile(h, kwargs, tile, o)
            torch.autograd.backward(y, grad_out[:, tile])
            grad_hidden[:, tile] = h.grad
            grad_local_output[:, tile] = o.grad
        del local_output, grad_out
        grad_output = attention.to_sequence(grad_local_output)
        del grad_local_output
        grad_qkv = attention.backward(grad_output)
        del grad_output
        for tile in tiles:
            h = hidden[:, tile].detach().requires_grad_()
            with torch.enable_grad():
                qkv = layer.run_tile(h, kwargs, tile)
            torch.autograd.backward(qkv, [g[:, :, tile] for g in grad_qkv])
            grad_hidden[:, tile] += h.grad
        return grad_hidden, None, None, *(None for _ in ctx.needs_input_grad[3:])


class SequenceTiledLayer(torch.nn.Module):
    """Mixed into a decoder layer's class by `tile_layers`: its forward runs the class's own
    over sequence tiles, with one Ulysses attention over the whole sequence in between."""

    tile_tokens: int
    sp_size: int
    ring_size: int  # SP = Ulysses x ring: the all-to-alls span sp_size / ring_size ranks
    tile_forward: Callable[..., Any]  # the class's own forward, compiled: (layer, hidden, kwargs)
    untiled_forward: Callable[..., Any]  # set on each tiled class

    @torch.compiler.disable
    def forward(self, hidden_states: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        if hidden_states.dim() != 3:
            raise ValueError(
                "a sequence-tiled decoder layer takes [batch, sequence, hidden] inputs, got shape "
                f"{tuple(hidden_states.shape)}"
            )
        _check_kwargs(self, kwargs)
        params = [p for p in self.parameters() if p.requires_grad]
        return _TiledLayer.apply(hidden_states, self, kwargs, *params)

    def run_tile(
        self,
        hidden: torch.Tensor,
        kwargs: dict[str, Any],
        tile: slice,
        attention_output: torch.Tensor | None = None,
    ) -> Any:
        """The layer's own forward on one tile: with `attention_output`, the tile's output;
        without, the tile's q, k, v (the forward stops at attention)."""
        with _tapping(_AttentionTap(answer=attention_output)) as tap:
            try:
                return self.tile_forward(self, hidden, _tile_kwargs(kwargs, tile))
            except _AttentionReached:
                return tap.qkv

    def attend(
        self,
        hidden: torch.Tensor,
        kwargs: dict[str, Any],
        grad: bool,
        ring: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> _Attention:
        """q, k, v tile by tile (no autograd), then attention over the whole sequence (under a
        ring, with `ring`, the forward's: not run again)."""
        tap = _AttentionTap()
        qkv: list[torch.Tensor] = []
        for tile in sequence_tiles(hidden.shape[1], self.tile_tokens):
            with torch.no_grad(), _tapping(tap):
                try:
                    self.tile_forward(self, hidden[:, tile], _tile_kwargs(kwargs, tile))
                    raise AutoSPCompileError(
                        f"{type(self).__name__} ran to its end without calling attention through "
                        f'attn_implementation="{TILED_ATTENTION}"; it cannot be tiled: train it '
                        "untiled (compile.tile_tokens=0)"
                    )
                except _AttentionReached:
                    pass
            if not qkv:
                qkv = [t.new_empty(*t.shape[:2], hidden.shape[1], t.shape[3]) for t in tap.qkv]
            for whole, part in zip(qkv, tap.qkv, strict=True):
                whole[:, :, tile] = part
        tap.qkv = tuple(qkv)
        del qkv
        q, k = tap.qkv[0], tap.qkv[1]
        layout = HeadLayout(
            query_heads=int(q.shape[_HEADS]),
            kv_heads=int(k.shape[_HEADS]),
            sp_size=self.sp_size // self.ring_size,
        )
        attention = _Attention(layout, self.tile_tokens, self.ring_size, ring)
        attention.run(tap, grad)
        return attention


def _run_untiled(layer: SequenceTiledLayer, hidden: torch.Tensor, kwargs: dict) -> Any:
    """One tile through the layer class's own forward (compiled by `tile_layers`)."""
    return layer.untiled_forward(hidden, **kwargs)


_tiled_classes: dict[type, type] = {}


def _tiled_class(cls: type) -> type:
    """One subclass per layer class, so that all layers share a type."""
    if cls not in _tiled_classes:
        _tiled_classes[cls] = type(
            f"SequenceTiled{cls.__name__}",
            (SequenceTiledLayer, cls),
            {"untiled_forward": getattr(cls, "forward")},  # noqa: B009 - a class, not an nn.Module
        )
    return _tiled_classes[cls]


def tile_layers(
    model: torch.nn.Module,
    tile_tokens: int,
    backend: AutoSPBackend | None = None,
    dynamic: bool | None = None,
) -> None:
    """Make every decoder layer of an HF model run in sequence tiles of `tile_tokens` tokens,
    in place, its tiles compiled with `backend` (None: eager, one device); applied again, it
    changes the tile size."""
    if tile_tokens < 1:
        raise ValueError(f"tile_tokens must be >= 1, got {tile_tokens}")
    refuse_tiled_router_loss(model)
    if not isinstance(model, PreTrainedModel):
        raise AutoSPCompileError(
            f"tiling whole decoder layers needs a Hugging Face model (its attention function is "
            f"swapped), got {type(model).__name__}; tile only the MLPs (tile_mlps)"
        )
    if model.config._attn_implementation not in (SP_ATTENTION, TILED_ATTENTION, "sdpa"):
        raise AutoSPCompileError(
            f'{type(model).__name__} uses attn_implementation="{model.config._attn_implementation}"; '
            'tiled layers need attn_implementation="sdpa"'
        )
    model.set_attn_implementation(TILED_ATTENTION)
    tile_forward = (
        torch.compile(_run_untiled, backend=backend, dynamic=dynamic)
        if backend is not None
        else _run_untiled
    )
    layers = decoder_layers(model)
    if backend is not None:  # each tiled layer makes its attention sequence parallel itself
        backend.sdpa_calls_rewritten += len(layers)
    for layer in layers:
        if not isinstance(layer, SequenceTiledLayer):
            layer.__class__ = _tiled_class(type(layer))
        assert isinstance(layer, SequenceTiledLayer)
        layer.tile_tokens = tile_tokens
        layer.sp_size = backend.sp_size if backend is not None else 1
        layer.ring_size = backend.ring_size if backend is not None else 1
        layer.tile_forward = tile_forward
