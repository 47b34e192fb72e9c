"""Per-GPU memory of a job, term by term, against the GPU; the ZeRO stage and checkpointing
policy it trains with; the longest sequence that fits.

Activations come from `trace_decoder_layer` (the partitioned joint graph of one decoder layer
at the configured width and local sequence, under FakeTensorMode); everything else is
arithmetic on the config, with P parameters, b bytes per element of the training dtype (2 in
bf16, 4 in fp32) and `world` ranks:
- ZeRO-1 (DeepSpeed): parameters and gradients b*P each, the whole model on every GPU; the
  optimizer shard is fp32 master weights, Adam's two moments and the fp32 gradient partition,
  16*P/world (sharded over every rank, SP ones included);
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
- communication: the all-to-all send/receive/concatenate buffers of the largest all-to-all,
  and under ZeRO-1 DeepSpeed's reduce and all-gather buckets (5e8 elements each);
- recompute working buffers: what one layer's backward recomputes, plus a gradient in and
  out of its largest tensor;
- a fragmentation and runtime margin: 10% of the above plus 1 GiB (CUDA context, NCCL).
Per-token terms (activations, logits, communication buffers, working buffers) are linear in
the local sequence length, so the longest sequence that fits is solved from one trace.

The plan also decides what the config leaves open: `parallel.zero_stage` null is ZeRO-1 when
the job fits under it, else ZeRO-3; `compile.activation_checkpointing=auto` is the first of
`AUTO_CANDIDATES` (least recomputation first) that fits; a `sac` budget left null is the
largest that fits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from slurm_autosp.checkpoint.estimate import signal_delay_warning
from slurm_autosp.compile.checkpointing import CheckpointSpec, Policy
from slurm_autosp.config import ActivationCheckpointing, JobConfig, Precision
from slurm_autosp.heads import valid_sp_sizes
from slurm_autosp.plan.trace import LayerTrace, hf_config, hf_layer_classes, trace_decoder_layer

GB = 1e9
ZERO_BUCKET_ELEMENTS = 5e8  # DeepSpeed's default reduce_bucket_size and allgather_bucket_size
ZERO1_OPTIMIZER_BYTES = 16  # fp32 master + Adam m + Adam v + fp32 gradient partition
FSDP2_STATE_BYTES = {"parameters": 4, "gradients": 4, "optimizer_shard": 8}  # fp32 shard, fp32 grad, Adam m + v
REDUCE_BYTES = 4  # FSDP2 reduce_dtype: fp32
MARGIN_FRACTION = 0.10
RUNTIME_RESERVE = 2**30
SAC_BUDGETS = (1.0, 0.75, 0.5, 0.25, 0.0)
ENGINES = {1: "DeepSpeed", 3: "FSDP2"}


def _sac_candidates(recompute_all_to_all: bool) -> tuple[CheckpointSpec, ...]:
    return tuple(CheckpointSpec(Policy.sac, budget=x, recompute_all_to_all=recompute_all_to_all) for x in SAC_BUDGETS)


# What `auto` chooses from, least recomputation first.
AUTO_CANDIDATES = (
    *_sac_candidates(False),
    CheckpointSpec(Policy.sac, budget=0.0, recompute_all_to_all=True),
    CheckpointSpec(Policy.full),
    CheckpointSpec(Policy.full, recompute_all_to_all=True),
)


@dataclass(frozen=True)
class ModelSize:
    """Parameter counts by FSDP2 group: one decoder layer, and the root (embedding, final norm, lm_head)."""

    layer: int
    layers: int
    root: int
    head: int  # the lm_head weight (the embedding's when tied)

    @property
    def total(self) -> int:
        return self.layer * self.layers + self.root


def model_size(cfg: JobConfig) -> ModelSize:
    """Parameter counts of the configured model, from one fake decoder layer (nothing allocated)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    layer_class, _ = hf_layer_classes(cfg.model)
    config = hf_config(cfg.model)
    with FakeTensorMode():
        layer = sum(p.numel() for p in layer_class(config, 0).parameters())
    embedding = config.vocab_size * config.hidden_size
    head = 0 if getattr(config, "tie_word_embeddings", False) else embedding
    return ModelSize(int(layer), config.num_hidden_layers, embedding + head + config.hidden_size, embedding)


