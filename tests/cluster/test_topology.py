"""launch.topology: parsing real tool outputs, expected vs detected topology, detection."""

import subprocess
from pathlib import Path

import pytest

from slurm_autosp.cluster.placement import (
    TopologyMismatch,
    check_detected_topology,
    node_report,
    unread_links_warning,
)
from slurm_autosp.cluster.topology import (
    ClusterTopology,
    LinkMatrix,
    NodeTopology,
    NodeView,
    RankView,
    TopologyError,
    compare_topology,
    detect_node_topology,
    node_clique,
    node_views,
    nvlink_domains_from_links,
    parse_nvidia_smi_fabric,
    parse_nvidia_smi_topo,
    parse_rocm_smi_topology,
    restrict_to_visible,
    topology_from_profile,
    visible_devices,
)
from slurm_autosp.config import ClusterConfig, Vendor

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


# ----------------------------------------------------------------- nvidia-smi topo -m


@pytest.mark.parametrize(
    "name, gpus, link",
    [("nvidia_smi_topo_dgx_a100.txt", 8, "NV12"), ("nvidia_smi_topo_dgx_h100.txt", 8, "NV18")],
)
def test_nvswitch_boxes_are_one_domain_of_eight(name, gpus, link):
    matrix = parse_nvidia_smi_topo(fixture(name))
    assert matrix.gpu_count == gpus
    assert matrix.links[0][1] == link and matrix.links[3][3] == "X"
    assert nvlink_domains_from_links(matrix) == (tuple(range(8)),)


def test_nvlink_bridged_pairs_are_two_domains_and_nics_come_from_columns():
    matrix = parse_nvidia_smi_topo(fixture("nvidia_smi_topo_a100_4gpu_nvlink_pairs.txt"))
    assert nvlink_domains_from_links(matrix) == ((0, 1), (2, 3))
    assert matrix.network_devices == ("mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3")


def test_pcie_only_gpus_each_stand_alone():
    matrix = parse_nvidia_smi_topo(fixture("nvidia_smi_topo_pcie_8x_rtx4090.txt"))
    assert matrix.gpu_count == 8
    assert nvlink_domains_from_links(matrix) == tuple((i,) for i in range(8))
    assert matrix.network_devices == ("NIC0", "NIC1")  # this capture has no NIC legend


def test_two_gpus_across_sockets_have_no_nvlink():
    matrix = parse_nvidia_smi_topo(fixture("nvidia_smi_topo_a100_2gpu_pcie.txt"))
    assert matrix.links == (("X", "SYS"), ("SYS", "X"))
    assert nvlink_domains_from_links(matrix) == ((0,), (1,))


def test_gb200_node_is_one_local_domain_of_four():
    matrix = parse_nvidia_smi_topo(fixture("nvidia_smi_topo_gb200_node.txt"))
    assert matrix.gpu_count == 4
    assert nvlink_domains_from_links(matrix) == ((0, 1, 2, 3),)


def test_nic_legend_names_the_network_devices():
    text = (
        "\tGPU0\tGPU1\tNIC0\tNIC1\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\n"
        "GPU0\t X \tNV18\tPIX\tSYS\t0-55\t0\t\tN/A\n"
        "GPU1\tNV18\t X \tSYS\tPIX\t56-111\t1\t\tN/A\n"
        "NIC0\tPIX\tSYS\t X \tSYS\n"
        "NIC1\tSYS\tPIX\tSYS\t X \n\n"
        "NIC Legend:\n\n  NIC0: mlx5_0\n  NIC1: mlx5_bond_0\n"
    )
    assert parse_nvidia_smi_topo(text).network_devices == ("mlx5_0", "mlx5_bond_0")


def test_colour_codes_in_the_header_are_ignored():
    text = fixture("nvidia_smi_topo_gb200_node.txt").replace("GPU0  GPU1", "\x1b[4mGPU0  GPU1", 1)
    assert parse_nvidia_smi_topo(text).gpu_count == 4


def test_text_without_a_topology_matrix_is_refused_with_what_was_seen():
    with pytest.raises(TopologyError, match="no header line naming GPU0.*NVIDIA-SMI has failed"):
        parse_nvidia_smi_topo(
            "NVIDIA-SMI has failed because it couldn't communicate with the driver\n"
        )


