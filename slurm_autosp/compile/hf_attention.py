"""Make Hugging Face models reach SDPA with attn_mask=None and is_causal=True under torch.compile.

With attn_implementation="sdpa" and no KV cache, transformers (5.x) builds a 4D mask whenever
it is traced: `find_packed_sequence_indices` cannot prove from position_ids that the batch is
not packed, so it keeps a packed-sequence mask and disables the is_causal shortcut. That mask
would be per shard and wrong for Ulysses (and S x S in memory). Keeping the KV cache on avoids
it but makes every decoder layer a different graph (the cache is indexed by `layer_idx`).

So the model is switched to `SP_ATTENTION`: HF's own SDPA attention function under another
name, with a mask function that returns no mask. Both refuse what dropping the mask would get
wrong (see attention_pattern): a padding mask (only `prepare_sp_inputs` may drop it safely), a
chunk shorter than the whole sequence, soft-capping, sinks, non-causal attention. Packed and
left-padded rows arrive with the cumulative document lengths `prepare_sp_inputs` derived (HF's
varlen arguments `cu_seq_lens_q`/`cu_seq_lens_k`), and a layer's sliding window as HF passes it
(`sliding_window`); either goes to `document_attention` instead of SDPA, which applies both.
The backend puts the same all-to-alls around either.
"""

from collections.abc import Callable
from typing import Any

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface

from slurm_autosp.compile.backend import AutoSPCompileError
from slurm_autosp.sp.all_to_all import registered_sp_size
from slurm_autosp.sp.attention_pattern import (
    check_attention_call,
    check_mask_request,
    layer_window,
    window_matters,
)
from slurm_autosp.sp.document_attention import document_attention

SP_ATTENTION = "slurm_autosp_sdpa"
TILED_ATTENTION = "slurm_autosp_tiled_sdpa"  # the attention of sequence-tiled layers (tiled_layer)


def _no_mask(
    *,
    kv_length: int,
    attention_mask: torch.Tensor | None = None,
    mask_function: Callable[..., Any] | None = None,
    local_size: int | None = None,
    config: Any = None,
    applies_windows: bool = True,
    **_: object,
) -> None:
    """Causal attention needs no mask: SDPA's is_causal covers it over the full sequence, and
    `document_attention` applies documents and sliding windows (unless not `applies_windows`:
    tiled layers attend over the whole row).

    `kv_length` is this rank's shard; the sequence the mask would cover is all SP ranks' shards.
    """
    if attention_mask is not None:
        raise AutoSPCompileError(
            "an attention_mask was passed to a model prepared for sequence parallelism; pass the "
            "batch through slurm_autosp.compile.prepare_sp_inputs(...) and call the model with "
            "its .model_kwargs() (padding becomes ignored labels and, on the left, a document of its own)"
        )
    check_mask_request(
        mask_function, local_size, kv_length * registered_sp_size(), config, applies_windows
    )
    return None


def _no_mask_tiled(**kwargs: Any) -> None:
    """`_no_mask` for tiled layers, whose attention is causal over the whole row: a sliding
    window shorter than it is refused there."""
    return _no_mask(**kwargs, applies_windows=False)


def _document_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    window: int | None,
    kwargs: dict[str, Any],
) -> tuple[torch.Tensor, None]:
    """Causal attention within each document (each row without `cu_seqlens`) and `window`,
    returned as HF's attention functions return it ([B, S, H, D], no weights)."""
    name = type(module).__name__
    if kwargs.get("dropout"):
        raise AutoSPCompileError(
            f"{name} asks for attention dropout={kwargs['dropout']} over packed documents or a "
            "sliding window; document attention has no dropout (set the model's attention_dropout=0)"
        )
    if kwargs.get("cu_seq_lens_k") is not cu_seqlens or (
        kwargs.get("max_length_k") is not kwargs.get("max_length_q")
    ):
        raise AutoSPCompileError(
            f"{name} got different cu_seq_lens_q and cu_seq_lens_k (or max_length_q and "
            "max_length_k); packed documents attend within themselves, so both must be the "
            "lengths prepare_sp_inputs derived"
        )
    scaling = kwargs.get("scaling")
    scale = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
    longest = _longest_document(name, kwargs.get("max_length_q"))
    output, _ = document_attention(query, key, value, cu_seqlens, scale, window or 0, longest)
    return output.transpose(1, 2).contiguous(), None


def _longest_document(name: str, carrier: object) -> int:
    """The longest document's length from the empty [longest, 0] tensor SPBatch.model_kwargs()
    passes as `max_length_q` (symbolic under Dynamo, so no batch compiles again); 0 for none."""
    if carrier is None:
        return 0
    if not isinstance(carrier, torch.Tensor) or carrier.dim() != 2 or carrier.shape[1] != 0:
        raise AutoSPCompileError(
            f"{name} got max_length_q={carrier!r}; AutoSP reads the longest document's length from "
            "the empty [longest, 0] tensor prepare_sp_inputs(...).model_kwargs() passes: call the "
            "model with those keyword arguments"
        )
    return carrier.shape[0]


def _sp_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> Any:
    """HF's SDPA attention, after refusing what it would silently ignore; attention within each
    document for packed rows, and within the window where the layer's is shorter than the whole
    sequence (this rank's shard times the SP size; a guard on that length, not a specialisation)."""
    check_attention_call(module, kwargs)
    cu_seqlens = kwargs.get("cu_seq_lens_q")
    window = layer_window(module, kwargs)
    if not window_matters(window, query.shape[2] * registered_sp_size()):
        window = None
    if cu_seqlens is not None or window is not None:
        return _document_attention_forward(module, query, key, value, cu_seqlens, window, kwargs)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register(SP_ATTENTION, _sp_sdpa_attention)
AttentionMaskInterface.register(SP_ATTENTION, _no_mask)
AttentionMaskInterface.register(TILED_ATTENTION, _no_mask_tiled)


def use_sp_attention(model: PreTrainedModel) -> None:
    """Switch an HF model from "sdpa" to `SP_ATTENTION` (a no-op when already switched, or when
    its layers are tiled: their attention is `TILED_ATTENTION`)."""
    current = model.config._attn_implementation
    if current in (SP_ATTENTION, TILED_ATTENTION):
        return
    if current != "sdpa":
        raise AutoSPCompileError(
            f'{type(model).__name__} uses attn_implementation="{current}"; AutoSP rewrites '
            'scaled_dot_product_attention calls, so load the model with attn_implementation="sdpa"'
        )
    model.set_attn_implementation(SP_ATTENTION)
