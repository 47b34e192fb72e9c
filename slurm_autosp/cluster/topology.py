"""Which GPUs share an NVLink (NVIDIA) or xGMI (AMD) domain, per node and across a job.

Sequence-parallel all-to-all is bandwidth hungry, so its groups must sit inside one such
domain. The deciding logic here is pure (parsers of the vendor tools' text, the expected
topology from a config profile, the comparison of the two); only `detect_node_topology`
runs the tools. Ranks are numbered node-major, then by local GPU index, which is how Slurm
(block distribution) and submitit number tasks.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from slurm_autosp.config import Vendor
from slurm_autosp.heads import choices_text, divisors

_ZERO_UUID = "00000000-0000-0000-0000-000000000000"
_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")
_NVLINK_CELL = re.compile(r"^NV\d+$")  # "NV12": a bonded set of 12 NVLinks


class TopologyError(ValueError):
    """A topology that cannot be parsed, built or trusted; the message says what to change."""


@dataclass(frozen=True)
class LinkMatrix:
    """GPU-to-GPU link types as a vendor tool reports them, plus the node's network devices."""

    links: tuple[
        tuple[str, ...], ...
    ]  # links[i][j]: "X"/"0" on the diagonal, "NV18", "SYS", "XGMI", ...
    network_devices: tuple[str, ...] = ()

    @property
    def gpu_count(self) -> int:
        return len(self.links)

    def fast_link(self, i: int, j: int) -> bool:
        """NVLink (NV#) or xGMI between GPUs i and j."""
        cell = self.links[i][j]
        return cell == "XGMI" or bool(_NVLINK_CELL.match(cell))


@dataclass(frozen=True)
class FabricState:
    """One GPU's `Fabric` block in `nvidia-smi -q`: its multi-node NVLink registration."""

    state: str
    status: str
    clique_id: str
    cluster_uuid: str
    health_summary: str | None = None

    @property
    def clique(self) -> str | None:
        """ "<ClusterUUID>/<CliqueId>" when the GPU is registered in a multi-node NVLink domain.

        H100 nodes report State Completed with an all-zero ClusterUUID: that is no domain, and
        treating it as one would put every H100 node of a job into the same "rack".
        """
        if self.state != "Completed" or self.status != "Success":
            return None
        if self.cluster_uuid in ("", "N/A", _ZERO_UUID):
            return None
        return f"{self.cluster_uuid}/{self.clique_id}"


@dataclass(frozen=True)
class NodeTopology:
    """One node: its GPUs, which of them share NVLink/xGMI, and its rack-level fabric clique."""

    hostname: str
    gpu_vendor: Vendor  # a plain string is accepted and converted ("nvidia", "amd", "none")
    gpu_count: int
    nvlink_domains: tuple[tuple[int, ...], ...]  # local GPU indices; every GPU in exactly one
    fabric_clique: str | None = None  # nodes with the same clique share one NVLink domain
    network_devices: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "gpu_vendor", Vendor(self.gpu_vendor))
        except ValueError:
            raise TopologyError(
                f"node {self.hostname}: gpu_vendor={self.gpu_vendor!r} is not one of "
                f"{', '.join(v.value for v in Vendor)}"
            ) from None
        if self.gpu_count < 0:
            raise TopologyError(f"node {self.hostname}: gpu_count={self.gpu_count} is negative")
        covered = sorted(i for domain in self.nvlink_domains for i in domain)
        if covered != list(range(self.gpu_count)):
            raise TopologyError(
                f"node {self.hostname}: nvlink_domains={[list(d) for d in self.nvlink_domains]} must "
                f"cover local GPUs 0..{self.gpu_count - 1} exactly once (a GPU without NVLink is a "
                f"domain of its own)"
            )


@dataclass(frozen=True)
class ClusterTopology:
    """The nodes of a job in rank order, and the job-wide NVLink domains as global rank lists."""

    nodes: tuple[NodeTopology, ...]
    nvlink_domains: tuple[tuple[int, ...], ...] = field(init=False, repr=False)
    world_size: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "nodes", tuple(self.nodes))
        first_rank, rank = [], 0
        for node in self.nodes:
            first_rank.append(rank)
            rank += node.gpu_count
        object.__setattr__(self, "world_size", rank)
        object.__setattr__(self, "nvlink_domains", _global_domains(self.nodes, first_rank))

    @property
    def domain_sizes(self) -> tuple[int, ...]:
        return tuple(len(domain) for domain in self.nvlink_domains)

    def __repr__(self) -> str:
        sizes = self.domain_sizes
        shape = (
            f"{len(sizes)} of {sizes[0]} GPUs" if len(set(sizes)) == 1 else f"sizes {list(sizes)}"
        )
        return (
            f"ClusterTopology({len(self.nodes)} nodes, {self.world_size} GPUs, "
            f"NVLink domains: {shape if sizes else 'none'})"
        )


