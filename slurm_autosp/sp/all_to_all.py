"""The Ulysses all-to-all as a custom op that compiled graphs can carry.

The op takes no process group argument: the group comes from a small registry at run
time. A compiled graph therefore contains nothing rank- or group-specific, is identical
on every rank and every SP group, and one compile cache serves them all.
"""

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

_sp_group: dist.ProcessGroup | None = None


def set_sp_group(group: dist.ProcessGroup | None) -> None:
    """Name the process group the all-to-all of this process runs over (None: unset)."""
    global _sp_group
    _sp_group = group


def current_sp_group() -> dist.ProcessGroup:
    """The registered SP group; an error says how to register one."""
    if _sp_group is None:
        raise RuntimeError(
            "slurm_autosp: no sequence-parallel process group is set; call "
            "slurm_autosp.compile.set_sp_group(group) (or use sp_group_context(group)) "
            "before running a model compiled with the AutoSP backend"
        )
    return _sp_group


def registered_sp_size() -> int:
    """Ranks in the registered SP group; 1 when none is registered (a single-device trace)."""
    return 1 if _sp_group is None else dist.get_world_size(_sp_group)


@contextmanager
def sp_group_context(group: dist.ProcessGroup) -> Iterator[None]:
    """Register `group` for the duration of a block, restoring the previous one after."""
    previous = _sp_group
    set_sp_group(group)
    try:
        yield
    finally:
        set_sp_group(previous)


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
