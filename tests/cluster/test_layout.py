"""cluster.layout: SP groups (Ulysses groups inside NVLink domains, rings across them), DP
across them, and the groups torch builds."""

import datetime
import math
import os
import sys

import pytest
import torch
import torch.multiprocessing as mp

from slurm_autosp.cluster.layout import (
    LayoutError,
    ParallelLayout,
    derive_parallel_layout,
)
from slurm_autosp.cluster.parallel_dims import device_mesh, parallel_dims_for
from slurm_autosp.cluster.placement import expected_topology, layout_for, layout_summary
from slurm_autosp.cluster.topology import ClusterTopology, NodeTopology, topology_from_profile
from slurm_autosp.compat.torch_api import flatten_mesh
from slurm_autosp.config import ConfigError, load_config
from slurm_autosp.heads import auto_ring_size

# "Fast" as a count, not a clock: Python calls (profiler events) per rank, so the bound holds on
# a loaded machine and fails for anything that grows faster than the world (measured: 3.0 per
# rank at 8192 ranks, 2.4 at 1152; a pairwise scan of 8192 ranks would be thousands).
CALLS_PER_RANK_BOUND = 8


def counting_python_calls(fn):
    """fn()'s result and how many Python and C function calls it made."""
    calls = 0

    def count(frame, event, arg):
        nonlocal calls
        if event in ("call", "c_call"):
            calls += 1

    sys.setprofile(count)
    try:
        result = fn()
    finally:
        sys.setprofile(None)
    return result, calls


def test_sp8_on_two_dgx_nodes_stays_inside_each_node():
    layout = derive_parallel_layout(topology_from_profile(2, 8, 8), sp_size=8)
    assert layout.sp_groups == (tuple(range(8)), tuple(range(8, 16)))
    assert layout.dp_groups == tuple((i, i + 8) for i in range(8))
    assert (layout.world_size, layout.sp_size, layout.dp_size, layout.cross_domain) == (
        16,
        8,
        2,
        False,
    )


def test_rank_helpers_answer_from_the_groups():
    layout = derive_parallel_layout(topology_from_profile(2, 8, 8), sp_size=4)
    assert layout.sp_group_of(6) == (4, 5, 6, 7)
    assert (layout.sp_rank(6), layout.dp_rank(6)) == (2, 1)
    assert (layout.sp_rank(13), layout.dp_rank(13)) == (1, 3)
    with pytest.raises(LayoutError, match=r"rank 16 is outside world_size 16 \(0..15\)"):
        layout.sp_rank(16)


def test_sp_groups_follow_detected_domains_not_rank_contiguity():
    # Two nodes of 4 A100s joined in NVLink pairs: SP=2 must pair (0,1),(2,3),...
    pairs = NodeTopology("della-1", "nvidia", 4, ((0, 1), (2, 3)))
    topo = ClusterTopology((pairs, NodeTopology("della-2", "nvidia", 4, ((0, 1), (2, 3)))))
    layout = derive_parallel_layout(topo, sp_size=2)
    assert layout.sp_groups == ((0, 1), (2, 3), (4, 5), (6, 7))
    with pytest.raises(LayoutError) as error:
        derive_parallel_layout(topo, sp_size=4)
    assert str(error.value) == (
        "sp_size=4 cannot be placed inside one NVLink domain: the job has 4 domains of 2 GPUs, "
        "so SP all-to-all would cross the inter-node network. SP sizes that fit inside a domain: "
        "1 or 2; Ulysses x ring splits of sp_size=4 whose all-to-alls stay inside domains: "
        "2 x 2 (ring_size=2), 1 x 4 (ring_size=4). Choose one of them, or set "
        "parallel.allow_cross_domain=true to accept the slower layout."
    )


def test_nvl72_racks_hold_sp_groups_spanning_nodes():
    layout = derive_parallel_layout(topology_from_profile(36, 4, 72), sp_size=36)
    assert layout.sp_groups == (
        tuple(range(36)),
        tuple(range(36, 72)),
        tuple(range(72, 108)),
        tuple(range(108, 144)),
    )
    assert not layout.cross_domain


