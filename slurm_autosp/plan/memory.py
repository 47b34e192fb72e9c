"""Per-GPU memory of a job, term by term, against the GPU; the longest sequence that fits.

Activations come from `trace_decoder_layer` (the partitioned joint graph of one decoder layer
at the configured width and local sequence, under FakeTensorMode); everything else is
arithmetic on the config:
- parameters and gradients: bf16 (fp32 when training in fp32), the whole model on every GPU
  under ZeRO-1, 1/world of it under parameter sharding (ZeRO-3);
- optimizer shard: fp32 master weights, Adam's two moments and the fp32 gradient partition,
  16 bytes per parameter over the world (ZeRO-1 shards it over every rank, SP ones included);
- activations: the layer's saved tensors times the depth, plus the rotary cos/sin all layers
  share;
- logits and loss: the final norm's saved tensors and the lm_head input, plus one chunk of
  fp32 logits and their gradient (`compile.loss_chunk_tokens`; 0 = all tokens at once);
- communication: the all-to-all send/receive/concatenate buffers of the largest all-to-all,
  and DeepSpeed's reduce and all-gather buckets (5e8 elements each);
- recompute working buffers: what one layer's backward recomputes, plus a gradient in and
  out of its largest tensor;
- a fragmentation and runtime margin: 10% of the above plus 1 GiB (CUDA context, NCCL).
Per-token terms (activations, logits, communication buffers, working buffers) are linear in
the local sequence length, so the longest sequence that fits is solved from one trace.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from slurm_autosp.checkpoint.estimate import signal_delay_warning
from slurm_autosp.compile.checkpointing import CheckpointSpec, Policy
from slurm_autosp.config import JobConfig, Precision
from slurm_autosp.heads import valid_sp_sizes
from slurm_autosp.plan.trace import LayerTrace, hf_config, hf_layer_classes, trace_decoder_layer

GB = 1e9
ZERO_BUCKET_ELEMENTS = 5e8  # DeepSpeed's default reduce_bucket_size and allgather_bucket_size
OPTIMIZER_BYTES_PER_PARAM = 16  # fp32 master + Adam m + Adam v + fp32 gradient partition
MARGIN_FRACTION = 0.10
RUNTIME_RESERVE = 2**30
SAC_BUDGETS = (1.0, 0.75, 0.5, 0.25, 0.0)


def count_parameters(cfg: JobConfig) -> int:
    """Parameters of the configured model, from one fake decoder layer (nothing allocated)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    layer_class, _ = hf_layer_classes(cfg.model)
    config = hf_config(cfg.model)
    with FakeTensorMode():
        layer = sum(p.numel() for p in layer_class(config, 0).parameters())
    embedding = config.vocab_size * config.hidden_size
    head = 0 if getattr(config, "tie_word_embeddings", False) else embedding
    return int(layer * config.num_hidden_layers + embedding + head + config.hidden_size)


