"""Causal ring attention over the registered ring group, within documents and sliding windows,
as custom ops compiled graphs can carry.

Ulysses splits heads, so it cannot use more ranks than there are query heads. Ring attention
splits the sequence instead: each of R ring ranks keeps its queries, and the other ranks'
key/value blocks come to it; the outputs of the blocks merge exactly through their
log-sum-exps. An SP group of `ulysses x ring` ranks runs the Ulysses all-to-all inside each
group of `ulysses` ranks and this op across the `ring` such groups.

Causal load balance: each ring rank holds chunks of the sequence, laid end to end
(`prepare_sp_inputs` orders the tokens so, `ring_layout` says which): the zigzag (2R chunks,
rank i holding i and 2R-1-i) without document boundaries, smaller chunks dealt out by their
work with them. Packed documents (`cu_seqlens`, the global boundaries, as document attention
reads them) and a sliding window (`window`) restrict which query reads which key; `ring_plan`
cuts each block pair into pieces by them, and a block no query of a rank reads is never sent to
it, so a windowed model's traffic grows with its window, not its sequence.

At step s each rank sends its own block to rank i + s and receives that of rank i - s (the
next step's exchange issued before this step's compute, overlapped where the backend overlaps
P2P, as NCCL does); K and V travel packed in one tensor, with their own (grouped) heads. As
exact as the kernel: each piece's (output, log-sum-exp) is merged in fp32. The backward reads
the merged output and log-sum-exp (saved by the forward, never recomputed), so each piece's
gradient is the exact share of the whole: dq stays local, a visited block's dk, dv go back to
its rank (fp32), which adds them in step order. Skipped blocks make the P2P ops of a step
involve some ranks only: NCCL allows that once the ring group's communicator exists, which
`cluster.distributed` ensures by binding each rank's device at init (eager communicators).

The kernel is per device (`varlen_kernel`), the code around it one. On CUDA the document
boundaries are read back to the host once per boundaries tensor (the first layer's call waits
for the GPU; the others, forward and backward, find them read); the CUDA kernel has not run on
a GPU.
"""

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.utils.weak import WeakTensorKeyDictionary

from slurm_autosp.sp.all_to_all import communication_counts, current_ring_group
from slurm_autosp.sp.document_attention import check_window, document_spans
from slurm_autosp.sp.ring_plan import Index, RingPlan, Round, ring_plan
from slurm_autosp.sp.varlen_kernel import varlen_backward, varlen_forward

# P2P tags of the K/V blocks and their gradients: gloo matches by them, NCCL by order (`_visits`)
_KV_TAG, _GRAD_TAG = 0, 1


class RingAttentionError(RuntimeError):
    """A ring attention call that cannot be run as compiled; the message says what to change."""


# ------------------------------------------------------------------ the ring


def _ring(ring_size: int) -> tuple[dist.ProcessGroup, int]:
    """The registered ring group, checked against the size the graph was compiled for, and
    this rank's place in it."""
    group = current_ring_group()
    if dist.get_world_size(group) != ring_size:
        raise RingAttentionError(
            f"the graph was compiled for ring_size={ring_size} but the registered ring group has "
            f"{dist.get_world_size(group)} ranks; compile with the group's size"
        )
    return group, dist.get_rank(group)


