"""Environment variables for NCCL (NVIDIA) or RCCL (AMD) on a given fabric, and the CUDA
allocator's configuration.

One pure function decides; the caller applies the result before torch.distributed starts
and logs it. Every variable is here for a stated reason (the table below); debug-only
variables appear only with debug=True; a value the user already set always wins.
RCCL reads the same NCCL_* variables as NCCL.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from slurm_autosp.config import Fabric, Vendor

_E = TypeVar("_E", Vendor, Fabric)


@dataclass(frozen=True)
class EnvSetting:
    """One variable: its value, why we set it, and the older/newer names that mean the same."""

    name: str
    value: str
    why: str
    aliases: tuple[str, ...] = ()


# Set for NCCL and RCCL alike (PyTorch drives both through ProcessGroupNCCL). Not
# TORCH_NCCL_AVOID_RECORD_STREAMS: every supported torch (2.11 on) keeps a collective's tensors
# alive without record_stream anyway, and warns at start that the variable is deprecated.
_GPU_COLLECTIVES = (
    EnvSetting(
        "TORCH_NCCL_TRACE_BUFFER_SIZE",
        "2000",
        "keep the flight recorder's ring of the last 2000 collectives so a hang or timeout "
        "can be diagnosed after the fact",
        aliases=("TORCH_FR_BUFFER_SIZE",),
    ),
    EnvSetting(
        "TORCH_NCCL_DUMP_ON_TIMEOUT",
        "1",
        "write the flight recorder's trace when a collective times out, instead of only "
        "aborting: the dump names the collective each rank was stuck in",
    ),
)

_NVIDIA = (
    EnvSetting(
        "PYTORCH_CUDA_ALLOC_CONF",
        "expandable_segments:True",
        "let the CUDA allocator grow segments in place instead of caching fixed-size ones: a "
        "long-context step allocates tensors of many sizes, which otherwise fragment the GPU "
        "into reserved memory nothing fits in (the memory plan's margin assumes it; torchtitan "
        "sets it)",
        aliases=("PYTORCH_ALLOC_CONF",),
    ),
    EnvSetting(
        "CUDA_DEVICE_ORDER",
        "PCI_BUS_ID",
        "number CUDA devices as nvidia-smi does, so the local GPU indices our SP groups were "
        "derived from (nvidia-smi topo -m) are the ones each rank opens",
    ),
)

_AMD = (
    EnvSetting(
        "HSA_FORCE_FINE_GRAIN_PCIE",
        "1",
        "fine-grained PCIe memory, which RCCL needs for GPU-direct network transfers; RCCL "
        "warns at start without it",
    ),
)

_FABRIC = {
    Fabric.infiniband: (
        EnvSetting(
            "NCCL_IB_TIMEOUT",
            "22",
            "InfiniBand retry timeout 4.096us * 2^22 (about 17 s): large jobs ride out "
            "congestion and link flaps instead of failing",
        ),
    ),
    Fabric.roce: (
        EnvSetting(
            "NCCL_IB_GID_INDEX",
            "3",
            "use the RoCEv2 GID (index 3 on Mellanox/ConnectX setups); index 0 is RoCEv1 and "
            "does not route across subnets. Check `show_gids` and override if different",
        ),
        EnvSetting(
            "NCCL_IB_TIMEOUT",
            "22",
            "RoCE retry timeout about 17 s: ride out congestion instead of failing",
        ),
    ),
    Fabric.efa: (
        EnvSetting("FI_PROVIDER", "efa", "make libfabric use EFA, never fall back to TCP sockets"),
        EnvSetting(
            "FI_EFA_USE_DEVICE_RDMA",
            "1",
            "GPUDirect RDMA over EFA on instances that support it (p4d, p5)",
        ),
        EnvSetting(
            "FI_EFA_SET_CUDA_SYNC_MEMOPS",
            "0",
            "skip setting CU_POINTER_ATTRIBUTE_SYNC_MEMOPS on registered buffers: fewer memory "
            "synchronisations, higher throughput (torchtitan's and AWS's scripts)",
        ),
        EnvSetting(
            "FI_EFA_FORK_SAFE",
            "1",
            "data-loader workers fork after EFA memory is registered; keep libfabric fork-safe",
        ),
        EnvSetting(
            "NCCL_P2P_NET_CHUNKSIZE",
            "524288",
            "larger chunks for point-to-point traffic over EFA (AWS's recommended value)",
        ),
    ),
    Fabric.slingshot: (
        EnvSetting(
            "NCCL_SOCKET_IFNAME",
            "hsn",
            "bootstrap over the high-speed network interfaces (hsn0, hsn1, ...); on the "
            "management Ethernet NCCL hangs or crawls",
        ),
        EnvSetting(
            "NCCL_IB_DISABLE",
            "1",
            "Slingshot is reached through libfabric (aws-ofi-nccl/rccl), not InfiniBand verbs",
        ),
        EnvSetting(
            "NCCL_CROSS_NIC",
            "1",
            "let rings use different NICs at each end: Slingshot's dragonfly is not rail-optimised",
        ),
        EnvSetting(
            "FI_CXI_DISABLE_HOST_REGISTER",
            "1",
            "stop the CXI provider registering host memory, which deadlocks with CUDA/HIP allocations",
        ),
        EnvSetting(
            "FI_MR_CACHE_MONITOR",
            "userfaultfd",
            "monitor the memory-registration cache with userfaultfd, the setting the HPE "
            "Slingshot sites recommend for GPU jobs",
        ),
    ),
    Fabric.tcp: (
        EnvSetting(
            "NCCL_IB_DISABLE",
            "1",
            "no RDMA fabric: do not probe InfiniBand/RoCE devices, use TCP sockets directly",
        ),
    ),
}

_DEBUG = (
    EnvSetting("NCCL_DEBUG", "INFO", "debug run: NCCL/RCCL report init, topology and transports"),
    EnvSetting("NCCL_DEBUG_SUBSYS", "INIT,NET", "debug run: limit NCCL_DEBUG to setup and network"),
)


def _member(kind: type[_E], value: str, key: str) -> _E:
    """value as a member of kind (Vendor or Fabric), or a ValueError naming the choices."""
    try:
        return kind(value)
    except ValueError:
        choices = ", ".join(m.value for m in kind)
        raise ValueError(f"{key}={value!r} is not one of {choices}") from None


def compile_cache_settings(
    user_env: Mapping[str, str], node_local_cache_dir: str | None = None
) -> tuple[EnvSetting, EnvSetting]:
    """Inductor's and Triton's cache directories, before user values are applied.

    node_local_cache_dir defaults to $SLURM_TMPDIR or $TMPDIR (from user_env) or /tmp, plus
    "slurm_autosp_cache_<uid>": compile caches on shared storage hit inode quotas and stale file
    handles, and a cold cache costs minutes per start. One per user: inductor unpickles what
    it finds there, so another user's directory must never be read (launch.compile_cache
    makes it 0700 and refuses one others can write).
    """
    cache_dir = node_local_cache_dir or os.path.join(
        user_env.get("SLURM_TMPDIR") or user_env.get("TMPDIR") or "/tmp",
        f"slurm_autosp_cache_{os.getuid()}",
    )
    return (
        EnvSetting(
            "TORCHINDUCTOR_CACHE_DIR",
            os.path.join(cache_dir, "inductor"),
            "Inductor's compile cache on node-local disk: shared filesystems hit inode quotas "
            "and stale handles",
        ),
        EnvSetting(
            "TRITON_CACHE_DIR",
            os.path.join(cache_dir, "triton"),
            "Triton's kernel cache on node-local disk, for the same reason",
        ),
    )


def collective_env_settings(
    vendor: Vendor | str,
    fabric: Fabric | str,
    *,
    user_env: Mapping[str, str],
    flight_recorder_prefix: str,
    debug: bool = False,
    node_local_cache_dir: str | None = None,
) -> tuple[EnvSetting, ...]:
    """Every variable we would set, with its reason, before user values are applied.
    `flight_recorder_prefix` is the start of each rank's dump file, in the run directory
    (the caller names it: the run directory's layout is lifecycle's, a floor above)."""
    vendor, fabric = _member(Vendor, vendor, "vendor"), _member(Fabric, fabric, "fabric")
    settings = list(compile_cache_settings(user_env, node_local_cache_dir))
    if vendor is Vendor.none:
        return tuple(settings)
    settings += _GPU_COLLECTIVES
    settings.append(
        EnvSetting(
            "TORCH_FR_DUMP_TEMP_FILE",
            flight_recorder_prefix,
            "where the flight recorder writes each rank's trace on a timeout: the run directory, "
            "so it survives the job",
            aliases=("TORCH_NCCL_DEBUG_INFO_TEMP_FILE",),
        )
    )
    settings += _NVIDIA if vendor is Vendor.nvidia else _AMD
    settings += _FABRIC[fabric]
    if debug:
        settings += _DEBUG
    return tuple(settings)


def collective_env(
    vendor: Vendor | str,
    fabric: Fabric | str,
    *,
    user_env: Mapping[str, str],
    flight_recorder_prefix: str,
    debug: bool = False,
    node_local_cache_dir: str | None = None,
) -> dict[str, str]:
    """The variables to export for this vendor and fabric; a user's own value always wins.

    A variable the user set (under its name or an alias) keeps the user's value in the
    result and none of our aliases is added, so exporting the result never overrides them.
    """
    return _user_values_win(
        collective_env_settings(
            vendor,
            fabric,
            user_env=user_env,
            flight_recorder_prefix=flight_recorder_prefix,
            debug=debug,
            node_local_cache_dir=node_local_cache_dir,
        ),
        user_env,
    )


def allocator_env(user_env: Mapping[str, str]) -> dict[str, str]:
    """The CUDA allocator's configuration a job on NVIDIA GPUs runs with (the memory plan
    assumes it), for a process that measures what such a job would; the user's value wins."""
    return _user_values_win([s for s in _NVIDIA if s.name == "PYTORCH_CUDA_ALLOC_CONF"], user_env)


def _user_values_win(settings: Iterable[EnvSetting], user_env: Mapping[str, str]) -> dict[str, str]:
    env: dict[str, str] = {}
    for setting in settings:
        user_names = [n for n in (setting.name, *setting.aliases) if n in user_env]
        if user_names:
            env.update({n: user_env[n] for n in user_names})
        else:
            env[setting.name] = setting.value
    return env