def test_an_sp_size_that_no_domain_holds_lists_the_sizes_that_would_work():
    with pytest.raises(
        LayoutError,
        match=r"2 domains of 72 GPUs.*fit inside a domain: 1, 2, 3, 4, 6, 8, 9, 12, 18, 24, 36 or 72;",
    ):
        derive_parallel_layout(topology_from_profile(36, 4, 72), sp_size=16)


def test_a_partial_rack_limits_sp_to_what_both_domains_hold():
    with pytest.raises(
        LayoutError, match=r"1 domain of 72 GPUs and 1 domain of 8 GPUs.*1, 2, 4 or 8;"
    ):
        derive_parallel_layout(topology_from_profile(20, 4, 72), sp_size=16)


def test_cross_domain_layout_is_an_explicit_recorded_choice():
    layout = derive_parallel_layout(
        topology_from_profile(4, 8, 8), sp_size=16, allow_cross_domain=True
    )
    assert layout.cross_domain
    assert layout.sp_groups == (tuple(range(16)), tuple(range(16, 32)))
    assert "SP groups span NVLink domains (allow_cross_domain)" in repr(layout)


def test_sp_size_must_divide_the_world():
    with pytest.raises(
        LayoutError, match=r"sp_size=12 does not divide world_size=16 \(choose 1, 2, 4, 8 or 16\)"
    ):
        derive_parallel_layout(topology_from_profile(2, 8, 8), sp_size=12)


def test_a_topology_without_gpus_is_refused():
    with pytest.raises(LayoutError, match="the topology has no GPUs"):
        derive_parallel_layout(ClusterTopology((NodeTopology("cpu-1", "none", 0, ()),)), sp_size=1)


def test_post_init_shows_the_arithmetic():
    with pytest.raises(LayoutError, match=r"sp_size\(4\) \* dp_size\(2\) = 8 != world_size\(16\)"):
        ParallelLayout(16, 4, 2, ((0, 1, 2, 3), (4, 5, 6, 7)), ((0, 4), (1, 5), (2, 6), (3, 7)))
    with pytest.raises(LayoutError, match="rank 1 \\(in group 1\\) is repeated"):
        ParallelLayout.from_sp_groups(((0, 1), (1, 3)))
    with pytest.raises(LayoutError, match="dp_groups must be the ranks at the same position"):
        ParallelLayout(4, 2, 2, ((0, 1), (2, 3)), ((0, 3), (1, 2)))


def test_repr_is_one_readable_log_line_even_at_scale():
    assert repr(derive_parallel_layout(topology_from_profile(2, 8, 8), sp_size=8)) == (
        "ParallelLayout(world_size 16 = sp 8 x dp 2; sp_groups 2 x [0-7], [8-15]; "
        "dp_groups 8 x [0,8], [1,9], ..., [7,15]; SP groups inside NVLink domains)"
    )
    big = repr(derive_parallel_layout(topology_from_profile(1024, 8, 8), sp_size=8))
    assert len(big) < 250
    assert "sp_groups 1024 x [0-7], [8-15], ..., [8184-8191]" in big
    assert "dp_groups 8 x [0,8,...,8184 (step 8)]" in big


def test_derivation_at_1024_nodes_of_8_gpus_is_correct_and_fast():
    topology = topology_from_profile(1024, 8, 8)
    layout, calls = counting_python_calls(lambda: derive_parallel_layout(topology, sp_size=8))
    assert calls <= CALLS_PER_RANK_BOUND * topology.world_size, calls
    assert layout.dp_size == 1024
    assert all(group == tuple(range(g * 8, g * 8 + 8)) for g, group in enumerate(layout.sp_groups))
    assert layout.dp_groups[3] == tuple(range(3, 8192, 8))
    assert (layout.sp_rank(8191), layout.dp_rank(8191)) == (7, 1023)


def test_derivation_for_nvl72_racks_is_correct_and_fast():
    topology = topology_from_profile(nodes=18 * 16, gpus_per_node=4, nvlink_domain_size=72)
    layout, calls = counting_python_calls(lambda: derive_parallel_layout(topology, sp_size=72))
    assert calls <= CALLS_PER_RANK_BOUND * topology.world_size, calls
    assert layout.dp_size == 16
    assert layout.sp_group_of(100) == tuple(range(72, 144))


# ------------------------------------------------------------------------ Ulysses x ring