def _exchange(
    send: torch.Tensor | None,
    receive_like: torch.Tensor | None,
    step: int,
    group: dist.ProcessGroup,
    tag: int,
    backwards: bool = False,
) -> tuple[torch.Tensor | None, list]:
    """Step `step`'s exchange: `send` (when not None) to ring rank i + step and a tensor like
    `receive_like` (when not None) from i - step, or the other way round `backwards`; returns
    the tensor being received and the requests to wait on before reading it."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    to, source = (rank - step) % size, (rank + step) % size
    if not backwards:
        to, source = source, to
    ops, received = [], None
    if send is not None:
        ops.append(dist.P2POp(dist.isend, send, group=group, tag=tag, group_peer=to))
        communication_counts.ring_bytes += send.nbytes
    if receive_like is not None:
        received = torch.empty_like(receive_like)
        ops.append(dist.P2POp(dist.irecv, received, group=group, tag=tag, group_peer=source))
    return received, dist.batch_isend_irecv(ops) if ops else []


def _wait(requests: list) -> None:
    for request in requests:
        request.wait()


def _check_shapes(query: torch.Tensor, key: torch.Tensor) -> None:
    if query.shape[2] % 2 or query.shape[1] % key.shape[1]:
        raise RingAttentionError(
            f"ring attention got queries {tuple(query.shape)} and keys {tuple(key.shape)}: the "
            "local sequence must be this ring rank's chunks as prepare_sp_inputs(..., "
            "ring_size=R) lays them out (an even length) and the query heads a multiple of the "
            "KV heads"
        )


def _tokens(tensor: torch.Tensor) -> torch.Tensor:
    """[B, H, S, D] (or [B, H, S]) as [B * S, H, ...], the pieces' token-major layout."""
    return tensor.transpose(1, 2).flatten(0, 1).contiguous()


def _untokens(tokens: torch.Tensor, batch: int, dtype: torch.dtype) -> torch.Tensor:
    """[B * S, H, ...] back to [B, H, S, ...] in `dtype`: a new tensor (a custom op's outputs
    may not alias each other, as K's and V's gradients would with one KV head)."""
    unflat = tokens.unflatten(0, (batch, -1)).transpose(1, 2)
    return unflat.to(dtype=dtype, memory_format=torch.contiguous_format, copy=True)


def _take(tensor: torch.Tensor, index: Index) -> torch.Tensor:
    return tensor[index] if isinstance(index, slice) else tensor.index_select(0, index)


# the documents read from each boundaries tensor, with the tensor's version when read: every
# layer's call, forward and backward, passes the same tensor, which is read back once
_READ_BOUNDARIES = WeakTensorKeyDictionary()


def _documents(
    cu_seqlens: torch.Tensor | None, batch: int, seq: int
) -> tuple[tuple[int, int, int], ...]:
    """(row, start, end) of every document; from a CUDA tensor read back to the host (a wait
    for the GPU) the first time that tensor is seen, not in every layer."""
    if cu_seqlens is None:
        return tuple(document_spans(None, batch, seq))
    read = _READ_BOUNDARIES.get(cu_seqlens)
    if read is None or read[0] != (cu_seqlens._version, batch, seq):
        read = ((cu_seqlens._version, batch, seq), tuple(document_spans(cu_seqlens, batch, seq)))
        _READ_BOUNDARIES[cu_seqlens] = read
    return read[1]


def _plan(
    query: torch.Tensor, cu_seqlens: torch.Tensor | None, window: int, ring_size: int
) -> RingPlan:
    """The ring's plan for these queries: the documents of the whole rows (R x local tokens)."""
    check_window(window)
    batch, _, local, _ = query.shape
    documents = _documents(cu_seqlens, batch, local * ring_size)
    return ring_plan(ring_size, local, documents, window, cu_seqlens is not None)


def _visits(
    plan: RingPlan, rank: int, kv: torch.Tensor, group: dist.ProcessGroup
) -> Iterator[tuple[int, tuple[Round, ...], torch.Tensor | None]]:
    """(step, what this rank computes against the visiting block, the block or None where this
    rank receives none at that step) for every step 1 .. R-1. The first exchange is issued at
    once, so it travels while the caller computes its own block; each next one before a step's
    block is handed out, so it travels while that step computes.

    Every rank walks every step, exchanging nothing where its plan skips one, so every rank
    issues its exchanges in the same global order (the backward's gradient returns between
    them): NCCL matches a pair's sends and receives by their order alone, not by tag."""
    sources, destinations = plan.sources(rank), plan.destinations(rank)
    steps = range(1, plan.ring_size)

    def start(step: int) -> tuple[torch.Tensor | None, list]:
        send = kv if step in destinations else None
        return _exchange(send, kv if step in sources else None, step, group, _KV_TAG)

    pending = start(steps[0]) if steps else (None, [])

    def visits() -> Iterator[tuple[int, tuple[Round, ...], torch.Tensor | None]]:
        nonlocal pending
        for step in steps:
            visiting, requests = pending
            _wait(requests)
            if step + 1 < plan.ring_size:
                pending = start(step + 1)
            yield step, plan.rounds[rank][(rank - step) % plan.ring_size], visiting

    return visits()


