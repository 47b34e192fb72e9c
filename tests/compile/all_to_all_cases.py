"""What every rank runs in the all-to-all tests."""

import torch
import torch.distributed as dist

from slurm_autosp.sp import sp_all_to_all, sp_group_context

B, H, S, D = 2, 4, 12, 3


def _full(seed: int) -> torch.Tensor:
    return torch.randn(B, H, S, D, generator=torch.Generator().manual_seed(seed))


def scatter_heads_gather_sequence() -> dict[str, float]:
    """Forward: the seq shard in, this rank's heads over the whole sequence out; the inverse
    restores the input; backward of <y, w> is w's seq shard (the inverse all-to-all)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    seq_shard = slice(rank * S // world, (rank + 1) * S // world)
    heads = slice(rank * H // world, (rank + 1) * H // world)
    full, weight = _full(0), _full(1)
    x = full[:, :, seq_shard].clone().requires_grad_()
    with sp_group_context(dist.group.WORLD):
        y = sp_all_to_all(x, 1, 2, world)
        back = sp_all_to_all(y, 2, 1, world)
        (y * weight[:, heads]).sum().backward()
    return {
        "forward": float((y - full[:, heads]).abs().max()),
        "inverse": float((back - x).abs().max()),
        "backward": float((x.grad - weight[:, :, seq_shard]).abs().max()),
    }
