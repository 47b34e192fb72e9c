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
runs chunk by chunk too, key and value gradients summed where chunks overlap.

On CUDA the op runs torch's flash varlen kernel (the aten forward and backward that
torch.nn.attention.varlen calls) once over the whole batch: the rows laid end to end as
[tokens, heads, dim], `cu_seqlens` (or one document per row) as its sequences, the window as
(W - 1, 0) (flash keeps keys q - W + 1 ... q: HF's q - k < W), grouped KV heads as they are,
bf16/fp16 only. It needs the longest document's length as a host int, `max_length`: reading it
from `cu_seqlens` would wait for the GPU in every layer, so `prepare_sp_inputs` computes it once
per micro-batch (and the CPU kernel checks it against the boundaries). The CUDA kernel has never
run on a GPU: its shapes, strides and dtypes are checked against the fakes on a fake CUDA device
(tests/compile/test_document_kernel.py), the arguments it builds run through a CPU model of
flash's contract against exact attention (tests/flash_contract.py), and its numbers are
checked by `kernel_check` on a GPU. Every [B, H,
S, D] tensor the op returns is laid out token by token ([B, S, H, D] transposed), as the varlen
kernel writes it, so on CUDA they are views, not copies; other devices are refused by name.
"""

from collections.abc import Iterator
from dataclasses import dataclass
from itertools import pairwise

import torch

from slurm_autosp.compat.torch_api import (
    flash_refusal,
    flash_varlen_backward,
    flash_varlen_forward,
)

aten = torch.ops.aten
# query tokens per chunk of a windowed document: the window, within these bounds. The upper one
# bounds the mask (chunk x (chunk + window - 1)) for long windows, the lower one the number of
# kernel calls for short ones; either way the work stays linear in the document's length.
_MIN_CHUNK, _MAX_CHUNK = 64, 512


def window_chunk(window: int) -> int:
    """How many queries of a windowed document one kernel call takes (ring attention's window
    slices too)."""
    return min(max(window, _MIN_CHUNK), _MAX_CHUNK)


class DocumentAttentionError(RuntimeError):
    """Document boundaries or a device the document attention op cannot serve exactly."""


def document_spans(
    cu_seqlens: torch.Tensor | None, batch: int, seq: int
) -> list[tuple[int, int, int]]:
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


def _check_max_length(documents: list[tuple[int, int, int]], max_length: int) -> None:
    """The longest document's length, when given, is the one the boundaries give: the CUDA
    kernel trusts it (reading the boundaries there would wait for the GPU)."""
    longest = max(end - start for _, start, end in documents)
    if max_length and max_length != longest:
        raise DocumentAttentionError(
            f"max_length={max_length}, but the longest document of cu_seqlens has {longest} "
            "tokens: pass the longest document's length, as prepare_sp_inputs(...).model_kwargs() does"
        )


def check_window(window: int) -> None:
    if window < 0:
        raise DocumentAttentionError(f"window={window}: a sliding window is a positive length")


def _pieces(documents: list[tuple[int, int, int]], window: int) -> Iterator[_Piece]:
    """What the kernel runs on: each document whole when the window covers it (or there is
    none), else in query chunks with the keys their window reaches within the document."""
    check_window(window)
    for row, start, end in documents:
        if not window or end - start <= window:
            yield _Piece(row, start, end, start)
            continue
        chunk = window_chunk(window)
        for q_start in range(start, end, chunk):
            k_start = max(start, q_start - window + 1)
            yield _Piece(row, q_start, min(q_start + chunk, end), k_start, window)


def _check_device(query: torch.Tensor) -> None:
    if query.device.type != "cpu":
        raise DocumentAttentionError(
            f"per-document and sliding-window attention run on CPU and CUDA only; on "
            f"{query.device.type} they need a varlen kernel, which is not wired in: train packed "
            "documents with data.documents=concat there, sliding windows no shorter than the "
            "sequence, and right padding"
        )


def _logsumexp_dtype(dtype: torch.dtype) -> torch.dtype:
    """What the flash kernels accumulate in (and write their log-sum-exp as)."""
    return torch.promote_types(dtype, torch.float32)


def _token_major(like: torch.Tensor) -> torch.Tensor:
    """An uninitialised tensor of the shape of `like` [B, H, S, D], laid out as [B, S, H, D]:
    how the varlen kernel writes its outputs, so every kernel and fake allocates them so."""
    batch, heads, seq, dim = like.shape
    return like.new_empty(batch, seq, heads, dim).transpose(1, 2)


@torch.library.custom_op("slurm_autosp::document_attention", mutates_args=())
def document_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    scale: float,
    window: int = 0,
    max_length: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of `query` [B, Hq, S, D] over `key`, `value` [B, Hkv, S, D] (Hq a multiple
    of Hkv: query head h reads KV head h // (Hq / Hkv)) within each document of `cu_seqlens`
    (None: each row is one) and, when `window` > 0, within the `window` latest keys.
    `max_length` is the longest document's length (0: not given; CUDA needs it with
    `cu_seqlens`). Returns the output [B, Hq, S, D] (token-major) and the log-sum-exp
    [B, Hq, S] the backward reads."""
    _check_device(query)
    batch, heads, seq, _ = query.shape
    group = heads // key.shape[1]
    output = _token_major(query)
    logsumexp = query.new_empty(batch, heads, seq, dtype=_logsumexp_dtype(query.dtype))
    documents = document_spans(cu_seqlens, batch, seq)
    _check_max_length(documents, max_length)
    for piece in _pieces(documents, window):
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
    max_length: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    batch, heads, seq, _ = query.shape
    return _token_major(query), query.new_empty(
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
    max_length: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of query, key and value (token-major), piece by piece (as the forward ran)
    from the saved output and log-sum-exp; a KV head's gradient sums over the query heads that
    read it, and a key's over the window chunks that read it."""
    _check_device(query)
    batch, heads, seq, _ = query.shape
    kv_heads = key.shape[1]
    group = heads // kv_heads
    grad_q = _token_major(query)
    grad_k, grad_v = _token_major(key).zero_(), _token_major(value).zero_()
    for piece in _pieces(document_spans(cu_seqlens, batch, seq), window):
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
    max_length: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _token_major(query), _token_major(key), _token_major(value)


def _setup_context(ctx: object, inputs: tuple, output: tuple) -> None:
    query, key, value, cu_seqlens, scale, window, max_length = inputs
    ctx.save_for_backward(query, key, value, *output, cu_seqlens)  # type: ignore[attr-defined]
    ctx.scale, ctx.window, ctx.max_length = scale, window, max_length  # type: ignore[attr-defined]


def _backward(
    ctx: object, grad_output: torch.Tensor, _grad_logsumexp: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None, None, None, None]:
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
        ctx.max_length,  # type: ignore[attr-defined]
    )
    return grad_q, grad_k, grad_v, None, None, None, None


document_attention.register_autograd(_backward, setup_context=_setup_context)


# ------------------------------------------------------------------ CUDA: the flash varlen kernel


def _check_flash(query: torch.Tensor) -> None:
    """What the flash varlen kernel computes, refused by name before it would fail inside."""
    if torch.version.hip:
        raise DocumentAttentionError(
            "per-document and sliding-window attention on ROCm (cluster.vendor=amd) run torch's "
            "flash varlen kernel, which has not been tested there: train packed documents with "
            "data.documents=concat, sliding windows no shorter than the sequence, and right padding"
        )
    why, precision = flash_refusal(query)
    if why:
        raise DocumentAttentionError(
            f"per-document and sliding-window attention on CUDA run the flash varlen kernel, "
            f"which {why}: "
            + (
                "train with train.precision=bf16"
                if precision
                else "train packed documents with data.documents=concat, sliding windows no "
                "shorter than the sequence, and right padding"
            )
        )


def _varlen_sequences(
    query: torch.Tensor, cu_seqlens: torch.Tensor | None, max_length: int
) -> tuple[torch.Tensor, int]:
    """The kernel's sequences over the rows laid end to end, and the longest one: the documents
    of `cu_seqlens`, or each row; nothing read back from the GPU."""
    batch, _, seq, _ = query.shape
    if cu_seqlens is None:
        rows = torch.arange(0, batch * seq + 1, seq, dtype=torch.int32, device=query.device)
        return rows, seq
    if max_length <= 0:
        raise DocumentAttentionError(
            f"document attention on {query.device} got cu_seqlens without max_length (the longest "
            "document's length), which the varlen kernel needs on the host: call the model with "
            "prepare_sp_inputs(...).model_kwargs(), which carries it"
        )
    return cu_seqlens, max_length


def _flash_window(window: int) -> tuple[int, bool]:
    """(window_size_left, is_causal) as torch's varlen_attn passes them, with window_size_right
    0: causal is (-1, 0), a window of W tokens (W - 1, 0), keys q - W + 1 ... q of the query's
    document."""
    check_window(window)
    return (window - 1, False) if window else (-1, True)


def _contiguous(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor.contiguous()`, written as a clone: on a CPU build, fake CUDA tensors (the shape
    checks of this kernel) cannot copy_, which .contiguous() calls."""
    if tensor.is_contiguous():
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)


def _packed(tensor: torch.Tensor) -> torch.Tensor:
    """[B, H, S, D] as the varlen kernel reads it: [B * S, H, D], contiguous (a view when the
    tensor is token-major already)."""
    batch, heads, seq, dim = tensor.shape
    return _contiguous(tensor.transpose(1, 2).reshape(batch * seq, heads, dim))


def _unpacked(packed: torch.Tensor, batch: int) -> torch.Tensor:
    """[B * S, H, D] back to [B, H, S, D], a token-major view."""
    return packed.unflatten(0, (batch, -1)).transpose(1, 2)


@document_attention.register_kernel("cuda")
def varlen_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    scale: float,
    window: int = 0,
    max_length: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`document_attention` on CUDA: what flash computes refused by name, then `flash_forward`."""
    _check_flash(query)
    return flash_forward(query, key, value, cu_seqlens, scale, window, max_length)


def flash_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    scale: float,
    window: int = 0,
    max_length: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One flash varlen call over the whole batch, with the arguments CUDA gets."""
    sequences, longest = _varlen_sequences(query, cu_seqlens, max_length)
    left, causal = _flash_window(window)
    output, lse = flash_varlen_forward(
        _packed(query),
        _packed(key),
        _packed(value),
        (sequences, sequences, longest, longest),
        causal,
        (left, 0),
        scale,
    )
    batch, _, seq, _ = query.shape
    # [Hq, B * S] as flash writes it, [B, Hq, S] as the fake declares it (a small copy)
    logsumexp = _contiguous(lse.unflatten(1, (batch, seq)).transpose(0, 1))
    return _unpacked(output, batch), logsumexp


@document_attention_backward.register_kernel("cuda")
def varlen_backward(
    grad_output: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    output: torch.Tensor,
    logsumexp: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    scale: float,
    window: int = 0,
    max_length: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`document_attention_backward` on CUDA: the flash varlen backward with the forward's
    sequences, window and scale, from its output and log-sum-exp."""
    sequences, longest = _varlen_sequences(query, cu_seqlens, max_length)
    left, causal = _flash_window(window)
    batch, heads = query.shape[:2]
    grads = flash_varlen_backward(
        _packed(grad_output),
        _packed(query),
        _packed(key),
        _packed(value),
        _packed(output),
        _contiguous(logsumexp.transpose(0, 1).reshape(heads, -1)),  # as the forward wrote it
        (sequences, sequences, longest, longest),
        causal,
        (left, 0),
        scale,
    )
    grad_q, grad_k, grad_v = (_unpacked(grad, batch) for grad in grads)
    return grad_q, grad_k, grad_v
