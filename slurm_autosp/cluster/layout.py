"""The sequence-parallel / data-parallel layout of a job: computed once, logged, passed around.

An SP group of P = Ulysses U x ring R ranks: Ulysses groups run an all-to-all around every
attention call, so each must sit inside one NVLink/xGMI domain; ring groups pass key/value
blocks point to point between neighbours, so they may span domains; DP groups (one gradient
all-reduce per step) span domains over the scale-out network. Within an SP group, position p
has ring index p // U and Ulysses index p % U: Ulysses group i is positions [i*U, (i+1)*U),
ring group u is positions {u, U+u, 2U+u, ...}. `derive_parallel_layout` decides the groups from
the topology; `mesh_ranks` lays them out as a (dp, ring, ulysses) device mesh, which
`cluster.parallel_dims.device_mesh` turns into torch.distributed groups.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import pairwise

from slurm_autosp.cluster.topology import ClusterTopology
from slurm_autosp.heads import choices_text, divisors


class LayoutError(ValueError):
    """A layout that cannot be built or placed; the message shows the arithmetic and the choices."""


@dataclass(frozen=True)
class ParallelLayout:
    """SP x DP degrees, the SP size's Ulysses x ring split, and the explicit rank groups that
    realise them.

    `dp_groups[j]` holds the j-th rank of every SP group, so ranks holding the same sequence
    shard average their gradients together. `cross_domain` records that the caller accepted
    Ulysses groups spanning NVLink domains; it should be logged as a warning. A ring spanning
    domains is the ring's design, not cross_domain.
    """

    world_size: int
    sp_size: int
    dp_size: int
    sp_groups: tuple[tuple[int, ...], ...]
    dp_groups: tuple[tuple[int, ...], ...]
    cross_domain: bool = False
    ring_size: int = 1
    _sp_slot: tuple[tuple[int, int], ...] = field(init=False, repr=False, compare=False)

    @classmethod
    def contiguous(cls, world_size: int, sp_size: int, ring_size: int = 1) -> ParallelLayout:
        """SP groups of consecutive ranks: a world with no cluster profile to place it by
        (verify's, the tests' and the benches')."""
        return cls.from_sp_groups(
            tuple(tuple(range(first, first + sp_size)) for first in range(0, world_size, sp_size)),
            ring_size=ring_size,
        )

    def __post_init__(self) -> None:
        if self.sp_size < 1 or self.dp_size < 1 or self.ring_size < 1:
            raise LayoutError(
                f"sp_size={self.sp_size}, dp_size={self.dp_size} and ring_size={self.ring_size} "
                "must be at least 1"
            )
        if self.sp_size % self.ring_size:
            raise LayoutError(
                f"ring_size={self.ring_size} does not divide sp_size={self.sp_size} "
                f"(sp_size = Ulysses x ring; choose {choices_text(divisors(self.sp_size))})"
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
        for kind, groups in (("Ulysses", self.ulysses_groups), ("ring", self.ring_groups)):
            unordered = next((g for g in groups if list(g) != sorted(g)), None)
            if unordered is not None:
                raise LayoutError(
                    f"the {kind} group {list(unordered)} is not in rank order: torch numbers a "
                    "group's ranks in ascending order, so its ranks' places in it would not be "
                    f"their places in the sequence (SP groups {_groups_text(self.sp_groups)}); "
                    + (
                        "the NVLink domains interleave in rank order so that no Ulysses x ring "
                        "split of this size keeps both in order: choose another ring_size "
                        "(1: no ring)"
                        if self.ring_size > 1
                        else "list each SP group's ranks in ascending order"
                    )
                )

    @classmethod
    def from_sp_groups(
        cls,
        sp_groups: tuple[tuple[int, ...], ...],
        cross_domain: bool = False,
        ring_size: int = 1,
    ) -> ParallelLayout:
        """The layout whose SP groups are these; DP, Ulysses and ring groups follow from them."""
        sp_size = len(sp_groups[0]) if sp_groups else 0
        dp_groups = tuple(tuple(group[j] for group in sp_groups) for j in range(sp_size))
        return cls(
            world_size=sum(len(g) for g in sp_groups),
            sp_size=sp_size,
            dp_size=len(sp_groups),
            sp_groups=sp_groups,
            dp_groups=dp_groups,
            cross_domain=cross_domain,
            ring_size=ring_size,
        )

    @property
    def ulysses_size(self) -> int:
        """Ranks of one all-to-all: the SP size over the ring size."""
        return self.sp_size // self.ring_size

    @property
    def ulysses_groups(self) -> tuple[tuple[int, ...], ...]:
        """Each SP group's consecutive slices of `ulysses_size` ranks, SP group by SP group."""
        u = self.ulysses_size
        return tuple(g[i : i + u] for g in self.sp_groups for i in range(0, self.sp_size, u))

    @property
    def ring_groups(self) -> tuple[tuple[int, ...], ...]:
        """The ranks at the same Ulysses position of each SP group's Ulysses groups, in ring
        order (neighbours hold adjacent blocks of the sequence), SP group by SP group."""
        u = self.ulysses_size
        return tuple(g[i::u] for g in self.sp_groups for i in range(u))

    @property
    def mesh_ranks(self) -> tuple[tuple[tuple[int, ...], ...], ...]:
        """The ranks as a (dp, ring, ulysses) mesh: [d][r][u] is Ulysses rank u of ring rank r
        of SP group d, so the mesh's rows along each dimension are the DP, ring and Ulysses
        groups."""
        u, r = self.ulysses_size, self.ring_size
        return tuple(tuple(tuple(g[i * u : (i + 1) * u]) for i in range(r)) for g in self.sp_groups)

    def sp_group_of(self, rank: int) -> tuple[int, ...]:
        """The ranks that share `rank`'s sequence (its SP group)."""
        return self.sp_groups[self._slot(rank)[0]]

    def sp_rank(self, rank: int) -> int:
        """Which shard of the sequence `rank` holds: its position in its SP group."""
        return self._slot(rank)[1]

    def dp_rank(self, rank: int) -> int:
        """Which data-parallel replica `rank` belongs to: the index of its SP group."""
        return self._slot(rank)[0]

    def ulysses_rank(self, rank: int) -> int:
        """Which slice of the heads `rank` takes in attention: its position in its Ulysses
        group."""
        return self.sp_rank(rank) % self.ulysses_size

    def ring_rank(self, rank: int) -> int:
        """Which of the sequence's ring_size blocks `rank`'s attention holds (its Ulysses
        group's tokens, after the all-to-all): its position in its ring group, whose neighbours
        hold the adjacent blocks."""
        return self.sp_rank(rank) // self.ulysses_size

    def _slot(self, rank: int) -> tuple[int, int]:
        if not 0 <= rank < self.world_size:
            raise LayoutError(
                f"rank {rank} is outside world_size {self.world_size} (0..{self.world_size - 1})"
            )
        return self._sp_slot[rank]

    def __repr__(self) -> str:
        inside = "SP groups" if self.ring_size == 1 else "Ulysses groups"
        placement = (
            f"{inside} span NVLink domains (allow_cross_domain)"
            if self.cross_domain
            else f"{inside} inside NVLink domains"
        )
        sp = f"sp {self.sp_size}"
        ring = ""
        if self.ring_size > 1:
            sp += f" (Ulysses {self.ulysses_size} x ring {self.ring_size})"
            ring = (
                f"ulysses_groups {_groups_text(self.ulysses_groups)}; "
                f"ring_groups {_groups_text(self.ring_groups)}; "
            )
        return (
            f"ParallelLayout(world_size {self.world_size} = {sp} x dp {self.dp_size}; "
            f"sp_groups {_groups_text(self.sp_groups)}; {ring}dp_groups "
            f"{_groups_text(self.dp_groups)}; {placement})"
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
    topology: ClusterTopology, sp_size: int, allow_cross_domain: bool = False, ring_size: int = 1
) -> ParallelLayout:
    """SP groups as consecutive slices of the NVLink domains, DP across them.

    The Ulysses groups (`sp_size // ring_size` consecutive ranks) must each sit inside one
    domain; with `ring_size` > 1 an SP group may then span domains, its ring passing blocks
    between them. A Ulysses size that every domain holds a whole number of times is placed
    inside domains. Any other is an error listing the splits that would fit, unless
    `allow_cross_domain`, which slices the same rank order across domain boundaries and records
    the choice in the layout.
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
    if ring_size < 1 or sp_size % ring_size:
        raise LayoutError(
            f"ring_size={ring_size} does not divide sp_size={sp_size} "
            f"(sp_size = Ulysses x ring; choose {choices_text(divisors(sp_size))})"
        )
    sizes = topology.domain_sizes
    ulysses = sp_size // ring_size
    fits = all(size % ulysses == 0 for size in sizes)
    if not fits and not allow_cross_domain:
        placeable = divisors(math.gcd(*sizes))
        splits = ", ".join(
            f"{u} x {sp_size // u} (ring_size={sp_size // u})"
            for u in reversed(divisors(sp_size))
            if u in placeable
        )
        what = (
            f"sp_size={sp_size}"
            if ring_size == 1
            else f"the Ulysses size {ulysses} (sp_size={sp_size} / ring_size={ring_size})"
        )
        raise LayoutError(
            f"{what} cannot be placed inside one NVLink domain: the job has "
            f"{_domain_sizes_text(sizes)}, so SP all-to-all would cross the inter-node network. "
            f"SP sizes that fit inside a domain: {choices_text(placeable)}; Ulysses x ring "
            f"splits of sp_size={sp_size} whose all-to-alls stay inside domains: {splits}. "
            "Choose one of them, or set parallel.allow_cross_domain=true to accept the slower layout."
        )
    order = [rank for domain in topology.nvlink_domains for rank in domain]
    sp_groups = tuple(
        _in_rank_order(order[start : start + sp_size], ulysses)
        for start in range(0, world, sp_size)
    )
    return ParallelLayout.from_sp_groups(sp_groups, cross_domain=not fits, ring_size=ring_size)


def _in_rank_order(ranks: list[int], ulysses: int) -> tuple[int, ...]:
    """An SP group's ranks placed as torch numbers its groups: each Ulysses slice ascending,
    the slices by their first rank (so each ring group ascends wherever some order of the
    slices lets it; ParallelLayout refuses the rest)."""
    slices = sorted(sorted(ranks[i : i + ulysses]) for i in range(0, len(ranks), ulysses))
    return tuple(rank for part in slices for rank in part)


def _domain_sizes_text(sizes: tuple[int, ...]) -> str:
    counts: dict[int, int] = {}
    for size in sizes:
        counts[size] = counts.get(size, 0) + 1
    return " and ".join(
        f"{count} domain{'s' if count > 1 else ''} of {size} GPU{'s' if size > 1 else ''}"
        for size, count in sorted(counts.items(), reverse=True)
    )