@dataclass
class PolicyMemory:
    """The breakdown for one checkpointing policy."""

    label: str
    spec: CheckpointSpec
    terms: dict[str, float]  # name -> bytes, in print order
    per_token: float  # bytes per local token of the terms that grow with the sequence
    fixed: float  # bytes of the terms that do not
    trace: LayerTrace

    @property
    def subtotal(self) -> float:
        return sum(self.terms.values())

    @property
    def margin(self) -> float:
        return MARGIN_FRACTION * self.subtotal + RUNTIME_RESERVE

    @property
    def total(self) -> float:
        return self.subtotal + self.margin

    def longest_local_seq(self, gpu_bytes: float) -> int:
        room = (gpu_bytes - RUNTIME_RESERVE) / (1 + MARGIN_FRACTION) - self.fixed
        return max(0, int(room // self.per_token)) if self.per_token else 0


@dataclass
class MemoryPlan:
    cfg: JobConfig
    parameters: int
    gpu_bytes: float
    zero_stage: int
    configured: PolicyMemory
    policies: list[PolicyMemory] = field(default_factory=list)
    sharded: list[PolicyMemory] = field(default_factory=list)  # the same under parameter sharding

    @property
    def fits(self) -> bool:
        return self.configured.total <= self.gpu_bytes

    def longest_seq(self, policy: PolicyMemory) -> int:
        """Longest sequence (tokens, over the SP group) per micro-batch row, in steps of 1024."""
        local = policy.longest_local_seq(self.gpu_bytes) // self.cfg.train.micro_batch
        return (local * self.cfg.parallel.sp_size) // 1024 * 1024


def _bytes_per_element(cfg: JobConfig) -> int:
    return 2 if cfg.precision is Precision.bf16 else 4


def _policy_memory(cfg: JobConfig, trace: LayerTrace, parameters: int, zero_stage: int, label: str) -> PolicyMemory:
    b = _bytes_per_element(cfg)
    world = cfg.cluster.world_size
    hf = hf_config(cfg.model)
    tokens = trace.tokens
    hidden, vocab, layers = hf.hidden_size, hf.vocab_size, hf.num_hidden_layers
    chunk = min(tokens, cfg.compile.loss_chunk_tokens or tokens)
    sharded = zero_stage == 3
    weights = parameters * b / (world if sharded else 1)
    per_token = {
        "activations": (layers * trace.activation_bytes + trace.shared_bytes) / tokens,
        # final norm: its fp32 input and rsqrt; the lm_head input; the labels
        "logits_and_loss_saved": hidden * 4 + 4 + hidden * b + 8,
        "communication_all_to_all": 3 * trace.largest_all_to_all_bytes / tokens,
        "recompute_working": trace.working_bytes / tokens,
    }
    logits_chunk = chunk * vocab * (b + 4 + 4)  # logits in the model dtype, fp32, fp32 gradient
    terms = {
        "parameters": weights,
        "gradients": weights,
        "optimizer_shard": OPTIMIZER_BYTES_PER_PARAM * parameters / world,
        "activations": per_token["activations"] * tokens,
        "logits_and_loss": per_token["logits_and_loss_saved"] * tokens + logits_chunk,
        "communication": per_token["communication_all_to_all"] * tokens + 2 * ZERO_BUCKET_ELEMENTS * b,
        "recompute_working": per_token["recompute_working"] * tokens,
    }
    if sharded:  # one layer's gathered parameters, and the next one's prefetched
        terms["communication"] += 2 * (parameters / max(layers, 1)) * b
    growing = sum(per_token.values()) + (vocab * (b + 8) if not cfg.compile.loss_chunk_tokens else 0)
    fixed = sum(terms.values()) - growing * tokens
    return PolicyMemory(label, trace.spec, terms, growing, fixed, trace)


def configured_spec(cfg: JobConfig, budget: float | None = None) -> CheckpointSpec:
    c = cfg.compile
    chosen = c.activation_memory_budget if budget is None else budget
    return CheckpointSpec(
        Policy(c.activation_checkpointing.value),
        budget=1.0 if chosen is None else chosen,
        recompute_all_to_all=c.recompute_all_to_all,
    )


def _label(spec: CheckpointSpec) -> str:
    if spec.policy is not Policy.sac:
        return spec.policy.value
    a2a = ", all-to-all recomputed" if spec.recompute_all_to_all else ""
    return f"sac (budget {spec.budget:g}{a2a})"


def build_plan(cfg: JobConfig) -> MemoryPlan:
    """Trace one decoder layer under every policy and lay out the per-GPU memory."""
    sp = cfg.parallel.sp_size
    local_seq = -(-cfg.data.seq_len // sp)
    dtype = torch.bfloat16 if cfg.precision is Precision.bf16 else torch.float32
    configured = configured_spec(cfg)
    a2a = cfg.compile.recompute_all_to_all
    specs = [
        CheckpointSpec(Policy.none, recompute_all_to_all=a2a),
        CheckpointSpec(Policy.torch_default),
        CheckpointSpec(Policy.full, recompute_all_to_all=a2a),
        *(CheckpointSpec(Policy.sac, budget=x, recompute_all_to_all=a2a) for x in SAC_BUDGETS),
        CheckpointSpec(Policy.sac, budget=0.0, recompute_all_to_all=True),
    ]
    if configured not in specs:
        specs.append(configured)
    traces = trace_decoder_layer(
        cfg.model, local_seq=local_seq, sp_size=sp, specs=specs, micro_batch=cfg.train.micro_batch, dtype=dtype
    )
    parameters = count_parameters(cfg)
    gpu_bytes = cfg.cluster.gpu_memory_gb * GB
    stage = cfg.parallel.zero_stage
    memories = {t.spec: _policy_memory(cfg, t, parameters, stage, _label(t.spec)) for t in traces}
    chosen = configured
    if configured.policy is Policy.sac and cfg.compile.activation_memory_budget is None:
        candidates = [CheckpointSpec(Policy.sac, budget=x, recompute_all_to_all=a2a) for x in SAC_BUDGETS]
        fitting = [s for s in candidates if memories[s].total <= gpu_bytes]
        chosen = fitting[0] if fitting else candidates[-1]  # the largest budget that fits
    plan = MemoryPlan(cfg, parameters, gpu_bytes, stage, memories[chosen])
    plan.policies = [memories[s] for s in specs]
    other = 3 if stage == 1 else 1
    plan.sharded = [_policy_memory(cfg, t, parameters, other, _label(t.spec)) for t in traces
                    if t.spec in {p.spec for p in plan.policies}]
    return plan


def _gb(value: float) -> str:
    return f"{value / GB:8.2f} GB"


def biggest_term(memory: PolicyMemory) -> tuple[str, float]:
    return max(memory.terms.items(), key=lambda item: item[1])


def _alternatives(plan: MemoryPlan) -> list[str]:
    """What would fit instead: another policy, parameter sharding, more GPUs in SP."""
    cfg = plan.cfg
    options = []
    fitting = [p.label for p in plan.policies if p.total <= plan.gpu_bytes]
    if fitting:
        options.append("another checkpointing policy: " + ", ".join(fitting))
    sharded = [p.label for p in plan.sharded if p.total <= plan.gpu_bytes]
    if plan.zero_stage == 1 and sharded:
        options.append("parameter sharding (parallel.zero_stage=3, not available yet) with: " + ", ".join(sharded))
    hf = hf_config(cfg.model)
    heads, kv = hf.num_attention_heads, getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
    domain = cfg.cluster.nvlink_domain_size or cfg.cluster.ranks_per_node
    for sp in valid_sp_sizes(heads, kv):
        if sp <= cfg.parallel.sp_size or sp > cfg.cluster.world_size:
            continue
        scale = cfg.parallel.sp_size / sp
        fitting = []
        for memory in [*plan.policies, *plan.sharded]:
            sharded = memory in plan.sharded
            total = (memory.fixed + memory.per_token * memory.trace.tokens * scale) * (1 + MARGIN_FRACTION) + RUNTIME_RESERVE
            if total <= plan.gpu_bytes:  # prefer no parameter sharding, then the least recomputation
                fitting.append(((sharded, memory.trace.recompute_flops), memory, sharded))
        if fitting:
            _, memory, sharded = min(fitting, key=lambda item: item[0])
            where = "" if sp <= domain else f" (beyond the NVLink domain of {domain})"
            stage = 3 if sharded and plan.zero_stage == 1 else plan.zero_stage
            options.append(f"parallel.sp_size={sp}{where} with {memory.label}" + (" and zero_stage=3" if stage == 3 else ""))
            break
    return options


def render(plan: MemoryPlan) -> str:
    cfg, memory = plan.cfg, plan.configured
    c = cfg.cluster
    local_seq = memory.trace.local_seq
    hf = hf_config(cfg.model)
    lines = [
        f"memory plan: {hf.model_type} {plan.parameters / 1e9:.2f}B parameters, {hf.num_hidden_layers} layers, "
        f"seq {cfg.data.seq_len} x micro_batch {cfg.train.micro_batch}, SP={cfg.parallel.sp_size} "
        f"({local_seq} tokens per rank), world {c.world_size}, ZeRO-{plan.zero_stage}, {cfg.precision.value}, "
        f"checkpointing {memory.label}",
        f"per GPU ({c.gpu_memory_gb:g} GB):",
    ]
    for name, value in memory.terms.items():
        lines.append(f"  {name:<26}{_gb(value)}")
    lines.append(f"  {'fragmentation_margin':<26}{_gb(memory.margin)}   (10% + 1 GiB runtime)")
    lines.append(f"  {'total':<26}{_gb(memory.total)}   of {c.gpu_memory_gb:g} GB")
    t = memory.trace
    lines.append(
        f"  one layer saves {t.activation_bytes / t.tokens:,.0f} bytes per token; O(S^2) tensors saved: "
        f"{len(t.quadratic_saved)}; attention recomputed: {t.recomputed_attention}; all-to-alls in backward: "
        f"{t.all_to_all_backward}"
    )
    lines.append("longest sequence that fits (this cluster shape, per policy):")
    for p in plan.policies:
        sharded = next(s for s in plan.sharded if s.spec == p.spec)
        other = "ZeRO-3" if plan.zero_stage == 1 else "ZeRO-1"
        lines.append(
            f"  {p.label:<38} ZeRO-{plan.zero_stage}: {plan.longest_seq(p):>9,}   {other}: {plan.longest_seq(sharded):>9,}"
            f"   (needs {p.total / GB:,.1f} GB at seq {cfg.data.seq_len})"
        )
    text, _, _ = verdict(plan)
    lines.append(text)
    return "\n".join(lines)


def verdict(plan: MemoryPlan) -> tuple[str, bool, str]:
    memory = plan.configured
    if plan.fits:
        budget = f" (compile.activation_memory_budget={memory.spec.budget:g})" if memory.spec.policy is Policy.sac else ""
        return (f"verdict: fits: {memory.total / GB:.1f} of {plan.gpu_bytes / GB:g} GB per GPU with {memory.label}{budget}",
                True, "")
    name, value = biggest_term(memory)
    reason = (f"needs {memory.total / GB:.1f} GB per GPU, the GPU has {plan.gpu_bytes / GB:g} GB; the biggest term is "
              f"{name} ({value / GB:.1f} GB)")
    if plan.zero_stage == 1 and name in ("parameters", "gradients"):
        reason += (": under ZeRO-1 every GPU holds the full weights and gradients "
                   f"({(memory.terms['parameters'] + memory.terms['gradients']) / GB:.0f} GB)")
    options = _alternatives(plan)
    fix = ("would fit: " + "; ".join(options)) if options else (
        "nothing tried here fits (more GPUs in SP, other checkpointing policies, parameter sharding)")
    return f"verdict: does not fit: {reason}\n  {fix}", False, f"{reason}. {fix}"


def plan_verdict(cfg: JobConfig) -> tuple[str, bool, str]:
    """(the plan's text, whether the job fits, why not): what submit prints and decides on.
    CPU jobs have no GPU memory to plan against: they always fit."""
    if not cfg.cluster.uses_gpus:
        return "memory plan: CPU ranks, no GPU memory to plan against", True, ""
    if cfg.model.builder:
        return ("memory plan: not available for model.builder models (the plan traces a Hugging Face "
                "decoder layer); nothing checked", True, "")
    plan = build_plan(cfg)
    text = render(plan)
    _, fits, reason = verdict(plan)
    warning = signal_delay_warning(cfg, count_parameters(cfg))
    if warning:
        text += f"\nwarning: {warning}"
    return text, fits, reason


def checkpoint_spec_for(cfg: JobConfig) -> CheckpointSpec:
    """The checkpointing policy training compiles with. A `sac` budget left null comes from the
    memory plan (the largest that fits the GPU); CPU ranks have no GPU to fit, so they keep
    everything (budget 1)."""
    spec = configured_spec(cfg)
    if spec.policy is Policy.sac and cfg.compile.activation_memory_budget is None and cfg.cluster.uses_gpus:
        if cfg.model.builder:  # no plan for the user's own model: keep the least
            return CheckpointSpec(Policy.sac, budget=0.0, recompute_all_to_all=spec.recompute_all_to_all)
        return build_plan(cfg).configured.spec
    return spec
