"""A CPU model of what torch's CUDA flash attention varlen kernels do with their arguments,
written from their source, so tests run the exact arguments the CUDA paths build and compare
the numbers with exact masked attention where no GPU is.

`FlashContract` is a dispatch mode: inside it, `aten._flash_attention_forward` and
`aten._flash_attention_backward` called with varlen arguments on CPU tensors compute what the
CUDA kernel computes, in float64 (float64 inputs stand for bf16/fp16 values taken as exact; the
log-sum-exp comes back in float64 then, fp32 otherwise). Every call's rule after flash's own
rewriting is recorded. A branch the model does not reproduce raises `FlashContractError`
instead of guessing.

The rules, from torch's copy of flash-attention 2 (aten/src/ATen/native/transformers/cuda/
flash_attn/, the same in torch 2.11 to 2.14):
- attention.cu `_flash_attention_forward`, attention_backward.cu `_flash_attention_backward`:
  a window side not given is -1; the backward makes grad_out and out contiguous.
- flash_api.cpp `mha_varlen_fwd`:
  `if (max_seqlen_q == 1 && !alibi_slopes_.has_value()) { is_causal = false; }`, then
  `if (is_causal) { window_size_right = 0; }`;
  `seqlenq_ngroups_swapped = max_seqlen_q == 1 && num_heads > num_heads_k && window_size_left < 0
  && window_size_right < 0 && p_dropout == 0.f && head_size_og % 8 == 0` swaps the query heads
  into the sequence dimension (for decoding): not modelled, refused;
  `if (window_size_left >= max_seqlen_k) { window_size_left = -1; }` and the same for the right;
  dtype fp16/bf16, cu_seqlens int32 and contiguous, head size a multiple of 8 up to 256, query
  heads a multiple of the KV heads, last dimensions contiguous; the log-sum-exp is
  `at::empty({num_heads, total_q}, kFloat)`.
- flash_api.cpp `mha_varlen_bwd`: `if (is_causal) { window_size_right = 0; }` (no
  `max_seqlen_q == 1` rule), the same window rewrite against `max_seqlen_k`, the same checks;
  GQA key and value gradients are summed over each KV head's query heads (`at::sum_out`).
- flash_api.cpp `set_params_fprop` (the backward's too): `params.is_causal = window_size_left < 0
  && window_size_right == 0`, then `if (window_size_left < 0 && window_size_right >= 0)
  window_size_left = seqlen_k;` and `if (window_size_left >= 0 && window_size_right < 0)
  window_size_right = seqlen_k;` where seqlen_k is `max_seqlen_k`;
  flash_fwd_launch_template.h: local attention when `(window_size_left >= 0 ||
  window_size_right >= 0) && !Is_causal`.
- mask.h `Mask::apply_mask`, with each sequence's own lengths (block_info.h `actual_seqlen_q/k`):
  a query row r keeps the keys `max(0, r + seqlen_k - seqlen_q - window_size_left)` (local only)
  up to, not including, `min(seqlen_k, r + 1 + seqlen_k - seqlen_q + window_size_right)` (causal or
  local): both aligned at the ends, bottom-right.
- softmax.h `Softmax::normalize_softmax_lse`: a row with no key gets the output 0 and the
  log-sum-exp `INFINITY` (flash_fwd_kernel.h writes the same where a block has no key).
- flash_bwd_kernel.h / softmax.h `scale_apply_exp2`: the backward recomputes
  P = exp(scale * QK - lse) from the log-sum-exp it is given (a -inf one taken as 0), and
  flash_bwd_preprocess_kernel.h `dot_do_o` D = rowsum(dO * O) from the output it is given:
  dV = P^T dO, dS = P (dO V^T - D), dQ = scale dS K, dK = scale dS^T Q.
- The grids come from `max_seqlen_q`/`max_seqlen_k` (flash_fwd_launch_template.h, the
  backward's too): a sequence longer than them would be left partly uncomputed; refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import pairwise

import torch
from torch.utils._python_dispatch import TorchDispatchMode

FORWARD = torch.ops.aten._flash_attention_forward.default
BACKWARD = torch.ops.aten._flash_attention_backward.default
_FLASH_DTYPES = (torch.bfloat16, torch.float16, torch.float64)  # float64: bf16/fp16, exact


class FlashContractError(RuntimeError):
    """What the CUDA kernel refuses, or a branch of it this model does not reproduce."""


@dataclass(frozen=True)
class KernelRule:
    """The mask the kernel applies once its arguments are rewritten: causal, local (a window of
    `left` keys before and `right` after each query's aligned key) or neither (every key)."""

    causal: bool
    local: bool
    left: int
    right: int

    def allowed(self, cum_seq_q: torch.Tensor, cum_seq_k: torch.Tensor, shape: tuple[int, int]):
        """[total_q, total_k]: which key each query row keeps, within its own sequence only
        (mask.h, each sequence's lengths aligned at the ends)."""
        q_seq, q_row, q_len = _positions(cum_seq_q, shape[0])
        k_seq, k_col, _ = _positions(cum_seq_k, shape[1])
        keep = (q_seq.unsqueeze(1) == k_seq.unsqueeze(0)) & (q_seq >= 0).unsqueeze(1)
        if not (self.causal or self.local):
            return keep
        k_len = (cum_seq_k.diff()[q_seq.clamp(min=0)]).unsqueeze(1)
        aligned = (q_row + k_len.squeeze(1) - q_len).unsqueeze(1)
        cols = k_col.unsqueeze(0)
        keep &= cols < torch.minimum(aligned + 1 + self.right, k_len)
        if self.local:
            keep &= cols >= torch.clamp(aligned - self.left, min=0)
        return keep


def _positions(cum_seq: torch.Tensor, total: int) -> tuple[torch.Tensor, ...]:
    """Per token: its sequence (-1 for tokens of none), its place in it and the sequence's
    length."""
    bounds = cum_seq.long()
    tokens = torch.arange(total)
    seq = torch.searchsorted(bounds, tokens, right=True) - 1
    inside = (seq >= 0) & (seq < bounds.numel() - 1) & (tokens < bounds[-1])
    seq = torch.where(inside, seq, -1)
    safe = seq.clamp(min=0)
    return seq, tokens - bounds[safe], bounds.diff()[safe]


def kernel_rule(max_seqlen_k: int, left: int, right: int) -> KernelRule:
    """flash_api.cpp's window rewrite against `max_seqlen_k` and set_params_fprop's."""
    if left >= max_seqlen_k:
        left = -1
    if right >= max_seqlen_k:
        right = -1
    causal = left < 0 and right == 0
    if left < 0 and right >= 0:
        left = max_seqlen_k
    if left >= 0 and right < 0:
        right = max_seqlen_k
    return KernelRule(causal, (left >= 0 or right >= 0) and not causal, left, right)


@dataclass(frozen=True)
class FlashCall:
    """One call as the kernel saw it: its sequences' (q_len, k_len) and its rule."""

    backward: bool
    lengths: tuple[tuple[int, int], ...]
    rule: KernelRule
    heads: tuple[int, int]


@dataclass
class FlashContract(TorchDispatchMode):
    """The flash varlen forward and backward computed as the CUDA kernel would, on CPU."""

    calls: list[FlashCall] = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__init__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is FORWARD:
            return self._forward(*args, **kwargs)
        if func is BACKWARD:
            return self._backward(*args, **kwargs)
        return func(*args, **kwargs)

    def _forward(
        self,
        query,
        key,
        value,
        cum_seq_q,
        cum_seq_k,
        max_q,
        max_k,
        dropout_p,
        is_causal,
        return_debug_mask,
        *,
        scale=None,
        window_size_left=None,
        window_size_right=None,
        seqused_k=None,
        alibi_slopes=None,
    ):
        _refuse_unmodelled(cum_seq_q, dropout_p, seqused_k, alibi_slopes)
        if return_debug_mask:
            raise FlashContractError("return_debug_mask is only for dropout: not modelled")
        _check_inputs(query, key, value, cum_seq_q, cum_seq_k)
        left = -1 if window_size_left is None else window_size_left
        right = -1 if window_size_right is None else window_size_right
        if max_q == 1:
            is_causal = False
        if is_causal:
            right = 0
        if max_q == 1 and query.shape[1] > key.shape[1] and left < 0 and right < 0:
            raise FlashContractError(
                "max_seqlen_q == 1 with grouped KV heads and no window takes flash's "
                "seqlenq_ngroups_swapped branch (decoding), which this model does not reproduce"
            )
        rule = kernel_rule(max_k, left, right)
        lengths = _lengths(cum_seq_q, cum_seq_k, max_q, max_k)
        self.calls.append(FlashCall(False, lengths, rule, (query.shape[1], key.shape[1])))
        output, lse = _forward(query, key, value, cum_seq_q, cum_seq_k, rule, _scale(scale, query))
        no_rng = torch.zeros(2, dtype=torch.uint64)
        return output, lse, no_rng, torch.empty(()), torch.empty(0, dtype=query.dtype)

    def _backward(
        self,
        grad_out,
        query,
        key,
        value,
        out,
        logsumexp,
        cum_seq_q,
        cum_seq_k,
        max_q,
        max_k,
        dropout_p,
        is_causal,
        philox_seed,
        philox_offset,
        *,
        scale=None,
        window_size_left=None,
        window_size_right=None,
    ):
        _refuse_unmodelled(cum_seq_q, dropout_p, None, None)
        _check_inputs(query, key, value, cum_seq_q, cum_seq_k)
        for name, tensor in (("grad_out", grad_out), ("out", out)):
            if tensor.shape != query.shape or tensor.dtype != query.dtype:
                raise FlashContractError(
                    f"{name} {tuple(tensor.shape)} {tensor.dtype} must be "
                    f"shaped and typed as the query {tuple(query.shape)}"
                )
        if tuple(logsumexp.shape) != (query.shape[1], query.shape[0]):
            raise FlashContractError(
                f"logsumexp {tuple(logsumexp.shape)} must be [num_heads, total_q] = "
                f"{[query.shape[1], query.shape[0]]}, as the varlen forward writes it"
            )
        left = -1 if window_size_left is None else window_size_left
        right = 0 if is_causal else (-1 if window_size_right is None else window_size_right)
        rule = kernel_rule(max_k, left, right)
        lengths = _lengths(cum_seq_q, cum_seq_k, max_q, max_k)
        self.calls.append(FlashCall(True, lengths, rule, (query.shape[1], key.shape[1])))
        return _backward(
            grad_out,
            query,
            key,
            value,
            out,
            logsumexp,
            cum_seq_q,
            cum_seq_k,
            rule,
            _scale(scale, query),
        )


def _refuse_unmodelled(cum_seq_q, dropout_p, seqused_k, alibi_slopes) -> None:
    if cum_seq_q is None:
        raise FlashContractError("the padded (non-varlen) flash call is not modelled")
    if dropout_p:
        raise FlashContractError(f"dropout_p={dropout_p}: dropout is not modelled")
    if seqused_k is not None or alibi_slopes is not None:
        raise FlashContractError("seqused_k and alibi_slopes are not modelled")


def _check_inputs(query, key, value, cum_seq_q, cum_seq_k) -> None:
    """flash_api.cpp's TORCH_CHECKs that the varlen calls of this project could meet."""
    if query.dtype not in _FLASH_DTYPES:
        raise FlashContractError("FlashAttention only support fp16 and bf16 data type")
    if key.dtype != query.dtype or value.dtype != query.dtype:
        raise FlashContractError("query and key/value must have the same dtype")
    for name, cu in (("cu_seqlens_q", cum_seq_q), ("cu_seqlens_k", cum_seq_k)):
        if cu.dtype != torch.int32 or not cu.is_contiguous() or cu.dim() != 1:
            raise FlashContractError(f"{name} must be a contiguous int32 vector")
    if cum_seq_q.numel() != cum_seq_k.numel() or cum_seq_q.numel() < 2:
        raise FlashContractError("cu_seqlens_q and cu_seqlens_k must both be batch_size + 1 > 1")
    if query.dim() != 3 or key.shape != value.shape or key.shape[2] != query.shape[2]:
        raise FlashContractError(
            f"query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)} "
            "must be [total, heads, head_size] with one head size"
        )
    head_size = query.shape[2]
    if head_size % 8 or head_size > 256:
        raise FlashContractError(f"head size {head_size}: a multiple of 8 up to 256")
    if query.shape[1] % key.shape[1]:
        raise FlashContractError(
            "Number of heads in key/value must divide number of heads in query"
        )
    if any(t.stride(-1) != 1 for t in (query, key, value)):
        raise FlashContractError("Input tensor must have contiguous last dimension")
    for name, cu, total in (("q", cum_seq_q, query.shape[0]), ("k", cum_seq_k, key.shape[0])):
        bounds = cu.tolist()
        if bounds[0] < 0 or bounds[-1] > total or any(b > a for a, b in pairwise(bounds[::-1])):
            raise FlashContractError(
                f"cu_seqlens_{name} {bounds} must rise within the {total} tokens given"
            )


def _lengths(cum_seq_q, cum_seq_k, max_q: int, max_k: int) -> tuple[tuple[int, int], ...]:
    """Each sequence's (q_len, k_len), none longer than the maxima the grids are sized by."""
    lengths = tuple(
        (q1 - q0, k1 - k0)
        for (q0, q1), (k0, k1) in zip(
            pairwise(cum_seq_q.tolist()), pairwise(cum_seq_k.tolist()), strict=True
        )
    )
    longest_q = max(q for q, _ in lengths)
    longest_k = max(k for _, k in lengths)
    if longest_q > max_q or longest_k > max_k:
        raise FlashContractError(
            f"max_seqlen_q={max_q}, max_seqlen_k={max_k} under the longest sequence "
            f"({longest_q}, {longest_k}): the kernel's grid would leave part of it uncomputed"
        )
    return lengths


def _scale(scale, query) -> float:
    return query.shape[-1] ** -0.5 if scale is None else scale


def _forward(query, key, value, cum_seq_q, cum_seq_k, rule: KernelRule, scale: float):
    group = query.shape[1] // key.shape[1]
    allowed = rule.allowed(cum_seq_q, cum_seq_k, (query.shape[0], key.shape[0]))
    q, k, v = (t.double() for t in (query, key, value))
    scores = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(group, dim=1)) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [H, total_q]: -inf where a row keeps no key
    probs = torch.where(allowed, (scores - lse.unsqueeze(-1)).exp(), 0.0)
    output = torch.einsum("hqk,khd->qhd", probs, v.repeat_interleave(group, dim=1))
    lse = lse.masked_fill(lse == float("-inf"), float("inf"))  # normalize_softmax_lse
    covered = _positions(cum_seq_q, query.shape[0])[0] >= 0  # other rows: never written
    output[~covered] = float("nan")
    lse[:, ~covered] = float("nan")
    lse_dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    return output.to(query.dtype), lse.to(lse_dtype)


