"""What AutoSP, the chunked loss or the router loss would compute differently from the model
itself, refused at admission before any rank starts (never approximated silently): attention
fields and kernels, heads a Ulysses size cannot split, layers the compiler cannot find, and
auxiliary losses."""

from __future__ import annotations

import sys
from typing import Any

from slurm_autosp.compile.traced_attention import TracedAttention, trace_attention
from slurm_autosp.config import (
    CompileConfig,
    ConfigError,
    DataConfig,
    DocumentBoundaries,
    JobConfig,
    ModelConfig,
    ParallelConfig,
    Precision,
    Vendor,
)
from slurm_autosp.heads import (
    grouped_on_each_rank,
    pairs_text,
    ulysses_ring_pairs,
    valid_sp_sizes,
)
from slurm_autosp.model import build_skeleton, hf_config, hf_model_class
from slurm_autosp.sp.attention_pattern import unsupported_attention, windowed_attention
from slurm_autosp.sp.chunked_loss import unsupported_logits
from slurm_autosp.sp.inputs import padded_length
from slurm_autosp.sp.router_loss import (
    family_difference,
    load_balancing_of,
    missing_balancing_attributes,
)


def refuse_unsupported_attention(cfg: JobConfig, seq_len: int | None = None) -> None:
    """Refuse, before any rank starts, a model whose attention, logits or auxiliary loss the
    compiled SP graph, the chunked loss or the router loss would compute differently from the
    model itself (never silently).

    `seq_len` defaults to data.seq_len; it is padded as training pads it (`padded_length`).
    """
    if cfg.model.builder:
        return  # the user's own module: refused where it runs (compile.hf_attention)
    config = hf_config(cfg.model)
    sp = cfg.parallel.sp_size
    seq = seq_len or cfg.data.seq_len
    ring = cfg.parallel.ulysses_ring[1]
    padded = padded_length(seq, sp, ring, cfg.data.documents is DocumentBoundaries.masked)
    source = (
        f"model.pretrained_path={cfg.model.pretrained_path}"
        if cfg.model.pretrained_path
        else f"model.model_type={cfg.model.model_type}"
    )
    traced = trace_attention(config) if cfg.compile.enabled else TracedAttention()
    problems = _field_problems(cfg, config, padded) + traced.sinks
    if not problems:  # what the fields do not show, the traced call does
        if traced.failure:
            raise ConfigError(f"{source}: {_own_failure(config, traced)}")
        if cfg.compile.enabled:
            _refuse_unsplit_heads(cfg.parallel, config, traced)
            problems = traced.unsupported + _no_attention_call(config, traced)
            problems += _no_decoder_layers(cfg.compile, config)
    if problems:
        raise ConfigError(
            f"{source} (sequence parallel over parallel.sp_size={sp}, data.seq_len={seq}) is not supported exactly:\n  - "
            + "\n  - ".join(problems)
            + "\n  Until these are supported, train this model without AutoSP (compile.enabled=false, "
            "parallel.sp_size=1). The fields named are HF config fields (model.extra.*, or the checkpoint's config.json)."
        )
    refuse_inexact_router_loss(cfg.model, config)


def _field_problems(cfg: JobConfig, config: Any, seq_len: int) -> list[str]:
    """What the HF config's fields ask for that AutoSP (or the chunked loss) would compute
    differently, each naming its field."""
    problems = unsupported_attention(config, seq_len) if cfg.compile.enabled else []
    if cfg.compile.enabled and cfg.cluster.gpus_per_node > 0:
        problems += _untested_varlen_attention(cfg, config, seq_len)
        problems += _math_kernel_attention(cfg, config, seq_len)
    model_class = hf_model_class(config)
    if cfg.compile.enabled and cfg.model.attn_implementation != "sdpa":
        problems.insert(
            0,
            f"model.attn_implementation={cfg.model.attn_implementation}: AutoSP rewrites the "
            "scaled_dot_product_attention calls transformers makes only under sdpa, so every "
            "rank would fail at its first step; set model.attn_implementation=sdpa",
        )
    if cfg.model.attn_implementation == "sdpa" and not getattr(model_class, "_supports_sdpa", True):
        problems.insert(
            0,
            f'transformers cannot run {model_class.__name__} with attn_implementation="sdpa", which '
            "AutoSP needs (it rewrites scaled_dot_product_attention); without AutoSP set "
            "model.attn_implementation=eager",
        )
    if cfg.compile.loss_chunk_tokens > 0:
        problems += [
            f"{p}; set compile.loss_chunk_tokens=0 (the model's own loss)"
            for p in unsupported_logits(config)
        ]
    return problems


