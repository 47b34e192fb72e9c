"""The AutoSP torch.compile backend: Ulysses all-to-alls around every attention call, then inductor.

Two steps, kept apart so each can change alone: `rewrite_sdpa_for_sp` edits the Dynamo FX
graph (q, k, v go from [B, H, S/P, D] to [B, H/P, S, D] before attention, the output comes
back after; attention is SDPA, or `document_attention` for packed rows), and
`compile_with_inductor` turns the rewritten graph into code, with the activation checkpointing
policy (`checkpointing.ActivationCheckpointSpec`) as recompute tags that the min-cut partitioner honours.
"""

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.node import Argument

import slurm_autosp.sp.all_to_all  # noqa: F401 - registers torch.ops.slurm_autosp.sp_all_to_all
import slurm_autosp.sp.document_attention  # noqa: F401 - registers its op
import slurm_autosp.sp.ring_attention  # noqa: F401 - registers torch.ops.slurm_autosp.ring_attention
from slurm_autosp.compat.torch_api import aot_module_simplified, compile_fx
from slurm_autosp.compile.activation_checkpointing import (
    ActivationCheckpointSpec,
    inductor_config_patches,
)
from slurm_autosp.config import ActivationCheckpointing
from slurm_autosp.heads import grouped_on_each_rank, valid_sp_sizes

_SDPA = torch.nn.functional.scaled_dot_product_attention
_SDPA_PARAMS = (
    "query",
    "key",
    "value",
    "attn_mask",
    "dropout_p",
    "is_causal",
    "scale",
    "enable_gqa",
)
_HEAD_DIM, _SEQ_DIM = 1, 2
_ALL_TO_ALL = torch.ops.slurm_autosp.sp_all_to_all.default
# causal attention within each document; returns (output, logsumexp), handles grouped KV heads
_DOCUMENT_ATTENTION = torch.ops.slurm_autosp.document_attention.default
# causal attention over the ring's sequence blocks; returns (output, logsumexp)
_RING_ATTENTION = torch.ops.slurm_autosp.ring_attention.default


class AutoSPCompileError(RuntimeError):
    """A model the AutoSP backend cannot make sequence parallel; the message says what to change."""


