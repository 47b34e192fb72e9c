"""The sequence-parallel / data-parallel layout of a job: computed once, logged, passed around.

SP groups run an all-to-all around every attention call, so each must sit inside one
NVLink/xGMI domain; DP groups (one gradient all-reduce per step) span domains over the
scale-out network. `derive_parallel_layout` decides that from the topology;
`build_process_groups` is the one place that turns it into torch.distributed groups.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import pairwise
from typing import TYPE_CHECKING

from slurm_autosp.cluster.topology import ClusterTopology
from slurm_autosp.heads import choices_text, divisors

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


class LayoutError(ValueError):
    """A layout that cannot be built or placed; the message shows the arithmetic and the choices."""


@dataclass(frozen=True)
class ParallelLayout:
    """SP x DP degrees and the explicit rank groups that realise them.

    `dp_groups[j]` holds the j-th rank of every SP group, so ranks holding the same sequence
    shard average their gradients together. `cross_domain` records that the caller accepted SP
    groups spanning NVLink domains; it should be logged as a warning.
    """

    world_size: int
    sp_size: int
    dp_size: int
    sp_groups: tuple[tuple[int, ...], ...]
    dp_groups: tuple[tuple[int, ...], ...]
    cross_domain: bool = False
    _sp_slot: tuple[tuple[int, int], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.sp_size < 1 or self.dp_size < 1:
            raise LayoutError(
                f"sp_size={self.sp_size} and dp_size={self.dp_size} must be at least 1"
            )
        if self.sp_size * self.dp_size != self.world_size:
            raise LayoutError(
                f"sp_size({self.sp_size}) * dp_size({self.dp_size}) = {self.sp_size * self.dp_size} "
                f"!= world_size({self.world_size})"
            )
        if len(self.sp_groups) != self.dp_size or any(
            len(g) != self.sp_size for g in self.sp_groups
        ):
            raise LayoutError(
                f"sp_groups must be dp_size({self.dp_size}) groups of sp_size({self.sp_size}) ranks; "
                f"got {len(self.sp_groups)} groups of sizes {sorted({len(g) for g in self.sp_groups})}"
            )
        slot: list[tuple[int, int] | None] = [None] * self.world_size
        for group_index, group in enumerate(self.sp_groups):
            for position, rank in enumerate(group):
                if not 0 <= rank < self.world_size or slot[rank] is not None:
                    problem = "out of range" if not 0 <= rank < self.world_size else "repeated"
                    raise LayoutError(
                        f"sp_groups must hold every rank 0..{self.world_size - 1} exactly once; "
                        f"rank {rank} (in group {group_index}) is {problem}"
                    )
                slot[rank] = (group_index, position)
        expected_dp = tuple(
            tuple(group[j] for group in self.sp_groups) for j in range(self.sp_size)
        )
        if self.dp_groups != expected_dp:
            got = list(self.dp_groups[0][:8]) if self.dp_groups else []
            raise LayoutError(
                "dp_groups must be the ranks at the same position of every SP group "
                f"(dp_groups[0] = {list(expected_dp[0][:8])}), got dp_groups[0] = {got}"
            )
        object.__setattr__(self, "_sp_slot", tuple(slot))

    @classmethod
    def from_sp_groups(
        cls, sp_groups: tuple[tuple[int, ...], ...], cross_domain: bool = False
    ) -> ParallelLayout:
        """The layout whose SP groups are these; DP groups follow from them."""
        sp_size = len(sp_groups[0]) if sp_groups else 0
        dp_groups = tuple(tuple(group[j] for group in sp_groups) for j in range(sp_size))
        return cls(
            world_size=sum(len(g) for g in sp_groups),
            sp_size=sp_size,
            dp_size=len(sp_groups),
            sp_groups=sp_groups,
            dp_groups=dp_groups,
            cross_domain=cross_domain,
        )

    def sp_group_of(self, rank: int) -> tuple[int, ...]:
        """The ranks that share `rank`'s sequence (its SP group)."""
        return self.sp_groups[self._slot(rank)[0]]

    def sp_rank(self, rank: int) -> int:
        """Which shard of the sequence `rank` holds: its position in its SP group."""
        return self._slot(rank)[1]

    def dp_rank(self, rank: int) -> int:
        """Which data-parallel replica `rank` belongs to: the index of its SP group."""
        return self._slot(rank)[0]

    def _slot(self, rank: int) -> tuple[int, int]:
        if not 0 <= rank < self.world_size:
            raise LayoutError(
                f"rank {rank} is outside world_size {self.world_size} (0..{self.world_size - 1})"
            )
        return self._sp_slot[rank]

    def __repr__(self) -> str:
        placement = (
            "SP groups span NVLink domains (allow_cross_domain)"
            if self.cross_domain
            else ("SP groups inside NVLink domains")
        )
        return (
            f"ParallelLayout(world_size {self.world_size} = sp {self.sp_size} x dp {self.dp_size}; "
            f"sp_groups {_groups_text(self.sp_groups)}; dp_groups {_groups_text(self.dp_groups)}; "
            f"{placement})"
        )


