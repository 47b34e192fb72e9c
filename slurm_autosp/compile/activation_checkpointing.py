"""Sequence-aware activation checkpointing (SAC): recompute tags on the joint graph.

torch's min-cut partitioner splits the joint forward+backward graph into a forward that
saves some tensors and a backward that recomputes the rest. It honours
`node.meta["recompute"]`: MUST_SAVE bans a node from recomputation, PREFER_RECOMPUTE forces
it to be recomputed. `ActivationCheckpointPass` writes those tags as an inductor joint-graph pass
(`torch._inductor.config.joint_custom_post_pass`), so nothing of torch is patched, and its
`uuid()` names the policy and the code of our ops, so inductor's and AOTAutograd's compile
caches key on them.

Policies (`compile.activation_checkpointing`; `auto` is resolved to one of them by the memory
plan, `slurm_autosp.memory_plan.activation_checkpoint_spec_for`):
- `sac`: attention (the SDPA kernels and packed rows' `document_attention`, whose outputs cost
  O(S^2) FLOPs to recompute) is always kept, never recomputed. The other forward tensors the backward depends on are kept greedily,
  dearest first, by the FLOPs it takes to recompute them (from the layer's inputs and what is
  already kept) per byte they occupy: a matmul output costs ~2*K FLOPs per element, an
  elementwise op ~1. Keeping stops when `budget` (a fraction of their total bytes) is spent;
  the rest is recomputed. Attention's kernels save only O(S) tensors (output, logsumexp), and
  nothing in the graph builds an S x S tensor, so no O(S^2) tensor can be saved.
- `none`: nothing is recomputed; every tensor the backward needs is saved.
- `full`: everything but the layer's inputs is recomputed, attention included (but ring
  attention, below).
- `torch_default`: no tags; the partitioner's own heuristics.
Under every policy but `torch_default`, `recompute_all_to_all` decides whether the Ulysses
all-to-alls are run again in backward (less memory, more communication) or their outputs
are saved. Ring attention's outputs (output and log-sum-exp, O(S) like the SDPA kernels') are
saved under every policy: running it again would pass every K/V block around the ring again.
"""

from __future__ import annotations

import hashlib
import operator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy
from torch.utils.flop_counter import flop_registry

import slurm_autosp.sp.all_to_all as all_to_all
import slurm_autosp.sp.document_attention as document_attention
import slurm_autosp.sp.ring_attention as ring_attention
from slurm_autosp.compat.torch_api import (
    CustomGraphPass,
    run_and_save_rng_state,
    run_with_rng_state,
)
from slurm_autosp.config import ActivationCheckpointing

aten = torch.ops.aten
ALL_TO_ALL = torch.ops.slurm_autosp.sp_all_to_all.default

DOCUMENT_ATTENTION = torch.ops.slurm_autosp.document_attention.default
DOCUMENT_ATTENTION_BACKWARD = torch.ops.slurm_autosp.document_attention_backward.default
RING_ATTENTION = torch.ops.slurm_autosp.ring_attention.default
RING_ATTENTION_BACKWARD = torch.ops.slurm_autosp.ring_attention_backward.default

# SDPA forward kernels (what F.scaled_dot_product_attention decomposes to in the joint graph),
# and packed rows' and the ring's attention, opaque ops in the joint graph.
ATTENTION_OPS = frozenset(
    op
    for name in (
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_flash_attention_forward",
        "_efficient_attention_forward",
    )
    if hasattr(aten, name)
    for op in [getattr(aten, name).default]
) | {DOCUMENT_ATTENTION, RING_ATTENTION}


# Their backward kernels: QK^T is recomputed, then dP, dS, dQ, dK, dV: ~2.5x the forward.
ATTENTION_BACKWARD_OPS = frozenset(
    getattr(aten, name).default
    for name in (
        "_scaled_dot_product_flash_attention_for_cpu_backward",
        "_scaled_dot_product_flash_attention_backward",
        "_scaled_dot_product_efficient_attention_backward",
        "_scaled_dot_product_cudnn_attention_backward",
    )
    if hasattr(aten, name)
) | {DOCUMENT_ATTENTION_BACKWARD, RING_ATTENTION_BACKWARD}