@dataclass(frozen=True)
class HeadLayout:
    """How one attention call's heads are spread over the SP ranks.

    `kv_repeat` > 1 when there are fewer KV heads than SP ranks: each KV head is repeated
    (repeat_interleave, so copies of one head stay adjacent) to `sp_size` heads, and SP rank r
    then holds KV head r // kv_repeat. Its query heads are [r*Hq/P, (r+1)*Hq/P), which under
    grouped attention read KV head floor(h*Hkv/Hq), in [r/kv_repeat, (r+1)/kv_repeat): that
    floor is r // kv_repeat for every one of them, so the rank holds exactly the KV head its
    queries need. When Hkv % P == 0 rank r holds KV heads [r*Hkv/P, (r+1)*Hkv/P) and query
    heads whose group index h // (Hq/Hkv) falls in that range, in the same local order.
    """

    query_heads: int
    kv_heads: int
    sp_size: int

    def __post_init__(self) -> None:
        if self.query_heads % self.sp_size or not (
            self.kv_heads % self.sp_size == 0 or self.sp_size % self.kv_heads == 0
        ):
            raise AutoSPCompileError(
                f"attention with {self.query_heads} query heads and {self.kv_heads} key/value heads "
                f"cannot be split over sp_size={self.sp_size}: the query heads must divide by the SP "
                f"size and the KV heads must divide by it or divide it. Valid SP sizes: "
                f"{valid_sp_sizes(self.query_heads, self.kv_heads)}"
            )

    @property
    def kv_repeat(self) -> int:
        return max(1, self.sp_size // self.kv_heads)

    @property
    def local_grouped(self) -> bool:
        """Whether each rank still has fewer KV heads than query heads (SDPA's enable_gqa)."""
        return grouped_on_each_rank(self.query_heads, self.kv_heads, self.sp_size)


def _where(node: fx.Node) -> str:
    """The user source line that produced `node`, for error messages."""
    lines = (node.meta.get("stack_trace") or "").splitlines()
    trace = [line.strip() for line in lines if line.strip(" ^~")]
    return f"{trace[-2]} ({trace[-1]})" if len(trace) >= 2 else node.name


def _sdpa_arguments(node: fx.Node) -> dict[str, Argument]:
    arguments: dict[str, Argument] = dict(zip(_SDPA_PARAMS, node.args, strict=False))
    arguments.update(node.kwargs)
    return arguments


def _check_causal_without_mask(node: fx.Node, arguments: dict[str, Argument]) -> None:
    if arguments.get("attn_mask") is not None:
        raise AutoSPCompileError(
            f"scaled_dot_product_attention at {_where(node)} receives an attn_mask. AutoSP attends "
            "over the whole sequence with is_causal=True and never builds an S x S mask. For "
            "Hugging Face models use compile_model(...) (it switches the model to "
            "slurm_autosp.compile.hf_attention.SP_ATTENTION) and pass the inputs from "
            "prepare_sp_inputs(...), which turns right padding into ignored labels and packed rows "
            "(position_ids or document_ids) into document attention; left padding is not supported."
        )
    if not arguments.get("is_causal", False):
        raise AutoSPCompileError(
            f"scaled_dot_product_attention at {_where(node)} is not causal (is_causal=False); "
            "AutoSP supports causal self-attention only."
        )


def _document_arguments(node: fx.Node) -> dict[str, Argument]:
    names = [a.name for a in _DOCUMENT_ATTENTION._schema.arguments]
    arguments: dict[str, Argument] = dict(zip(names, node.args, strict=False))
    arguments.update(node.kwargs)
    return arguments


def _example_value(target: Callable, args: tuple, kwargs: dict[str, Argument]) -> object:
    """What `target` returns for the arguments' example values, computed on fake tensors.

    Without autograd recording (a saved-tensors hook around the compiling call would be handed
    fake tensors); the outputs require grad as the op's would.
    """
    values = fx.node.map_arg((args, kwargs), lambda n: n.meta["example_value"])
    tensors = [v for v in pytree.tree_leaves(values) if isinstance(v, FakeTensor)]
    requires_grad = any(t.requires_grad for t in tensors)
    # Dynamo's fake mode, which the backend's own must not mix with
    with tensors[0].fake_mode, torch.no_grad():
        output = target(*values[0], **values[1])
    return pytree.tree_map_only(
        torch.Tensor, lambda t: t.requires_grad_(requires_grad and t.is_floating_point()), output
    )


def _call(
    graph: fx.Graph, target: Callable, args: tuple, kwargs: dict[str, Argument] | None = None
) -> fx.Node:
    """graph.call_function with the example value Dynamo gives every node: AOTAutograd's cache
    reads it (a method's receiver must be a tensor), without it every start retraces."""
    kwargs = kwargs or {}
    node = graph.call_function(target, args, kwargs)
    node.meta["example_value"] = _example_value(target, args, kwargs)
    return node


def _ring_attention_instead(
    graph: fx.Graph, node: fx.Node, arguments: dict[str, Argument], ring_size: int
) -> list[fx.Node]:
    """Replace the attention call `node` (SDPA, or document attention with its boundaries and
    window; its q, k, v already Ulysses-scattered) by ring attention over `ring_size` ranks;
    returns the nodes that read its output."""
    if arguments.get("dropout_p"):
        raise AutoSPCompileError(
            f"scaled_dot_product_attention at {_where(node)} has dropout_p={arguments['dropout_p']}; "
            f"ring attention (parallel.ring_size={ring_size}) has no dropout: set the model's "
            "attention_dropout=0, or parallel.ring_size=1"
        )
    query = arguments["query"]
    assert isinstance(query, fx.Node)
    scale = arguments.get("scale")  # a float, or a node: Dynamo makes a changed float symbolic
    if scale is None:
        scale = int(query.meta["example_value"].shape[-1]) ** -0.5
    if isinstance(scale, int):
        scale = float(scale)
    with graph.inserting_before(node):
        ring = _call(
            graph,
            _RING_ATTENTION,
            (query, arguments["key"], arguments["value"], scale, ring_size),
            {"cu_seqlens": arguments.get("cu_seqlens"), "window": arguments.get("window", 0)},
        )
        if node.target is not _DOCUMENT_ATTENTION:  # SDPA returns the output alone
            output = _call(graph, operator.getitem, (ring, 0))
            node.replace_all_uses_with(output)
            graph.erase_node(node)
            return [output]
    # document attention returns (output, log-sum-exp) as the ring does: its items read the ring's
    items = [u for u in node.users if u.target is operator.getitem]
    node.replace_all_uses_with(ring)
    graph.erase_node(node)
    for item in items:
        item.meta["example_value"] = ring.meta["example_value"][item.args[1]]
    return [item for item in items if item.args[1] == 0]


def _rewrite_one(graph: fx.Graph, node: fx.Node, sp_size: int, ring_size: int = 1) -> None:
    ulysses = sp_size // ring_size
    documents = node.target is _DOCUMENT_ATTENTION
    if documents:  # the cumulative lengths are global: they hold for the whole sequence as is
        arguments = _document_arguments(node)
    else:
        arguments = _sdpa_arguments(node)
        _check_causal_without_mask(node, arguments)
    query, key, value = (arguments[name] for name in ("query", "key", "value"))
    assert isinstance(query, fx.Node) and isinstance(key, fx.Node) and isinstance(value, fx.Node)
    if query.meta["example_value"].dim() != 4:
        raise AutoSPCompileError(
            f"scaled_dot_product_attention at {_where(node)} gets {query.meta['example_value'].dim()}-D "
            "queries; AutoSP needs [batch, heads, sequence, head_dim]"
        )
    layout = _head_layout(
        int(query.meta["example_value"].shape[_HEAD_DIM]),
        int(key.meta["example_value"].shape[_HEAD_DIM]),
        sp_size,
        ring_size,
    )

    def scatter_heads(tensor: fx.Node, repeat: int) -> fx.Node:
        if repeat > 1:
            tensor = _call(graph, torch.repeat_interleave, (tensor, repeat), {"dim": _HEAD_DIM})
        return _call(graph, _ALL_TO_ALL, (tensor, _HEAD_DIM, _SEQ_DIM, ulysses))

    with graph.inserting_before(node):
        arguments["query"] = scatter_heads(query, 1)
        arguments["key"] = scatter_heads(key, layout.kv_repeat)
        arguments["value"] = scatter_heads(value, layout.kv_repeat)
    if ring_size > 1:  # it reads grouped KV heads as they are
        for output in _ring_attention_instead(graph, node, arguments, ring_size):
            _gather_heads_after(graph, output, ulysses)
        return
    if not documents:
        arguments["enable_gqa"] = layout.local_grouped
    node.args = ()
    node.kwargs = arguments
    node.meta["example_value"] = _example_value(
        _DOCUMENT_ATTENTION if documents else _SDPA, (), arguments
    )
    outputs = [node]
    if documents:  # the attention output is item 0; the log-sum-exp stays for backward
        items = [u for u in node.users if u.target is operator.getitem]
        for item in items:
            item.meta["example_value"] = node.meta["example_value"][item.args[1]]
        outputs = [item for item in items if item.args[1] == 0]
    for local in outputs:
        _gather_heads_after(graph, local, ulysses)


def _head_layout(query_heads: int, kv_heads: int, sp_size: int, ring_size: int) -> HeadLayout:
    """How the heads split over the Ulysses ranks: all SP ranks without a ring, a ring rank's
    sp_size / ring_size with one (the ring splits the sequence, not the heads)."""
    if ring_size == 1:
        return HeadLayout(query_heads, kv_heads, sp_size)
    try:
        return HeadLayout(query_heads, kv_heads, sp_size // ring_size)
    except AutoSPCompileError as error:
        raise AutoSPCompileError(
            f"{error} (with parallel.ring_size={ring_size} the heads split over the Ulysses size "
            f"parallel.sp_size / parallel.ring_size = {sp_size} / {ring_size}: choose a ring_size "
            f"that leaves one of those)"
        ) from error


def _gather_heads_after(graph: fx.Graph, local: fx.Node, sp_size: int) -> None:
    """Every user of `local` ([B, H/P, S, D]) reads it back as [B, H, S/P, D]."""
    with graph.inserting_after(local):
        output = _call(graph, _ALL_TO_ALL, (local, _SEQ_DIM, _HEAD_DIM, sp_size))
    local.replace_all_uses_with(output, delete_user_cb=lambda user: user is not output)


def rewrite_sdpa_for_sp(gm: fx.GraphModule, sp_size: int, ring_size: int = 1) -> int:
    """Wrap every attention call in `gm` (scaled_dot_product_attention, document_attention)
    with the Ulysses all-to-alls over sp_size / ring_size ranks; with `ring_size` > 1 SDPA
    becomes ring attention across the ring (document attention too, with its boundaries and window).

    Returns how many calls were rewritten; a graph without any is legal (e.g. the lm_head
    graph after a graph break).
    """
    calls = [
        n
        for n in gm.graph.nodes
        if n.op == "call_function" and n.target in (_SDPA, _DOCUMENT_ATTENTION)
    ]
    for node in calls:
        _rewrite_one(gm.graph, node, sp_size, ring_size)
    if calls:
        gm.graph.lint()
        gm.recompile()
    return len(calls)


def compile_with_inductor(
    gm: fx.GraphModule,
    example_inputs: Sequence[torch.Tensor],
    checkpointing: ActivationCheckpointSpec | None = None,
) -> Callable:
    """Compile a rewritten graph to code with inductor, partitioning forward and backward under
    `checkpointing` (None: torch's default partitioner heuristics)."""
    spec = checkpointing or ActivationCheckpointSpec(ActivationCheckpointing.torch_default)
    compiled = compile_fx(gm, list(example_inputs), config_patches=inductor_config_patches(spec))
    assert callable(compiled)  # ahead-of-time modes return paths or weights; this one code
    return compiled


def _as_is(
    gm: fx.GraphModule, example_inputs: Sequence[torch.Tensor | int | torch.SymInt | None]
) -> Any:
    return gm


def compile_without_codegen(gm: fx.GraphModule, example_inputs: Sequence[torch.Tensor]) -> Callable:
    """A rewritten graph through AOTAutograd (forward and backward graphs run as traced), with
    no inductor code generation: what `verify.codegen=false` runs to check the SP rewrite of a
    model in seconds rather than a minute of C++ compilation."""
    return aot_module_simplified(gm, list(example_inputs), fw_compiler=_as_is, bw_compiler=_as_is)


class AutoSPBackend:
    """A torch.compile backend making SDPA attention sequence parallel over `sp_size` ranks:
    Ulysses over all of them, or (`ring_size` > 1) Ulysses over sp_size / ring_size ranks and
    ring attention across `ring_size` such groups. The process groups are set at run time with
    `set_sp_group` (`set_sp_groups(ulysses, ring)` with a ring).

    Reuse one instance for a run: Dynamo's cache only serves graphs compiled by the same
    backend object. `sdpa_calls_rewritten` counts attention calls rewritten so far, over
    every graph this backend compiled.
    """

    def __init__(
        self,
        sp_size: int,
        checkpointing: ActivationCheckpointSpec | None = None,
        ring_size: int = 1,
        codegen: bool = True,
    ) -> None:
        if sp_size < 1:
            raise ValueError(f"sp_size must be >= 1, got {sp_size}")
        if ring_size < 1 or sp_size % ring_size:
            raise ValueError(
                f"ring_size={ring_size} must divide sp_size={sp_size} (sp_size = ulysses x ring)"
            )
        self.sp_size = sp_size
        self.ring_size = ring_size
        self.codegen = (
            codegen  # False: no inductor (compile_without_codegen; no checkpointing pass)
        )
        self.checkpointing = checkpointing or ActivationCheckpointSpec(
            ActivationCheckpointing.torch_default
        )
        self.sdpa_calls_rewritten = 0

    def __repr__(self) -> str:
        ring = f", ring_size={self.ring_size}" if self.ring_size > 1 else ""
        codegen = "" if self.codegen else ", codegen=False"
        return (
            f"AutoSPBackend(sp_size={self.sp_size}{ring}, checkpointing="
            f"{self.checkpointing.key()}{codegen})"
        )

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[torch.Tensor]) -> Callable:
        rewritten = rewrite_sdpa_for_sp(gm, self.sp_size, self.ring_size)
        compiled = (
            compile_with_inductor(gm, example_inputs, self.checkpointing)
            if self.codegen
            else compile_without_codegen(gm, example_inputs)
        )
        self.sdpa_calls_rewritten += (
            rewritten  # only now: inductor may make Dynamo retrace and call again
        )
        return compiled

    def require_sdpa_found(self) -> None:
        """Raise unless some compiled graph had attention to rewrite; call after the first step."""
        if self.sdpa_calls_rewritten == 0:
            raise AutoSPCompileError(
                "no scaled_dot_product_attention found in the compiled model, so nothing was made "
                "sequence parallel and each rank would attend only within its own shard. Use a "
                "model whose attention calls torch.nn.functional.scaled_dot_product_attention "
                '(for Hugging Face models: attn_implementation="sdpa").'
            )