def _groups_text(groups: tuple[tuple[int, ...], ...], show: int = 2) -> str:
    """[[0-7], [8-15], ..., [8184-8191]] with a count, short enough for one log line."""
    shown = [f"[{_ranks_text(g)}]" for g in groups[:show]]
    if len(groups) > show + 1:
        shown.append("...")
    if len(groups) > show:
        shown.append(f"[{_ranks_text(groups[-1])}]")
    return f"{len(groups)} x " + ", ".join(shown)


def _ranks_text(ranks: tuple[int, ...], show: int = 4) -> str:
    if len(ranks) > 1 and all(b == a + 1 for a, b in pairwise(ranks)):
        return f"{ranks[0]}-{ranks[-1]}"
    if len(ranks) > 1 and len(set(b - a for a, b in pairwise(ranks))) == 1 and len(ranks) > show:
        step = ranks[1] - ranks[0]
        return f"{ranks[0]},{ranks[1]},...,{ranks[-1]} (step {step})"
    if len(ranks) > show:
        return ",".join(map(str, ranks[:show])) + f",... ({len(ranks)} ranks)"
    return ",".join(map(str, ranks))


def derive_parallel_layout(
    topology: ClusterTopology, sp_size: int, allow_cross_domain: bool = False
) -> ParallelLayout:
    """SP groups as consecutive slices of the NVLink domains, DP across them.

    A size that every domain can hold a whole number of times is placed inside domains.
    Any other size that divides the world is an error listing the sizes that would fit,
    unless `allow_cross_domain`, which slices the same rank order across domain boundaries
    and records the choice in the layout.
    """
    world = topology.world_size
    if world < 1:
        raise LayoutError(
            f"the topology has no GPUs ({len(topology.nodes)} nodes, none with GPUs); "
            "describe the devices in the config when running without GPUs"
        )
    if sp_size < 1 or world % sp_size:
        raise LayoutError(
            f"sp_size={sp_size} does not divide world_size={world} "
            f"(choose {choices_text(divisors(world))})"
        )
    sizes = topology.domain_sizes
    fits = all(size % sp_size == 0 for size in sizes)
    if not fits and not allow_cross_domain:
        placeable = divisors(math.gcd(*sizes))
        raise LayoutError(
            f"sp_size={sp_size} cannot be placed inside one NVLink domain: the job has "
            f"{_domain_sizes_text(sizes)}, so SP all-to-all would cross the inter-node network. "
            f"SP sizes that fit inside a domain: {choices_text(placeable)}. "
            "Choose one of them, or set parallel.allow_cross_domain=true to accept the slower layout."
        )
    order = [rank for domain in topology.nvlink_domains for rank in domain]
    sp_groups = tuple(tuple(order[start : start + sp_size]) for start in range(0, world, sp_size))
    return ParallelLayout.from_sp_groups(sp_groups, cross_domain=not fits)


def _domain_sizes_text(sizes: tuple[int, ...]) -> str:
    counts: dict[int, int] = {}
    for size in sizes:
        counts[size] = counts.get(size, 0) + 1
    return " and ".join(
        f"{count} domain{'s' if count > 1 else ''} of {size} GPU{'s' if size > 1 else ''}"
        for size, count in sorted(counts.items(), reverse=True)
    )


def build_process_groups(layout: ParallelLayout) -> tuple[ProcessGroup, ProcessGroup]:
    """Create every SP and DP group; return this rank's (sp_group, dp_group).

    torch.distributed requires every rank to call new_group for every group, in the same
    order, even for groups it is not in: so all ranks walk the same two lists.
    """
    import torch.distributed as dist

    if dist.get_world_size() != layout.world_size:
        raise LayoutError(
            f"torch.distributed has world_size {dist.get_world_size()} but the layout was derived "
            f"for {layout.world_size} ranks; derive it from the job's topology"
        )
    rank = dist.get_rank()
    mine = {}
    for kind, groups in (("sp", layout.sp_groups), ("dp", layout.dp_groups)):
        for ranks in groups:
            group = dist.new_group(list(ranks))
            if rank in ranks:
                mine[kind] = group
    return mine["sp"], mine["dp"]
