"""What every rank runs in the ring attention tests: the op alone against full causal attention,
and ring attention's re-runs under each checkpointing policy (the whole-model equivalence
cases are sp_cases' and train_cases' with a ring_size)."""

import torch
import torch.distributed as dist
from sp_cases import register_sp_groups, tiny_model, ulysses_and_ring_groups

import slurm_autosp.sp.ring_attention as ring_module
from slurm_autosp.compile import AutoSPBackend, compile_model
from slurm_autosp.compile.activation_checkpointing import ActivationCheckpointSpec
from slurm_autosp.config import ActivationCheckpointing
from slurm_autosp.sp import (
    communication_counts,
    prepare_sp_inputs,
    sp_group_context,
    sp_token_positions,
)
from slurm_autosp.sp.ring_attention import ring_attention


def _causal_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    documents: torch.Tensor | None = None,
    window: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain causal attention in float64 (grouped KV heads repeated) within the documents
    (`documents` [B, S]: each token's document) and the window: output and log-sum-exp."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))
    scores = (q @ k.transpose(-1, -2)) * scale
    seq = q.shape[2]
    position = torch.arange(seq)
    allowed = (position[None, :] <= position[:, None]).expand(q.shape[0], seq, seq)
    if window:
        allowed = allowed & (position[:, None] - position[None, :] < window)
    if documents is not None:
        allowed = allowed & (documents[:, :, None] == documents[:, None, :])
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    return scores.softmax(-1) @ v, scores.logsumexp(-1)


def _documents(lengths: list[list[int]], seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's document ([B, S]) of rows cut into documents of `lengths` (the rest of a row
    one more), and the global cu_seqlens of the rows laid end to end."""
    ids, bounds = [], [0]
    for row, row_lengths in enumerate(lengths):
        cut = [*row_lengths, seq - sum(row_lengths)] if sum(row_lengths) < seq else row_lengths
        ids.append(torch.cat([torch.full((n,), d) for d, n in enumerate(cut)]))
        bounds += [row * seq + int(end) for end in torch.tensor(cut).cumsum(0)]
    return torch.stack(ids), torch.tensor(bounds, dtype=torch.int32)


def ring_op_against_full_attention(
    kv_heads: int,
    chunk: int = 5,
    dtype: torch.dtype = torch.float32,
    lengths: list[list[int]] | None = None,
    window: int = 0,
    tags_by_order: bool = False,
) -> dict[str, float]:
    """The ring op over the world as one ring (zigzag shards of a sequence of 2 x world chunks),
    forward and backward in `dtype`, against float64 causal attention over the whole sequence
    of the same (rounded) inputs, within the documents of `lengths` (per row; None: a row is
    one) and the `window`; each figure max |x - x_ref| / max |x_ref| over this rank's rows.
    `tags_by_order` gives the gradients' sends the blocks' tag: gloo then matches a pair's
    messages by their order alone, as NCCL does."""
    ring = dist.get_world_size()
    batch, heads, dim = 2, 4, 8
    seq = 2 * ring * chunk
    generator = torch.Generator().manual_seed(3)
    q, grad_out = (
        torch.randn(batch, heads, seq, dim, generator=generator).to(dtype) for _ in range(2)
    )
    k, v = (torch.randn(batch, kv_heads, seq, dim, generator=generator).to(dtype) for _ in range(2))
    scale = dim**-0.5
    documents, cu_seqlens = _documents(lengths, seq) if lengths else (None, None)
    full = [t.double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = _causal_reference(*full, scale, documents, window)
    ref_out.backward(grad_out.double())

    held = sp_token_positions(seq, dist.get_rank(), ring, ring, cu_seqlens)
    local = [t[:, :, held].clone().requires_grad_() for t in (q, k, v)]
    ulysses_group, ring_group = ulysses_and_ring_groups(1, ring)
    grad_tag = ring_module._GRAD_TAG
    try:
        ring_module._GRAD_TAG = ring_module._KV_TAG if tags_by_order else grad_tag
        with sp_group_context(ulysses_group, ring_group):
            out, lse = ring_attention(*local, scale, ring, cu_seqlens, window)
            out.backward(grad_out[:, :, held])
    finally:
        ring_module._GRAD_TAG = grad_tag

    def error(x: torch.Tensor, ref: torch.Tensor) -> float:
        return float((x.detach().double() - ref.detach()).abs().max() / ref.detach().abs().max())

    return {
        "out": error(out, ref_out[:, :, held]),
        "lse": error(lse, ref_lse[:, :, held]),
        "dq": error(local[0].grad, full[0].grad[:, :, held]),
        "dk": error(local[1].grad, full[1].grad[:, :, held]),
        "dv": error(local[2].grad, full[2].grad[:, :, held]),
    }


def ring_reruns_under(policy: str) -> dict[str, int]:
    """One step of the tiny Llama as SP=2 over a ring of 2 (Ulysses 1), compiled under the
    checkpointing `policy`: the ring forwards that ran during backward, and the backwards."""
    spec = ActivationCheckpointSpec(ActivationCheckpointing(policy))
    model = tiny_model("llama", 2)
    compile_model(model, AutoSPBackend(2, spec, ring_size=2), per_layer=True)
    register_sp_groups(2, 2)
    shard = prepare_sp_inputs(
        torch.randint(1, 256, (1, 64), generator=torch.Generator().manual_seed(0)),
        sp_rank=dist.get_rank(),
        sp_size=2,
        ring_size=2,
    )
    loss = model(**shard.model_kwargs(torch.tensor(64))).loss
    forwards, backwards = communication_counts.ring_forwards, communication_counts.ring_backwards
    loss.backward()
    return {
        "forwards_in_backward": communication_counts.ring_forwards - forwards,
        "backwards": communication_counts.ring_backwards - backwards,
    }
