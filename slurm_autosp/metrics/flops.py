"""Model FLOPs of a training step, and the peak FLOP/s that MFU is measured against.

Per sequence of S tokens, forward + backward (backward = 2x forward):

    6 * N * S                 matmuls with the weights a token runs through: N = all parameters
                              except the input embedding (a lookup, not a matmul; counted when
                              it is tied to the output head, which is a matmul) and, in an MoE,
                              the routed experts a token is not sent to (it runs top_k of E;
                              shared experts and the router run for every token)
  + 6 * L * d_attn * S^2      attention scores QK^T and their use AV: 2 * S^2 * d_attn FLOPs
                              each per layer forward, x3 for forward + backward = 12 * L *
                              d_attn * S^2, halved because attention is causal and the
                              kernels skip the masked half

with L layers and d_attn = attention heads x head dim. Counts that do not halve the causal
term (Megatron's, torchtitan's) are up to 12 * L * d_attn * S^2 / (6 * N * S) higher at long
context; MFU here is the work actually needed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slurm_autosp.config import JobConfig, Precision, Vendor

# Dense bf16 tensor-core peaks in TFLOP/s, matched against torch.cuda.get_device_name() in
# this order (the first substring found wins).
PEAK_BF16_TFLOPS = (
    ("GB200", 2500.0),
    ("B200", 2250.0),
    ("GH200", 989.0),
    ("H200", 989.0),
    ("H100 PCIE", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),
    ("H800", 989.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("MI355X", 2500.0),
    ("MI325X", 1307.0),
    ("MI300X", 1307.0),
    ("MI250X", 383.0),
)
# The GPU a job is taken to run on before any of its ranks has seen one (admission runs on a
# login node) unless trace.peak_tflops_per_gpu says otherwise, with its plain fp32 peak (no TF32:
# torch's default): the GPUs the shipped configs describe.
ASSUMED_GPU = {Vendor.nvidia: ("H100", 67.0), Vendor.amd: ("MI300X", 163.4)}


@dataclass(frozen=True)
class FlopCount:
    dense_params: int  # the parameters each token's matmuls use (an MoE's active ones)
    layers: int | None  # None: not an HF-style model; the attention term is left out
    attn_width: int | None
    seq_len: int
    sequences_per_step: int
    idle_expert_params: int = 0  # an MoE's routed expert weights a token does not run

    @property
    def per_sequence(self) -> float:
        dense = 6.0 * self.dense_params * self.seq_len
        if self.layers is None or self.attn_width is None:
            return dense
        return dense + 6.0 * self.layers * self.attn_width * self.seq_len**2

    @property
    def per_step(self) -> float:
        return self.per_sequence * self.sequences_per_step

    @property
    def attention_share(self) -> float:
        dense = 6.0 * self.dense_params * self.seq_len
        return 1.0 - dense / self.per_sequence if self.per_sequence else 0.0

    def describe(self) -> str:
        attention = (
            f"6 * L({self.layers}) * d_attn({self.attn_width}) * S^2"
            if self.layers is not None
            else "attention term left out (no num_hidden_layers / num_attention_heads in the model config)"
        )
        idle = (
            f", routed experts a token skips ({self.idle_expert_params:,}) left out"
            if self.idle_expert_params
            else ""
        )
        return (
            f"FLOPs per sequence = 6 * N({self.dense_params:,}{idle}) * S({self.seq_len}) + {attention} "
            f"= {self.per_sequence:.4g} ({self.attention_share:.0%} attention, causal: half of S^2); "
            f"x {self.sequences_per_step} sequences per step = {self.per_step:.4g}"
        )


def count_flops(model: torch.nn.Module, seq_len: int, sequences_per_step: int) -> FlopCount:
    params = sum(p.numel() for p in model.parameters())
    embedding = _input_embedding(model)
    if embedding is not None and not _tied_to_output(model, embedding):
        params -= embedding.numel()
    config = getattr(model, "config", None)
    idle = _idle_expert_params(model, getattr(config, "num_experts_per_tok", None))
    layers = getattr(config, "num_hidden_layers", None)
    heads = getattr(config, "num_attention_heads", None)
    head_dim = getattr(config, "head_dim", None)
    hidden = getattr(config, "hidden_size", None)
    if head_dim is None and heads and hidden:
        head_dim = hidden // heads
    attn_width = heads * head_dim if heads and head_dim else None
    return FlopCount(
        params - idle, layers if attn_width else None, attn_width, seq_len, sequences_per_step, idle
    )


def _idle_expert_params(model: torch.nn.Module, config_top_k: int | None) -> int:
    """The routed expert weights a token does not run: of each MoE block's E experts (its
    `experts` child, HF's fused [E, ...] weights or a list of experts) a token runs top_k (the
    block's or its router's `top_k`, else the config's num_experts_per_tok)."""
    idle = 0
    for block in model.modules():
        experts = dict(block.named_children()).get("experts")
        if experts is None:
            continue
        count = getattr(experts, "num_experts", None) or (
            len(experts) if isinstance(experts, torch.nn.ModuleList) else None
        )
        top_k = _top_k(block) or config_top_k
        if count and top_k and top_k < count:
            weights = sum(p.numel() for p in experts.parameters())
            idle += weights * (count - top_k) // count
    return idle