def _global_domains(
    nodes: Sequence[NodeTopology], first_rank: Sequence[int]
) -> tuple[tuple[int, ...], ...]:
    """Local domains shifted to global ranks; all GPUs of nodes in one fabric clique merge."""
    domains: list[tuple[int, ...]] = []
    clique_members: dict[str, list[int]] = {}
    for node, offset in zip(nodes, first_rank, strict=True):
        if node.fabric_clique is not None:
            clique_members.setdefault(node.fabric_clique, []).extend(
                range(offset, offset + node.gpu_count)
            )
        else:
            domains.extend(tuple(offset + i for i in sorted(d)) for d in node.nvlink_domains)
    domains.extend(tuple(ranks) for ranks in clique_members.values() if ranks)
    return tuple(sorted(domains))


# ---------------------------------------------------------------------------- parsers


def parse_nvidia_smi_topo(text: str) -> LinkMatrix:
    """Parse `nvidia-smi topo -m`: the GPU rows of the matrix and the NICs it lists.

    Accepts tab- or space-separated output (as printed, or as pasted into documents) and
    both NIC styles: `mlx5_0` column headers, or `NIC0` headers with a "NIC Legend".
    """
    lines = [_ANSI_ESCAPE.sub("", line).rstrip() for line in text.splitlines()]
    header_at = next((n for n, line in enumerate(lines) if "GPU0" in line.split()), None)
    if header_at is None:
        raise TopologyError(
            "nvidia-smi topo -m output has no header line naming GPU0; "
            f"first line was {lines[0] if lines else '(empty)'!r}"
        )
    header = lines[header_at].split()
    columns = header[: header.index("CPU")] if "CPU" in header else header
    rows: dict[str, list[str]] = {}
    for line in lines[header_at + 1 :]:
        tokens = line.split()
        if not tokens or tokens[0] not in columns:
            continue
        rows[tokens[0]] = tokens[1 : 1 + len(columns)]
    gpus = [name for name in columns if re.fullmatch(r"GPU\d+", name)]
    missing = [name for name in gpus if len(rows.get(name, ())) != len(columns)]
    if missing:
        raise TopologyError(
            f"nvidia-smi topo -m output: rows {missing} are missing or shorter than the "
            f"{len(columns)} columns {columns}"
        )
    gpu_columns = [columns.index(name) for name in gpus]
    links = tuple(tuple(rows[name][c] for c in gpu_columns) for name in gpus)
    legend = dict(re.findall(r"^\s*(NIC\d+):\s*(\S+)\s*$", "\n".join(lines), flags=re.MULTILINE))
    nics = tuple(legend.get(name, name) for name in columns if name not in gpus)
    return LinkMatrix(links=links, network_devices=nics)


def parse_rocm_smi_topology(text: str) -> LinkMatrix:
    """Parse the "Link Type between two GPUs" table of `rocm-smi --showtopo`/`--showtopotype`."""
    lines = text.splitlines()
    start = next((n for n, line in enumerate(lines) if "Link Type between two GPUs" in line), None)
    if start is None:
        raise TopologyError(
            "rocm-smi output has no 'Link Type between two GPUs' table; run `rocm-smi --showtopotype`"
        )
    header_at = next(
        (n for n in range(start + 1, len(lines)) if lines[n].split()[:1] == ["GPU0"]), None
    )
    if header_at is None:
        raise TopologyError("rocm-smi link-type table has no header row starting with GPU0")
    names = lines[header_at].split()
    links: list[tuple[str, ...]] = []
    for line in lines[header_at + 1 : header_at + 1 + len(names)]:
        tokens = line.split()
        if len(tokens) != len(names) + 1 or tokens[0] != names[len(links)]:
            raise TopologyError(
                f"rocm-smi link-type row {len(links)} should be {names[len(links)]} followed by "
                f"{len(names)} entries; got {line!r}"
            )
        links.append(tuple(tokens[1:]))
    return LinkMatrix(links=tuple(links))