@dataclass(frozen=True)
class ActivationCheckpointSpec:
    """What the partitioner is told to save; `budget` applies to `sac` only. A resolved policy:
    `auto` is the memory plan's to turn into one of the others (plan.activation_checkpoint_spec_for)."""

    policy: ActivationCheckpointing = ActivationCheckpointing.sac
    budget: float = 0.0  # sac: fraction of the bytes of the tensors backward depends on kept (1: none recomputed)
    recompute_all_to_all: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "policy", ActivationCheckpointing(self.policy))
        if self.policy is ActivationCheckpointing.auto:
            raise ValueError("activation checkpointing auto is the memory plan's to resolve")
        if not 0.0 <= self.budget <= 1.0:
            raise ValueError(f"activation memory budget must be in [0, 1], got {self.budget}")

    def key(self) -> str:
        """Identifies the policy in compile caches."""
        return f"{self.policy.value}:budget={self.budget:.6g}:recompute_a2a={self.recompute_all_to_all}"


# ----------------------------------------------------------------------------- cost model


def _val(node: fx.Node) -> Any:
    return node.meta.get("val", node.meta.get("example_value"))


def _hint(value: Any) -> int:
    """A concrete int for a possibly symbolic size (its hint)."""
    if isinstance(value, torch.SymInt):
        return int(value.node.shape_env.size_hint(value.node.expr))
    return int(value)


def tensor_bytes(node: fx.Node) -> int:
    """Bytes of a node's tensor output(s); 0 for non-tensors."""
    return sum(
        _hint(v.numel()) * v.element_size()
        for v in torch.utils._pytree.tree_leaves(_val(node))
        if isinstance(v, torch.Tensor)
    )


def _shapes(arg: Any) -> Any:
    if isinstance(arg, fx.Node):
        value = _val(arg)
        if isinstance(value, torch.Tensor):
            return torch.Size(_hint(s) for s in value.shape)
        if isinstance(value, (tuple, list)):
            return type(value)(
                torch.Size(_hint(s) for s in v.shape) if isinstance(v, torch.Tensor) else v
                for v in value
            )
        return value
    if isinstance(arg, (list, tuple)):
        return type(arg)(_shapes(a) for a in arg)
    return arg


def wrapped_op(node: fx.Node) -> tuple[Any, tuple, dict]:
    """(op, args, kwargs) of a node, looking through the RNG-replay wrappers the partitioner
    puts around random ops it recomputes (SDPA kernels are random: they can do dropout)."""
    if node.target is run_with_rng_state:
        return node.args[1], tuple(node.args[2:]), dict(node.kwargs)
    if node.target is run_and_save_rng_state:
        return node.args[0], tuple(node.args[1:]), dict(node.kwargs)
    return node.target, tuple(node.args), dict(node.kwargs)


def is_attention(node: fx.Node) -> bool:
    """An SDPA forward kernel, bare or wrapped for RNG replay."""
    return node.op == "call_function" and wrapped_op(node)[0] in ATTENTION_OPS


def _attention_flops(node: fx.Node) -> int:
    """FLOPs of an SDPA kernel: 4*B*H*Sq*Skv*D forward (QK^T and PV), 2.5x that backward,
    halved when causal. Document attention counts as causal over the whole row: its documents'
    lengths are data, so this is its bound (reached by a row of one document without a window).
    Ring attention's keys are the whole sequence, ring_size times its local block."""
    op, args, kwargs = wrapped_op(node)
    backward = op in ATTENTION_BACKWARD_OPS
    names = [a.name for a in op._schema.arguments]

    def argument(name: str, default: Any) -> Any:
        if name in kwargs:
            return kwargs[name]
        index = names.index(name)
        return args[index] if index < len(args) else default

    query, key = argument("query", None), argument("key", None)
    batch, heads, s_q, d = _shapes(query)
    s_kv = _shapes(key)[-2]
    ring = op in (RING_ATTENTION, RING_ATTENTION_BACKWARD)
    if ring:
        s_kv *= argument("ring_size", 1)
    flops = 4 * batch * heads * s_q * s_kv * d * (5 if backward else 2) // 2
    causal = (
        ring
        or op in (DOCUMENT_ATTENTION, DOCUMENT_ATTENTION_BACKWARD)
        or argument("is_causal", False)
    )
    return flops // 2 if causal else flops


