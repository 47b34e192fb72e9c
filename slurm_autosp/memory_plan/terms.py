"""Per-GPU memory of a job, term by term, so a job that cannot fit is refused before any GPU
time is spent, and the longest sequence that fits is known.

Activations come from `trace_decoder_layer` (the partitioned joint graph of one decoder layer
at the configured width and local sequence, under FakeTensorMode); everything else is
arithmetic on the config, with P parameters, b bytes per element of the training dtype (2 in
bf16, 4 in fp32) and `world` ranks:
- ZeRO-1 (DeepSpeed): parameters b*P, the whole model on every GPU, and its gradient in fp32,
  4*P (micro-batches accumulate and ranks reduce in fp32, in bf16 runs too); the optimizer
  shard is fp32 master weights and Adam's two moments, 12*P/world (sharded over every rank, SP
  ones included), plus an fp32 gradient partition of its own (16*P/world) in fp32 runs and
  under offload, where bf16's partition is not a view of the whole gradient;
- ZeRO-3 (FSDP2: `fully_shard` per decoder layer and at the root over the whole world; the
  model's own fp32 parameters are the optimizer's, reduce-scatter after every micro-batch):
  parameters 4*P/world (fp32 shards), gradients 4*P/world (fp32 shards), optimizer shard
  8*P/world (Adam's m and v, no master copy); gathered weights: the unsharded b-byte copy of the
  root group (embedding, final norm, lm_head: gathered for the whole forward and backward) and
  of two decoder layers (the current one and the prefetched one), the lm_head's unsharded
  b-byte gradient (alive from the loss to the root's reduce-scatter at the end of backward),
  and one layer's unsharded gradient in b bytes plus its fp32 copy for the reduce-scatter (at
  the start of backward, the peak; the root group's own reduce-scatter comes after the
  activations are freed);
- activations: the layer's saved tensors times the depth, plus the rotary cos/sin all layers
  share;
- logits and loss: the final norm's saved tensors and the lm_head input, plus one chunk of
  fp32 logits and their gradient (`compile.loss_chunk_tokens`; 0 = all tokens at once);
- document boundaries (`data.documents=masked` only): every prepared micro-batch's cu_seqlens,
  int32, at most one entry per token of the whole sequence (a document per token) plus one;
- communication: the all-to-all send/receive/concatenate buffers of the largest all-to-all
  (over the Ulysses group: the layer is traced at the Ulysses size);
- ring attention (`parallel.ring_size` > 1 only): what one layer's ring attention holds at its
  peak, in backward: K and V of this rank's block, the visiting one and the next; dK and dV in
  fp32 of this rank's block, the visiting block's share, the previous share in flight and the
  share received; the token-major copies of the queries, output and output gradient and the
  fp32 query gradient (`ring_blocks_per_token`); a block is the rank's key/value heads (after
  the Ulysses all-to-all, repeated to one a rank when fewer) over Ulysses x local tokens;
- recompute working buffers: what one layer's backward recomputes, plus a gradient in and
  out of its largest tensor;
- what the traced graph cannot see, each named: the attention backward kernel's own buffers
  at the full sequence (flash's fp32 dq accumulator; with fewer key/value heads than query
  heads on the rank, dk and dv expanded to every query head before they are summed; an untiled
  layer's attention only: a tiled layer's schedule counts them), and cuBLAS's workspaces;
  outside torch's allocator, the CUDA context and NCCL's buffers per communicator, or, once a
  job of the run's layout has run a step, what it measured (metrics.outside_allocator);
- fragmentation: 5% of the allocator's terms (the job runs with expandable segments).
Under ZeRO-1 the gradient's way into DeepSpeed, at the top of backward while the activations
live: with bf16 (BF16_Optimizer) each bf16 gradient and its fp32 copy as it is added into the
fp32 gradient, at most the largest tensor's (`gradient_conversion`); the reduction then runs in
place on that flat fp32 gradient, after backward, with no bucket. Otherwise (fp32, optimizer
offload: DeepSpeed's ZeRO optimizer) its fp32 reduce bucket of 5e8 elements, allocated at the
first gradient hook (`reduce_bucket`); the all-gather of the updated weights runs in place.
Optimizer offload moves state from the GPU to host memory: under ZeRO-1 (DeepSpeed's
ZeRO-Offload) the optimizer shard, plus a pinned b-byte staging copy of the rank's parameter
partition on the host; under ZeRO-3 (FSDP2's CPUOffloadPolicy) the fp32 parameter and gradient
shards and Adam's moments, the gathered weights staying on the GPU. Host memory per node (80%
of `cluster.host_memory_gb` usable) holds offloaded activations and optimizer state together;
offloaded activations take their exact bytes plus one slab of the offload's host arena
(sp/host_arena.py: 64 MiB) per rank.
With `model.lora` (LoRA adapters, the base frozen), P counts every parameter, the frozen base's
and the adapters', and T the trained ones (the adapters: rank x (in + out) for each adapted
linear): only those have gradients and optimizer state. So under ZeRO-1 the parameters stay
b*P but the gradient is 4*T, the optimizer shard 12*T/world and the gradient conversion the
largest adapter's; under ZeRO-3 the adapters' fp32 shards are 4*T/world and the frozen base's
b*(P - T)/world (sharded in the compute dtype), gradients 4*T/world and Adam's moments 8*T/world, and of the gathered terms only a layer's adapters have a gradient (the
lm_head none, unless adapted). The activations are the full fine-tune's: an adapted linear's
rank-r intermediate (r values per token, saved for its B) is not counted, nor what a frozen
linear left unadapted no longer saves (its input, needed only for its weight's gradient; an
adapted one's input is saved for the adapter's A): an overestimate where few are adapted.
Per-token terms (activations, logits, communication buffers, working buffers) are linear in
the local sequence length, so the longest sequence that fits is solved from one trace.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from slurm_autosp.compile.activation_checkpointing import ActivationCheckpointSpec
from slurm_autosp.config import DocumentBoundaries, JobConfig, ModelConfig, Precision
from slurm_autosp.lifecycle.run_dir import RunDir
from slurm_autosp.memory_plan.compute_time import compute_seconds
from slurm_autosp.memory_plan.layer_graph import LayerTrace, hf_layer_classes
from slurm_autosp.memory_plan.policies import Rung, rung_label, tile_tokens_for
from slurm_autosp.metrics.outside_allocator import OutsideAllocator
from slurm_autosp.model import build_skeleton, hf_config
from slurm_autosp.sp.host_arena import SLAB_BYTES

GB = 1e9
ZERO_BUCKET_ELEMENTS = 5e8  # DeepSpeed's default reduce_bucket_size and allgather_bucket_size
ZERO1_OPTIMIZER_BYTES = 12  # fp32 master + Adam m + Adam v
ZERO1_GRADIENT_PARTITION_BYTES = 4  # a separate fp32 gradient partition (fp32 runs, offload)
FSDP2_STATE_BYTES = {
    "parameters": 4,
    "gradients": 4,
    "optimizer_shard": 8,
}  # fp32 shard, fp32 grad, Adam m + v
REDUCE_BYTES = 4  # gradients reduce in fp32: FSDP2's reduce_dtype, DeepSpeed's grad_accum_dtype
CU_SEQLENS_BYTES = 4  # int32, one per document of a micro-batch, and its total
# Estimates, not measurements (the probe measures them on the user's GPUs):
FRAGMENTATION = 0.05  # of the allocator's terms, with PYTORCH_CUDA_ALLOC_CONF=expandable_segments
CUDA_CONTEXT_BYTES = 0.6 * GB  # the CUDA context and its lazily loaded kernels, per process
NCCL_BYTES_PER_COMMUNICATOR = 2**28  # 32 channels x (send + receive) x 4 MiB NCCL_BUFFSIZE
CUBLAS_WORKSPACE_BYTES = 2 * 32 * 2**20  # cuBLASLt's 32 MiB on sm90, compute and side stream
FLASH_DQ_ACCUMULATOR_BYTES = 4  # flash backward accumulates dq in fp32
RING_GRADIENT_BYTES = 4  # dK and dV go back to their block's rank in fp32


def with_margin(subtotal: float) -> float:
    """The allocator's bytes for `subtotal` bytes of terms: fragmentation on top."""
    return subtotal * (1 + FRAGMENTATION)