@dataclass
class PolicyMemory:
    """The breakdown for one checkpointing policy under one ZeRO stage."""

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
    zero_stage: int  # the stage training runs: configured, or chosen by the plan
    configured: PolicyMemory  # the policy training compiles with, under `zero_stage`
    memories: dict[int, dict[CheckpointSpec, PolicyMemory]]  # per ZeRO stage (1, 3), every traced policy
    stage_note: str = ""  # why the plan chose the stage; empty when configured
    policy_note: str = ""  # how the plan chose the policy; empty when configured

    @property
    def fits(self) -> bool:
        return self.configured.total <= self.gpu_bytes

    @property
    def policies(self) -> list[PolicyMemory]:
        return list(self.memories[self.zero_stage].values())

    def longest_seq(self, policy: PolicyMemory) -> int:
        """Longest sequence (tokens, over the SP group) per micro-batch row, in steps of 1024."""
        local = policy.longest_local_seq(self.gpu_bytes) // self.cfg.train.micro_batch
        return (local * self.cfg.parallel.sp_size) // 1024 * 1024


def _bytes_per_element(cfg: JobConfig) -> int:
    return 2 if cfg.precision is Precision.bf16 else 4


def _state_terms(cfg: JobConfig, size: ModelSize, zero_stage: int) -> dict[str, float]:
    """Parameters, gradients and optimizer state per GPU (see the module docstring)."""
    b, world, params = _bytes_per_element(cfg), cfg.cluster.world_size, size.total
    if zero_stage == 3:
        return {name: nbytes * params / world for name, nbytes in FSDP2_STATE_BYTES.items()}
    return {"parameters": b * params, "gradients": b * params, "optimizer_shard": ZERO1_OPTIMIZER_BYTES * params / world}


def _gathered_weights(cfg: JobConfig, size: ModelSize) -> float:
    """FSDP2's unsharded buffers at the peak: the root group and two layers gathered, the
    lm_head's gradient, one layer's gradient and its fp32 copy for the reduce-scatter."""
    b = _bytes_per_element(cfg)
    return b * (size.root + 2 * size.layer + size.head) + (b + REDUCE_BYTES) * size.layer


def _policy_memory(cfg: JobConfig, trace: LayerTrace, size: ModelSize, zero_stage: int) -> PolicyMemory:
    b = _bytes_per_element(cfg)
    hf = hf_config(cfg.model)
    tokens = trace.tokens
    hidden, vocab = hf.hidden_size, hf.vocab_size
    chunk = min(tokens, cfg.compile.loss_chunk_tokens or tokens)
    per_token = {
        "activations": (size.layers * trace.activation_bytes + trace.shared_bytes) / tokens,
        # final norm: its fp32 input and rsqrt; the lm_head input; the labels
        "logits_and_loss_saved": hidden * 4 + 4 + hidden * b + 8,
        "communication_all_to_all": 3 * trace.largest_all_to_all_bytes / tokens,
        "recompute_working": trace.working_bytes / tokens,
    }
    logits_chunk = chunk * vocab * (b + 4 + 4)  # logits in the model dtype, fp32, fp32 gradient
    buckets = 2 * ZERO_BUCKET_ELEMENTS * b if zero_stage == 1 else 0.0
    terms = {
        **_state_terms(cfg, size, zero_stage),
        **({"gathered_weights": _gathered_weights(cfg, size)} if zero_stage == 3 else {}),
        "activations": per_token["activations"] * tokens,
        "logits_and_loss": per_token["logits_and_loss_saved"] * tokens + logits_chunk,
        "communication": per_token["communication_all_to_all"] * tokens + buckets,
        "recompute_working": per_token["recompute_working"] * tokens,
    }
    growing = sum(per_token.values()) + (vocab * (b + 8) if not cfg.compile.loss_chunk_tokens else 0)
    fixed = sum(terms.values()) - growing * tokens
    return PolicyMemory(_label(trace.spec), trace.spec, terms, growing, fixed, trace)


def _policy_from_plan(cfg: JobConfig) -> bool:
    """Whether the plan chooses the checkpointing: `auto`, or `sac` with its budget left null."""
    c = cfg.compile
    return c.activation_checkpointing is ActivationCheckpointing.auto or (
        c.activation_checkpointing is ActivationCheckpointing.sac and c.activation_memory_budget is None
    )


