"""Dry runs and submit-time checks work without a GPU or a cluster and submit nothing."""

import pytest
from in_process import run_command
from slurm_helpers import REPO

from slurm_autosp.cluster.placement import TopologyMismatch, check_detected_topology
from slurm_autosp.cluster.topology import (
    NodeTopology,
    nvlink_domains_from_links,
    parse_nvidia_smi_topo,
)
from slurm_autosp.commands.submit import main as submit_main
from slurm_autosp.config import load_config

FIXTURES = REPO / "tests" / "fixtures"


def submit(*args):
    return run_command(submit_main, *args)


def test_llama70b_dry_run_prints_script_environment_and_layout(tmp_path):
    proc = submit("cfg=configs/llama70b_128k.yaml", "dry_run=true", f"run.output_root={tmp_path}")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for line in (
        "#SBATCH --nodes=8",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --ntasks-per-node=8",
        "#SBATCH --signal=USR2@120",  # two of 80 layers and one save: 62 s
        "#SBATCH --requeue",
    ):
        assert line in out
    assert "TORCH_NCCL_TRACE_BUFFER_SIZE=2000" in out and "NCCL_IB_TIMEOUT=" in out
    assert "ParallelLayout(world_size 64 = sp 8 x dp 8" in out
    assert "hidden_size: 8192" in out
    assert "nothing submitted" in out
    assert "zero_stage: 3" in out  # the stage the plan chose, fixed in the config the job runs with
    assert "ZeRO-3 (FSDP2; chosen: does not fit under ZeRO-1)" in out and "verdict: fits" in out
    assert (
        "warning: cluster.signal_delay_s" not in out
    )  # each rank writes 1/64 of the sharded state: 13.2 GB
    assert not (tmp_path / "llama70b_128k").exists()


