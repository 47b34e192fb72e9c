"""From the config's cluster profile to the job's parallel layout, and the check at job start
that the machines really are what the profile promised.

Submit derives the layout from the profile, so a size that cannot be placed is refused
before any allocation. Every job re-derives it from the same profile after checking the
profile against what each node detects: ranks then agree on the groups by construction.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
from collections.abc import Iterable, Sequence

import torch.distributed as dist

from slurm_autosp.cluster.layout import (
    LayoutError,
    ParallelLayout,
    derive_parallel_layout,
)
from slurm_autosp.cluster.rank_failure import describe_failure
from slurm_autosp.cluster.topology import (
    ClusterTopology,
    NodeTopology,
    NodeView,
    RankView,
    TopologyError,
    compare_topology,
    detect_node_topology,
    node_views,
    topology_from_profile,
    visible_devices,
)
from slurm_autosp.config import ClusterConfig, ConfigError, JobConfig, Vendor

log = logging.getLogger(__name__)


class TopologyMismatch(RuntimeError):
    """The nodes are not what `cluster.*` describes; the message shows both."""


def expected_topology(c: ClusterConfig) -> ClusterTopology:
    """GPU jobs: the profile's NVLink domains. CPU jobs: each node's ranks share memory, so a
    node is one domain of `ranks_per_node` devices."""
    if c.uses_gpus:
        return topology_from_profile(
            c.nodes, c.gpus_per_node, c.nvlink_domain_size or c.gpus_per_node, c.vendor
        )
    ranks = c.ranks_per_node
    node = lambda n: NodeTopology(f"node{n}", Vendor.none, ranks, (tuple(range(ranks)),))  # noqa: E731
    return ClusterTopology(tuple(node(n) for n in range(c.nodes)))


def _profile_topology(c: ClusterConfig) -> ClusterTopology:
    try:
        return expected_topology(c)
    except TopologyError as err:
        raise ConfigError(f"cluster.nvlink_domain_size / cluster.gpus_per_node: {err}") from err


def layout_for(cfg: JobConfig) -> ParallelLayout:
    """The layout this config gets, or a ConfigError naming the keys to change."""
    topology = _profile_topology(cfg.cluster)
    p = cfg.parallel
    _, ring = p.ulysses_ring
    try:
        return derive_parallel_layout(topology, p.sp_size, p.allow_cross_domain, ring)
    except LayoutError as err:
        raise ConfigError(
            f"parallel.sp_size={p.sp_size} / parallel.ring_size={ring}: {err}"
        ) from err


def layout_summary(cluster: ClusterConfig, layout: ParallelLayout) -> str:
    """Where the groups sit, in nodes and NVLink domains, for the dry run and the job's log:
    e.g. "SP 64 = Ulysses 8 x ring 8: Ulysses groups inside NVLink domains (the first on node
    0), ring over nodes 0-7 (8 NVLink domains)"."""
    per_node = cluster.ranks_per_node
    domains = _profile_topology(cluster).nvlink_domains
    domain_of = {rank: d for d, ranks in enumerate(domains) for rank in ranks}

    def where(ranks: tuple[int, ...]) -> str:
        first, last = ranks[0] // per_node, ranks[-1] // per_node
        spanned = len({domain_of[r] for r in ranks})
        nodes = f"node {first}" if first == last else f"nodes {first}-{last}"
        return nodes + (f" ({spanned} NVLink domains)" if spanned > 1 else "")

    if layout.ring_size == 1:
        return f"SP {layout.sp_size} (Ulysses): the first SP group on {where(layout.sp_groups[0])}"
    inside = "span NVLink domains" if layout.cross_domain else "inside NVLink domains"
    return (
        f"SP {layout.sp_size} = Ulysses {layout.ulysses_size} x ring {layout.ring_size}: "
        f"Ulysses groups {inside} (the first on {where(layout.ulysses_groups[0])}), ring over "
        f"{where(layout.ring_groups[0])}"
    )