def node_flops(node: fx.Node) -> int:
    """FLOPs of one node: matmuls and attention by formula, anything else one per output element."""
    if node.op != "call_function" or node.target is operator.getitem or is_view(node):
        return 0
    if is_attention(node) or node.target in ATTENTION_BACKWARD_OPS:
        return _attention_flops(node)
    packet = getattr(node.target, "overloadpacket", None)
    if packet in flop_registry:
        formula = flop_registry[packet]
        try:  # registry formulas are wrapped to turn tensors into shapes; we pass shapes already
            return int(
                formula.__wrapped__(
                    *_shapes(list(node.args)),
                    out_shape=_shapes(node),
                    **{k: _shapes(v) for k, v in node.kwargs.items()},
                )
            )
        except Exception:  # noqa: BLE001 - an unusual signature: count it as elementwise
            pass
    return sum(
        _hint(v.numel())
        for v in torch.utils._pytree.tree_leaves(_val(node))
        if isinstance(v, torch.Tensor)
    )


# ----------------------------------------------------------------------------- tagging


def split_joint_graph(graph: fx.Graph) -> tuple[list[fx.Node], set[fx.Node]]:
    """(forward call_function nodes in order, the backward nodes) of a joint graph: backward
    is everything downstream of a tangent."""
    backward: set[fx.Node] = set()
    forward = []
    for node in graph.nodes:
        if node.op == "placeholder":
            if node.name.startswith("tangents"):
                backward.add(node)
        elif node.op == "call_function":
            if any(a in backward for a in node.all_input_nodes):
                backward.add(node)
            else:
                forward.append(node)
    return forward, backward


