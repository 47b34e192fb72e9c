"""What every rank runs in the ring attention tests: the op alone against full causal attention
(the whole-model cases are sp_cases' and train_cases' with a ring_size)."""

import torch
import torch.distributed as dist
from sp_cases import ulysses_and_ring_groups

from slurm_autosp.sp import sp_group_context, sp_token_positions
from slurm_autosp.sp.ring_attention import ring_attention


def _causal_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain causal attention in float64 (grouped KV heads repeated): output and log-sum-exp."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))
    scores = (q @ k.transpose(-1, -2)) * scale
    seq = q.shape[2]
    future = torch.ones(seq, seq, dtype=torch.bool).triu(1)
    scores = scores.masked_fill(future, float("-inf"))
    return scores.softmax(-1) @ v, scores.logsumexp(-1)


def ring_op_against_full_attention(kv_heads: int, chunk: int = 5) -> dict[str, float]:
    """The ring op over the world as one ring (zigzag shards of a sequence of 2 x world chunks),
    forward and backward, against float64 causal attention over the whole sequence; each figure
    max |x - x_ref| / max |x_ref| over this rank's rows."""
    ring = dist.get_world_size()
    batch, heads, dim = 2, 4, 8
    seq = 2 * ring * chunk
    generator = torch.Generator().manual_seed(3)
    q, grad_out = (torch.randn(batch, heads, seq, dim, generator=generator) for _ in range(2))
    k, v = (torch.randn(batch, kv_heads, seq, dim, generator=generator) for _ in range(2))
    scale = dim**-0.5
    full = [t.double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = _causal_reference(*full, scale)
    ref_out.backward(grad_out.double())

    held = sp_token_positions(seq, dist.get_rank(), ring, ring)
    local = [t[:, :, held].clone().requires_grad_() for t in (q, k, v)]
    ulysses_group, ring_group = ulysses_and_ring_groups(1, ring)
    with sp_group_context(ulysses_group, ring_group):
        out, lse = ring_attention(*local, scale, ring)
        out.backward(grad_out[:, :, held])

    def error(x: torch.Tensor, ref: torch.Tensor) -> float:
        return float((x.detach().double() - ref.detach()).abs().max() / ref.detach().abs().max())

    return {
        "out": error(out, ref_out[:, :, held]),
        "lse": error(lse, ref_lse[:, :, held]),
        "dq": error(local[0].grad, full[0].grad[:, :, held]),
        "dk": error(local[1].grad, full[1].grad[:, :, held]),
        "dv": error(local[2].grad, full[2].grad[:, :, held]),
    }
