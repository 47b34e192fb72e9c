"""Causal attention within each document of packed rows and within a sliding window, as custom
ops compiled graphs can carry.

Documents are given by `cu_seqlens`, the cumulative document lengths of the batch's rows laid end
to end (row b's tokens are b*S ... (b+1)*S - 1, and every row starts a document), the varlen
convention of flash attention; without them each row is one document. A `window` of W tokens
lets a query attend to the W latest keys of its document, itself included (Hugging Face's
`sliding_window`: q - k < W). Under Ulysses each rank holds the whole sequence for its heads
after the all-to-all, so the same global `cu_seqlens` serve every rank, and the graph stays
rank-independent: the boundaries are a runtime input, read only inside the op.

The op is opaque to Dynamo and inductor (its loop over documents depends on the data). On CPU
it runs torch's flash kernel once per document, forward and backward: exact, nothing S x S,
nothing recomputed (the backward reads the output and log-sum-exp the forward saved). A
document longer than the window is cut into query chunks, each attending to the keys its
window reaches under a chunk-sized additive mask (chunk x (chunk + W - 1)): every query sees
all of its keys inside its chunk, so the chunk's log-sum-exp is the whole one and the backward
runs chunk by chunk too, key and value gradients summed where chunks overlap. Other devices
are refused by name until their varlen kernel is wired in and tested.
"""

from collections.abc import Iterator
from dataclasses import dataclass
from itertools import pairwise

import torch

aten = torch.ops.aten
# query tokens per chunk of a windowed document: the window, within these bounds. The upper one
# bounds the mask (chunk x (chunk + window - 1)) for long windows, the lower one the number of
# kernel calls for short ones; either way the work stays linear in the document's length.
_MIN_CHUNK, _MAX_CHUNK = 64, 512


class DocumentAttentionError(RuntimeError):
    """Document boundaries or a device the document attention op cannot serve exactly."""


def _documents(cu_seqlens: torch.Tensor | None, batch: int, seq: int) -> list[tuple[int, int, int]]:
    """(row, start, end) of each document (each row one without `cu_seqlens`); refuses boundaries
    that are not a partition of the rows into documents (increasing, none spanning two rows, so
    each row starts one)."""
    if cu_seqlens is None:
        return [(row, 0, seq) for row in range(batch)]
    bounds = [int(b) for b in cu_seqlens.tolist()]
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != batch * seq:
        raise DocumentAttentionError(
            f"cu_seqlens {bounds[:4]}...{bounds[-2:]} must run from 0 to batch x sequence = "
            f"{batch} x {seq} = {batch * seq} (the whole sequence: under sequence parallelism "
            "the attention must run after the all-to-all, i.e. in a model compiled with the AutoSP backend)"
        )
    documents = []
    for start, end in pairwise(bounds):
        row = start // seq
        if end <= start or end > (row + 1) * seq:
            raise DocumentAttentionError(
                f"cu_seqlens has a document [{start}, {end}) that is empty or crosses the end of "
                f"row {row} (rows of {seq} tokens): every row must start a document"
            )
        documents.append((row, start - row * seq, end - row * seq))
    return documents


