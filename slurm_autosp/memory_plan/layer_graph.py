"""What one decoder layer saves for backward, read off its partitioned joint graph.

The layer is built at the configured width under FakeTensorMode (no memory is allocated),
compiled by Dynamo with the same SDPA rewrite as training (`rewrite_sdpa_for_sp`), traced to
a joint graph by AOTAutograd with inductor's decompositions, and partitioned by inductor's own
`partition_fn` (its joint-graph passes, our checkpointing pass, torch's min-cut) under the
policy. The forward graph's extra outputs are then exactly what training saves for backward,
and the backward graph shows what it recomputes.
"""

from __future__ import annotations

import copy
import operator
import sys
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from slurm_autosp.cluster.compile_cache import private_compile_cache
from slurm_autosp.compat.torch_api import (
    FakeTensorMode,
    aot_module_simplified,
    inductor_config,
    partition_fn,
    select_decomp_table,
)
from slurm_autosp.compile.activation_checkpointing import (
    ALL_TO_ALL,
    ActivationCheckpointSpec,
    inductor_config_patches,
    is_attention,
    is_quadratic,
    is_view,
    node_flops,
    tensor_bytes,
)
from slurm_autosp.compile.backend import rewrite_sdpa_for_sp
from slurm_autosp.compile.hf_attention import SP_ATTENTION
from slurm_autosp.config import ModelConfig
from slurm_autosp.model import hf_config, hf_decoder_layer_class


@dataclass(frozen=True)
class SavedTensor:
    name: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    kind: str  # activation | parameter | shared (the rotary cos/sin every layer receives)


@dataclass
class LayerTrace:
    """One decoder layer under one checkpointing policy at one local sequence length."""

    spec: ActivationCheckpointSpec
    local_seq: int
    micro_batch: int
    sp_size: int = 1  # the Ulysses size: the ranks of the all-to-alls
    ring_size: int = 1  # attention's FLOPs count each rank's ring of key/value blocks
    tiled: bool = False  # traced with the MLP outside the graph (see trace_decoder_layer)
    saved: list[SavedTensor] = field(default_factory=list)
    forward_flops: int = 0
    backward_flops: int = 0
    recompute_flops: int = 0
    recomputed_attention: int = 0
    all_to_all_forward: int = 0
    all_to_all_backward: int = 0
    recomputed_bytes: int = 0  # tensors the backward recomputes, all together
    largest_forward_bytes: int = 0
    largest_all_to_all_bytes: int = 0
    forward_peak_bytes: int = 0  # peak of the tensors each graph allocates itself (liveness in
    backward_peak_bytes: int = 0  # graph order), beyond its inputs
    tile_bytes_per_token: int = 0  # tiled: what one tile's recompute holds, per token of the tile
    # a tiled layer: the full-width bytes alive while one of its tiles runs (0: a tiled MLP,
    # whose tile runs inside the layer's backward, at its peak)
    tile_alongside_bytes: int = 0

    @property
    def activation_bytes(self) -> int:
        return sum(t.nbytes for t in self.saved if t.kind == "activation")

    @property
    def shared_bytes(self) -> int:
        return sum(t.nbytes for t in self.saved if t.kind == "shared")

    @property
    def tokens(self) -> int:
        return self.local_seq * self.micro_batch

    @property
    def quadratic_saved(self) -> list[SavedTensor]:
        return [
            t
            for t in self.saved
            if t.kind == "activation" and is_quadratic(t.shape, self.local_seq, self.sp_size)
        ]

    @property
    def working_bytes(self) -> int:
        """Working buffers beyond the saved tensors: the larger of the forward's and the
        backward's (recomputation included) peak of live intermediate tensors."""
        return max(self.forward_peak_bytes, self.backward_peak_bytes)

    def working_bytes_with(self, tile: int) -> int:
        """Working buffers with tiles of `tile` tokens: a tiled MLP's tile adds to the layer's
        peak; a tiled layer's tile runs beside only what lives between its tiles, so its peak
        is the larger of that plus the tile and the full-width points (attention's backward)."""
        tile_bytes = tile * self.tile_bytes_per_token
        if not self.tile_alongside_bytes:
            return self.working_bytes + tile_bytes
        return max(self.working_bytes, self.tile_alongside_bytes + tile_bytes)