def _candidates(cfg: JobConfig) -> tuple[CheckpointSpec, ...]:
    """The specs training may compile with, in order of preference (least recomputation
    first): auto's candidates, a null sac budget's, or the one configured."""
    c = cfg.compile
    if c.activation_checkpointing is ActivationCheckpointing.auto:
        return AUTO_CANDIDATES
    if _policy_from_plan(cfg):
        return _sac_candidates(c.recompute_all_to_all)
    policy = Policy(c.activation_checkpointing.value)
    budget = c.activation_memory_budget if policy is Policy.sac else 0.0
    return (CheckpointSpec(policy, budget=budget, recompute_all_to_all=c.recompute_all_to_all),)


def _traced_specs(cfg: JobConfig) -> list[CheckpointSpec]:
    """Every policy of the plan's table, the candidates included, once each."""
    a2a = cfg.compile.recompute_all_to_all
    table = [
        CheckpointSpec(Policy.none, recompute_all_to_all=a2a),
        CheckpointSpec(Policy.torch_default),
        *_sac_candidates(a2a),
        *AUTO_CANDIDATES,
        CheckpointSpec(Policy.full, recompute_all_to_all=a2a),
    ]
    return list(dict.fromkeys([*table, *_candidates(cfg)]))


def _label(spec: CheckpointSpec) -> str:
    a2a = "all-to-all recomputed" if spec.recompute_all_to_all and spec.policy is not Policy.torch_default else ""
    if spec.policy is Policy.sac:
        return f"sac (budget {spec.budget:g}{', ' + a2a if a2a else ''})"
    return f"{spec.policy.value} ({a2a})" if a2a else spec.policy.value


def _choose_policy(
    cfg: JobConfig, memories: dict[CheckpointSpec, PolicyMemory], gpu_bytes: float
) -> tuple[CheckpointSpec, str]:
    """The first candidate that fits (the last, the least memory, when none does), and how it was chosen."""
    candidates = _candidates(cfg)
    if not _policy_from_plan(cfg):
        return candidates[0], ""
    fitting = [s for s in candidates if memories[s].total <= gpu_bytes]
    if cfg.compile.activation_checkpointing is ActivationCheckpointing.auto:
        how, best = "chosen by auto", "the least recomputation"
    else:
        how, best = "budget chosen by the plan", "the largest"
    if fitting:
        return fitting[0], f"{how}: {best} that fits"
    return candidates[-1], f"{how}: nothing fits, the least memory"


def _whole_model_graph(cfg: JobConfig) -> bool:
    """A whole-model compile rules ZeRO-3 out: FSDP2 is wired for one graph per decoder layer."""
    return cfg.compile.enabled and not cfg.compile.per_layer


def _choose_stage(cfg: JobConfig, fits_under_zero1: bool) -> tuple[int, str]:
    """The configured stage; else ZeRO-1 when the job fits under it, else ZeRO-3."""
    if cfg.parallel.zero_stage is not None:
        return cfg.parallel.zero_stage, ""
    if fits_under_zero1:
        return 1, "chosen: fits without parameter sharding"
    if _whole_model_graph(cfg):
        return 1, "chosen: ZeRO-3 needs compile.per_layer=true"
    return 3, "chosen: does not fit under ZeRO-1"