def is_view(node: fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return bool(
        schema
        and schema.returns
        and schema.returns[0].alias_info is not None
        and not schema.returns[0].alias_info.is_write
    )


def _is_random(node: fx.Node) -> bool:
    return hasattr(node.target, "tags") and torch.Tag.nondeterministic_seeded in node.target.tags


def _reaches(
    node: fx.Node, backward: set[fx.Node], saved: set[fx.Node], memo: dict[fx.Node, bool]
) -> bool:
    """Whether the backward depends on `node` other than through the `saved` tensors (then it
    must be saved or recomputed)."""
    if node not in memo:
        memo[node] = any(
            u in backward or (u not in saved and _reaches(u, backward, saved, memo))
            for u in node.users
        )
    return memo[node]


def recompute_flops(node: fx.Node, kept: set[fx.Node]) -> int:
    """FLOPs to recompute `node` from the layer's inputs and the `kept` tensors."""
    chain: set[fx.Node] = set()
    stack = [node]
    while stack:
        current = stack.pop()
        if current in chain:
            continue
        chain.add(current)
        stack.extend(
            i for i in current.all_input_nodes if i.op == "call_function" and i not in kept
        )
    return sum(node_flops(n) for n in chain)


def _choose_kept(
    candidates: list[fx.Node], kept: set[fx.Node], budget_bytes: float
) -> set[fx.Node]:
    """Greedy: keep the candidate dearest to recompute per byte (given what is kept so far)
    while it fits the budget; a candidate that does not fit is recomputed."""
    chosen: set[fx.Node] = set()
    undecided = list(candidates)
    spent = 0
    while undecided:
        best = max(undecided, key=lambda n: recompute_flops(n, kept | chosen) / tensor_bytes(n))
        undecided.remove(best)
        if spent + tensor_bytes(best) <= budget_bytes:
            chosen.add(best)
            spent += tensor_bytes(best)
    return chosen


def tag_joint_graph(graph: fx.Graph, spec: ActivationCheckpointSpec) -> dict[str, int]:
    """Write `node.meta["recompute"]` on the forward nodes of `graph`; returns counts by decision.

    SAC's candidates are the forward tensors the backward depends on, directly or through a
    recomputation (not through a kept tensor); `budget` is the fraction of their bytes that may
    be kept: 1 recomputes nothing, 0 only what attention (and the all-to-alls, unless they are
    replayed) keep. Views are always recomputed (they are free).
    """
    counts = {"attention_kept": 0, "all_to_all_kept": 0, "kept": 0, "recomputed": 0}
    if spec.policy is ActivationCheckpointing.torch_default:
        return counts
    save, recompute = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE
    nodes, backward = split_joint_graph(graph)
    reach: dict[fx.Node, bool] = {}
    decisions: dict[fx.Node, CheckpointPolicy] = {}
    candidates: list[fx.Node] = []
    for node in nodes:
        if node.target is operator.getitem:
            continue  # follows its producer, below
        if node.target is RING_ATTENTION:  # under every policy: see the module docstring
            decisions[node] = save
            counts["attention_kept"] += 1
        elif node.target in ATTENTION_OPS:
            decisions[node] = recompute if spec.policy is ActivationCheckpointing.full else save
            counts["attention_kept"] += spec.policy is not ActivationCheckpointing.full
        elif node.target is ALL_TO_ALL:
            decisions[node] = recompute if spec.recompute_all_to_all else save
            counts["all_to_all_kept"] += not spec.recompute_all_to_all
        elif _is_random(node):
            decisions[node] = save  # never replay randomness
        elif spec.policy is ActivationCheckpointing.none:
            decisions[node] = save
        elif (
            spec.policy is ActivationCheckpointing.full or is_view(node) or tensor_bytes(node) == 0
        ):
            decisions[node] = recompute
        else:
            decisions[node] = recompute
            candidates.append(node)
    always = {n for n, d in decisions.items() if d is save}
    candidates = [n for n in candidates if _reaches(n, backward, always, reach)]
    if candidates:
        budget_bytes = spec.budget * sum(tensor_bytes(n) for n in candidates)
        for node in _choose_kept(candidates, always, budget_bytes):
            decisions[node] = save
    for node, decision in decisions.items():
        node.meta["recompute"] = decision
        for user in node.users:  # getitems of a multi-output node share its decision
            if user.target is operator.getitem:
                user.meta["recompute"] = decision
        if (
            node.target not in ATTENTION_OPS
            and node.target is not ALL_TO_ALL
            and not _is_random(node)
        ):
            counts["kept" if decision is save else "recomputed"] += 1
    return counts


def code_key() -> str:
    """A digest of the code that compiled artifacts hold without Dynamo having traced it: this
    policy, and the custom ops' backward formulas (AOTAutograd's cache keys on the graph, which
    names an op but not its formula), so a changed formula is never served from a cache."""
    digest = hashlib.sha256()
    for source in (
        __file__,
        all_to_all.__file__,
        document_attention.__file__,
        ring_attention.__file__,
    ):
        digest.update(Path(str(source)).read_bytes())
    return digest.hexdigest()[:16]


class ActivationCheckpointPass(CustomGraphPass):
    """The policy as an inductor joint-graph pass; `uuid()` keys the compile caches on it and
    on our code (`code_key`)."""

    def __init__(self, spec: ActivationCheckpointSpec) -> None:
        self.spec = spec
        self.last_counts: dict[str, int] = {}

    def __call__(self, graph: fx.Graph) -> None:
        self.last_counts = tag_joint_graph(graph, self.spec)

    def uuid(self) -> str:
        return f"slurm_autosp.checkpointing:{self.spec.key()}:{_CODE_KEY}"

    def __repr__(self) -> str:
        return f"ActivationCheckpointPass({self.spec.key()})"


_CODE_KEY = code_key()


def inductor_config_patches(spec: ActivationCheckpointSpec) -> dict[str, Any]:
    """Inductor config under which `compile_fx` applies `spec`; the pass is there under
    torch_default too (it tags nothing), for its cache key."""
    return {"joint_custom_post_pass": ActivationCheckpointPass(spec)}


def is_quadratic(shape: tuple[int, ...], local_seq: int, sp_size: int) -> bool:
    """Whether a tensor of `shape` grows with S^2 (an S x S mask or score matrix, whole or
    sharded): it spans the whole sequence in one dim and at least this rank's shard in another."""
    dims = sorted((int(d) for d in shape), reverse=True)
    return len(dims) >= 2 and dims[0] >= local_seq * sp_size and dims[1] >= local_seq
