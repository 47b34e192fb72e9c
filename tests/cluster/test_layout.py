"""launch.layout: SP groups inside NVLink domains, DP across them, and the groups torch builds."""

import os
import sys

import pytest
import torch.multiprocessing as mp

from slurm_autosp.cluster.layout import (
    LayoutError,
    ParallelLayout,
    build_process_groups,
    derive_parallel_layout,
)
from slurm_autosp.cluster.topology import ClusterTopology, NodeTopology, topology_from_profile

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
        "1 or 2. Choose one of them, or set parallel.allow_cross_domain=true to accept the slower layout."
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
        match=r"2 domains of 72 GPUs.*fit inside a domain: 1, 2, 3, 4, 6, 8, 9, 12, 18, 24, 36 or 72\.",
    ):
        derive_parallel_layout(topology_from_profile(36, 4, 72), sp_size=16)


def test_a_partial_rack_limits_sp_to_what_both_domains_hold():
    with pytest.raises(
        LayoutError, match=r"1 domain of 72 GPUs and 1 domain of 8 GPUs.*1, 2, 4 or 8\."
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


# ----------------------------------------------------------------- torch.distributed groups


def _groups_worker(rank: int, world: int, init_file: str, results) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    layout = derive_parallel_layout(topology_from_profile(2, 2, 2), sp_size=2)
    sp_group, dp_group = build_process_groups(layout)
    value = torch.tensor([float(rank)])
    dist.all_reduce(value, group=sp_group)
    members = torch.tensor([float(rank)])
    dist.all_reduce(members, group=dp_group)
    results[rank] = (
        value.item(),
        members.item(),
        dist.get_world_size(sp_group),
        dist.get_world_size(dp_group),
    )
    dist.destroy_process_group()


def test_process_groups_reduce_within_sp_and_dp_groups(tmp_path):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    init_file = str(tmp_path / "rendezvous")  # a file, not a port another process could take
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_groups_worker, args=(4, init_file, results), nprocs=4, join=True)
        got = dict(results)
    # sp_groups (0,1),(2,3); dp_groups (0,2),(1,3)
    assert got == {
        0: (1.0, 2.0, 2, 2),
        1: (1.0, 4.0, 2, 2),
        2: (5.0, 2.0, 2, 2),
        3: (5.0, 4.0, 2, 2),
    }


def test_build_process_groups_refuses_a_layout_for_another_world(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 8)
    layout = derive_parallel_layout(topology_from_profile(2, 2, 2), sp_size=2)
    with pytest.raises(
        LayoutError,
        match="torch.distributed has world_size 8 but the layout was derived for 4 ranks",
    ):
        build_process_groups(layout)
