"""Causal attention within each document of packed rows, as custom ops compiled graphs can carry.

Documents are given by `cu_seqlens`, the cumulative document lengths of the batch's rows laid end
to end (row b's tokens are b*S ... (b+1)*S - 1, and every row starts a document), the varlen
convention of flash attention. Under Ulysses each rank holds the whole sequence for its heads
after the all-to-all, so the same global `cu_seqlens` serve every rank, and the graph stays
rank-independent: the boundaries are a runtime input, read only inside the op.

The op is opaque to Dynamo and inductor (its loop over documents depends on the data). On CPU
it runs torch's flash kernel once per document, forward and backward: exact, nothing S x S,
nothing recomputed (the backward reads the output and log-sum-exp the forward saved). Other
devices are refused by name until their varlen kernel is wired in and tested.
"""

from itertools import pairwise

import torch

aten = torch.ops.aten


class DocumentAttentionError(RuntimeError):
    """Document boundaries or a device the document attention op cannot serve exactly."""


def _documents(cu_seqlens: torch.Tensor, batch: int, seq: int) -> list[tuple[int, int, int]]:
    """(row, start, end) of each document; refuses boundaries that are not a partition of the
    rows into documents (increasing, none spanning two rows, so each row starts one)."""
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


def _check_device(query: torch.Tensor) -> None:
    if query.device.type != "cpu":
        raise DocumentAttentionError(
            f"per-document attention runs on CPU only so far; on {query.device.type} it needs the "
            "varlen flash kernel, which is not wired in yet: train packed documents with "
            "data.documents=concat there"
        )


def _logsumexp_dtype(dtype: torch.dtype) -> torch.dtype:
    """What the CPU flash kernel accumulates in (and writes its log-sum-exp as)."""
    return torch.promote_types(dtype, torch.float32)


@torch.library.custom_op("slurm_autosp::document_attention", mutates_args=())
def document_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of `query` [B, Hq, S, D] over `key`, `value` [B, Hkv, S, D] (Hq a multiple
    of Hkv: query head h reads KV head h // (Hq / Hkv)) within each document of `cu_seqlens`.
    Returns the output [B, Hq, S, D] and the log-sum-exp [B, Hq, S] the backward reads."""
    _check_device(query)
    batch, heads, seq, _ = query.shape
    group = heads // key.shape[1]
    output = torch.empty_like(query)
    logsumexp = query.new_empty(batch, heads, seq, dtype=_logsumexp_dtype(query.dtype))
    for row, start, end in _documents(cu_seqlens, batch, seq):
        span = (slice(row, row + 1), slice(None), slice(start, end))
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
            query[span],
            key[span].repeat_interleave(group, dim=1),
            value[span].repeat_interleave(group, dim=1),
            0.0,
            True,
            scale=scale,
        )
        output[span] = out
        logsumexp[span] = lse
    return output, logsumexp


@document_attention.register_fake
def _(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
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
    cu_seqlens: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of query, key and value, document by document from the saved output and
    log-sum-exp; a KV head's gradient sums over the query heads that read it."""
    _check_device(query)
    batch, heads, seq, dim = query.shape
    kv_heads = key.shape[1]
    group = heads // kv_heads
    grads = torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)
    for row, start, end in _documents(cu_seqlens, batch, seq):
        span = (slice(row, row + 1), slice(None), slice(start, end))
        grad_q, grad_k, grad_v = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_output[span].contiguous(),
            query[span],
            key[span].repeat_interleave(group, dim=1),
            value[span].repeat_interleave(group, dim=1),
            output[span],
            logsumexp[span],
            0.0,
            True,
            scale=scale,
        )
        grads[0][span] = grad_q
        for whole, part in ((grads[1], grad_k), (grads[2], grad_v)):
            whole[span] = part.unflatten(1, (kv_heads, group)).sum(dim=2)
    return grads


@document_attention_backward.register_fake
def _(
    grad_output: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    output: torch.Tensor,
    logsumexp: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


def _setup_context(ctx: object, inputs: tuple, output: tuple) -> None:
    query, key, value, cu_seqlens, scale = inputs
    ctx.save_for_backward(query, key, value, *output, cu_seqlens)  # type: ignore[attr-defined]
    ctx.scale = scale  # type: ignore[attr-defined]


def _backward(
    ctx: object, grad_output: torch.Tensor, _grad_logsumexp: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None, None]:
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
    )
    return grad_q, grad_k, grad_v, None, None


document_attention.register_autograd(_backward, setup_context=_setup_context)
