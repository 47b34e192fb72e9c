"""Causal ring attention over the registered ring group, as custom ops compiled graphs can carry.

Ulysses splits heads, so it cannot use more ranks than there are query heads. Ring attention
splits the sequence instead: each of R ring ranks keeps its queries, and the key/value blocks
travel around the ring, one hop per step; the outputs of the R blocks merge exactly through
their log-sum-exps. An SP group of `ulysses x ring` ranks runs the Ulysses all-to-all inside
each group of `ulysses` ranks and this op across the `ring` such groups.

Causal load balance (zigzag): the sequence is cut into 2R chunks and ring rank i holds chunks
i and 2R-1-i, laid end to end (`prepare_sp_inputs` orders the tokens so). Against the block
of ring rank j, rank i then computes: j == i, causal attention over its own 2 chunks; j < i,
all its queries over j's first chunk (j's second lies after both of i's); j > i, its second
chunk's queries over both of j's chunks (its first lies before both). Every step but the first
is half a block, the same work on every rank.

As exact as the block kernel: each block's (output, log-sum-exp) is merged in fp32. The backward reads the merged output and log-sum-exp (saved by the forward, never
recomputed), so each block's gradient is the exact share of the whole: dq stays local, and the
block's dk, dv travel around the ring with it, gathering every rank's share, one final hop
bringing them home. K and V travel packed in one tensor, with their own (grouped) heads: no
repeated KV is materialised or sent. The next block's send and receive are issued before the
current block's compute (overlapped where the backend overlaps P2P, as NCCL does); in backward
a block's dk, dv leave once this rank's share is added, and travel during the next block's
compute.

The block kernel is per device, the code around it one: on CPU torch's flash kernel for CPU
(grouped KV heads natively, log-sum-exp returned), on CUDA the flash varlen kernel (bf16/fp16)
with each row one sequence, as document attention runs it. The CUDA kernel has not run on a GPU.
"""

import torch
import torch.distributed as dist

from slurm_autosp.compat.torch_api import (
    flash_attention_backward,
    flash_attention_forward,
    flash_refusal,
)
from slurm_autosp.sp.all_to_all import communication_counts, current_ring_group

aten = torch.ops.aten
_KV_TAG, _GRAD_TAG = 0, 1  # P2P tags: the K/V blocks and their gradients, matched apart on gloo


class RingAttentionError(RuntimeError):
    """A ring attention call that cannot be run as compiled; the message says what to change."""


# ------------------------------------------------------------------ the per-device block kernel


def _check_cuda(query: torch.Tensor) -> None:
    why, precision = flash_refusal(query)
    if why:
        raise RingAttentionError(
            f"ring attention on CUDA runs the flash kernel, which {why}: "
            + ("train with train.precision=bf16, or " if precision else "set ")
            + "parallel.ring_size=1 with a parallel.sp_size the heads split over"
        )


def _rows(batch: int, seq: int, device: torch.device) -> torch.Tensor:
    """Cumulative lengths of `batch` rows of `seq` tokens: each row one varlen sequence."""
    return torch.arange(0, batch * seq + 1, seq, dtype=torch.int32, device=device)


def _packed(tensor: torch.Tensor) -> torch.Tensor:
    """[B, H, S, D] as the varlen kernel reads it: [B * S, H, D]."""
    return tensor.transpose(1, 2).flatten(0, 1).contiguous()


def _unpacked(packed: torch.Tensor, batch: int) -> torch.Tensor:
    return packed.unflatten(0, (batch, -1)).transpose(1, 2)