_EXTERN_KERNELS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.baddbmm.default,
    ALL_TO_ALL,
}


def _is_extern(node: fx.Node) -> bool:
    """Whether inductor runs the node as a kernel of its own (a library call: matmuls,
    collectives, attention, higher-order ops) rather than fusing it with its neighbours."""
    return (
        node.target in _EXTERN_KERNELS
        or is_attention(node)
        or not isinstance(node.target, torch._ops.OpOverload)
    )


def _kernels(graph: fx.Graph) -> list[list[fx.Node]]:
    """The graph's call_function nodes as inductor runs them: each extern kernel alone, and each
    run of the other nodes between two of them fused into one kernel."""
    kernels: list[list[fx.Node]] = []
    fusing = False
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        extern = _is_extern(node) and node.target is not operator.getitem
        if extern or not fusing:
            kernels.append([])
        kernels[-1].append(node)
        fusing = not extern
    return kernels


def peak_live_bytes(graph: fx.Graph) -> int:
    """Peak bytes of the intermediate tensors a graph allocates, as inductor runs it: kernel by
    kernel (see _kernels), each allocating the outputs read after it, all alive with its inputs,
    each tensor freed after the kernel that reads it last (views keep their base alive). Inputs
    and outputs are not counted: they are the saved activations, parameters and gradients,
    counted elsewhere. A fused kernel holds all its inputs and outputs at once (e.g. SiLU's
    backward: gate, up and the incoming gradient in, three products out), which a node-by-node
    walk of the graph would miss."""
    output = next(n for n in graph.nodes if n.op == "output")
    returned = set(output.all_input_nodes)
    base: dict[fx.Node, fx.Node] = {}
    readers: dict[fx.Node, list[fx.Node]] = {}
    for node in graph.nodes:
        if (
            node.op == "call_function"
            and (is_view(node) or node.target is operator.getitem)
            and node.args
        ):
            parent = node.args[0]
            if isinstance(parent, fx.Node):
                base[node] = base.get(parent, parent)
        for arg in node.all_input_nodes:
            readers.setdefault(base.get(arg, arg), []).append(node)
    kernels = _kernels(graph)
    kernel_of = {node: k for k, kernel in enumerate(kernels) for node in kernel}
    last_read = {
        node: max(kernel_of.get(r, len(kernels)) for r in nodes) for node, nodes in readers.items()
    }
    live = peak = 0
    for k, kernel in enumerate(kernels):
        written = [
            node
            for node in kernel
            if node not in base and node not in returned and last_read.get(node, k) > k
        ]
        live += sum(tensor_bytes(node) for node in written)
        peak = max(peak, live)
        held = {n for n in kernel_of if n not in base and n not in returned and kernel_of[n] < k}
        live -= sum(tensor_bytes(n) for n in held if last_read.get(n) == k)
    return peak


def hf_layer_classes(model: ModelConfig) -> tuple[type, type]:
    """The decoder-layer and rotary-embedding classes of an HF causal LM family."""
    layer_class = hf_decoder_layer_class(hf_config(model))
    module = sys.modules[layer_class.__module__]
    rotary = [
        getattr(module, n)
        for n in dir(module)
        if n.endswith("RotaryEmbedding") and not n.startswith("_")
    ]
    return layer_class, rotary[0]