def parse_nvidia_smi_fabric(text: str) -> tuple[FabricState, ...]:
    """Parse every `Fabric` block of `nvidia-smi -q` (also its `grep -C` excerpts), one per GPU."""
    states = []
    lines = text.splitlines()
    for n, line in enumerate(lines):
        if line.strip() != "Fabric":
            continue
        indent = len(line) - len(line.lstrip())
        values: dict[str, str] = {}
        for inner in lines[n + 1 :]:
            if not inner.strip() or inner.strip() == "--":
                break
            if len(inner) - len(inner.lstrip()) <= indent:
                break
            key, sep, value = inner.partition(":")
            if sep:
                values[key.strip()] = value.strip()
        states.append(
            FabricState(
                state=values.get("State", "N/A"),
                status=values.get("Status", "N/A"),
                clique_id=values.get("CliqueId", "N/A"),
                cluster_uuid=values.get("ClusterUUID", "N/A"),
                health_summary=values.get("Summary"),
            )
        )
    return tuple(states)


def nvlink_domains_from_links(matrix: LinkMatrix) -> tuple[tuple[int, ...], ...]:
    """Split GPUs into groups in which every pair has a direct NVLink/xGMI link.

    Greedy in index order: a GPU joins the current group only if it links directly to every
    member. An NVSwitch box gives one group of 8; NVLink-bridged pairs give pairs; a DGX-1
    hybrid cube-mesh gives its two fully connected quads; PCIe-only GPUs stand alone.
    """
    unplaced = list(range(matrix.gpu_count))
    domains = []
    while unplaced:
        group = [unplaced.pop(0)]
        for gpu in list(unplaced):
            if all(
                matrix.fast_link(gpu, member) and matrix.fast_link(member, gpu) for member in group
            ):
                group.append(gpu)
                unplaced.remove(gpu)
        domains.append(tuple(group))
    return tuple(domains)


def node_clique(states: Iterable[FabricState]) -> str | None:
    """The node's multi-node NVLink clique, if every GPU reports the same registered one."""
    cliques = {state.clique for state in states}
    if len(cliques) == 1:
        return cliques.pop()
    return None


def restrict_to_visible(matrix: LinkMatrix, visible: str | None) -> LinkMatrix:
    """The sub-matrix of the GPUs a visible-devices string names, renumbered 0..n-1.

    Slurm shows each task the job's GPUs (CUDA_VISIBLE_DEVICES/ROCR_VISIBLE_DEVICES); a tool
    that sees the whole node must not make the job's local ranks refer to GPUs it does not
    own. UUID lists are left alone.
    """
    if not visible:
        return matrix
    parts = [p.strip() for p in visible.split(",") if p.strip()]
    if not all(p.isdigit() for p in parts):
        return matrix
    keep = [int(p) for p in parts]
    outside = [i for i in keep if i >= matrix.gpu_count]
    if outside:
        raise TopologyError(
            f"visible devices {visible!r} name GPUs {outside}, but the tool reports only "
            f"{matrix.gpu_count} GPUs (0..{matrix.gpu_count - 1})"
        )
    links = tuple(tuple(matrix.links[i][j] for j in keep) for i in keep)
    return LinkMatrix(links=links, network_devices=matrix.network_devices)


@dataclass(frozen=True)
class RankView:
    """The GPUs one rank was shown, gathered from every rank before its node is probed."""

    host: str
    local_rank: int
    visible: str | None  # its visible-devices string (visible_devices); None: the whole node


@dataclass(frozen=True)
class NodeView:
    """The GPUs one node's ranks were shown together: what its first rank detects."""

    host: str
    ranks: int
    visible: str | None  # the ranks' GPUs in rank order, for restrict_to_visible; None: all
    # each rank shown only its own GPU, all under one id (per-task device cgroups renumber
    # it 0): no rank's tools see the node's other GPUs, so its links cannot be read
    isolated: bool


def visible_devices(env: Mapping[str, str], vendor: Vendor) -> str | None:
    """The GPUs a rank is shown, as the vendor's runtime reads them: CUDA_VISIBLE_DEVICES
    (NVIDIA), ROCR_VISIBLE_DEVICES or else HIP_VISIBLE_DEVICES (AMD); None where unset."""
    if vendor == Vendor.amd:
        return env.get("ROCR_VISIBLE_DEVICES") or env.get("HIP_VISIBLE_DEVICES")
    return env.get("CUDA_VISIBLE_DEVICES")