def communicators(cfg: JobConfig) -> int:
    """NCCL communicators a rank holds buffers for: the world's, and the SP and DP groups'
    where they are proper subgroups, and under a ring its Ulysses and ring groups."""
    sp, world = cfg.parallel.sp_size, cfg.cluster.world_size
    _, ring = cfg.parallel.ulysses_ring
    return 1 + (1 < sp < world) + (1 < world // sp < world) + 2 * (ring > 1)


def outside_allocator(cfg: JobConfig, zero_stage: int) -> tuple[dict[str, float], str]:
    """GPU memory torch's allocator never sees (none on CPU ranks), and where the figure comes
    from: measured after the first step by the run's own job, else by its probe, where it ran
    this layout (metrics.outside_allocator); else estimated."""
    if not cfg.cluster.uses_gpus:
        return {}, ""
    run = RunDir(cfg.run.dir)
    ulysses, ring = cfg.parallel.ulysses_ring
    other = ""
    for path in (run.outside_allocator, run.probe_run.outside_allocator):
        recorded = OutsideAllocator.read(path)
        if recorded is None:
            continue
        if recorded.matches(cfg.cluster.world_size, ulysses * ring, ring, zero_stage):
            return {"outside_allocator": recorded.bytes}, (
                f"measured on {recorded.device} after step {recorded.step}, the busiest rank: "
                f"{path}"
            )
        other += (
            f"; {path} holds another layout's (world {recorded.world_size}, SP "
            f"{recorded.sp_size}, ring {recorded.ring_size}, ZeRO-{recorded.zero_stage})"
        )
    return {
        "cuda_context": CUDA_CONTEXT_BYTES,
        "nccl_buffers": NCCL_BYTES_PER_COMMUNICATOR * communicators(cfg),
    }, f"estimated until a job of this layout measures it{other}"


def offload_lag_layers(cfg: JobConfig, trace: LayerTrace, layers: int) -> float:
    """Layers' worth of saved tensors the forward leaves on the GPU behind their copies to host
    memory, beyond the one in flight: none while a layer's copy over the host link takes no
    longer than its forward; else each layer's copy falls (1 - forward / copy) of a layer
    further behind, and nothing holds the forward back. None on CPU ranks (plain copies)."""
    if not cfg.cluster.uses_gpus or not trace.activation_bytes:
        return 0.0
    copy = trace.activation_bytes / (cfg.cluster.host_link_gb_per_s * GB)
    forward = compute_seconds(cfg.trace, trace.forward_flops)
    return layers * max(0.0, 1 - forward / copy)


def attention_backward_per_token(cfg: JobConfig) -> float:
    """The attention backward kernel's buffers per local token (after the all-to-all a rank
    holds the whole sequence for 1/sp of the heads: the same bytes as all heads of its own
    tokens): flash's fp32 dq, and dk, dv expanded to the query heads when the rank's key/value
    heads are fewer."""
    hf = hf_config(cfg.model)
    heads, kv_heads = hf.num_attention_heads, hf.num_key_value_heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
    ulysses, _ = cfg.parallel.ulysses_ring
    q_width = heads * head_dim
    rank_kv_heads = max(1, kv_heads // ulysses)  # fewer than the Ulysses size: repeated
    expanded = (
        2 * bytes_per_element(cfg.precision) * q_width if rank_kv_heads < heads // ulysses else 0
    )
    return FLASH_DQ_ACCUMULATOR_BYTES * q_width + expanded


def kv_block_per_token(cfg: JobConfig, ulysses: int) -> float:
    """Bytes per local token of one K (or V) block a ring passes: the rank's key/value heads
    after the Ulysses all-to-all (repeated to one a rank when fewer) over Ulysses x local
    tokens."""
    hf = hf_config(cfg.model)
    heads, kv_heads = hf.num_attention_heads, hf.num_key_value_heads or hf.num_attention_heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
    return ulysses * max(1, kv_heads // ulysses) * head_dim * bytes_per_element(cfg.precision)


def ring_blocks_per_token(cfg: JobConfig, ulysses: int, ring: int) -> float:
    """The ring's buffers per local token at their peak, attention's backward (none without a
    ring): K and V of this rank's block, of the visiting one and of the next (model dtype); dK
    and dV in fp32 of this rank's block, of the visiting block's share, of the previous share
    still in flight and of the share received; and the token-major copies of the queries, the
    output and its gradient (model dtype) beside the queries' gradient (fp32)."""
    if ring == 1:
        return 0.0
    hf = hf_config(cfg.model)
    heads = hf.num_attention_heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
    b = bytes_per_element(cfg.precision)
    fp32 = RING_GRADIENT_BYTES / b
    kv = 2 * kv_block_per_token(cfg, ulysses) * (3 + 4 * fp32)
    queries = heads * head_dim * b * (3 + fp32)  # the rank's heads / U over U x local tokens
    return kv + queries


# of a node's host memory, for offloaded activations and optimizer state (the rest: OS, data)
HOST_USABLE = 0.8


@dataclass(frozen=True)
class ModelSize:
    """Parameter counts by FSDP2 group: the largest decoder layer (where an MoE has dense
    layers too, an MoE one with every expert), and the root (embedding, final norm, lm_head);
    and of each, those trained: all of them in a full fine-tune, only the adapters under
    `model.lora` (the base frozen: no gradient, no optimizer state)."""

    layer: int
    layers: int
    root: int
    head: int  # the lm_head weight (the embedding's when tied)
    in_layers: int  # every decoder layer's parameters together
    largest: int  # the largest single tensor: the embedding, or a layer's (an MoE's experts)
    trained_layer: int  # of the largest layer's parameters, those trained
    trained_in_layers: int
    trained_root: int
    trained_head: int  # the lm_head's trained parameters: its weight, its adapters, or none
    trained_largest: int  # the largest trained tensor

    @property
    def total(self) -> int:
        return self.in_layers + self.root

    @property
    def trained(self) -> int:
        return self.trained_in_layers + self.trained_root

    @property
    def frozen(self) -> int:
        return self.total - self.trained


def model_size(model: ModelConfig) -> ModelSize:
    """Parameter counts of the configured model, from its decoder layers built on the meta
    device (nothing allocated; an MoE's layers hold every expert, not only those a token runs).
    With `model.lora`, from the whole model built on the meta device with its adapters, as
    training builds it (model.build_skeleton): PEFT decides which linear layers it adapts."""
    if model.lora is not None:
        return _adapted_size(model)
    layer_class, _ = hf_layer_classes(model)
    config = hf_config(model)
    with torch.device("meta"):
        built = [layer_class(config, i) for i in range(config.num_hidden_layers)]
    layers = [sum(p.numel() for p in layer.parameters()) for layer in built]
    embedding = config.vocab_size * config.hidden_size
    head = 0 if getattr(config, "tie_word_embeddings", False) else embedding
    largest = max(p.numel() for layer in built for p in layer.parameters())
    return ModelSize(
        int(max(layers)),
        config.num_hidden_layers,
        embedding + head + config.hidden_size,
        embedding,
        int(sum(layers)),
        int(max(embedding, largest)),
        int(max(layers)),
        int(sum(layers)),
        embedding + head + config.hidden_size,
        embedding,
        int(max(embedding, largest)),
    )


def _adapted_size(model: ModelConfig) -> ModelSize:
    """`model_size` of a model with LoRA adapters: every parameter, the frozen base and the
    adapters, and of them those trained (`requires_grad`: the adapters)."""
    layer_class, _ = hf_layer_classes(model)
    skeleton = build_skeleton(model)
    built = [m for m in skeleton.modules() if isinstance(m, layer_class)]
    assert built, f"no {layer_class.__name__} in the model"

    def count(params: Iterable[torch.nn.Parameter], trained: bool = False) -> int:
        return int(sum(p.numel() for p in params if p.requires_grad or not trained))

    layers = [(count(m.parameters()), count(m.parameters(), True)) for m in built]
    total, trained = count(skeleton.parameters()), count(skeleton.parameters(), True)
    in_layers, trained_in_layers = (sum(c) for c in zip(*layers, strict=True))
    layer, trained_layer = max(layers)
    head = getattr(skeleton, "get_output_embeddings", lambda: None)()
    head_trained = count(head.parameters(), True) if isinstance(head, torch.nn.Module) else 0
    config = hf_config(model)
    return ModelSize(
        layer,
        len(built),
        total - in_layers,
        config.vocab_size * config.hidden_size,
        in_layers,
        max(p.numel() for p in skeleton.parameters()),
        trained_layer,
        trained_in_layers,
        trained - trained_in_layers,
        head_trained,
        max((p.numel() for p in skeleton.parameters() if p.requires_grad), default=0),
    )


@dataclass
class PolicyMemory:
    """The breakdown for one rung of the memory ladder under one ZeRO stage."""

    label: str
    rung: Rung
    terms: dict[str, float]  # name -> bytes, in print order
    per_token: float  # bytes per local token of the terms that grow with the sequence
    fixed: float  # bytes of the terms that do not
    trace: LayerTrace
    host_per_token: float = 0.0  # bytes per local token this rank keeps in host memory (offload)
    host_bytes_per_rank: float = 0.0  # the node's host memory for offload, shared by its ranks
    tile_tokens: int = 0
    # bytes this rank keeps in host memory whatever the sequence: offloaded optimizer state
    host_fixed: float = 0.0
    # tiled layers: the working set is the larger of the full-width peak (in per_token) and
    # what lives beside a tile plus the tile; this line, (per token, fixed), is the tile
    # branch's excess over the full-width one, counted where positive
    tile_excess: tuple[float, float] = (0.0, 0.0)
    # bytes outside torch's allocator: the CUDA context, NCCL's buffers
    outside: dict[str, float] = field(default_factory=dict)
    outside_source: str = ""  # measured or estimated, and by what

    @property
    def spec(self) -> ActivationCheckpointSpec:
        return self.rung.spec

    @property
    def host_bytes(self) -> float:
        return self.host_at(self.trace.tokens)

    def host_at(self, tokens: float) -> float:
        """This rank's host memory at `tokens` local tokens: offloaded activations and state."""
        return self.host_fixed + self.host_per_token * tokens

    def fits(self, gpu_bytes: float) -> bool:
        return self.total <= gpu_bytes and self.host_bytes <= self.host_bytes_per_rank

    @property
    def subtotal(self) -> float:
        return sum(self.terms.values())

    @property
    def margin(self) -> float:
        """Fragmentation of the allocator's terms."""
        return with_margin(self.subtotal) - self.subtotal

    @property
    def allocator_total(self) -> float:
        """What torch's allocator reserves: the terms and their fragmentation."""
        return self.subtotal + self.margin

    def excess_at(self, tokens: float) -> float:
        per_token, fixed = self.tile_excess
        return max(0.0, fixed + per_token * tokens)

    def total_at(self, tokens: float) -> float:
        """The total, margin and memory outside the allocator included, at `tokens` local
        tokens instead of the traced ones."""
        allocator = with_margin(self.fixed + self.per_token * tokens + self.excess_at(tokens))
        return allocator + sum(self.outside.values())

    @property
    def total(self) -> float:
        return self.allocator_total + sum(self.outside.values())

    def longest_local_seq(self, gpu_bytes: float) -> int:
        room = (gpu_bytes - sum(self.outside.values())) / (1 + FRAGMENTATION) - self.fixed
        longest = max(0, int(room // self.per_token)) if self.per_token else 0
        excess_per_token, excess_fixed = self.tile_excess
        if excess_fixed and self.per_token + excess_per_token > 0:  # both branches must fit
            tiled = (room - excess_fixed) // (self.per_token + excess_per_token)
            longest = min(longest, max(0, int(tiled)))
        host_room = self.host_bytes_per_rank - self.host_fixed
        if host_room < 0:
            return 0
        if self.host_per_token:
            longest = min(longest, int(host_room // self.host_per_token))
        return longest


@dataclass
class MemoryPlan:
    cfg: JobConfig
    parameters: int
    trained: int  # the parameters trained: all, or under `model.lora` the adapters'
    gpu_bytes: float
    zero_stage: int  # the stage training runs: configured, or chosen by the plan
    configured: PolicyMemory  # the rung training runs with, under `zero_stage`
    memories: dict[int, dict[Rung, PolicyMemory]]  # per ZeRO stage (1, 3), every traced rung
    stage_note: str = ""  # why the plan chose the stage; empty when configured
    policy_note: str = ""  # how the plan chose the policy; empty when configured

    @property
    def fits(self) -> bool:
        return self.configured.fits(self.gpu_bytes)

    @property
    def policies(self) -> list[PolicyMemory]:
        return list(self.memories[self.zero_stage].values())

    def longest_seq(self, policy: PolicyMemory) -> int:
        """Longest sequence (tokens, over the SP group) per micro-batch row, in steps of 1024."""
        local = policy.longest_local_seq(self.gpu_bytes) // self.cfg.train.micro_batch
        return (local * self.cfg.parallel.sp_size) // 1024 * 1024


def _count(parameters: int) -> str:
    """e.g. 42M, 8.03B."""
    return f"{parameters / 1e9:.2f}B" if parameters >= 1e9 else f"{parameters / 1e6:,.1f}M"


def trained_summary(plan: MemoryPlan) -> str:
    """What a LoRA run trains, e.g. "LoRA rank 16 on 7 projections: 42.0M of 8.07B parameters
    trained"; empty for a full fine-tune."""
    lora = plan.cfg.model.lora
    if lora is None:
        return ""
    targets = ", ".join(lora.target_modules)
    return (
        f"LoRA rank {lora.rank} on {targets}: {_count(plan.trained)} of "
        f"{_count(plan.parameters)} parameters trained (the base frozen: no gradients, no "
        "optimizer state)"
    )


def bytes_per_element(precision: Precision) -> int:
    return 2 if precision is Precision.bf16 else 4


def _state_terms(cfg: JobConfig, size: ModelSize, zero_stage: int) -> dict[str, float]:
    """Parameters, gradients and optimizer state per GPU (see the module docstring): every
    parameter is held, only the trained ones have gradients and optimizer state."""
    b, world = bytes_per_element(cfg.precision), cfg.cluster.world_size
    trained = size.trained
    if zero_stage == 3:  # a LoRA model's frozen base is sharded in b bytes (engine/fsdp2.py)
        per_parameter = {"parameters": trained, "gradients": trained, "optimizer_shard": trained}
        state = {
            name: nbytes * per_parameter[name] / world for name, nbytes in FSDP2_STATE_BYTES.items()
        }
        state["parameters"] += b * size.frozen / world
        return state
    partition = ZERO1_GRADIENT_PARTITION_BYTES if b == 4 else 0
    return {
        "parameters": b * size.total,
        "gradients": REDUCE_BYTES * trained,
        "optimizer_shard": (ZERO1_OPTIMIZER_BYTES + partition) * trained / world,
    }


def _offloaded_state(
    cfg: JobConfig, size: ModelSize, zero_stage: int, state: dict[str, float]
) -> tuple[dict[str, float], float]:
    """The state terms left on the GPU under optimizer offload, and the host bytes per rank:
    ZeRO-1 moves the optimizer shard with an fp32 gradient partition of its own, and stages a
    b-byte copy of the parameter partition in pinned host memory (the fp32 gradient stays on
    the GPU, accumulating); ZeRO-3 moves the fp32 shards, their gradients and Adam's moments.
    Only the trained parameters' state: a LoRA run's frozen base stays where it is under
    ZeRO-1, and moves with the other shards under ZeRO-3."""
    if zero_stage == 3:
        return {name: 0.0 for name in state}, sum(state.values())
    shard = size.trained / cfg.cluster.world_size
    host = (
        ZERO1_OPTIMIZER_BYTES + ZERO1_GRADIENT_PARTITION_BYTES + bytes_per_element(cfg.precision)
    ) * shard
    return {**state, "optimizer_shard": 0.0}, host


def _gathered_weights(precision: Precision, size: ModelSize) -> float:
    """FSDP2's unsharded buffers at the peak: the root group and two layers gathered, the
    lm_head's gradient, one layer's gradient and its fp32 copy for the reduce-scatter (of the
    trained parameters only: a frozen one has no gradient)."""
    b = bytes_per_element(precision)
    return (
        b * (size.root + 2 * size.layer + size.trained_head)
        + (b + REDUCE_BYTES) * size.trained_layer
    )


def policy_memory(
    cfg: JobConfig, trace: LayerTrace, size: ModelSize, zero_stage: int, rung: Rung
) -> PolicyMemory:
    """One rung's terms under one ZeRO stage, and the bytes per token of those that grow with the sequence.

        Offload moves the layers' saved tensors and the loss's saved inputs to host memory: on the
        GPU stay two layers' worth (the one being written out or the one in use, and the one
        fetched ahead), more where the copies out fall behind the forward (offload_lag_layers),
        and the shared rotary tensors. Tiled MLPs add one tile's recompute working set
    to the layer's peak; a whole layer's tiles under `full` run beside only what lives between
    them (then no all-to-all spans the sequence, see tiled_layer_trace), so the working set is
    the larger of that plus a tile and the full-width peak (`tile_excess`)."""
    b = bytes_per_element(cfg.precision)
    hf = hf_config(cfg.model)
    tokens = trace.tokens
    hidden, vocab = hf.hidden_size, hf.vocab_size
    chunk = min(tokens, cfg.compile.loss_chunk_tokens or tokens)
    layers_saved = size.layers * trace.activation_bytes / tokens
    loss_saved = (
        hidden * 4 + 4 + hidden * b + 8
    )  # final norm: its fp32 input and rsqrt; the lm_head input; the labels
    resident_layers = (
        min(2 + offload_lag_layers(cfg, trace, size.layers), size.layers)
        if rung.offload
        else size.layers
    )
    per_token = {
        "activations": (resident_layers * trace.activation_bytes + trace.shared_bytes) / tokens,
        "logits_and_loss_saved": 0.0 if rung.offload else loss_saved,
        "communication_all_to_all": 3 * trace.largest_all_to_all_bytes / tokens,
        "recompute_working": trace.working_bytes / tokens,
        # a tiled layer's schedule counts them (layer_graph.tiled_layer_trace)
        "attention_backward": 0.0 if rung.tiled else attention_backward_per_token(cfg),
        "ring_kv_blocks": ring_blocks_per_token(cfg, *cfg.parallel.ulysses_ring),
    }
    tile = tile_tokens_for(cfg.compile, hf.intermediate_size, b, tokens) if rung.tiled else 0
    beside_tile = trace.tile_alongside_bytes  # a tiled layer's: see LayerTrace.working_bytes_with
    tile_excess = (
        ((beside_tile - trace.working_bytes) / tokens, tile * trace.tile_bytes_per_token)
        if beside_tile
        else (0.0, 0.0)
    )
    logits_chunk = chunk * vocab * (b + 4 + 4)  # logits in the model dtype, fp32, fp32 gradient
    if cfg.data.documents is DocumentBoundaries.masked:  # bytes per document: bound by tokens
        per_token["document_boundaries"] = (
            CU_SEQLENS_BYTES * cfg.parallel.sp_size * cfg.train.grad_accum
        )
    state, host_state = _state_terms(cfg, size, zero_stage), 0.0
    if rung.offload_optimizer:
        state, host_state = _offloaded_state(cfg, size, zero_stage, state)
    terms = {
        **state,
        **({"gathered_weights": _gathered_weights(cfg.precision, size)} if zero_stage == 3 else {}),
        **(_zero1_gradient_path(cfg.precision, size, rung) if zero_stage == 1 else {}),
        "activations": per_token["activations"] * tokens,
        "logits_and_loss": per_token["logits_and_loss_saved"] * tokens + logits_chunk,
        "communication": per_token["communication_all_to_all"] * tokens,
        "recompute_working": trace.working_bytes_with(tile),
        "attention_backward": per_token["attention_backward"] * tokens,
        **(
            {"ring_kv_blocks": per_token["ring_kv_blocks"] * tokens}
            if per_token["ring_kv_blocks"]
            else {}
        ),
        **({"cublas_workspace": CUBLAS_WORKSPACE_BYTES} if cfg.cluster.uses_gpus else {}),
    }
    if "document_boundaries" in per_token:  # train_step prepares every micro-batch up front
        terms["document_boundaries"] = (
            per_token["document_boundaries"] * tokens + CU_SEQLENS_BYTES * cfg.train.grad_accum
        )
    growing = sum(per_token.values()) + (
        vocab * (b + 8) if not cfg.compile.loss_chunk_tokens else 0
    )
    excess = max(0.0, tile_excess[1] + tile_excess[0] * tokens)
    fixed = sum(terms.values()) - growing * tokens - excess
    host_per_token = layers_saved + loss_saved if rung.offload else 0.0
    host_per_rank = cfg.cluster.host_memory_gb * GB * HOST_USABLE / cfg.cluster.ranks_per_node
    return PolicyMemory(
        rung_label(rung),
        rung,
        terms,
        growing,
        fixed,
        trace,
        host_per_token,
        host_per_rank,
        tile,
        host_state + (SLAB_BYTES if rung.offload else 0.0),
        tile_excess,
        *outside_allocator(cfg, zero_stage),
    )


def _zero1_gradient_path(precision: Precision, size: ModelSize, rung: Rung) -> dict[str, float]:
    """What ZeRO-1's gradients take on their way into DeepSpeed during backward (see the
    module docstring): DeepSpeed runs BF16_Optimizer for bf16 without optimizer offload, its
    ZeRO optimizer otherwise (runtime/engine.py, _configure_zero_optimizer's choice)."""
    b = bytes_per_element(precision)
    if b == 2 and not rung.offload_optimizer:
        return {"gradient_conversion": (b + REDUCE_BYTES) * size.trained_largest}
    return {"reduce_bucket": ZERO_BUCKET_ELEMENTS * REDUCE_BYTES}
