"""A round of ring pieces (`ring_plan.Round`) through one attention kernel, per device.

On CUDA it is one call of torch's flash varlen kernel (the aten forward and backward that
torch.nn.attention.varlen calls): the pieces' queries and keys laid end to end as [tokens,
heads, dim], their cumulative lengths as its sequences, their rule as its window, grouped KV
heads as they are, bf16/fp16 only. On CPU the same sequences run one at a time through torch's
flash kernel for CPU, each with the mask flash's rule gives (none where the rule is plain
causal or every key): so the CPU tests check the arithmetic CUDA runs, all but the kernel.
The CUDA kernel has not run on a GPU: its shapes are checked on a fake CUDA device, and the
arguments `flash_forward` and `flash_backward` build run through a CPU model of the kernel's
contract (tests/flash_contract.py) against exact attention.
"""

from __future__ import annotations

from itertools import accumulate, pairwise

import torch

from slurm_autosp.compat.torch_api import (
    flash_refusal,
    flash_varlen_backward,
    flash_varlen_forward,
)
from slurm_autosp.sp.ring_plan import Piece, Round

aten = torch.ops.aten


class VarlenKernelError(RuntimeError):
    """A round the kernel of this device cannot compute; the message says what to change."""


def check_flash(query: torch.Tensor) -> None:
    """What the CUDA flash kernel would fail on, refused by name before it runs."""
    why, precision = flash_refusal(query)
    if why:
        raise VarlenKernelError(
            f"ring attention on CUDA runs the flash varlen kernel, which {why}: "
            + ("train with train.precision=bf16, or " if precision else "set ")
            + "parallel.ring_size=1 with a parallel.sp_size the heads split over"
        )


def _mask(piece: Piece, dtype: torch.dtype) -> tuple[torch.Tensor | None, bool]:
    """(additive mask, is_causal) of one piece for the CPU kernel, which aligns causality at the
    start: flash's rule, aligned at the ends, as a mask where the two differ."""
    if piece.rule == (-1, -1):
        return None, False
    if piece.rule == (-1, 0) and piece.q_len == piece.k_len:
        return None, True
    i = torch.arange(piece.q_len).unsqueeze(1) + (piece.k_len - piece.q_len)
    j = torch.arange(piece.k_len).unsqueeze(0)
    allowed = torch.ones(piece.q_len, piece.k_len, dtype=torch.bool)
    if piece.left >= 0:
        allowed &= j >= i - piece.left
    if piece.right >= 0:
        allowed &= j <= i + piece.right
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, float("-inf")), False


def _spans(round_: Round) -> list[tuple[slice, slice]]:
    """Each piece's (query, key) slices of the round's packed tokens."""
    q_ends = accumulate((p.q_len for p in round_.pieces), initial=0)
    k_ends = accumulate((p.k_len for p in round_.pieces), initial=0)
    return [
        (slice(q0, q1), slice(k0, k1))
        for (q0, q1), (k0, k1) in zip(pairwise(q_ends), pairwise(k_ends), strict=True)
    ]


def _heads_first(tokens: torch.Tensor) -> torch.Tensor:
    """[T, H, D] as one batch row of the CPU kernel: [1, H, T, D]."""
    return tokens.transpose(0, 1).unsqueeze(0)


def _tokens_first(heads: torch.Tensor) -> torch.Tensor:
    """[1, H, T, ...] back to [T, H, ...]."""
    return heads[0].transpose(0, 1)


def _flash_rule(round_: Round) -> tuple[bool, tuple[int, int]]:
    """(is_causal, (window_size_left, window_size_right)) of the round's pieces for flash."""
    return round_.rule == (-1, 0), round_.rule


def _sequences(round_: Round, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """The flash varlen kernel's cum_seq_q, cum_seq_k, max_seqlen_q, max_seqlen_k for the round.

    Flash reads the maxima as rules too, not only as the sizes of its grid. A window side that
    reaches max_seqlen_k is dropped and then bounded by it (flash_api.cpp: `window_size_right =
    -1`, then set_params_fprop's `window_size_right = seqlen_k`), which cuts the keys of a piece
    whose last query lies further than that past its last key; and max_seqlen_q == 1 with
    grouped KV heads and no window swaps heads into queries (the decoding branch). So max_k
    exceeds both sides of the round's window and max_q is at least 2: a sequence shorter than
    either only leaves blocks of the grid idle."""
    _, _, cu_q, cu_k = round_.on(device)
    left, right = round_.rule
    return cu_q, cu_k, max(round_.max_q, 2), max(round_.max_k, left + 1, right + 1)


def flash_forward(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, round_: Round, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`varlen_forward` on CUDA: one flash varlen call over the round's pieces."""
    causal, window = _flash_rule(round_)
    output, lse = flash_varlen_forward(
        query, key, value, _sequences(round_, query.device), causal, window, scale
    )
    return output, lse.transpose(0, 1)  # flash writes it [Hq, Tq]


def flash_backward(
    grad_output: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    output: torch.Tensor,
    lse: torch.Tensor,
    round_: Round,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`varlen_backward` on CUDA: flash's varlen backward of `flash_forward`'s call."""
    causal, window = _flash_rule(round_)
    return flash_varlen_backward(
        grad_output,
        query,
        key,
        value,
        output,
        lse.transpose(0, 1).contiguous(),  # as flash wrote it
        _sequences(round_, query.device),
        causal,
        window,
        scale,
    )


def varlen_forward(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, round_: Round, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of the round's queries [Tq, Hq, D] over its keys and values [Tk, Hkv, D],
    piece by piece: the output [Tq, Hq, D] and its log-sum-exp [Tq, Hq] (fp32)."""
    if query.device.type == "cuda":
        check_flash(query)
        return flash_forward(query, key, value, round_, scale)
    output = torch.empty_like(query)
    lse = query.new_empty(query.shape[:2], dtype=torch.float32)
    for piece, (queries, keys) in zip(round_.pieces, _spans(round_), strict=True):
        mask, causal = _mask(piece, query.dtype)
        out, piece_lse = aten._scaled_dot_product_flash_attention_for_cpu(
            _heads_first(query[queries]),
            _heads_first(key[keys]),
            _heads_first(value[keys]),
            0.0,
            causal,
            attn_mask=mask,
            scale=scale,
        )
        output[queries] = _tokens_first(out)
        lse[queries] = _tokens_first(piece_lse)
    return output, lse


def varlen_backward(
    grad_output: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    output: torch.Tensor,
    lse: torch.Tensor,
    round_: Round,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of the round's queries, keys and values (token-major, as they came) given the
    whole attention's `output` and log-sum-exp `lse` [Tq, Hq] for its queries: each piece's
    exact share of the whole's."""
    if query.device.type == "cuda":
        return flash_backward(grad_output, query, key, value, output, lse, round_, scale)
    grad_q, grad_k, grad_v = (torch.zeros_like(t) for t in (query, key, value))
    for piece, (queries, keys) in zip(round_.pieces, _spans(round_), strict=True):
        mask, causal = _mask(piece, query.dtype)
        part_q, part_k, part_v = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            _heads_first(grad_output[queries]).contiguous(),
            _heads_first(query[queries]),
            _heads_first(key[keys]),
            _heads_first(value[keys]),
            _heads_first(output[queries]),
            _heads_first(lse[queries]).contiguous(),
            0.0,
            causal,
            attn_mask=mask,
            scale=scale,
        )
        grad_q[queries] += _tokens_first(part_q)
        grad_k[keys] += _tokens_first(part_k)
        grad_v[keys] += _tokens_first(part_v)
    return grad_q, grad_k, grad_v