@dataclass(frozen=True)
class _Piece:
    """Queries [q_start, q_end) of a row attending to keys [k_start, q_end): causal over the span
    when `window` is 0, else under the window's mask."""

    row: int
    q_start: int
    q_end: int
    k_start: int
    window: int = 0

    def queries(self) -> tuple[slice, slice, slice]:
        return slice(self.row, self.row + 1), slice(None), slice(self.q_start, self.q_end)

    def keys(self) -> tuple[slice, slice, slice]:
        return slice(self.row, self.row + 1), slice(None), slice(self.k_start, self.q_end)

    def mask(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        """Additive mask [queries, keys]: 0 where k <= q and q - k < window, -inf elsewhere."""
        if not self.window:
            return None
        q = torch.arange(self.q_start, self.q_end, device=device).unsqueeze(1)
        k = torch.arange(self.k_start, self.q_end, device=device).unsqueeze(0)
        allowed = (k <= q) & (q - k < self.window)
        return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(
            ~allowed, float("-inf")
        )


def _pieces(cu_seqlens: torch.Tensor | None, batch: int, seq: int, window: int) -> Iterator[_Piece]:
    """What the kernel runs on: each document whole when the window covers it (or there is
    none), else in query chunks with the keys their window reaches within the document."""
    if window < 0:
        raise DocumentAttentionError(f"window={window}: a sliding window is a positive length")
    for row, start, end in _documents(cu_seqlens, batch, seq):
        if not window or end - start <= window:
            yield _Piece(row, start, end, start)
            continue
        chunk = min(max(window, _MIN_CHUNK), _MAX_CHUNK)
        for q_start in range(start, end, chunk):
            k_start = max(start, q_start - window + 1)
            yield _Piece(row, q_start, min(q_start + chunk, end), k_start, window)


def _check_device(query: torch.Tensor) -> None:
    if query.device.type != "cpu":
        raise DocumentAttentionError(
            f"per-document and sliding-window attention run on CPU only so far; on "
            f"{query.device.type} they need the varlen flash kernel, which is not wired in yet: "
            "train packed documents with data.documents=concat there, sliding windows no "
            "shorter than the sequence, and right padding"
        )


def _logsumexp_dtype(dtype: torch.dtype) -> torch.dtype:
    """What the CPU flash kernel accumulates in (and writes its log-sum-exp as)."""
    return torch.promote_types(dtype, torch.float32)


@torch.library.custom_op("slurm_autosp::document_attention", mutates_args=())
def document_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    scale: float,
    window: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of `query` [B, Hq, S, D] over `key`, `value` [B, Hkv, S, D] (Hq a multiple
    of Hkv: query head h reads KV head h // (Hq / Hkv)) within each document of `cu_seqlens`
    (None: each row is one) and, when `window` > 0, within the `window` latest keys.
    Returns the output [B, Hq, S, D] and the log-sum-exp [B, Hq, S] the backward reads."""
    _check_device(query)
    batch, heads, seq, _ = query.shape
    group = heads // key.shape[1]
    output = torch.empty_like(query)
    logsumexp = query.new_empty(batch, heads, seq, dtype=_logsumexp_dtype(query.dtype))
    for piece in _pieces(cu_seqlens, batch, seq, window):
        queries, keys = piece.queries(), piece.keys()
        mask = piece.mask(query.dtype, query.device)
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
            query[queries],
            key[keys].repeat_interleave(group, dim=1),
            value[keys].repeat_interleave(group, dim=1),
            0.0,
            mask is None,
            attn_mask=mask,
            scale=scale,
        )
        output[queries] = out
        logsumexp[queries] = lse
    return output, logsumexp


@document_attention.register_fake
def _(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    scale: float,
    window: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    batch, heads, seq, _ = query.shape
    return torch.empty_like(query), query.new_empty(
        batch, heads, seq, dtype=_logsumexp_dtype(query.dtype)
    )


@torch.library.custom_op("slurm_autosp::document_attention_backward", mutates_args=())
def document_attention_backward(
    grad_output: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    output: torch.Tensor,
    logsumexp: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    scale: float,
    window: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of query, key and value, piece by piece (as the forward ran) from the saved
    output and log-sum-exp; a KV head's gradient sums over the query heads that read it, and
    a key's over the window chunks that read it."""
    _check_device(query)
    batch, heads, seq, _ = query.shape
    kv_heads = key.shape[1]
    group = heads // kv_heads
    grad_q = torch.empty_like(query)
    grad_k, grad_v = torch.zeros_like(key), torch.zeros_like(value)
    for piece in _pieces(cu_seqlens, batch, seq, window):
        queries, keys = piece.queries(), piece.keys()
        mask = piece.mask(query.dtype, query.device)
        part_q, part_k, part_v = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_output[queries].contiguous(),
            query[queries],
            key[keys].repeat_interleave(group, dim=1),
            value[keys].repeat_interleave(group, dim=1),
            output[queries],
            logsumexp[queries],
            0.0,
            mask is None,
            attn_mask=mask,
            scale=scale,
        )
        grad_q[queries] = part_q
        for whole, part in ((grad_k, part_k), (grad_v, part_v)):
            whole[keys] += part.unflatten(1, (kv_heads, group)).sum(dim=2)
    return grad_q, grad_k, grad_v


@document_attention_backward.register_fake
def _(
    grad_output: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    output: torch.Tensor,
    logsumexp: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    scale: float,
    window: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


def _setup_context(ctx: object, inputs: tuple, output: tuple) -> None:
    query, key, value, cu_seqlens, scale, window = inputs
    ctx.save_for_backward(query, key, value, *output, cu_seqlens)  # type: ignore[attr-defined]
    ctx.scale, ctx.window = scale, window  # type: ignore[attr-defined]


def _backward(
    ctx: object, grad_output: torch.Tensor, _grad_logsumexp: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None, None, None]:
    query, key, value, output, logsumexp, cu_seqlens = ctx.saved_tensors  # type: ignore[attr-defined]
    grad_q, grad_k, grad_v = document_attention_backward(
        grad_output,
        query,
        key,
        value,
        output,
        logsumexp,
        cu_seqlens,
        ctx.scale,  # type: ignore[attr-defined]
        ctx.window,  # type: ignore[attr-defined]
    )
    return grad_q, grad_k, grad_v, None, None, None


document_attention.register_autograd(_backward, setup_context=_setup_context)