def test_sp64_on_eight_dgx_nodes_is_ulysses8_inside_nodes_and_ring8_across_them():
    layout = derive_parallel_layout(topology_from_profile(8, 8, 8), sp_size=64, ring_size=8)
    assert (layout.sp_size, layout.ulysses_size, layout.ring_size, layout.dp_size) == (64, 8, 8, 1)
    assert layout.ulysses_groups == tuple(tuple(range(n * 8, n * 8 + 8)) for n in range(8))
    assert layout.ring_groups == tuple(tuple(range(u, 64, 8)) for u in range(8))
    assert not layout.cross_domain  # the ring spans nodes by design; all-to-alls stay inside
    # position p: ring index p // U, Ulysses index p % U; ring neighbours on adjacent nodes
    assert (layout.sp_rank(19), layout.ring_rank(19), layout.ulysses_rank(19)) == (19, 2, 3)
    assert layout.ring_groups[3][layout.ring_rank(19)] == 19
    assert "sp 64 (Ulysses 8 x ring 8) x dp 1" in repr(layout)
    assert "ulysses_groups 8 x [0-7], [8-15], ..., [56-63]" in repr(layout)
    assert "ring_groups 8 x [0,8,...,56 (step 8)]" in repr(layout)


def test_ring_groups_hold_the_same_position_of_every_ulysses_group_per_sp_group():
    layout = derive_parallel_layout(topology_from_profile(4, 8, 8), sp_size=16, ring_size=2)
    assert layout.sp_groups == (tuple(range(16)), tuple(range(16, 32)))
    assert layout.ulysses_groups[:3] == (tuple(range(8)), tuple(range(8, 16)), tuple(range(16, 24)))
    assert layout.ring_groups[:2] == ((0, 8), (1, 9))
    assert layout.ring_groups[8:10] == ((16, 24), (17, 25))
    assert layout.dp_groups[9] == (9, 25)
    for rank in range(32):
        group = layout.sp_group_of(rank)
        position = layout.ring_rank(rank) * layout.ulysses_size + layout.ulysses_rank(rank)
        assert group[position] == rank


def test_ring_size_one_keeps_todays_groups_and_repr():
    plain = derive_parallel_layout(topology_from_profile(2, 8, 8), sp_size=8)
    assert plain == derive_parallel_layout(topology_from_profile(2, 8, 8), sp_size=8, ring_size=1)
    assert plain.ulysses_groups == plain.sp_groups
    assert plain.ring_groups == tuple((r,) for r in range(16))
    assert "Ulysses" not in repr(plain) and "ring" not in repr(plain)


def test_nvl72_racks_hold_whole_ulysses_groups_and_rings_cross_racks():
    # GB200 NVL72: 18 nodes of 4 GPUs a rack; two racks
    layout = derive_parallel_layout(topology_from_profile(36, 4, 72), sp_size=144, ring_size=2)
    assert layout.ulysses_groups == (tuple(range(72)), tuple(range(72, 144)))
    assert layout.ring_groups[5] == (5, 77)
    # a ring inside one rack: both Ulysses groups of an SP group of 16 in rack 0
    inside = derive_parallel_layout(topology_from_profile(36, 4, 72), sp_size=16, ring_size=2)
    assert inside.ulysses_groups[:2] == (tuple(range(8)), tuple(range(8, 16)))


def test_a_partial_rack_takes_ulysses_groups_that_every_domain_holds():
    # 20 nodes of 4 GPUs on NVL72 racks: one domain of 72 GPUs and one of 8
    layout = derive_parallel_layout(topology_from_profile(20, 4, 72), sp_size=16, ring_size=2)
    assert layout.sp_groups[4] == tuple(range(64, 80))  # spans both domains
    assert layout.ulysses_groups[8:10] == (tuple(range(64, 72)), tuple(range(72, 80)))
    assert not layout.cross_domain


def test_nvlink_pairs_take_ulysses_pairs_and_a_ring_over_them():
    pairs = NodeTopology("della-1", "nvidia", 4, ((0, 1), (2, 3)))
    topo = ClusterTopology((pairs, NodeTopology("della-2", "nvidia", 4, ((0, 1), (2, 3)))))
    layout = derive_parallel_layout(topo, sp_size=8, ring_size=4)
    assert layout.ulysses_groups == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert layout.ring_groups == ((0, 2, 4, 6), (1, 3, 5, 7))


