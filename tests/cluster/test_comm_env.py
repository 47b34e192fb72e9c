"""launch.comm_env: NCCL/RCCL variables per vendor and fabric, user values always winning."""

import os
from pathlib import Path

import pytest

from slurm_autosp.cluster.comm_env import allocator_env, collective_env, collective_env_settings
from slurm_autosp.cluster.compile_cache import private_cache_dir
from slurm_autosp.compat import torch_api
from slurm_autosp.config import ConfigError, Fabric, Vendor, load_config
from slurm_autosp.launch.job import collective_env_for
from slurm_autosp.lifecycle.run_dir import RunDir

RUN_DIR = "/shared/runs/llama70b_128k"
FLIGHT_RECORDER = str(RunDir(Path(RUN_DIR)).flight_recorder_prefix)


def env(vendor="nvidia", fabric="infiniband", user_env=None, **kwargs):
    return collective_env(
        vendor, fabric, user_env=user_env or {}, flight_recorder_prefix=FLIGHT_RECORDER, **kwargs
    )


def test_efa_selects_the_efa_provider_without_cuda_sync_memops():
    e = env(fabric="efa")
    assert e["FI_PROVIDER"] == "efa"
    assert e["FI_EFA_SET_CUDA_SYNC_MEMOPS"] == "0"
    assert e["FI_EFA_USE_DEVICE_RDMA"] == "1"


def test_every_gpu_run_keeps_a_flight_recorder_in_the_run_dir_and_no_deprecated_variable():
    """TORCH_NCCL_AVOID_RECORD_STREAMS is every supported torch's default; setting it warns."""
    for vendor in ("nvidia", "amd"):
        e = env(vendor=vendor)
        assert "TORCH_NCCL_AVOID_RECORD_STREAMS" not in e
        assert int(e["TORCH_NCCL_TRACE_BUFFER_SIZE"]) > 0
        assert e["TORCH_FR_DUMP_TEMP_FILE"] == f"{RUN_DIR}/flight_recorder/rank_"