Z_LOSS_FIELDS = ("router_z_loss_coef", "z_loss_coefficient")


def refuse_inexact_router_loss(model: ModelConfig, config: Any) -> None:
    """An MoE's router load-balancing loss (`output_router_logits`) is computed by
    `sp.router_loss` under every layout, one device included, so its family's own
    `load_balancing_loss_func` must be that function: checked on random router logits (with and
    without padding), so a new family is admitted or refused by what it computes, not by its
    name. A z-loss (the model's mean over only the tokens it sees) is refused too."""
    problems = [
        f"a z-loss ({field}={getattr(config, field)}) averaged over each rank's tokens only; "
        f"set model.extra.{field}=0"
        for field in Z_LOSS_FIELDS
        if getattr(config, field, 0)
    ]
    if getattr(config, "output_router_logits", False):
        problems += [
            f"the router's load-balancing loss (output_router_logits=True): {why}; set "
            "model.extra.output_router_logits=false to train without it"
            for why in _router_loss_differences(model, config)
        ]
    if problems:
        source = (
            f"model.pretrained_path={model.pretrained_path}"
            if model.pretrained_path
            else f"model.model_type={model.model_type}"
        )
        raise ConfigError(
            f"{source}: an auxiliary loss AutoSP does not compute exactly:\n  - "
            + "\n  - ".join(problems)
        )


def refuse_tiled_router_loss(model: ModelConfig, tile_tokens: int) -> None:
    """Sequence tiling (configured, or chosen by the plan) with an MoE's load-balancing loss:
    the tiles would not record the router's logits as the loss needs them (compile.tiling)."""
    if not tile_tokens or model.builder:
        return
    if getattr(hf_config(model), "output_router_logits", False):
        raise ConfigError(
            f"compile.tile_tokens={tile_tokens} (configured, or the memory plan's choice: see "
            "python -m slurm_autosp plan) with an MoE's router load-balancing loss "
            "(output_router_logits=true): sequence tiles do not record the router's logits as "
            "the loss needs them; set model.extra.output_router_logits=false, or give the job "
            "more GPUs (parallel.sp_size) so the plan fits without tiling"
        )


def _router_loss_differences(model: ModelConfig, config: Any) -> list[str]:
    """Why the family's load-balancing loss is not `sp.router_loss`'s (empty: it is)."""
    model_class = hf_model_class(config)
    family = getattr(sys.modules[model_class.__module__], "load_balancing_loss_func", None)
    if family is None:
        return [f"{model_class.__name__}'s module has no load_balancing_loss_func"]
    skeleton = build_skeleton(model)
    missing = missing_balancing_attributes(skeleton)
    if missing:
        return [f"{model_class.__name__} keeps no {', '.join(missing)}"]
    balancing = load_balancing_of(skeleton)
    assert balancing is not None  # output_router_logits is on
    differs = family_difference(family, balancing.num_experts, balancing.top_k)
    return [] if differs is None else [f"{model_class.__name__}: {differs}"]


def _own_failure(config: Any, traced: TracedAttention) -> str:
    """Why the model fails without AutoSP at these fields; where its attention receives other
    key/value heads than `num_key_value_heads` (an MLA model expands its own), that field."""
    named = getattr(config, "num_key_value_heads", None)
    hint = ""
    if traced.layer and named and named != traced.kv_heads:
        hint = (
            f"; its attention ({traced.layer}) receives {traced.query_heads} query and "
            f"{traced.kv_heads} key/value heads, but num_key_value_heads={named} makes transformers "
            f"repeat each key/value head {traced.query_heads // named} times: set "
            f"model.num_key_value_heads={traced.kv_heads}"
        )
    return (
        f"the model fails on its own at these fields, before AutoSP changes anything "
        f"({traced.failure}){hint}. Fix its fields (model.*, model.extra.*, or the checkpoint's "
        "config.json)"
    )