def _partitioned_graphs(
    model: ModelConfig,
    local_seq: int,
    sp_size: int,
    micro_batch: int,
    dtype: torch.dtype,
    specs: list[ActivationCheckpointSpec],
    tiled: bool,
    ring_size: int,
) -> tuple[list[tuple[fx.GraphModule, fx.GraphModule]], list[bool]]:
    """Trace the joint graph once, rewritten as the AutoSP backend rewrites it (under a ring
    with ring attention, which every policy saves); partition a copy of it under each spec."""
    layer_class, rotary_class = hf_layer_classes(model)
    config = hf_config(model)
    config._attn_implementation = SP_ATTENTION
    # an MoE layer's experts as one grouped matmul over the tokens' top-k choices: its shapes do
    # not depend on the routing, so fake tensors trace the layer whole
    config._experts_implementation = "grouped_mm"
    partitions: list[tuple[fx.GraphModule, fx.GraphModule]] = []
    is_parameter: list[bool] = []

    def partition_each(joint: fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> Any:
        for spec in specs:
            with inductor_config.patch(inductor_config_patches(spec)):
                partitions.append(partition_fn(copy.deepcopy(joint), joint_inputs, **kwargs))
        return partitions[0]

    def backend(gm: fx.GraphModule, example_inputs: list) -> Any:
        rewrite_sdpa_for_sp(gm, sp_size * ring_size, ring_size)
        is_parameter.extend(isinstance(i, torch.nn.Parameter) for i in example_inputs)
        return aot_module_simplified(
            gm,
            example_inputs,
            fw_compiler=lambda g, _: g,
            bw_compiler=lambda g, _: g,
            partition_fn=partition_each,
            decompositions=select_decomp_table(),
        )

    torch.compiler.reset()
    previous_dtype = torch.get_default_dtype()
    try:
        with FakeTensorMode():
            torch.set_default_dtype(dtype)
            layer = layer_class(config, 0)
            if tiled:
                layer.mlp = torch.nn.Identity()  # a tiled MLP runs outside the layer's graph
            rotary = rotary_class(config)
            torch.set_default_dtype(previous_dtype)
            hidden = torch.empty(
                micro_batch, local_seq, config.hidden_size, dtype=dtype, requires_grad=True
            )
            position_ids = torch.arange(local_seq).expand(micro_batch, local_seq)
            cos, sin = rotary(hidden, position_ids)
            with private_compile_cache():  # Dynamo reads inductor's cache directory
                torch.compile(layer, backend=backend)(
                    hidden,
                    position_embeddings=(cos, sin),
                    position_ids=position_ids,
                    use_cache=False,
                )
    finally:
        torch.set_default_dtype(previous_dtype)
        torch.compiler.reset()
    return partitions, is_parameter


def trace_decoder_layer(
    model: ModelConfig,
    *,
    local_seq: int,
    sp_size: int,
    specs: list[ActivationCheckpointSpec],
    micro_batch: int = 1,
    dtype: torch.dtype = torch.bfloat16,
    tiled: bool = False,
    ring_size: int = 1,
) -> list[LayerTrace]:
    """Trace one decoder layer once and partition it under each spec; nothing is allocated.

    `sp_size` is the Ulysses size (the all-to-alls' ranks); under a ring of `ring_size` (SP =
    Ulysses x ring) the layer is traced with ring attention in place of SDPA, as the backend
    compiles it: its output and log-sum-exp saved under every policy, its FLOPs those of its
    queries over the whole ring's keys (balanced causal blocks).

    `tiled`: the MLP runs in sequence tiles outside the layer's graph (compile.tiling), so the
    layer is traced without it; its one saved tensor, the MLP input, and the forward it
    recomputes in backward are added here. Its per-tile working memory does not grow with the
    sequence and is the memory plan's to add.

    Traces are kept for the process (a trace of a large layer takes seconds): planning the
    same job again, as `submit` after `plan` or each dry run of a test session, reuses them.
    """
    key = (repr(model), local_seq, sp_size, tuple(specs), micro_batch, dtype, tiled, ring_size)
    if key not in _TRACES:
        _TRACES[key] = _trace(
            model, local_seq, sp_size, specs, micro_batch, dtype, tiled, ring_size
        )
    return copy.deepcopy(_TRACES[key])


_TRACES: dict[tuple[Any, ...], list[LayerTrace]] = {}


def forget_traces() -> None:
    """Drop the kept traces: for a caller that changes how torch partitions graphs (the
    checkpointing bench's DeepSpeed rows patch its min-cut), which no key can see."""
    _TRACES.clear()


def _trace(
    model: ModelConfig,
    local_seq: int,
    sp_size: int,
    specs: list[ActivationCheckpointSpec],
    micro_batch: int,
    dtype: torch.dtype,
    tiled: bool,
    ring_size: int,
) -> list[LayerTrace]:
    partitions, is_parameter = _partitioned_graphs(
        model, local_seq, sp_size, micro_batch, dtype, specs, tiled, ring_size
    )
    traces = [
        _read_partition(
            spec, forward, backward, is_parameter, local_seq, micro_batch, sp_size, ring_size
        )
        for spec, (forward, backward) in zip(specs, partitions, strict=True)
    ]
    if tiled:
        config = hf_config(model)
        shape = (micro_batch, local_seq, config.hidden_size)
        nbytes = micro_batch * local_seq * config.hidden_size * dtype.itemsize
        mlp_flops = 2 * 3 * config.hidden_size * config.intermediate_size * micro_batch * local_seq
        for trace in traces:
            trace.tiled = True
            # the tile's gate, up, activation and product and their gradients; its input and output gradient
            trace.tile_bytes_per_token = (8 * config.intermediate_size + 2 * config.hidden_size) * (
                dtype.itemsize
            )
            trace.saved.append(
                SavedTensor(
                    "tiled_mlp_input",
                    shape,
                    str(dtype).removeprefix("torch."),
                    nbytes,
                    "activation",
                )
            )
            trace.forward_flops += mlp_flops
            trace.backward_flops += (
                3 * mlp_flops
            )  # the recomputed forward, then input and weight gradients
            trace.recompute_flops += mlp_flops
    return traces


def _read_partition(
    spec: ActivationCheckpointSpec,
    forward: fx.GraphModule,
    backward: fx.GraphModule,
    is_parameter: list[bool],
    local_seq: int,
    micro_batch: int,
    sp_size: int,
    ring_size: int,
) -> LayerTrace:
    trace = LayerTrace(
        spec=spec,
        local_seq=local_seq,
        micro_batch=micro_batch,
        sp_size=sp_size,
        ring_size=ring_size,
    )

    def flops_of(node: fx.Node) -> int:
        return node_flops(node)  # ring attention's count its keys over the whole ring

    placeholders = [n for n in forward.graph.nodes if n.op == "placeholder"]
    parameters = {p for p, is_param in zip(placeholders, is_parameter, strict=False) if is_param}
    output = next(n for n in forward.graph.nodes if n.op == "output")
    hidden_placeholder = placeholders[0] if placeholders else None
    seen: set[str] = set()
    for node in output.args[0][1:]:
        if not isinstance(node, fx.Node) or node.name in seen:
            continue
        seen.add(node.name)
        value = node.meta.get("val")
        if not isinstance(value, torch.Tensor):
            continue
        if node in parameters:
            kind = "parameter"
        elif node.op == "placeholder" and node is not hidden_placeholder:
            kind = "shared"
        else:
            kind = "activation"
        shape = tuple(int(s) for s in value.shape)
        trace.saved.append(
            SavedTensor(
                node.name, shape, str(value.dtype).removeprefix("torch."), tensor_bytes(node), kind
            )
        )

    forward_names = set()
    for node in forward.graph.nodes:
        if node.op != "call_function":
            continue
        forward_names.add(node.name)
        trace.forward_flops += flops_of(node)
        if not is_view(node):
            trace.largest_forward_bytes = max(trace.largest_forward_bytes, tensor_bytes(node))
        if node.target is ALL_TO_ALL:
            trace.all_to_all_forward += 1
            trace.largest_all_to_all_bytes = max(trace.largest_all_to_all_bytes, tensor_bytes(node))
    for node in backward.graph.nodes:
        if node.op != "call_function":
            continue
        flops = flops_of(node)
        trace.backward_flops += flops
        if node.target is ALL_TO_ALL:
            trace.all_to_all_backward += 1
        if node.name in forward_names or is_attention(node):
            trace.recompute_flops += flops
            trace.recomputed_bytes += 0 if is_view(node) else tensor_bytes(node)
            trace.recomputed_attention += is_attention(node)
    trace.forward_peak_bytes = peak_live_bytes(forward.graph)
    trace.backward_peak_bytes = peak_live_bytes(backward.graph)
    return trace


def tiled_layer_trace(
    model: ModelConfig,
    spec: ActivationCheckpointSpec,
    whole: LayerTrace,
    untiled: LayerTrace,
    dtype: torch.dtype,
) -> LayerTrace:
    """A decoder layer tiled whole (compile.tiled_layer), from `whole`, the untiled layer traced
    under `none` at the same length (every tensor its backward needs saved), and `untiled`, the
    layer traced under `spec`, the policy its tiles are compiled with.

    It saves its input; the rotary cos/sin stay shared. Full-sequence tensors live only between
    the tiles, at the points of compile.tiled_layer's schedule counted here, per local token
    (b bytes per element; q and o the query heads' width, kv the key and value heads' after
    repetition to the SP size, kv0 before; h the hidden size; lse fp32 per query head):
    forward: q + kv0 + q (an all-to-all's output beside all three inputs), then q + kv + o + lse
    + o (attention's inputs and output, and the output back on this rank's tokens); backward,
    besides the layer's input: h + q + kv0 + q (the same, beside the incoming gradient), then
    h + q + kv + o + lse + o + o + h (attention with its autograd, the local output, its
    gradient, the input's gradient), then h + q + kv + o + lse + o + (q + kv) + 2q (attention's
    backward: the output's gradient, q, k, v's, and the fp32 dq accumulator of flash
    attention's backward kernel), then h + 2 (q + kv) (the gradients back to this rank's
    tokens). One tile holds, per token, what the layer compiled under `spec` holds in its
    backward (its saved input and its recompute working set, the attention it never runs included:
    an upper bound) plus the chunked all-to-alls' buffers (four of the widest per token: input
    slice, send, receive, output slice). A backward tile runs beside the second point's tensors
    (forward tiles beside fewer); attention's backward runs between the tiles, so the peak is the
    larger of the two (LayerTrace.working_bytes_with).
    The q, k, v projections run four times a step, not twice.
    """
    config = hf_config(model)
    b = dtype.itemsize
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    repeat = max(1, whole.sp_size // kv_heads)
    q = heads * head_dim * b
    kv0, kv = 2 * kv_heads * head_dim * b, 2 * kv_heads * repeat * head_dim * b
    o, h, lse = q, config.hidden_size * b, heads * 4
    forward = max(2 * q + kv0, q + kv + 2 * o + lse)
    between_tiles = 2 * h + q + kv + 3 * o + lse  # the backward's tiles run beside these
    backward = max(
        h + 2 * q + kv0,
        between_tiles,
        h + 2 * q + 2 * kv + 2 * o + lse + 2 * q,
        h + 2 * (q + kv),
    )
    tokens = whole.tokens
    projections = 2 * tokens * config.hidden_size * (heads + 2 * kv_heads) * head_dim
    saved = [
        SavedTensor(
            "layer_input",
            (whole.micro_batch, whole.local_seq, config.hidden_size),
            str(dtype).removeprefix("torch."),
            h * tokens,
            "activation",
        ),
        *(t for t in whole.saved if t.kind in ("shared", "parameter")),
    ]
    ring = whole.ring_size > 1
    if ring:  # the ring's output and log-sum-exp, kept from the forward: the ring never reruns
        saved += [
            SavedTensor(
                "ring_attention_output",
                (tokens, q // b),
                str(dtype).removeprefix("torch."),
                o * tokens,
                "activation",
            ),
            SavedTensor(
                "ring_attention_logsumexp", (tokens, heads), "float32", lse * tokens, "activation"
            ),
        ]
    recompute = whole.forward_flops + 2 * projections
    return LayerTrace(
        spec=spec,
        local_seq=whole.local_seq,
        micro_batch=whole.micro_batch,
        sp_size=whole.sp_size,
        ring_size=whole.ring_size,
        tiled=True,
        saved=saved,
        forward_flops=whole.forward_flops + projections,
        backward_flops=whole.backward_flops + recompute,
        recompute_flops=recompute,
        recomputed_attention=0 if ring else 1,
        all_to_all_forward=whole.all_to_all_forward,
        all_to_all_backward=2 * whole.all_to_all_forward,
        largest_forward_bytes=max(q, h) * tokens,
        forward_peak_bytes=forward * tokens,
        backward_peak_bytes=backward * tokens,
        tile_bytes_per_token=(untiled.activation_bytes + untiled.working_bytes) // tokens
        + 4 * max(q, kv),
        tile_alongside_bytes=between_tiles * tokens,
    )