def test_rccl_gets_fine_grained_pcie_and_nccl_gets_pci_bus_device_order():
    assert env(vendor="amd")["HSA_FORCE_FINE_GRAIN_PCIE"] == "1"
    assert "CUDA_DEVICE_ORDER" not in env(vendor="amd")
    assert env(vendor="nvidia")["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert "HSA_FORCE_FINE_GRAIN_PCIE" not in env(vendor="nvidia")


def test_nvidia_runs_get_expandable_segments_unless_the_user_configured_the_allocator():
    assert env()["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        e = env(user_env={name: "max_split_size_mb:512"})
        assert e[name] == "max_split_size_mb:512"
        assert [k for k in e if k.endswith("ALLOC_CONF")] == [name]
    assert not any(k.endswith("ALLOC_CONF") for k in env(vendor="amd"))


def test_the_gpu_check_runs_with_the_allocator_setting_of_an_nvidia_job_or_the_users():
    assert allocator_env({}) == {"PYTORCH_CUDA_ALLOC_CONF": env()["PYTORCH_CUDA_ALLOC_CONF"]}
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        assert allocator_env({name: "max_split_size_mb:512"}) == {name: "max_split_size_mb:512"}


def test_compile_caches_are_node_local_and_follow_slurm_tmpdir():
    assert (
        env()["TRITON_CACHE_DIR"] == f"/tmp/slurm_autosp_cache_{os.getuid()}/triton"
    )  # one per user
    e = env(user_env={"SLURM_TMPDIR": "/local/job42"})
    assert e["TORCHINDUCTOR_CACHE_DIR"] == f"/local/job42/slurm_autosp_cache_{os.getuid()}/inductor"
    assert env(node_local_cache_dir="/nvme/cache")["TRITON_CACHE_DIR"] == "/nvme/cache/triton"


def test_debug_variables_only_in_debug_runs():
    for vendor in Vendor:
        for fabric in Fabric:
            assert "NCCL_DEBUG" not in env(vendor, fabric)
    assert env(debug=True)["NCCL_DEBUG"] == "INFO"


def test_user_values_always_win():
    user = {"FI_PROVIDER": "tcp", "NCCL_DEBUG": "WARN", "TRITON_CACHE_DIR": "/home/me/triton"}
    e = env(fabric="efa", user_env=user, debug=True)
    assert {k: e[k] for k in user} == user


def test_torchs_exported_default_cache_is_not_taken_for_the_users_choice():
    """Importing torch._dynamo exports TORCHINDUCTOR_CACHE_DIR=torch's default (also into the
    job's environment, from the submitting process): the node-local cache still applies."""
    cfg = load_config(["cfg=configs/tiny_cpu.yaml"])
    default = {
        "TORCHINDUCTOR_CACHE_DIR": torch_api.inductor_default_cache_dir(),
        "TMPDIR": "/local",
    }
    assert collective_env_for(cfg, default)["TORCHINDUCTOR_CACHE_DIR"] == (
        f"/local/slurm_autosp_cache_{os.getuid()}/inductor"
    )
    mine = {"TORCHINDUCTOR_CACHE_DIR": "/scratch/me/inductor"}
    assert collective_env_for(cfg, mine)["TORCHINDUCTOR_CACHE_DIR"] == "/scratch/me/inductor"


def test_a_user_value_under_another_name_wins_too():
    e = env(user_env={"TORCH_FR_BUFFER_SIZE": "0"})
    assert e["TORCH_FR_BUFFER_SIZE"] == "0"
    assert "TORCH_NCCL_TRACE_BUFFER_SIZE" not in e


@pytest.mark.parametrize(
    "fabric, expected",
    [
        ("infiniband", {"NCCL_IB_TIMEOUT": "22"}),
        ("roce", {"NCCL_IB_GID_INDEX": "3"}),
        ("slingshot", {"NCCL_SOCKET_IFNAME": "hsn", "FI_CXI_DISABLE_HOST_REGISTER": "1"}),
        ("tcp", {"NCCL_IB_DISABLE": "1"}),
    ],
)
def test_each_fabric_gets_its_own_variables(fabric, expected):
    e = env(fabric=fabric)
    assert {k: e[k] for k in expected} == expected
    assert "FI_PROVIDER" not in e


def test_cpu_runs_get_only_the_compile_caches():
    assert sorted(env(vendor="none", fabric="tcp")) == [
        "TORCHINDUCTOR_CACHE_DIR",
        "TRITON_CACHE_DIR",
    ]


def test_every_variable_says_why():
    for vendor in Vendor:
        for fabric in Fabric:
            for s in collective_env_settings(
                vendor, fabric, user_env={}, flight_recorder_prefix=FLIGHT_RECORDER, debug=True
            ):
                assert len(s.why) > 20, s.name


def test_unknown_vendor_or_fabric_names_the_choices():
    with pytest.raises(ValueError, match=r"vendor='intel' is not one of nvidia, amd, none"):
        env(vendor="intel")
    with pytest.raises(
        ValueError, match=r"fabric='omnipath' is not one of infiniband, roce, efa, slingshot, tcp"
    ):
        env(fabric="omnipath")


def test_a_compile_cache_directory_others_can_write_is_refused(tmp_path):
    """Inductor unpickles its cache: a shared or planted directory must not be used."""
    mine = tmp_path / "cache" / "inductor"
    private_cache_dir(str(mine))
    assert oct(mine.stat().st_mode & 0o777) == oct(0o700)
    mine.chmod(0o777)
    with pytest.raises(ConfigError, match="writable by others.*compile.cache_dir"):
        private_cache_dir(str(mine))


def test_a_compile_cache_directory_in_a_sticky_shared_directory_is_accepted(tmp_path):
    """torch's default cache, /tmp/torchinductor_<user>, which importing torch._dynamo exports to every job."""
    shared = tmp_path / "tmp"
    shared.mkdir()
    shared.chmod(0o1777)
    private_cache_dir(str(shared / "torchinductor_me"))
    shared.chmod(0o777)
    with pytest.raises(
        ConfigError, match=r"directory .*tmp is owned by uid \d+ or writable by others"
    ):
        private_cache_dir(str(shared / "torchinductor_me"))