def block_forward(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of `query` [B, Hq, Sq, D] over one block of `key`, `value` [B, Hkv, Sk, D]
    (query head h reads KV head h // (Hq / Hkv)); causal only for Sq == Sk. Returns the output
    and its log-sum-exp [B, Hq, Sq] in fp32."""
    if query.device.type != "cuda":
        return aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, 0.0, causal, scale=scale
        )
    _check_cuda(query)
    batch, _, s_q, _ = query.shape
    s_k = key.shape[2]
    output, lse, *_ = flash_attention_forward(
        _packed(query),
        _packed(key),
        _packed(value),
        _rows(batch, s_q, query.device),
        _rows(batch, s_k, query.device),
        s_q,
        s_k,
        0.0,
        causal,
        False,
        scale=scale,
    )
    # [Hq, B * Sq] as flash writes it
    return _unpacked(output, batch), lse.unflatten(1, (batch, s_q)).transpose(0, 1)


def block_backward(
    grad_output: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    output: torch.Tensor,
    logsumexp: torch.Tensor,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one block's query, key and value, given the whole attention's `output` and
    `logsumexp` for these queries: then they are this block's exact share of the whole's."""
    if query.device.type != "cuda":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_output.contiguous(),
            query,
            key,
            value,
            output,
            logsumexp,
            0.0,
            causal,
            scale=scale,
        )
    batch, heads, s_q, _ = query.shape
    s_k = key.shape[2]
    grads = flash_attention_backward(
        _packed(grad_output),
        _packed(query),
        _packed(key),
        _packed(value),
        _packed(output),
        logsumexp.transpose(0, 1).reshape(heads, -1).contiguous(),
        _rows(batch, s_q, query.device),
        _rows(batch, s_k, query.device),
        s_q,
        s_k,
        0.0,
        causal,
        torch.zeros(2, dtype=torch.uint64, device=query.device),  # no dropout
        torch.empty(0, device=query.device),
        scale=scale,
    )
    grad_q, grad_k, grad_v = (_unpacked(grad, batch) for grad in grads)
    return grad_q, grad_k, grad_v


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


def _pass_on(send: torch.Tensor, group: dist.ProcessGroup, tag: int) -> tuple[torch.Tensor, list]:
    """Send `send` to the next ring rank and receive the previous one's into a new tensor;
    returns it and the requests to wait on before reading it."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    received = torch.empty_like(send)
    ops = [
        dist.P2POp(dist.isend, send, group=group, tag=tag, group_peer=(rank + 1) % size),
        dist.P2POp(dist.irecv, received, group=group, tag=tag, group_peer=(rank - 1) % size),
    ]
    communication_counts.ring_bytes += send.nbytes
    return received, dist.batch_isend_irecv(ops)


def _wait(requests: list) -> None:
    for request in requests:
        request.wait()


def _check_shapes(query: torch.Tensor, key: torch.Tensor) -> None:
    if query.shape[2] % 2 or query.shape[1] % key.shape[1]:
        raise RingAttentionError(
            f"ring attention got queries {tuple(query.shape)} and keys {tuple(key.shape)}: the "
            "local sequence must be the two zigzag chunks of prepare_sp_inputs(..., ring_size=R) "
            "(an even length) and the query heads a multiple of the KV heads"
        )


def _merge(
    output: torch.Tensor, lse: torch.Tensor, block: torch.Tensor, block_lse: torch.Tensor
) -> None:
    """Fold one block's (output, log-sum-exp) into the running fp32 ones, in place."""
    merged = torch.logaddexp(lse, block_lse)
    output.mul_((lse - merged).exp().unsqueeze(-1))
    output.add_(block.float() * (block_lse - merged).exp().unsqueeze(-1))
    lse.copy_(merged)


def _source_blocks(rank: int, ring_size: int, chunk: int) -> list[tuple[slice, slice]]:
    """For each step after the first, which of this rank's query rows attend to which of the
    visiting block's key rows (zigzag: see the module docstring)."""
    whole, first, second = slice(None), slice(None, chunk), slice(chunk, None)
    return [
        (whole, first) if (rank - step) % ring_size < rank else (second, whole)
        for step in range(1, ring_size)
    ]


@torch.library.custom_op("slurm_autosp::ring_attention", mutates_args=())
def ring_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, ring_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of this ring rank's zigzag queries [B, Hq, 2c, D] over the whole
    sequence, whose key/value blocks [B, Hkv, 2c, D] (Hq a multiple of Hkv) the ring's
    `ring_size` ranks hold. Returns the output [B, Hq, 2c, D] and its log-sum-exp [B, Hq, 2c]
    (fp32), which the backward reads."""
    _check_shapes(query, key)
    group, rank = _ring(ring_size)
    communication_counts.ring_forwards += 1
    kv = torch.stack([key, value])
    if ring_size > 1:  # the first visiting block travels while the own one is computed
        incoming, requests = _pass_on(kv, group, _KV_TAG)
    block, block_lse = block_forward(query, key, value, True, scale)
    # fp32, laid out as the fake declares them (the kernels' may be token-major)
    output, lse = block.float().contiguous(), block_lse.float().contiguous()
    for step, (rows, keys) in enumerate(_source_blocks(rank, ring_size, query.shape[2] // 2), 1):
        _wait(requests)
        kv = incoming
        if step < ring_size - 1:
            incoming, requests = _pass_on(kv, group, _KV_TAG)
        block, block_lse = block_forward(
            query[:, :, rows], kv[0, :, :, keys], kv[1, :, :, keys], False, scale
        )
        _merge(output[:, :, rows], lse[:, :, rows], block, block_lse)
    return output.to(query.dtype), lse


@ring_attention.register_fake
def _(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, ring_size: int
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of query, key and value, block by block as the forward ran, from its merged
    output and log-sum-exp. A visiting block's dk, dv (fp32) follow it around the ring, each
    rank adding its share; after the last step one more hop takes each home."""
    group, rank = _ring(ring_size)
    communication_counts.ring_backwards += 1
    kv = torch.stack([key, value])
    if ring_size > 1:
        incoming, requests = _pass_on(kv, group, _KV_TAG)
    grad_q, grad_k, grad_v = block_backward(
        grad_output, query, key, value, output, logsumexp, True, scale
    )
    grad_q = grad_q.float().contiguous()
    grad_kv = torch.stack([grad_k, grad_v]).float()  # the block in hand's, travelling with it
    for step, (rows, keys) in enumerate(_source_blocks(rank, ring_size, query.shape[2] // 2), 1):
        outgoing = grad_kv  # held until its send is waited on
        grad_kv, grad_requests = _pass_on(outgoing, group, _GRAD_TAG)
        _wait(requests)
        kv = incoming
        if step < ring_size - 1:
            incoming, requests = _pass_on(kv, group, _KV_TAG)
        part_q, part_k, part_v = block_backward(
            grad_output[:, :, rows],
            query[:, :, rows],
            kv[0, :, :, keys],
            kv[1, :, :, keys],
            output[:, :, rows],
            logsumexp[:, :, rows],
            False,
            scale,
        )
        grad_q[:, :, rows] += part_q
        _wait(grad_requests)
        grad_kv[0, :, :, keys] += part_k
        grad_kv[1, :, :, keys] += part_v
    if ring_size > 1:  # home: the block of this rank's successor, every rank's share added
        outgoing = grad_kv
        grad_kv, grad_requests = _pass_on(outgoing, group, _GRAD_TAG)
        _wait(grad_requests)
    grad_k, grad_v = grad_kv.to(key.dtype).unbind(0)
    return grad_q.to(query.dtype), grad_k, grad_v.clone()  # a custom op's outputs may not alias


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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (
        torch.empty_like(query, memory_format=torch.contiguous_format),
        torch.empty_like(key, memory_format=torch.contiguous_format),
        torch.empty_like(value, memory_format=torch.contiguous_format),
    )


def _setup_context(ctx: object, inputs: tuple, output: tuple) -> None:
    query, key, value, scale, ring_size = inputs
    ctx.save_for_backward(query, key, value, *output)  # type: ignore[attr-defined]
    ctx.scale, ctx.ring_size = scale, ring_size  # type: ignore[attr-defined]


def _backward(
    ctx: object, grad_output: torch.Tensor, _grad_logsumexp: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None, None]:
    query, key, value, output, logsumexp = ctx.saved_tensors  # type: ignore[attr-defined]
    grad_q, grad_k, grad_v = ring_attention_backward(
        grad_output,
        query,
        key,
        value,
        output,
        logsumexp,
        ctx.scale,  # type: ignore[attr-defined]
        ctx.ring_size,  # type: ignore[attr-defined]
    )
    return grad_q, grad_k, grad_v, None, None


ring_attention.register_autograd(_backward, setup_context=_setup_context)