def test_a_truncated_matrix_is_refused():
    text = "\n".join(fixture("nvidia_smi_topo_dgx_a100.txt").splitlines()[:5])
    with pytest.raises(TopologyError, match=r"rows \['GPU4', 'GPU5', 'GPU6', 'GPU7'\] are missing"):
        parse_nvidia_smi_topo(text)


def test_hybrid_cube_mesh_splits_into_fully_connected_quads():
    # DGX-1 (V100) NVLink pattern: quads 0-3 and 4-7 fully linked, plus one link per GPU across.
    nv = {
        (0, 1),
        (0, 2),
        (0, 3),
        (1, 2),
        (1, 3),
        (2, 3),
        (4, 5),
        (4, 6),
        (4, 7),
        (5, 6),
        (5, 7),
        (6, 7),
        (0, 4),
        (1, 5),
        (2, 6),
        (3, 7),
    }
    links = tuple(
        tuple(
            "X" if i == j else ("NV1" if (min(i, j), max(i, j)) in nv else "SYS") for j in range(8)
        )
        for i in range(8)
    )
    assert nvlink_domains_from_links(LinkMatrix(links)) == ((0, 1, 2, 3), (4, 5, 6, 7))


def test_visible_devices_restrict_the_matrix_to_the_jobs_gpus():
    matrix = parse_nvidia_smi_topo(fixture("nvidia_smi_topo_a100_4gpu_nvlink_pairs.txt"))
    mine = restrict_to_visible(matrix, "1,2")
    assert mine.links == (("X", "SYS"), ("SYS", "X"))
    assert restrict_to_visible(matrix, "GPU-8a1c...") is matrix
    with pytest.raises(TopologyError, match=r"name GPUs \[7\].*reports only 4 GPUs"):
        restrict_to_visible(matrix, "0,7")


# ----------------------------------------------------------------- nvidia-smi -q Fabric


def test_gb200_fabric_block_names_its_clique():
    (state,) = parse_nvidia_smi_fabric(fixture("nvidia_smi_q_fabric_gb200_grep.txt"))
    assert (state.state, state.status, state.clique_id) == ("Completed", "Success", "2")
    assert state.health_summary == "Unhealthy"
    assert state.clique == "dc6e40c4-d722-4357-9ba6-5291dd461278/2"


def test_h100_completed_with_zero_cluster_uuid_is_no_multi_node_domain():
    states = parse_nvidia_smi_fabric(fixture("nvidia_smi_q_h100_sxm_8gpu.txt"))
    assert len(states) == 8
    assert {(s.state, s.status, s.cluster_uuid) for s in states} == {
        ("Completed", "Success", "00000000-0000-0000-0000-000000000000")
    }
    assert node_clique(states) is None


@pytest.mark.parametrize(
    "name",
    ["nvidia_smi_q_fabric_insufficient_resources.txt", "nvidia_smi_q_fabric_in_progress.txt"],
)
def test_unregistered_fabric_states_give_no_clique(name):
    (state,) = parse_nvidia_smi_fabric(fixture(name))
    assert state.clique is None


def test_gpus_disagreeing_on_their_clique_give_none():
    (a,) = parse_nvidia_smi_fabric(fixture("nvidia_smi_q_fabric_gb200_grep.txt"))
    (b,) = parse_nvidia_smi_fabric(fixture("nvidia_smi_q_fabric_in_progress.txt"))
    assert node_clique([a, a]) == a.clique
    assert node_clique([a, b]) is None


# ----------------------------------------------------------------- rocm-smi


def test_mi300_series_node_is_one_xgmi_domain_of_eight():
    matrix = parse_rocm_smi_topology(fixture("rocm_smi_showtopo_mi300_series_8gpu.txt"))
    assert matrix.gpu_count == 8 and matrix.links[0][0] == "0" and matrix.links[2][5] == "XGMI"
    assert nvlink_domains_from_links(matrix) == (tuple(range(8)),)


def test_mi210_node_with_infinity_fabric_bridge_is_one_domain_of_four():
    matrix = parse_rocm_smi_topology(fixture("rocm_smi_showtopo_mi210_4gpu.txt"))
    assert nvlink_domains_from_links(matrix) == ((0, 1, 2, 3),)