def node_views(ranks: Sequence[RankView]) -> dict[int, NodeView]:
    """Each node's view, keyed by its first rank, from every rank's in rank order.

    A node's ranks are its local rank 0 and the ranks after it (node-major, as submitit
    numbers them), not the ranks of one host: local jobs stand several nodes on one host.
    Every rank computes the same from the same gather, so an error here is raised by all.
    """
    firsts = [rank for rank, view in enumerate(ranks) if view.local_rank == 0]
    ends = [*firsts[1:], len(ranks)]
    return {first: node_view(ranks[first:end]) for first, end in zip(firsts, ends, strict=True)}


def node_view(ranks: Sequence[RankView]) -> NodeView:
    """What one node's ranks were shown together.

    Ranks shown disjoint GPUs (--gpus-per-task=1 or --gpu-bind binding by visible devices)
    or the same ones (--gpus-per-node, the default) show the node's GPUs between them. Ranks
    each shown one GPU under colliding ids are isolated. Other overlaps are refused: which
    GPU a rank uses could not be told.
    """
    host, count = ranks[0].host, len(ranks)
    shown = [_device_ids(r.visible) for r in ranks]
    if not all(shown):
        return NodeView(host, count, None, isolated=False)
    ids = [i for own in shown for i in own]
    union = list(dict.fromkeys(ids))
    if len(union) == len(ids):
        return NodeView(host, count, ",".join(union), isolated=False)
    if all(len(own) == 1 for own in shown):
        return NodeView(host, count, ranks[0].visible, isolated=True)
    if all(own == shown[0] for own in shown):
        return NodeView(host, count, ranks[0].visible, isolated=False)
    raise TopologyError(
        f"node {host}: its ranks were shown overlapping GPUs (visible devices of local ranks "
        f"0-{count - 1}: {', '.join(repr(r.visible) for r in ranks)}); show every rank all of "
        "the node's GPUs (--gpus-per-node) or each rank its own (--gpus-per-task=1)"
    )


def _device_ids(visible: str | None) -> tuple[str, ...]:
    """The ids a visible-devices string names; none where it is unset or empty (all GPUs)."""
    return tuple(p.strip() for p in (visible or "").split(",") if p.strip())


# ---------------------------------------------------------------------------- expected vs detected


def topology_from_profile(
    nodes: int, gpus_per_node: int, nvlink_domain_size: int, gpu_vendor: Vendor = Vendor.nvidia
) -> ClusterTopology:
    """The topology a config profile promises.

    nvlink_domain_size <= gpus_per_node: each node splits into domains of that size (8 on a
    DGX H100). Larger: consecutive nodes form racks of nvlink_domain_size / gpus_per_node
    nodes sharing one domain (72 on a GB200 NVL72 of 18 nodes x 4 GPUs); a job that ends
    inside a rack gets a smaller last domain.
    """
    if nodes < 1 or gpus_per_node < 1 or nvlink_domain_size < 1:
        raise TopologyError(
            f"nodes={nodes}, gpus_per_node={gpus_per_node}, nvlink_domain_size={nvlink_domain_size}: "
            "all must be at least 1"
        )
    if nvlink_domain_size <= gpus_per_node:
        if gpus_per_node % nvlink_domain_size:
            raise TopologyError(
                f"nvlink_domain_size={nvlink_domain_size} does not divide gpus_per_node={gpus_per_node} "
                f"(choose {choices_text(divisors(gpus_per_node))}, or a multiple of {gpus_per_node} for racks)"
            )
        local = tuple(
            tuple(range(start, start + nvlink_domain_size))
            for start in range(0, gpus_per_node, nvlink_domain_size)
        )
        return ClusterTopology(
            tuple(NodeTopology(f"node{n}", gpu_vendor, gpus_per_node, local) for n in range(nodes))
        )
    if nvlink_domain_size % gpus_per_node:
        raise TopologyError(
            f"nvlink_domain_size={nvlink_domain_size} spans nodes but is not a multiple of "
            f"gpus_per_node={gpus_per_node} (e.g. {gpus_per_node * (nvlink_domain_size // gpus_per_node)} "
            f"or {gpus_per_node * (nvlink_domain_size // gpus_per_node + 1)})"
        )
    nodes_per_rack = nvlink_domain_size // gpus_per_node
    whole_node = (tuple(range(gpus_per_node)),)
    return ClusterTopology(
        tuple(
            NodeTopology(
                f"node{n}",
                gpu_vendor,
                gpus_per_node,
                whole_node,
                fabric_clique=f"rack{n // nodes_per_rack}",
            )
            for n in range(nodes)
        )
    )