def _backward(grad_out, query, key, value, out, lse, cum_seq_q, cum_seq_k, rule, scale):
    kv_heads, group = key.shape[1], query.shape[1] // key.shape[1]
    allowed = rule.allowed(cum_seq_q, cum_seq_k, (query.shape[0], key.shape[0]))
    q, k, v, d_out, o = (t.double() for t in (query, key, value, grad_out, out))
    lse = lse.double().masked_fill(lse == float("-inf"), 0.0)  # scale_apply_exp2
    k_all, v_all = (t.repeat_interleave(group, dim=1) for t in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q, k_all) * scale
    probs = torch.where(allowed, (scores - lse.unsqueeze(-1)).exp(), 0.0)
    d_probs = torch.einsum("qhd,khd->hqk", d_out, v_all)
    delta = (d_out * o).sum(-1).transpose(0, 1).unsqueeze(-1)  # dot_do_o: [H, total_q, 1]
    d_scores = torch.where(allowed, probs * (d_probs - delta), 0.0)
    grad_q = torch.einsum("hqk,khd->qhd", d_scores, k_all) * scale
    grad_k = torch.einsum("hqk,qhd->khd", d_scores, q) * scale
    grad_v = torch.einsum("hqk,qhd->khd", probs, d_out)
    grad_k, grad_v = (g.unflatten(1, (kv_heads, group)).sum(2) for g in (grad_k, grad_v))
    return grad_q.to(query.dtype), grad_k.to(key.dtype), grad_v.to(value.dtype)
