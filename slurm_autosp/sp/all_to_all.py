"""The Ulysses all-to-all as a custom op that compiled graphs can carry, and the registry of the
SP process groups that it and ring attention (sp.ring_attention) run over.

The ops take no process group argument: the groups come from a small registry at run time.
A compiled graph therefore contains nothing rank- or group-specific, is identical on every
rank and every SP group, and one compile cache serves them all. An SP group of
`ulysses x ring` ranks has two: the Ulysses group (the all-to-all, heads split) and the ring
group (ring attention's K/V passed around, sequence blocks); without ring attention the
Ulysses group is the whole SP group.
"""

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

_sp_group: dist.ProcessGroup | None = None
_ring_group: dist.ProcessGroup | None = None


@dataclass
class CommunicationCounts:
    """What this process's SP ops did since `reset()`: bytes sent (the bench's bytes per layer)
    and ring attention's forward and backward calls (the tests' proof that checkpointing never
    runs the ring's forward again in backward)."""

    all_to_all_bytes: int = 0
    ring_bytes: int = 0
    ring_forwards: int = 0
    ring_backwards: int = 0

    def reset(self) -> None:
        self.all_to_all_bytes = self.ring_bytes = self.ring_forwards = self.ring_backwards = 0


communication_counts = CommunicationCounts()


def set_sp_groups(ulysses: dist.ProcessGroup | None, ring: dist.ProcessGroup | None = None) -> None:
    """Name the groups this process's SP ops run over: the all-to-all's Ulysses group and ring
    attention's ring group (None: no ring, the Ulysses group is the whole SP group)."""
    global _sp_group, _ring_group
    _sp_group, _ring_group = ulysses, ring


def set_sp_group(group: dist.ProcessGroup | None) -> None:
    """Name the process group the all-to-all of this process runs over, without a ring (None: unset)."""
    set_sp_groups(group)


def current_sp_group() -> dist.ProcessGroup:
    """The registered SP (Ulysses) group; an error says how to register one."""
    if _sp_group is None:
        raise RuntimeError(
            "slurm_autosp: no sequence-parallel process group is set; call "
            "slurm_autosp.compile.set_sp_group(group) (or use sp_group_context(group)) "
            "before running a model compiled with the AutoSP backend"
        )
    return _sp_group


def current_ring_group() -> dist.ProcessGroup:
    """The registered ring group; an error says how to register one."""
    if _ring_group is None:
        raise RuntimeError(
            "slurm_autosp: no ring process group is set, but the model was compiled with "
            "ring attention (ring_size > 1); call slurm_autosp.sp.set_sp_groups(ulysses=..., "
            "ring=...) (or use sp_group_context(ulysses, ring)) before running it"
        )
    return _ring_group


def registered_sp_size() -> int:
    """Ranks sharing a sequence (Ulysses x ring); 1 when none is registered (a single-device trace)."""
    if _sp_group is None:
        return 1
    ring = 1 if _ring_group is None else dist.get_world_size(_ring_group)
    return dist.get_world_size(_sp_group) * ring


def all_reduce_over_sp(tensor: torch.Tensor) -> None:
    """Sum `tensor` in place over every rank sharing this rank's sequences: over its Ulysses
    group, then its ring group (one member of every Ulysses group), which together are the SP
    group. Nothing to do when no group is registered (one device)."""
    if _sp_group is not None:
        dist.all_reduce(tensor, group=_sp_group)
    if _ring_group is not None:
        dist.all_reduce(tensor, group=_ring_group)


@contextmanager
def sp_group_context(
    group: dist.ProcessGroup, ring: dist.ProcessGroup | None = None
) -> Iterator[None]:
    """Register `group` (and `ring`) for the duration of a block, restoring the previous ones after."""
    previous = (_sp_group, _ring_group)
    set_sp_groups(group, ring)
    try:
        yield
    finally:
        set_sp_groups(*previous)


@torch.library.custom_op("slurm_autosp::sp_all_to_all", mutates_args=())
def sp_all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, sp_size: int) -> torch.Tensor:
    """Split `x` into `sp_size` chunks along `scatter_dim`, send chunk j to SP rank j, and
    concatenate the chunks received along `gather_dim` in rank order.

    [B, H, S/P, D] with (scatter_dim=1, gather_dim=2) becomes [B, H/P, S, D]: this rank's
    heads over the whole sequence. Swapping the two dims is the exact inverse.
    """
    group = current_sp_group()
    if dist.get_world_size(group) != sp_size:
        raise RuntimeError(
            f"slurm_autosp: the graph was compiled for sp_size={sp_size} but the registered "
            f"SP group has {dist.get_world_size(group)} ranks; compile with the group's size"
        )
    send = torch.stack(x.chunk(sp_size, dim=scatter_dim))
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    communication_counts.all_to_all_bytes += send.nbytes * (sp_size - 1) // sp_size
    return torch.cat(received.unbind(0), dim=gather_dim)


@sp_all_to_all.register_fake
def _(x: torch.Tensor, scatter_dim: int, gather_dim: int, sp_size: int) -> torch.Tensor:
    shape = list(x.shape)
    shape[scatter_dim] = shape[scatter_dim] // sp_size
    shape[gather_dim] = shape[gather_dim] * sp_size
    return x.new_empty(shape)


def _backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
    """The gradient of an all-to-all is the all-to-all with the two dims swapped."""
    scatter_dim, gather_dim, sp_size = ctx.sp_dims  # type: ignore[attr-defined]
    return sp_all_to_all(grad, gather_dim, scatter_dim, sp_size), None, None, None


def _setup_context(ctx: object, inputs: tuple, output: torch.Tensor) -> None:
    _, scatter_dim, gather_dim, sp_size = inputs
    ctx.sp_dims = (scatter_dim, gather_dim, sp_size)  # type: ignore[attr-defined]


sp_all_to_all.register_autograd(_backward, setup_context=_setup_context)