def compare_topology(expected: ClusterTopology, detected: ClusterTopology) -> list[str]:
    """Human-readable differences between what the config promises and what the job found."""
    problems = []
    if len(expected.nodes) != len(detected.nodes):
        problems.append(f"nodes: expected {len(expected.nodes)}, detected {len(detected.nodes)}")
    for n, (want, got) in enumerate(zip(expected.nodes, detected.nodes, strict=False)):
        if want.gpu_vendor != got.gpu_vendor:
            problems.append(
                f"node {n} ({got.hostname}): GPU vendor expected {want.gpu_vendor.value}, detected {got.gpu_vendor.value}"
            )
        if want.gpu_count != got.gpu_count:
            problems.append(
                f"node {n} ({got.hostname}): GPUs expected {want.gpu_count}, detected {got.gpu_count}"
            )
    if expected.nvlink_domains != detected.nvlink_domains:
        want_sizes, got_sizes = (
            _sizes_text(expected.domain_sizes),
            _sizes_text(detected.domain_sizes),
        )
        first = next(
            (
                (w, g)
                for w, g in zip(expected.nvlink_domains, detected.nvlink_domains, strict=False)
                if w != g
            ),
            None,
        )
        detail = (
            f"; first difference: expected ranks {_ranks_text(first[0])} together, detected "
            f"{_ranks_text(first[1])}"
            if first
            else ""
        )
        problems.append(f"NVLink domains: expected {want_sizes}, detected {got_sizes}{detail}")
    return problems


def _sizes_text(sizes: Sequence[int]) -> str:
    if not sizes:
        return "none"
    counts: dict[int, int] = {}
    for size in sizes:
        counts[size] = counts.get(size, 0) + 1
    return " + ".join(f"{count} x {size} GPUs" for size, count in counts.items())


def _ranks_text(ranks: Sequence[int]) -> str:
    """[0, 1, 2, 3, 8] -> "0-3,8"."""
    parts, start = [], None
    for n, rank in enumerate(ranks):
        if start is None:
            start = rank
        if n + 1 == len(ranks) or ranks[n + 1] != rank + 1:
            parts.append(f"{start}-{rank}" if rank != start else f"{rank}")
            start = None
    return ",".join(parts)


# ---------------------------------------------------------------------------- detection (side effects)

Runner = Callable[..., "subprocess.CompletedProcess[str]"]


def detect_node_topology(
    visible: str | None,
    *,
    which: Callable[[str], str | None] = shutil.which,
    run: Runner = subprocess.run,
    timeout_s: float = 60.0,
) -> NodeTopology:
    """Ask nvidia-smi or rocm-smi about this node's GPUs that `visible` names (its ranks'
    together, NodeView.visible; None: all); without either tool, a node with no GPUs.

    A tool that is present but fails raises TopologyError: guessing would risk exactly the
    silent bad layout this module exists to prevent.
    """
    hostname = socket.gethostname()
    if which("nvidia-smi"):
        matrix = restrict_to_visible(
            parse_nvidia_smi_topo(_run_tool(run, ["nvidia-smi", "topo", "-m"], timeout_s)),
            visible,
        )
        fabric = parse_nvidia_smi_fabric(_run_tool(run, ["nvidia-smi", "-q"], timeout_s))
        return NodeTopology(
            hostname,
            Vendor.nvidia,
            matrix.gpu_count,
            nvlink_domains_from_links(matrix),
            fabric_clique=node_clique(fabric),
            network_devices=matrix.network_devices,
        )
    if which("rocm-smi"):
        matrix = restrict_to_visible(
            parse_rocm_smi_topology(_run_tool(run, ["rocm-smi", "--showtopotype"], timeout_s)),
            visible,
        )
        return NodeTopology(
            hostname,
            Vendor.amd,
            matrix.gpu_count,
            nvlink_domains_from_links(matrix),
            network_devices=_rdma_devices(),
        )
    return NodeTopology(hostname, Vendor.none, 0, (), network_devices=_rdma_devices())


def _run_tool(run: Runner, argv: list[str], timeout_s: float) -> str:
    command = " ".join(argv)
    try:
        done = run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired as exc:
        raise TopologyError(
            f"`{command}` did not answer within {timeout_s:.0f}s; set the topology in the config "
            "(cluster.gpus_per_node, cluster.nvlink_domain_size) to skip detection"
        ) from exc
    if done.returncode != 0:
        raise TopologyError(
            f"`{command}` exited with {done.returncode}: {done.stderr.strip()[:300] or done.stdout.strip()[:300]}"
        )
    return done.stdout


def _rdma_devices(root: str = "/sys/class/infiniband") -> tuple[str, ...]:
    try:
        return tuple(sorted(os.listdir(root)))
    except OSError:
        return ()