@pytest.mark.slow
def test_llama8b_256k_lora_dry_run_plans_the_adapters_on_one_node(tmp_path):
    proc = submit(
        "cfg=configs/llama8b_256k_lora.yaml", "dry_run=true", f"run.output_root={tmp_path}"
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "#SBATCH --nodes=1" in out and "zero_stage: 1" in out
    assert "41.9M of 8.07B parameters trained" in out and "verdict: fits" in out
    assert "nothing submitted" in out
    assert not (tmp_path / "llama8b_256k_lora").exists()


def test_llama8b_32m_dry_run_shows_ulysses_inside_nodes_and_the_ring_across_them(tmp_path):
    proc = submit("cfg=configs/llama8b_32m.yaml", "dry_run=true", f"run.output_root={tmp_path}")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert (
        "SP 128 = Ulysses 8 x ring 16: Ulysses groups inside NVLink domains (the first on node 0), "
        "ring over nodes 0-15 (16 NVLink domains)"
    ) in out
    assert "ParallelLayout(world_size 128 = sp 128 (Ulysses 8 x ring 16) x dp 1" in out
    assert "ring_groups 8 x [0,8,...,120 (step 8)]" in out
    assert "  ring_size: 16\n" in out  # resolved once, written into the config the job runs with
    assert "#SBATCH --signal=USR2@2400" in out and "verdict: fits" in out


def test_on_nvl72_racks_ulysses_groups_stay_in_a_rack_and_the_ring_crosses_racks(tmp_path):
    proc = submit(
        "cfg=configs/llama8b_32m.yaml",
        "cluster.nodes=36",
        "cluster.gpus_per_node=4",
        "cluster.nvlink_domain_size=72",
        "parallel.sp_size=144",
        "dry_run=true",
        f"run.output_root={tmp_path}",
    )
    assert proc.returncode == 0, proc.stderr
    # 32 heads, racks of 72 GPUs: the largest Ulysses size both allow is 8
    assert (
        "SP 144 = Ulysses 8 x ring 18: Ulysses groups inside NVLink domains (the first on nodes "
        "0-1), ring over nodes 0-34 (2 NVLink domains)"
    ) in proc.stdout


def test_a_step_no_slurm_signal_delay_can_cover_is_refused_naming_what_shortens_it(tmp_path):
    """Stopping at the step's end, 8 nodes' 15.6 h step is past SLURM's limit; stopping at a
    layer boundary, as the plan chooses, two of its 32 layers are not."""
    eight_nodes = (
        "cfg=configs/llama8b_32m.yaml",
        "cluster.nodes=8",
        "parallel.sp_size=64",
        "cluster.host_memory_gb=4096",  # 8 nodes of 2 TB cannot hold its offloaded activations
        "cluster.gpu_memory_gb=141",  # nor 80 GB GPUs the ring's buffers (H200s)
        "dry_run=true",
        f"run.output_root={tmp_path}",
    )
    proc = submit(*eight_nodes, "cluster.stop_at=step")
    assert proc.returncode == 2, proc.stdout
    assert (
        "it would need cluster.signal_delay_s=70096, more than SLURM sends its signal ahead "
        "(65535 s): stop within the step (cluster.stop_at=layer), shorten the step (each "
        "sequence over more GPUs: parallel.sp_size and cluster.nodes), or measure it with the "
        "probe if the estimate is too slow"
    ) in proc.stderr
    layers = submit(*eight_nodes, "cluster.signal_delay_s=4411")
    assert layers.returncode == 0, layers.stderr
    assert "within 2 of 32 layers' share of the step: 3,503.2 s" in layers.stdout


def test_signal_delay_too_short_for_a_step_and_a_save_is_refused(tmp_path):
    proc = submit(
        "cfg=configs/llama70b_128k.yaml",
        "dry_run=true",
        "checkpoint.write_gb_per_s=0.1",
        f"run.output_root={tmp_path}",
    )
    assert proc.returncode == 2, proc.stdout
    assert (
        "error: cluster.signal_delay_s=120 cannot cover two layers of a step plus one synchronous "
        "save after SLURM's pre-timeout signal (USR2): set cluster.signal_delay_s=211 or more"
    ) in proc.stderr
    assert "save: rank 0 writes 13.2 GB, 132.3 s at checkpoint.write_gb_per_s=0.1" in proc.stderr
    assert not (tmp_path / "llama70b_128k").exists()


def test_ulysses_larger_than_an_nvlink_domain_is_refused_with_the_valid_sizes():
    proc = submit(
        "cfg=configs/llama70b_128k.yaml",
        "parallel.sp_size=16",
        "parallel.ring_size=1",
        "dry_run=true",
    )
    assert proc.returncode == 2
    assert "parallel.sp_size=16 / parallel.ring_size=1" in proc.stderr
    assert "SP sizes that fit inside a domain: 1, 2, 4 or 8" in proc.stderr
    assert "8 x 2 (ring_size=2)" in proc.stderr


def test_crossing_domains_on_request_is_allowed():
    proc = submit(
        "cfg=configs/llama70b_128k.yaml",
        "parallel.sp_size=16",
        "parallel.ring_size=1",
        "parallel.allow_cross_domain=true",
        "dry_run=true",
    )
    assert proc.returncode == 0, proc.stderr
    assert "SP groups span NVLink domains" in proc.stdout


def test_unknown_key_fails_at_once():
    proc = submit("cfg=configs/tiny_cpu.yaml", "train.stepz=3")
    assert proc.returncode == 2 and "train.stepz" in proc.stderr


def detected_node(fixture):
    matrix = parse_nvidia_smi_topo((FIXTURES / fixture).read_text())
    return NodeTopology("gpu-node-1", "nvidia", matrix.gpu_count, nvlink_domains_from_links(matrix))


def test_detected_topology_matching_the_profile_passes():
    cfg = load_config(["cfg=configs/llama8b_32k.yaml"])
    check_detected_topology(
        cfg.cluster, [detected_node("nvidia_smi_topo_dgx_h100.txt")] + [None] * 7
    )


def test_detected_topology_that_disagrees_with_the_profile_stops_the_job_naming_both():
    cfg = load_config(["cfg=configs/llama8b_32k.yaml"])
    with pytest.raises(TopologyMismatch) as err:
        check_detected_topology(
            cfg.cluster, [detected_node("nvidia_smi_topo_pcie_8x_rtx4090.txt")] + [None] * 7
        )
    message = str(err.value)
    assert "cluster.nvlink_domain_size=8" in message
    assert "NVLink domains: expected 1 x 8 GPUs, detected 8 x 1 GPUs" in message