def test_a_ulysses_group_larger_than_a_domain_is_refused_naming_the_splits_that_fit():
    with pytest.raises(LayoutError) as error:
        derive_parallel_layout(topology_from_profile(8, 8, 8), sp_size=64, ring_size=4)
    assert str(error.value).startswith(
        "the Ulysses size 16 (sp_size=64 / ring_size=4) cannot be placed inside one NVLink "
        "domain: the job has 8 domains of 8 GPUs"
    )
    assert "splits of sp_size=64 whose all-to-alls stay inside domains: 8 x 8 (ring_size=8), " in (
        str(error.value)
    )


def test_a_ring_size_that_does_not_divide_sp_is_refused():
    with pytest.raises(LayoutError, match=r"ring_size=3 does not divide sp_size=8 \(sp_size = "):
        derive_parallel_layout(topology_from_profile(2, 8, 8), sp_size=8, ring_size=3)
    with pytest.raises(LayoutError, match=r"ring_size=3 does not divide sp_size=8"):
        ParallelLayout.from_sp_groups((tuple(range(8)),), ring_size=3)


def test_derivation_of_ulysses_and_ring_groups_at_1024_nodes_is_fast():
    topology = topology_from_profile(1024, 8, 8)

    def groups():
        layout = derive_parallel_layout(topology, sp_size=64, ring_size=8)
        return layout, layout.ulysses_groups, layout.ring_groups

    (layout, ulysses, ring), calls = counting_python_calls(groups)
    assert calls <= CALLS_PER_RANK_BOUND * topology.world_size, calls
    assert len(ulysses) == 1024 and len(ring) == 1024
    assert ring[-1] == tuple(range(8191 - 56, 8192, 8))


LLAMA8B_8_NODES = ["cfg=configs/llama8b_4m.yaml", "cluster.nodes=8"]  # 32 heads, 8 KV heads


@pytest.mark.parametrize(
    ("overrides", "ring"),
    [
        (["parallel.sp_size=8"], 1),  # Ulysses alone inside a node, as before
        (["parallel.sp_size=16"], 2),  # past the node: Ulysses 8 x ring 2
        (["parallel.sp_size=64"], 8),  # past the heads (32): Ulysses 8 x ring 8
        (["parallel.sp_size=16", "parallel.allow_cross_domain=true"], 1),  # asked for all-to-all
        (["parallel.sp_size=64", "parallel.allow_cross_domain=true"], 8),  # past the heads: ring
        (["parallel.sp_size=64", "parallel.ring_size=16"], 16),  # configured: kept
    ],
)
def test_a_null_ring_size_is_ulysses_as_large_as_heads_and_domain_allow(overrides, ring):
    """Resolved once, as the config is loaded: every reader gets the number."""
    assert load_config([*LLAMA8B_8_NODES, *overrides]).parallel.ring_size == ring


@pytest.mark.parametrize(
    ("nodes", "gpus", "domain"),
    [
        (1, 0, None),
        (2, 8, None),
        (2, 8, 4),
        (3, 8, 2),
        (4, 4, 72),
        (36, 4, 72),
        (20, 4, 72),
        (1, 4, 16),
    ],
)
def test_the_configs_domain_size_is_the_one_its_topology_has(nodes, gpus, domain):
    """The ring size is resolved from the profile's NVLink domains before any topology is
    built: the config's arithmetic gives what the topology's domains have in common."""
    keys = [f"cluster.nodes={nodes}", f"cluster.gpus_per_node={gpus}", "cluster.backend=slurm"]
    cfg = load_config([*keys, *([f"cluster.nvlink_domain_size={domain}"] if domain else [])])
    sizes = expected_topology(cfg.cluster).domain_sizes
    assert cfg.cluster.nvlink_domain_gcd() == math.gcd(*sizes), sizes


def test_auto_ring_size_on_nvl72_racks_meets_heads_and_domain():
    # 8B's 32 heads on racks of 72: the Ulysses size must divide 72 and be a head split: 8
    assert auto_ring_size(144, 72, 32, 8) == 18
    assert auto_ring_size(72, 72, 64, 8) == 9  # 70B: 64 heads, Ulysses 8 x ring 9
    assert auto_ring_size(144, 72, None, None) == 2  # heads unknown: the domain alone