def test_two_xgmi_hives_joined_by_pcie_are_two_domains():
    header = "       " + "".join(f"GPU{i:<10}" for i in range(8))
    rows = [
        f"GPU{i}   "
        + "  ".join("0" if i == j else ("XGMI" if i // 4 == j // 4 else "PCIE") for j in range(8))
        for i in range(8)
    ]
    text = "=== Link Type between two GPUs ===\n" + header + "\n" + "\n".join(rows) + "\n"
    assert nvlink_domains_from_links(parse_rocm_smi_topology(text)) == ((0, 1, 2, 3), (4, 5, 6, 7))


def test_rocm_output_without_link_types_is_refused_with_the_command_to_run():
    with pytest.raises(TopologyError, match="rocm-smi --showtopotype"):
        parse_rocm_smi_topology("=== Weight between two GPUs ===\n")


# ----------------------------------------------------------------- cluster topology


def test_ranks_are_node_major_and_nvl72_racks_merge_by_clique():
    racks = topology_from_profile(nodes=36, gpus_per_node=4, nvlink_domain_size=72)
    assert racks.world_size == 144
    assert racks.nvlink_domains == (tuple(range(72)), tuple(range(72, 144)))


def test_a_job_ending_inside_a_rack_gets_a_smaller_last_domain():
    assert topology_from_profile(20, 4, 72).domain_sizes == (72, 8)


def test_fat_tree_profile_has_one_domain_per_node():
    topo = topology_from_profile(nodes=2, gpus_per_node=8, nvlink_domain_size=8)
    assert topo.nvlink_domains == (tuple(range(8)), tuple(range(8, 16)))
    assert repr(topo) == "ClusterTopology(2 nodes, 16 GPUs, NVLink domains: 2 of 8 GPUs)"


@pytest.mark.parametrize(
    "args, message",
    [
        ((2, 8, 3), r"nvlink_domain_size=3 does not divide gpus_per_node=8 \(choose 1, 2, 4 or 8"),
        (
            (2, 4, 70),
            r"nvlink_domain_size=70 spans nodes but is not a multiple of gpus_per_node=4 \(e.g. 68 or 72\)",
        ),
        ((0, 4, 4), r"nodes=0.*at least 1"),
    ],
)
def test_impossible_profiles_are_refused_with_the_choices(args, message):
    with pytest.raises(TopologyError, match=message):
        topology_from_profile(*args)


def test_node_domains_must_cover_every_gpu_once():
    with pytest.raises(TopologyError, match=r"must cover local GPUs 0..3 exactly once"):
        NodeTopology("gpu-1", "nvidia", 4, ((0, 1), (1, 2)))
    with pytest.raises(TopologyError, match=r"gpu_vendor='intel' is not one of nvidia, amd, none"):
        NodeTopology("gpu-1", "intel", 0, ())


def test_matching_topologies_compare_equal():
    assert compare_topology(topology_from_profile(4, 8, 8), topology_from_profile(4, 8, 8)) == []


def test_mismatches_name_both_values():
    expected = topology_from_profile(nodes=2, gpus_per_node=8, nvlink_domain_size=8)
    pairs = NodeTopology("gpu-7", "nvidia", 8, ((0, 1), (2, 3), (4, 5), (6, 7)))
    detected = ClusterTopology((NodeTopology("gpu-6", "nvidia", 8, (tuple(range(8)),)), pairs))
    assert compare_topology(expected, detected) == [
        "NVLink domains: expected 2 x 8 GPUs, detected 1 x 8 GPUs + 4 x 2 GPUs; "
        "first difference: expected ranks 8-15 together, detected 8-9"
    ]
    fewer = ClusterTopology((NodeTopology("gpu-6", "amd", 4, ((0, 1, 2, 3),)),))
    assert compare_topology(expected, fewer)[:3] == [
        "nodes: expected 2, detected 1",
        "node 0 (gpu-6): GPU vendor expected nvidia, detected amd",
        "node 0 (gpu-6): GPUs expected 8, detected 4",
    ]


# ----------------------------------------------------------------- detection


def fake_tools(outputs: dict[str, str], returncode: int = 0):
    def run(argv, **kwargs):
        assert kwargs["timeout"] > 0 and kwargs["capture_output"]
        return subprocess.CompletedProcess(
            argv, returncode, outputs[" ".join(argv)], "driver not loaded"
        )

    return run


def test_detection_on_a_machine_without_gpu_tools_reports_no_gpus():
    node = detect_node_topology(None, which=lambda tool: None)
    assert (node.gpu_vendor, node.gpu_count, node.nvlink_domains) == ("none", 0, ())


def test_detection_on_this_machine_does_not_fail():
    node = detect_node_topology(None)
    assert node.gpu_vendor in ("nvidia", "amd", "none") and node.hostname


def test_detection_reads_nvidia_smi_and_keeps_the_jobs_gpus():
    run = fake_tools(
        {
            "nvidia-smi topo -m": fixture("nvidia_smi_topo_a100_4gpu_nvlink_pairs.txt"),
            "nvidia-smi -q": fixture("nvidia_smi_q_h100_sxm_8gpu.txt"),
        }
    )
    node = detect_node_topology("2,3", which=lambda t: t == "nvidia-smi", run=run)
    assert (node.gpu_vendor, node.gpu_count, node.nvlink_domains) == ("nvidia", 2, ((0, 1),))
    assert node.fabric_clique is None and "mlx5_0" in node.network_devices


def test_detection_reads_the_clique_of_a_gb200_node():
    run = fake_tools(
        {
            "nvidia-smi topo -m": fixture("nvidia_smi_topo_gb200_node.txt"),
            "nvidia-smi -q": fixture("nvidia_smi_q_fabric_gb200_grep.txt"),
        }
    )
    node = detect_node_topology(None, which=lambda t: t == "nvidia-smi", run=run)
    assert node.fabric_clique == "dc6e40c4-d722-4357-9ba6-5291dd461278/2"


def test_detection_reads_rocm_smi():
    run = fake_tools(
        {"rocm-smi --showtopotype": fixture("rocm_smi_showtopo_mi300_series_8gpu.txt")}
    )
    node = detect_node_topology(None, which=lambda t: t == "rocm-smi", run=run)
    assert (node.gpu_vendor, node.nvlink_domains) == ("amd", (tuple(range(8)),))


def test_a_failing_tool_is_an_error_not_a_guess():
    run = fake_tools({"nvidia-smi topo -m": ""}, returncode=9)
    with pytest.raises(
        TopologyError, match="`nvidia-smi topo -m` exited with 9: driver not loaded"
    ):
        detect_node_topology(None, which=lambda t: t == "nvidia-smi", run=run)


def test_a_hanging_tool_is_reported_with_how_to_skip_detection():
    def run(argv, **kwargs):
        raise subprocess.TimeoutExpired(argv, kwargs["timeout"])

    with pytest.raises(
        TopologyError, match="did not answer within 5s; set the topology in the config"
    ):
        detect_node_topology(None, which=lambda t: t == "nvidia-smi", run=run, timeout_s=5)


# ----------------------------------------------------------------- one GPU per task (#48)


def slurm_node(*visible: str | None, host: str = "gpu-node-1") -> list[RankView]:
    """One node's ranks as Slurm starts them: local ranks 0.. with their visible devices."""
    return [RankView(host, n, shown) for n, shown in enumerate(visible)]


def detect_on(view: NodeView, topo: str, query: str) -> NodeTopology:
    """What the node's first rank detects for `view`, nvidia-smi answering as captured."""
    run = fake_tools({"nvidia-smi topo -m": fixture(topo), "nvidia-smi -q": fixture(query)})
    return detect_node_topology(view.visible, which=lambda t: t == "nvidia-smi", run=run)


def test_visible_devices_are_read_as_the_vendors_runtime_reads_them():
    env = {"CUDA_VISIBLE_DEVICES": "3", "HIP_VISIBLE_DEVICES": "5"}
    assert visible_devices(env, Vendor.nvidia) == "3"
    assert visible_devices(env, Vendor.amd) == "5"
    assert visible_devices({**env, "ROCR_VISIBLE_DEVICES": "4"}, Vendor.amd) == "4"
    assert visible_devices({}, Vendor.nvidia) is None


def test_ranks_bound_to_one_gpu_each_by_visible_devices_detect_the_whole_node():
    # --gpus-per-task=1 / --gpu-bind=single:1: local rank n is shown GPU n of the DGX H100
    cluster = ClusterConfig(gpus_per_node=8)
    (view,) = node_views(slurm_node(*"01234567")).values()
    node = node_report(
        cluster,
        view,
        detect_on(view, "nvidia_smi_topo_dgx_h100.txt", "nvidia_smi_q_h100_sxm_8gpu.txt"),
    )
    check_detected_topology(cluster, [node])  # before #48: "GPUs expected 8, detected 1"
    assert (node.gpu_count, node.nvlink_domains) == (8, (tuple(range(8)),))
    assert (view.visible, view.isolated) == ("0,1,2,3,4,5,6,7", False)


def test_ranks_shown_the_whole_node_detect_it_as_before():
    # --gpus-per-node (submitit's default): every task is shown all of the job's GPUs
    whole = "0,1,2,3,4,5,6,7"
    assert node_views(slurm_node(*[whole] * 8))[0] == NodeView("gpu-node-1", 8, whole, False)
    assert node_views(slurm_node(*[None] * 8))[0] == NodeView("gpu-node-1", 8, None, False)


def test_a_nodes_ranks_follow_its_local_rank_0_even_on_one_host():
    # two nodes' ranks, then a local job standing two nodes on one host
    views = node_views(slurm_node("0", "1") + slurm_node("1", "0", host="gpu-node-2"))
    assert views == {
        0: NodeView("gpu-node-1", 2, "0,1", False),
        2: NodeView("gpu-node-2", 2, "1,0", False),
    }
    assert list(node_views(slurm_node(None) + slurm_node(None))) == [0, 1]


def test_tasks_each_seeing_only_their_own_gpu_take_the_profiles_domains_with_a_warning():
    # per-task device cgroups: each task's GPU is renumbered 0, and nvidia-smi in local rank 0
    # sees that one GPU of the node (a single-GPU H100 view captured in a device-isolated pod)
    cluster = ClusterConfig(gpus_per_node=8, nvlink_domain_size=4)
    views = node_views(slurm_node(*["0"] * 8))
    (view,) = views.values()
    assert view.isolated
    detected = detect_on(
        view, "nvidia_smi_topo_h100_one_gpu_view.txt", "nvidia_smi_q_h100_one_gpu_view.txt"
    )
    assert detected.gpu_count == 1
    node = node_report(cluster, view, detected)
    assert (node.gpu_vendor, node.gpu_count) == ("nvidia", 8)
    assert node.nvlink_domains == ((0, 1, 2, 3), (4, 5, 6, 7))
    check_detected_topology(cluster, [node])
    assert unread_links_warning(cluster, views.values()) == (
        "GPU links of node gpu-node-1 could not be read because each task sees only its own "
        "GPU: their NVLink domains are the profile's (cluster.nvlink_domain_size=4), trusted, "
        "not checked"
    )


def test_nodes_whose_links_were_read_give_no_warning():
    cluster = ClusterConfig(gpus_per_node=8)
    assert unread_links_warning(cluster, node_views(slurm_node(*"01234567")).values()) is None


def test_ranks_shown_overlapping_sets_of_gpus_are_refused_naming_the_node():
    with pytest.raises(
        TopologyError, match=r"node gpu-node-3: .*local ranks 0-2: '0,1', '1,2', '0,1'\)"
    ):
        node_views(slurm_node("0,1", "1,2", "0,1", host="gpu-node-3"))


def test_one_gpu_per_task_still_counts_the_nodes_gpus_against_the_profile():
    # 4 tasks each shown their own GPU on a node the profile says has 8: a real mismatch
    cluster = ClusterConfig(gpus_per_node=8)
    (view,) = node_views(slurm_node(*"0123")).values()
    node = node_report(
        cluster,
        view,
        detect_on(view, "nvidia_smi_topo_dgx_h100.txt", "nvidia_smi_q_h100_sxm_8gpu.txt"),
    )
    with pytest.raises(TopologyMismatch, match="GPUs expected 8, detected 4"):
        check_detected_topology(cluster, [node])