def _no_attention_call(config: Any, traced: TracedAttention) -> list[str]:
    """A model whose forward reached no attention function of transformers' calls attention its
    own way, which AutoSP does not make sequence parallel."""
    if traced.layer or traced.stopped:
        return []
    return [
        f"{hf_model_class(config).__name__} calls no attention function of transformers' "
        "(model.attn_implementation) in its forward; AutoSP makes attention sequence parallel there"
    ]


def _no_decoder_layers(compile: CompileConfig, config: Any) -> list[str]:
    """Per-layer compilation compiles the modules a model's `_no_split_modules` names."""
    model_class = hf_model_class(config)
    if not compile.per_layer or getattr(model_class, "_no_split_modules", None):
        return []
    return [
        f"compile.per_layer=true: {model_class.__name__} names no decoder layer class "
        "(_no_split_modules) to compile one at a time; set compile.per_layer=false"
    ]


def _refuse_unsplit_heads(parallel: ParallelConfig, config: Any, traced: TracedAttention) -> None:
    """The Ulysses size against the heads the model's attention receives (traced), else its
    config's: config validation sees only the heads a config names, not a checkpoint's
    (model.pretrained_path), not those an MLA model expands, nor the split a null ring size
    resolves to."""
    _, ring = parallel.ulysses_ring
    sp, heads = parallel.sp_size, config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if traced.layer:
        heads, kv_heads = traced.query_heads, traced.kv_heads
    if sp // ring not in valid_sp_sizes(heads, kv_heads):
        raise ConfigError(
            f"parallel.sp_size={sp} / parallel.ring_size={ring}: the Ulysses size {sp // ring} "
            f"cannot split the model's {heads} query / {kv_heads} key-value heads over its ranks; "
            f"(Ulysses x ring) splits of parallel.sp_size={sp} that work: "
            f"{pairs_text(ulysses_ring_pairs(sp, heads, kv_heads))}"
        )


def _document_kernel_patterns(data: DataConfig, config: Any, seq_len: int) -> list[str]:
    """The attention patterns `document_attention` computes (windows, packed documents)."""
    return windowed_attention(config, seq_len) + (
        ["per-document attention (data.documents=masked)"]
        if data.documents is DocumentBoundaries.masked
        else []
    )


def _untested_varlen_attention(cfg: JobConfig, config: Any, seq_len: int) -> list[str]:
    """On GPU ranks `document_attention` (windows, packed documents) runs torch's flash varlen
    kernel: in bf16 on NVIDIA GPUs. fp32 (flash computes bf16/fp16 only) and ROCm (untested)
    are refused, naming the key to change."""
    needed = _document_kernel_patterns(cfg.data, config, seq_len)
    if cfg.cluster.vendor is Vendor.amd:
        why = (
            "on AMD GPUs (cluster.vendor=amd): the flash varlen kernel it runs there has not "
            "been tested on ROCm"
        )
    elif cfg.precision is Precision.fp32:
        why = (
            "in fp32 on GPUs (train.precision=fp32): the flash varlen kernel computes in bf16 "
            "or fp16 only; set train.precision=bf16"
        )
    else:
        return []
    return [f"{p} over {seq_len} tokens {why}" for p in needed]


def _math_kernel_attention(cfg: JobConfig, config: Any, seq_len: int) -> list[str]:
    """On GPU ranks an fp32 SDPA call whose ranks keep grouped key/value heads (enable_gqa)
    has no fused kernel (flash computes bf16/fp16; the memory-efficient one takes no grouped
    heads) and falls to the math kernel, which holds every S x S score: refused by name.
    (Windows, packed documents and the ring run kernels of their own, refused in fp32 there.)"""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    ulysses, ring = cfg.parallel.ulysses_ring
    if (
        cfg.precision is not Precision.fp32
        or ring > 1
        or _document_kernel_patterns(cfg.data, config, seq_len)
        or not grouped_on_each_rank(heads, kv_heads, ulysses)
    ):
        return []
    return [
        f"grouped key/value heads in fp32 on GPUs (train.precision=fp32): {heads} query and "
        f"{kv_heads} key/value heads over {ulysses} Ulysses ranks leave each rank grouped heads, "
        "which no fused fp32 attention kernel takes; torch would fall back to its math kernel, "
        f"which holds the {seq_len:,} x {seq_len:,} scores of each head; set "
        "train.precision=bf16"
    ]