def _attend(
    rounds: tuple[Round, ...],
    query: torch.Tensor,
    kv: torch.Tensor,
    output: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
) -> None:
    """Fold the rounds' attention of `query` [T, Hq, D] over the block `kv` [2, T, Hkv, D] into
    the running fp32 `output` [T, Hq, D] and log-sum-exp `lse` [T, Hq], in place."""
    for round_ in rounds:
        q_index, k_index, _, _ = round_.on(query.device)
        block, block_lse = varlen_forward(
            _take(query, q_index), _take(kv[0], k_index), _take(kv[1], k_index), round_, scale
        )
        held, held_lse = _take(output, q_index), _take(lse, q_index)
        merged = torch.logaddexp(held_lse, block_lse)
        held = held * (held_lse - merged).exp().unsqueeze(-1)
        held += block.float() * (block_lse - merged).exp().unsqueeze(-1)
        if isinstance(q_index, slice):
            output[q_index] = held
            lse[q_index] = merged
        else:
            output.index_copy_(0, q_index, held)
            lse.index_copy_(0, q_index, merged)


def _attend_backward(
    rounds: tuple[Round, ...],
    saved: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    kv: torch.Tensor,
    grad_q: torch.Tensor,
    grad_kv: torch.Tensor,
    scale: float,
) -> None:
    """Add the rounds' shares of the gradients to `grad_q` [T, Hq, D] and the block's
    `grad_kv` [2, T, Hkv, D] (fp32), from `saved`: grad_output, query, output, log-sum-exp."""
    grad_output, query, output, lse = saved
    for round_ in rounds:
        q_index, k_index, _, _ = round_.on(query.device)
        part_q, part_k, part_v = varlen_backward(
            _take(grad_output, q_index),
            _take(query, q_index),
            _take(kv[0], k_index),
            _take(kv[1], k_index),
            _take(output, q_index),
            _take(lse, q_index),
            round_,
            scale,
        )
        for whole, part, index in (
            (grad_q, part_q, q_index),
            (grad_kv[0], part_k, k_index),
            (grad_kv[1], part_v, k_index),
        ):
            if isinstance(index, slice):
                whole[index] += part.float()
            else:
                whole.index_add_(0, index, part.float())