def check_detected_topology(cluster: ClusterConfig, reports: Sequence[NodeTopology | None]) -> None:
    """Compare what each node found (one report per node, others None) with the profile."""
    nodes = tuple(r for r in reports if r is not None)
    if not cluster.uses_gpus:
        if len(nodes) != cluster.nodes:
            raise TopologyMismatch(
                f"cluster.nodes={cluster.nodes} but the job runs on {len(nodes)} nodes"
            )
        return
    problems = compare_topology(expected_topology(cluster), ClusterTopology(nodes))
    if problems:
        raise TopologyMismatch(
            "the nodes differ from the cluster profile (cluster.gpus_per_node="
            f"{cluster.gpus_per_node}, cluster.nvlink_domain_size={cluster.nvlink_domain_size or cluster.gpus_per_node}, "
            f"cluster.vendor={cluster.vendor.value}):\n  "
            + "\n  ".join(problems)
            + "\nfix the profile to match the machines, or request the machines it describes"
        )


def node_report(cluster: ClusterConfig, view: NodeView, detected: NodeTopology) -> NodeTopology:
    """What a node reports: what its first rank detected, or where the node is isolated (its
    tasks each see only their own GPU) one GPU per rank in the profile's NVLink domains, as
    no task can read the links. Vendor, fabric clique and network devices stay detected."""
    if not view.isolated:
        return detected
    size = cluster.nvlink_domain_size or cluster.gpus_per_node
    domains = tuple(
        tuple(range(start, min(start + size, view.ranks))) for start in range(0, view.ranks, size)
    )
    return dataclasses.replace(detected, gpu_count=view.ranks, nvlink_domains=domains)


def unread_links_warning(cluster: ClusterConfig, nodes: Iterable[NodeView]) -> str | None:
    """The warning rank 0 logs where some node's links could not be read, or None."""
    hosts = [node.host for node in nodes if node.isolated]
    if not hosts:
        return None
    return (
        f"GPU links of {'node' if len(hosts) == 1 else 'nodes'} {', '.join(hosts)} could not be "
        "read because each task sees only its own GPU: their NVLink domains are the profile's "
        f"(cluster.nvlink_domain_size={cluster.nvlink_domain_size or cluster.gpus_per_node}), "
        "trusted, not checked"
    )


def verify_topology(cluster: ClusterConfig, local_rank: int) -> None:
    """Each node's first rank detects its GPUs; rank 0 checks them all; every rank learns the
    verdict, so a mismatch stops the whole job before the model loads. A detection that raises
    is gathered as that rank's report, so every rank raises it rather than leave the others
    waiting in the gather for the rank that raised.

    Every rank first shares the GPUs it was shown, so a node whose tasks each see only their
    own GPU is detected with all of its ranks' (node_views). A CPU job's ranks use no GPU:
    what they are shown decides nothing."""
    shown = visible_devices(os.environ, cluster.vendor) if cluster.uses_gpus else None
    mine = RankView(socket.gethostname(), local_rank, shown)
    views = [mine] * dist.get_world_size()
    dist.all_gather_object(views, mine)
    nodes = node_views(views)
    report: NodeTopology | str | None = None
    if local_rank == 0:
        try:
            view = nodes[dist.get_rank()]
            report = node_report(cluster, view, detect_node_topology(view.visible))
        except Exception as err:  # any error: every rank must reach the gather
            report = describe_failure(dist.get_rank(), err)
    reports: list[NodeTopology | str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(reports, report)
    failed = [r for r in reports if isinstance(r, str)]
    if failed:
        raise TopologyError(
            "could not detect every node's GPUs: "
            + "; ".join(failed)
            + "\nfix that node's GPU tools (nvidia-smi, rocm-smi), or leave the node out of the "
            "job (sbatch --exclude) and submit again"
        )
    verdict = [""]
    if dist.get_rank() == 0:
        warning = unread_links_warning(cluster, nodes.values())
        if warning:
            log.warning("%s", warning)
        try:
            check_detected_topology(cluster, [r for r in reports if isinstance(r, NodeTopology)])
        except TopologyMismatch as err:
            verdict = [str(err)]
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0]:
        raise TopologyMismatch(verdict[0])