def _top_k(block: torch.nn.Module) -> int | None:
    """The experts a token runs, as the MoE block or its router keeps it."""
    for module in (block, *block.children()):
        top_k = getattr(module, "top_k", None)
        if isinstance(top_k, int):
            return top_k
    return None


def _input_embedding(model: torch.nn.Module) -> torch.Tensor | None:
    get = getattr(model, "get_input_embeddings", None)
    module = get() if callable(get) else None
    return getattr(module, "weight", None)


def _tied_to_output(model: torch.nn.Module, embedding: torch.Tensor) -> bool:
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    return getattr(head, "weight", None) is embedding


def peak_tflops(
    configured: float | None, device: torch.device, bf16: bool
) -> tuple[float | None, str]:
    """The per-device peak MFU is measured against, and where it came from. None on CPU and on
    GPUs not in the table (set trace.peak_tflops_per_gpu), and for fp32 training (the table
    holds bf16 peaks)."""
    if configured:
        return configured, "trace.peak_tflops_per_gpu"
    if device.type != "cuda":
        return None, "CPU: no peak FLOP/s, so no MFU (TFLOP/s is still reported)"
    name = torch.cuda.get_device_name(device)
    if not bf16:
        return (
            None,
            f"{name} in fp32: the table holds bf16 peaks; set trace.peak_tflops_per_gpu for MFU",
        )
    for key, tflops in PEAK_BF16_TFLOPS:
        if key in name.upper():
            return tflops, f"dense bf16 peak of {name}"
    return None, f"{name} is not in the peak table; set trace.peak_tflops_per_gpu for MFU"


def assumed_peak_tflops(cfg: JobConfig) -> tuple[float, str]:
    """The per-GPU peak of a job's GPUs before it runs, and where it came from:
    trace.peak_tflops_per_gpu, else the vendor's assumed GPU (ASSUMED_GPU) in the job's
    precision."""
    if cfg.trace.peak_tflops_per_gpu:
        return cfg.trace.peak_tflops_per_gpu, "trace.peak_tflops_per_gpu"
    name, fp32 = ASSUMED_GPU[cfg.cluster.vendor]
    if cfg.precision is Precision.bf16:
        bf16 = next(tflops for key, tflops in PEAK_BF16_TFLOPS if key == name)
        return bf16, f"{name} dense bf16, assumed: set trace.peak_tflops_per_gpu for another GPU"
    return fp32, f"{name} fp32 without TF32, assumed: set trace.peak_tflops_per_gpu for another GPU"