def build_plan(cfg: JobConfig) -> MemoryPlan:
    """Trace one decoder layer under every policy, lay out the per-GPU memory under ZeRO-1 and
    ZeRO-3, and choose the stage and policy the config leaves open."""
    sp = cfg.parallel.sp_size
    local_seq = -(-cfg.data.seq_len // sp)
    dtype = torch.bfloat16 if cfg.precision is Precision.bf16 else torch.float32
    traces = trace_decoder_layer(
        cfg.model, local_seq=local_seq, sp_size=sp, specs=_traced_specs(cfg), micro_batch=cfg.train.micro_batch,
        dtype=dtype,
    )
    size = model_size(cfg)
    gpu_bytes = cfg.cluster.gpu_memory_gb * GB
    memories = {stage: {t.spec: _policy_memory(cfg, t, size, stage) for t in traces} for stage in (1, 3)}
    zero1_spec, _ = _choose_policy(cfg, memories[1], gpu_bytes)
    stage, stage_note = _choose_stage(cfg, memories[1][zero1_spec].total <= gpu_bytes)
    spec, policy_note = _choose_policy(cfg, memories[stage], gpu_bytes)
    return MemoryPlan(cfg, size.total, gpu_bytes, stage, memories[stage][spec], memories, stage_note, policy_note)


def _gb(value: float) -> str:
    return f"{value / GB:8.2f} GB"


def biggest_term(memory: PolicyMemory) -> tuple[str, float]:
    return max(memory.terms.items(), key=lambda item: item[1])


def _stage_setting(cfg: JobConfig, stage: int) -> str:
    """What to set for `stage`: the key when the config fixes another stage, and per_layer for ZeRO-3."""
    keys = [f"parallel.zero_stage={stage}"] if cfg.parallel.zero_stage not in (None, stage) else []
    if stage == 3 and _whole_model_graph(cfg):
        keys.append("compile.per_layer=true")
    return " and ".join(keys)


def _alternatives(plan: MemoryPlan) -> list[str]:
    """What would fit instead: another policy, the other ZeRO stage, more GPUs in SP."""
    cfg = plan.cfg
    options = []
    fitting = [p.label for p in plan.policies if p.total <= plan.gpu_bytes]
    if fitting:
        options.append("another checkpointing policy: " + ", ".join(fitting))
    other = 3 if plan.zero_stage == 1 else 1
    fitting = [p.label for p in plan.memories[other].values() if p.total <= plan.gpu_bytes]
    if fitting:
        what = "parameter sharding (parallel.zero_stage=3" if other == 3 else "ZeRO-1 (parallel.zero_stage=1"
        per_layer = ", compile.per_layer=true" if other == 3 and _whole_model_graph(cfg) else ""
        options.append(f"{what}{per_layer}) with: " + ", ".join(fitting))
    hf = hf_config(cfg.model)
    heads, kv = hf.num_attention_heads, getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
    domain = cfg.cluster.nvlink_domain_size or cfg.cluster.ranks_per_node
    for sp in valid_sp_sizes(heads, kv):
        if sp <= cfg.parallel.sp_size or sp > cfg.cluster.world_size:
            continue
        scale = cfg.parallel.sp_size / sp
        fitting = []
        for stage, memories in plan.memories.items():
            for memory in memories.values():
                tokens = memory.trace.tokens * scale
                total = (memory.fixed + memory.per_token * tokens) * (1 + MARGIN_FRACTION) + RUNTIME_RESERVE
                if total <= plan.gpu_bytes:  # prefer no parameter sharding, then the least recomputation
                    fitting.append(((stage, memory.trace.recompute_flops), memory, stage))
        if fitting:
            _, memory, stage = min(fitting, key=lambda item: item[0])
            where = "" if sp <= domain else f" (beyond the NVLink domain of {domain})"
            setting = _stage_setting(cfg, stage)
            options.append(f"parallel.sp_size={sp}{where} with {memory.label}" + (f" and {setting}" if setting else ""))
            break
    return options


def _engine(plan: MemoryPlan) -> str:
    """e.g. "ZeRO-3 (FSDP2; chosen: does not fit under ZeRO-1)"."""
    note = f"; {plan.stage_note}" if plan.stage_note else ""
    return f"ZeRO-{plan.zero_stage} ({ENGINES[plan.zero_stage]}{note})"


def render(plan: MemoryPlan) -> str:
    cfg, memory = plan.cfg, plan.configured
    c = cfg.cluster
    hf = hf_config(cfg.model)
    policy_note = f", {plan.policy_note}" if plan.policy_note else ""
    lines = [
        f"memory plan: {hf.model_type} {plan.parameters / 1e9:.2f}B parameters, {hf.num_hidden_layers} layers, "
        f"seq {cfg.data.seq_len} x micro_batch {cfg.train.micro_batch}, SP={cfg.parallel.sp_size} "
        f"({memory.trace.local_seq} tokens per rank), world {c.world_size}, {cfg.precision.value}",
        f"  {_engine(plan)}; checkpointing {memory.label}{policy_note}",
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
    lines.append(f"longest sequence that fits (this cluster shape, per policy; GB per GPU under ZeRO-{plan.zero_stage} "
                 f"at seq {cfg.data.seq_len}):")
    for spec, p in plan.memories[plan.zero_stage].items():
        chosen = "   <- chosen" if spec == memory.spec else ""
        lines.append(
            f"  {p.label:<38} ZeRO-1: {plan.longest_seq(plan.memories[1][spec]):>9,}   "
            f"ZeRO-3: {plan.longest_seq(plan.memories[3][spec]):>9,}   needs {p.total / GB:6.1f} GB{chosen}"
        )
    text, _, _ = verdict(plan)
    lines.append(text)
    return "\n".join(lines)


def verdict(plan: MemoryPlan) -> tuple[str, bool, str]:
    memory = plan.configured
    if plan.fits:
        sac = plan.cfg.compile.activation_checkpointing is ActivationCheckpointing.sac
        budget = f" (compile.activation_memory_budget={memory.spec.budget:g})" if sac else ""
        return (f"verdict: fits: {memory.total / GB:.1f} of {plan.gpu_bytes / GB:g} GB per GPU under "
                f"ZeRO-{plan.zero_stage} with {memory.label}{budget}", True, "")
    name, value = biggest_term(memory)
    reason = (f"needs {memory.total / GB:.1f} GB per GPU under ZeRO-{plan.zero_stage}, the GPU has "
              f"{plan.gpu_bytes / GB:g} GB; the biggest term is {name} ({value / GB:.1f} GB)")
    if plan.zero_stage == 1 and name in ("parameters", "gradients"):
        reason += (": under ZeRO-1 every GPU holds the full weights and gradients "
                   f"({(memory.terms['parameters'] + memory.terms['gradients']) / GB:.0f} GB)")
    options = _alternatives(plan)
    fix = ("would fit: " + "; ".join(options)) if options else (
        "nothing tried here fits (more GPUs in SP, other checkpointing policies, parameter sharding)")
    return f"verdict: does not fit: {reason}\n  {fix}", False, f"{reason}. {fix}"


class PlanVerdict(NamedTuple):
    text: str  # the plan as printed
    fits: bool
    reason: str  # why not; empty when it fits
    zero_stage: int  # the stage the job will train with


def plan_verdict(cfg: JobConfig) -> PlanVerdict:
    """What submit prints and decides on. CPU jobs have no GPU memory to plan against: they
    always fit."""
    if not cfg.cluster.uses_gpus:
        return PlanVerdict("memory plan: CPU ranks, no GPU memory to plan against", True, "", zero_stage_for(cfg))
    if cfg.model.builder:
        return PlanVerdict("memory plan: not available for model.builder models (the plan traces a Hugging Face "
                           "decoder layer); nothing checked", True, "", zero_stage_for(cfg))
    plan = build_plan(cfg)
    text = render(plan)
    _, fits, reason = verdict(plan)
    warning = signal_delay_warning(cfg, plan.parameters, plan.zero_stage)
    if warning:
        text += f"\nwarning: {warning}"
    return PlanVerdict(text, fits, reason, plan.zero_stage)


def _has_plan(cfg: JobConfig) -> bool:
    """Only GPU jobs with a Hugging Face model are planned (the plan traces an HF decoder layer)."""
    return cfg.cluster.uses_gpus and not cfg.model.builder


def zero_stage_for(cfg: JobConfig) -> int:
    """The ZeRO stage training runs: the configured one; without a plan (CPU ranks, builder
    models) ZeRO-1; else the plan's (ZeRO-1 when the job fits under it, else ZeRO-3)."""
    if cfg.parallel.zero_stage is not None:
        return cfg.parallel.zero_stage
    return build_plan(cfg).zero_stage if _has_plan(cfg) else 1


def checkpoint_spec_for(cfg: JobConfig) -> CheckpointSpec:
    """The checkpointing policy training compiles with: the configured one, or, for `auto` and
    a null `sac` budget, the plan's choice. Without a plan: CPU ranks have no GPU to fit, so
    they keep everything (sac budget 1); builder models keep the least (sac budget 0)."""
    if not _policy_from_plan(cfg):
        return _candidates(cfg)[0]
    if _has_plan(cfg):
        return build_plan(cfg).configured.spec
    budget = 1.0 if not cfg.cluster.uses_gpus else 0.0
    return CheckpointSpec(Policy.sac, budget=budget, recompute_all_to_all=cfg.compile.recompute_all_to_all)