def test_the_dry_run_line_names_where_ulysses_and_ring_groups_sit():
    cfg = load_config([*LLAMA8B_8_NODES, "parallel.sp_size=64"])
    assert layout_summary(cfg.cluster, layout_for(cfg)) == (
        "SP 64 = Ulysses 8 x ring 8: Ulysses groups inside NVLink domains (the first on node 0), "
        "ring over nodes 0-7 (8 NVLink domains)"
    )


def test_an_explicit_ring_too_small_for_the_domain_is_refused_naming_both_keys():
    with pytest.raises(ConfigError) as error:
        layout_for(load_config([*LLAMA8B_8_NODES, "parallel.sp_size=64", "parallel.ring_size=4"]))
    assert str(error.value).startswith(
        "parallel.sp_size=64 / parallel.ring_size=4: the Ulysses size 16"
    )


def test_groups_of_domains_listed_out_of_rank_order_are_placed_in_rank_order():
    # the link matrix may list a node's domains in any order: the ring must still ascend, as
    # torch numbers a group's ranks (ascending), so a rank's place in it is its place in the ring
    node = NodeTopology("pcie-1", "nvidia", 4, ((1, 3), (0, 2)))
    layout = derive_parallel_layout(ClusterTopology((node,)), sp_size=4, ring_size=2)
    assert layout.sp_groups == ((0, 2, 1, 3),)
    assert layout.ulysses_groups == ((0, 2), (1, 3))
    assert layout.ring_groups == ((0, 1), (2, 3))


def test_domains_that_interleave_past_any_rank_order_are_refused_naming_the_group():
    # NVLink pairs {0, 3} and {1, 2}: whichever pair comes first, one ring pairs 3 with 2
    node = NodeTopology("pcie-1", "nvidia", 4, ((0, 3), (1, 2)))
    with pytest.raises(LayoutError) as refused:
        derive_parallel_layout(ClusterTopology((node,)), sp_size=4, ring_size=2)
    assert str(refused.value).startswith(
        "the ring group [3, 2] is not in rank order: torch numbers a group's ranks in ascending "
        "order"
    )
    assert str(refused.value).endswith("choose another ring_size (1: no ring)")
    # without a ring each pair is one Ulysses group, in order
    assert derive_parallel_layout(ClusterTopology((node,)), sp_size=2).sp_groups == ((0, 3), (1, 2))
    with pytest.raises(LayoutError) as listed:  # given out of order without a ring
        ParallelLayout.from_sp_groups(((1, 0), (2, 3)))
    assert str(listed.value).startswith("the Ulysses group [1, 0] is not in rank order")
    assert str(listed.value).endswith("list each SP group's ranks in ascending order")


# ----------------------------------------------------------------- torch.distributed groups


def _rank_main(rank: int, world: int, init_file: str, case, results) -> None:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=TIMEOUT
    )
    try:
        results[rank] = case(rank)
    finally:
        dist.destroy_process_group()


TIMEOUT = datetime.timedelta(minutes=7)  # not a backend's default