@torch.library.custom_op("slurm_autosp::ring_attention", mutates_args=())
def ring_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    ring_size: int,
    cu_seqlens: torch.Tensor | None = None,
    window: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of this ring rank's queries [B, Hq, L, D] (its chunks, `ring_layout`)
    over the whole sequence, whose key/value blocks [B, Hkv, L, D] (Hq a multiple of Hkv)
    the ring's `ring_size` ranks hold, within the documents of `cu_seqlens` (global, as
    document attention reads them; None: each row one) and, when `window` > 0, the `window`
    latest keys. Returns the output [B, Hq, L, D] and its log-sum-exp [B, Hq, L] (fp32),
    which the backward reads."""
    _check_shapes(query, key)
    group, rank = _ring(ring_size)
    plan = _plan(query, cu_seqlens, window, ring_size)
    communication_counts.ring_forwards += 1
    batch = query.shape[0]
    queries, kv = _tokens(query), torch.stack([_tokens(key), _tokens(value)])
    visits = _visits(plan, rank, kv, group)  # the first block travels from here
    output = queries.new_zeros(queries.shape, dtype=torch.float32)
    lse = queries.new_full(queries.shape[:2], float("-inf"), dtype=torch.float32)
    _attend(plan.rounds[rank][rank], queries, kv, output, lse, scale)
    for _, rounds, visiting in visits:
        if visiting is not None:
            _attend(rounds, queries, visiting, output, lse, scale)
    return _untokens(output, batch, query.dtype), _untokens(lse, batch, torch.float32)


@ring_attention.register_fake
def _(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    ring_size: int,
    cu_seqlens: torch.Tensor | None = None,
    window: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    batch, heads, seq, _ = query.shape
    return torch.empty_like(query, memory_format=torch.contiguous_format), query.new_empty(
        batch, heads, seq, dtype=torch.float32
    )


@torch.library.custom_op("slurm_autosp::ring_attention_backward", mutates_args=())
def ring_attention_backward(
    grad_output: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    output: torch.Tensor,
    logsumexp: torch.Tensor,
    scale: float,
    ring_size: int,
    cu_seqlens: torch.Tensor | None = None,
    window: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of query, key and value, block by block as the forward ran, from its merged
    output and log-sum-exp. A visited block's dk, dv (fp32) go back to its rank at the step it
    came, one step's in flight while the next is computed."""
    group, rank = _ring(ring_size)
    plan = _plan(query, cu_seqlens, window, ring_size)
    communication_counts.ring_backwards += 1
    batch = query.shape[0]
    kv = torch.stack([_tokens(key), _tokens(value)])
    saved = (_tokens(grad_output), _tokens(query), _tokens(output), _tokens(logsumexp))
    visits = _visits(plan, rank, kv, group)
    grad_q = saved[1].new_zeros(saved[1].shape, dtype=torch.float32)
    grad_kv = kv.new_zeros(kv.shape, dtype=torch.float32)  # this rank's block's, all shares
    _attend_backward(plan.rounds[rank][rank], saved, kv, grad_q, grad_kv, scale)
    returning: tuple[torch.Tensor | None, list, torch.Tensor | None] = (None, [], None)
    sent_to = plan.destinations(rank)  # the ranks it sent its block return their shares
    for step, rounds, visiting in visits:
        share = None
        if visiting is not None:
            share = torch.zeros_like(grad_kv)
            _attend_backward(rounds, saved, visiting, grad_q, share, scale)
        _add_returned(grad_kv, returning)  # the previous step's shares, in flight meanwhile
        received, requests = _exchange(
            share, grad_kv if step in sent_to else None, step, group, _GRAD_TAG, backwards=True
        )
        returning = (received, requests, share)
    _add_returned(grad_kv, returning)
    grad_k, grad_v = (_untokens(grad, batch, key.dtype) for grad in grad_kv.unbind(0))
    return _untokens(grad_q, batch, query.dtype), grad_k, grad_v


def _add_returned(
    grad_kv: torch.Tensor, returning: tuple[torch.Tensor | None, list, torch.Tensor | None]
) -> None:
    """Wait for a step's gradient exchange and add the share another rank sent back for this
    rank's block (the sent share is held until then)."""
    received, requests, _sent = returning
    _wait(requests)
    if received is not None:
        grad_kv += received


@ring_attention_backward.register_fake
def _(
    grad_output: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    output: torch.Tensor,
    logsumexp: torch.Tensor,
    scale: float,
    ring_size: int,
    cu_seqlens: torch.Tensor | None = None,
    window: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (
        torch.empty_like(query, memory_format=torch.contiguous_format),
        torch.empty_like(key, memory_format=torch.contiguous_format),
        torch.empty_like(value, memory_format=torch.contiguous_format),
    )


def _setup_context(ctx: object, inputs: tuple, output: tuple) -> None:
    query, key, value, scale, ring_size, cu_seqlens, window = inputs
    ctx.save_for_backward(query, key, value, *output, cu_seqlens)  # type: ignore[attr-defined]
    ctx.scale, ctx.ring_size, ctx.window = scale, ring_size, window  # type: ignore[attr-defined]


def _backward(
    ctx: object, grad_output: torch.Tensor, _grad_logsumexp: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None, None, None, None]:
    query, key, value, output, logsumexp, cu_seqlens = ctx.saved_tensors  # type: ignore[attr-defined]
    grad_q, grad_k, grad_v = ring_attention_backward(
        grad_output,
        query,
        key,
        value,
        output,
        logsumexp,
        ctx.scale,  # type: ignore[attr-defined]
        ctx.ring_size,  # type: ignore[attr-defined]
        cu_seqlens,
        ctx.window,  # type: ignore[attr-defined]
    )
    return grad_q, grad_k, grad_v, None, None, None, None


ring_attention.register_autograd(_backward, setup_context=_setup_context)