def _on_four_ranks(case, tmp_path) -> dict:
    """`case(rank)` on each of 4 spawned gloo ranks, by rank."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    init_file = str(tmp_path / "rendezvous")  # a file, not a port another process could take
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank_main, args=(4, init_file, case, results), nprocs=4, join=True)
        return dict(results)


def _sums_over(rank: int, groups) -> tuple[float, ...]:
    import torch
    import torch.distributed as dist

    sums = []
    for group in groups:
        value = torch.tensor([float(rank)])
        dist.all_reduce(value, group=group)
        sums.append(value.item())
    return tuple(sums)


def _sp_and_dp_groups(rank: int):
    import torch
    import torch.distributed as dist

    layout = derive_parallel_layout(topology_from_profile(2, 2, 2), sp_size=2)
    dims = parallel_dims_for(layout, rank % 2, torch.device("cpu"))
    assert dims.ulysses_group is dims.sp_group and dims.ring_group is None  # ring_size 1
    sizes = (dist.get_world_size(dims.sp_group), dist.get_world_size(dims.dp_group))
    return _sums_over(rank, (dims.sp_group, dims.dp_group)) + sizes


@pytest.mark.slow
def test_process_groups_reduce_within_sp_and_dp_groups(tmp_path):
    # sp_groups (0,1),(2,3); dp_groups (0,2),(1,3)
    assert _on_four_ranks(_sp_and_dp_groups, tmp_path) == {
        0: (1.0, 2.0, 2, 2),
        1: (1.0, 4.0, 2, 2),
        2: (5.0, 2.0, 2, 2),
        3: (5.0, 4.0, 2, 2),
    }


def _ring_groups(rank: int):
    import torch

    layout = derive_parallel_layout(topology_from_profile(2, 2, 2), sp_size=4, ring_size=2)
    dims = parallel_dims_for(layout, rank % 2, torch.device("cpu"))
    assert (dims.ulysses_size, dims.ring_size) == (2, 2)
    assert (dims.ring_rank, dims.ulysses_rank) == (rank // 2, rank % 2)
    return _sums_over(rank, (dims.sp_group, dims.dp_group, dims.ulysses_group, dims.ring_group))


@pytest.mark.slow
def test_ring_process_groups_reduce_within_ulysses_and_ring_groups(tmp_path):
    # one SP group (0-3), DP of one; Ulysses (0,1),(2,3) on each node; rings (0,2),(1,3)
    assert _on_four_ranks(_ring_groups, tmp_path) == {
        0: (6.0, 0.0, 1.0, 2.0),
        1: (6.0, 1.0, 1.0, 4.0),
        2: (6.0, 2.0, 5.0, 2.0),
        3: (6.0, 3.0, 5.0, 4.0),
    }


def _interleaved_groups(rank: int):
    import torch
    import torch.distributed as dist

    # NVLink domains {0, 2} and {1, 3}: the SP group in domain order, not rank order
    layout = ParallelLayout.from_sp_groups(((0, 2, 1, 3),), ring_size=2)
    dims = parallel_dims_for(layout, rank, torch.device("cpu"))
    # why FSDP2 shards over the world in rank order, not over this mesh flattened: the
    # flattening's coordinates follow the layout, its group's ranks follow the world
    flat = flatten_mesh(dims.mesh, "world", ("gloo", None))
    groups = (dims.sp_group, dims.dp_group, dims.ulysses_group, dims.ring_group)
    return (
        dims.mesh.mesh.tolist(),
        dims.mesh.mesh_dim_names,
        tuple(tuple(dist.get_process_group_ranks(g)) for g in groups),
        dims.sp_group is dist.group.WORLD,
        # every group waits as long as the world was told to, not its backend's default
        {g._get_backend(torch.device("cpu")).options._timeout for g in groups},
        (flat.get_coordinate(), dist.get_rank(flat.get_group())),
    )


@pytest.mark.slow
def test_the_device_mesh_holds_an_interleaved_layout_and_its_groups_are_the_layouts(tmp_path):
    got = _on_four_ranks(_interleaved_groups, tmp_path)
    mesh = [[[0, 2], [1, 3]]]  # [dp][ring][ulysses]
    ulysses = {0: (0, 2), 2: (0, 2), 1: (1, 3), 3: (1, 3)}
    ring = {0: (0, 1), 1: (0, 1), 2: (2, 3), 3: (2, 3)}
    flat_coordinate = {0: 0, 1: 2, 2: 1, 3: 3}  # rank 2 is the flattening's coordinate 1
    for rank in range(4):
        # the SP group spans the world, yet is a communicator of its own, not the default group
        groups = ((0, 1, 2, 3), (rank,), ulysses[rank], ring[rank])
        flat = ((flat_coordinate[rank],), rank)
        expected = (mesh, ("dp", "ring", "ulysses"), groups, False, {TIMEOUT}, flat)
        assert got[rank] == expected


def test_the_device_mesh_refuses_a_layout_for_another_world(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 8)
    layout = derive_parallel_layout(topology_from_profile(2, 2, 2), sp_size=2)
    with pytest.raises(
        LayoutError,
        match="torch.distributed has world_size 8 but the layout was derived for 4 ranks",
    ):
        device_mesh(layout, torch.device("cpu"))
