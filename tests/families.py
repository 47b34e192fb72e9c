"""The family battery's cases: every causal-LM family the installed transformers maps
(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, so a new release's families join by themselves), each
built tiny, and what AutoSP is expected to do with it: train it exactly at SP=2, or refuse it
by name before any rank starts. Never a traceback.

A family is left out only by a named rule (`skip_rule`); one whose tiny config needs fields
of its own gets them from `OVERRIDES`; a few families are checked again with a feature turned
on (`VARIANTS`). `EXPECTED` is the outcome of each case as data: a case whose outcome changes
(a fix lands, a refusal is lifted) flips one entry, and the families table in docs/compiler.md
(`families_table`, checked by tests/test_readme.py) follows.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch
from pool_dims import pool_dims
from transformers import AutoConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from slurm_autosp.config import JobConfig, load_config
from slurm_autosp.verify import VerifyOptions, compare_sp_step, full_fp32
from slurm_autosp.verify.options import special_ids_within

TINY = "cfg=configs/tiny_cpu.yaml"
SP_SIZE = 2


class Outcome(str, enum.Enum):
    exact = "exact"  # verify at SP=2 passes (<= 1e-5)
    refused = "refused"  # admission refuses by name (ConfigError; submit would exit 2)
    inexact = "inexact"  # verify runs and fails: a known bug, to flip to exact when fixed


@dataclass(frozen=True)
class Expected:
    outcome: Outcome
    reason: str = ""  # a REASONS key: what the refusal (or the failure) names


# what a refusal must say, and how docs/compiler.md's families table names it
REASONS: dict[str, tuple[str, str]] = {
    "mixing": (
        "mixes tokens along the sequence outside attention",
        "layers that mix tokens outside attention (linear attention, state spaces, convolutions)",
    ),
    "sdpa": ('attn_implementation="sdpa"', "no SDPA attention in transformers"),
    "sinks": ("attention sinks", "attention sinks"),
    "softcap": ("soft-capping", "attention logit soft-capping"),
    "logits": (
        "the chunked loss does not apply",
        "logits transformed after the output embedding, with the chunked loss",
    ),
    "chunked": ("chunked attention", "chunked attention shorter than the sequence"),
    "bidirectional": ("bidirectional attention", "bidirectional attention"),
    "not_causal": ("is not causal", "non-causal attention (encoders)"),
    "own_mask": ("builds itself", "an attention mask the model builds itself"),
    "own_attention": (
        "calls no attention function of transformers'",
        "attention outside transformers' attention functions",
    ),
    "no_layers": (
        "names no decoder layer class",
        "no decoder layer class (_no_split_modules) to compile per layer",
    ),
    "kv_heads": (
        "set model.num_key_value_heads=",
        "num_key_value_heads other than the key/value heads its attention receives (MLA)",
    ),
    "fails": ("fails on its own", "fails without AutoSP at the tiny config"),
    "router_loss": (
        "set model.extra.output_router_logits=false",
        "an MoE router loss other than sp.router_loss's (output_router_logits=true)",
    ),
    "fp32_rounding": (
        "",
        "fp32 rounding: one device's own fp32 gradients are over 1e-5 from fp64",
    ),
}


@dataclass(frozen=True)
class Case:
    """One battery entry: a family, the overrides its tiny config needs, and a name."""

    name: str
    model_type: str
    overrides: tuple[str, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)

    def job_config(self) -> JobConfig:
        """The tiny job (tiny_cpu.yaml: vocab 256, 2 layers, 4 heads, 2 KV heads) of this
        family, its special token ids moved into the vocabulary."""
        cfg = load_config(
            [TINY, f"model.model_type={self.model_type}", f"parallel.sp_size={SP_SIZE}"]
            + list(self.overrides)
        )
        cfg.model.extra.update(self.extra)
        assert cfg.model.vocab_size is not None
        cfg.model.extra.update(special_ids_within(cfg.model, cfg.model.vocab_size))
        return cfg


ENCODER_DECODER = "encoder-decoder"
MULTIMODAL = "multimodal, or a wrapper of a text family tested alone"
CANNOT_BUILD = "cannot build tiny"


def skip_rule(model_type: str) -> tuple[str, str] | None:
    """The named rule that leaves a family out of the battery, and why it applies; None: in."""
    if model_type in CANNOT_BUILD_TINY:
        return CANNOT_BUILD, CANNOT_BUILD_TINY[model_type]
    config = AutoConfig.for_model(model_type)
    if config.is_encoder_decoder:
        return ENCODER_DECODER, "is_encoder_decoder"
    parts = sorted(getattr(config, "sub_configs", None) or {})
    if any(k in p for p in parts for k in ("vision", "audio", "vq", "text_config")):
        return MULTIMODAL, ", ".join(parts)
    return None


CANNOT_BUILD_TINY: dict[str, str] = {
    "gemma4_assistant": "a drafting assistant: it runs on its target model's key/value states, "
    "not alone (and its default config does not validate)",
    "blt": "four models in one (patcher, local encoder and decoder, global transformer) whose "
    "sub-configs keep their full sizes (500k-row hash embeddings): tiny fields do not reach them",
}


def _with(model_type: str, *overrides: str, **extra: Any) -> Case:
    return Case(model_type, model_type, overrides, extra)


# multi-head latent attention expands its key/value heads to every query head
_ALL_KV_HEADS = "model.num_key_value_heads=4"
_MOE = {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}

# fields a family's tiny config needs beyond tiny_cpu.yaml's, to build at all
OVERRIDES: dict[str, Case] = {
    case.model_type: case
    for case in [
        _with("deepseek_v2", _ALL_KV_HEADS, **_MOE),
        *(
            _with(mla, _ALL_KV_HEADS)
            for mla in (
                "axk1",
                "axk2",
                "deepseek_v3",
                "glm4_moe_lite",
                "minicpm3",
                "sarvam_mla",
                "youtu",
                "dots3_note_text",  # not MLA, but its config insists on as many KV heads
            )
        ),
        _with("codegen", rotary_dim=8),  # no more rotary dimensions than the head's 8
        _with("gptj", rotary_dim=8),
        _with(
            "cohere_compass_text",
            rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 10000.0}},
        ),
        _with(
            "dbrx",
            attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
            ffn_config={"ffn_hidden_size": 128, "moe_num_experts": 4, "moe_top_k": 2},
        ),
        _with("dots1", n_shared_experts=1, **_MOE),
        # 512 experts by default, each a graph break of its own in the expert loop: 4
        _with(
            "longcat_flash",
            _ALL_KV_HEADS,
            n_routed_experts=4,
            zero_expert_num=2,
            moe_topk=2,
            expert_ffn_hidden_size=32,
        ),
        _with("afmoe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
        _with("jetmoe", num_local_experts=4, kv_channels=8),
        # its per-layer input embedding has a vocabulary of its own: 262144 x 256 by default
        _with("gemma4_text", vocab_size_per_layer_input=256, hidden_size_per_layer_input=16),
        _with(
            "gemma3n_text",
            num_kv_shared_layers=0,
            layer_types=["sliding_attention", "full_attention"],
            activation_sparsity_pattern=[0.0, 0.0],
        ),
        _with("hunyuan_v1_dense", "model.head_dim=16"),  # no head_dim of its own
        _with("hunyuan_v1_moe", "model.head_dim=16"),
        _with("ministral", "model.head_dim=16"),
        _with("lfm2_moe", layer_types=["conv", "full_attention"]),
        _with("zamba", layer_types=["linear_attention", "hybrid"]),
        _with("zamba2", layer_types=["linear_attention", "hybrid"], hybrid_layer_ids=[1]),
        _with("mamba2", "model.head_dim=8", num_heads=16, n_groups=1),
        _with("gpt_neo", attention_types=[[["global", "local"], 1]]),
        _with("xlnet", "model.max_position_embeddings=null", d_head=16),
    ]
}

# families checked again with a feature on (verify's sequences are 61 tokens: a window or
# chunk of 16 matters)
VARIANTS: list[Case] = [
    Case("deepseek_v3+kv2", "deepseek_v3", ("model.num_key_value_heads=2",)),  # MLA: 4 received
    Case("mixtral+aux", "mixtral", (), {"output_router_logits": True}),
    Case("qwen3_moe+aux", "qwen3_moe", (), {"output_router_logits": True}),
    Case("qwen2_moe+aux", "qwen2_moe", (), {"output_router_logits": True}),
    Case(
        "jetmoe+aux",
        "jetmoe",
        (),
        {"num_local_experts": 4, "kv_channels": 8, "output_router_logits": True},
    ),
    Case("mistral+window", "mistral", (), {"sliding_window": 16}),
    Case(
        "qwen2+window_layers",
        "qwen2",
        (),
        {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1},
    ),
    Case(
        "gemma3_text+windows",
        "gemma3_text",
        (),
        {"sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"]},
    ),
    Case(
        "cohere2+own_loss",
        "cohere2",
        ("compile.loss_chunk_tokens=0",),
        {"sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"]},
    ),
    Case("llama4_text+chunk", "llama4_text", (), {"attention_chunk_size": 16}),
]

EXACT = Expected(Outcome.exact)

# each case's outcome at SP=2 with verify's defaults (the measured table: tests/compile/
# test_families.py); a refused case's reason is the first of REASONS' order its message names
EXPECTED: dict[str, Expected] = {
    "afmoe": EXACT,
    "apertus": EXACT,
    "apertus1p5_text": EXACT,
    "arcee": EXACT,
    "aria_text": EXACT,
    "axk1": EXACT,
    "axk2": Expected(Outcome.refused, "mixing"),
    "bailing_hybrid": Expected(Outcome.refused, "mixing"),
    "bamba": Expected(Outcome.refused, "mixing"),
    "beam": Expected(Outcome.refused, "logits"),
    "bert": Expected(Outcome.refused, "not_causal"),
    "bert-generation": Expected(Outcome.refused, "not_causal"),
    "big_bird": Expected(Outcome.refused, "sdpa"),
    "biogpt": Expected(Outcome.refused, "no_layers"),
    "bitnet": EXACT,
    "bloom": Expected(Outcome.refused, "sdpa"),
    "camembert": Expected(Outcome.refused, "not_causal"),
    "codegen": EXACT,
    "cohere": Expected(Outcome.refused, "logits"),
    "cohere2": Expected(Outcome.refused, "logits"),
    "cohere2_moe": Expected(Outcome.refused, "logits"),
    "cohere_compass_text": EXACT,
    "cpmant": Expected(Outcome.refused, "sdpa"),
    "ctrl": Expected(Outcome.refused, "no_layers"),
    "cwm": EXACT,
    "data2vec-text": Expected(Outcome.refused, "not_causal"),
    "dbrx": Expected(Outcome.refused, "fails"),
    "deepseek_v2": EXACT,
    "deepseek_v3": EXACT,
    "deepseek_v32": Expected(Outcome.refused, "mixing"),
    "deepseek_v4": Expected(Outcome.refused, "mixing"),
    "diffllama": Expected(Outcome.inexact, "fp32_rounding"),
    "doge": Expected(Outcome.refused, "own_mask"),
    "dory": EXACT,
    "dots1": EXACT,
    "dots3_note_text": Expected(Outcome.refused, "mixing"),
    "electra": Expected(Outcome.refused, "not_causal"),
    "ernie": Expected(Outcome.refused, "not_causal"),
    "ernie4_5": EXACT,
    "ernie4_5_moe": EXACT,
    "exaone": EXACT,
    "exaone4": EXACT,
    "exaone_moe": EXACT,
    "falcon": Expected(Outcome.refused, "own_attention"),
    "falcon_h1": Expected(Outcome.refused, "mixing"),
    "falcon_mamba": Expected(Outcome.refused, "mixing"),
    "flex_olmo": EXACT,
    "flint": Expected(Outcome.refused, "sinks"),
    "gemma": EXACT,
    "gemma2": Expected(Outcome.refused, "softcap"),
    "gemma3_text": EXACT,
    "gemma3n_text": Expected(Outcome.refused, "logits"),
    "gemma4_text": EXACT,
    "gemma4_unified_text": Expected(Outcome.refused, "bidirectional"),
    "glm": EXACT,
    "glm4": EXACT,
    "glm4_moe": EXACT,
    "glm4_moe_lite": EXACT,
    "glm_moe_dsa": Expected(Outcome.refused, "mixing"),
    "gpt-sw3": EXACT,
    "gpt2": EXACT,
    "gpt_bigcode": EXACT,
    "gpt_neo": Expected(Outcome.refused, "sdpa"),
    "gpt_neox": EXACT,
    "gpt_neox_japanese": Expected(Outcome.refused, "sdpa"),
    "gpt_oss": Expected(Outcome.refused, "sinks"),
    "gptj": EXACT,
    "granite": EXACT,
    "granite_swa": Expected(Outcome.refused, "sinks"),
    "granitemoe": EXACT,
    "granitemoe_swa": Expected(Outcome.refused, "sinks"),
    "granitemoehybrid": Expected(Outcome.refused, "mixing"),
    "granitemoeshared": EXACT,
    "helium": EXACT,
    "hrm_text": EXACT,
    "hunyuan_v1_dense": EXACT,
    "hunyuan_v1_moe": EXACT,
    "hy_v3": EXACT,
    "hy_v4": Expected(Outcome.refused, "mixing"),
    "hyperclovax": EXACT,
    "inkling2_loop_text": Expected(Outcome.refused, "mixing"),
    "inkling2_text": Expected(Outcome.refused, "mixing"),
    "inkling_text": Expected(Outcome.refused, "mixing"),
    "internlm3": EXACT,
    "iquestcoder": EXACT,
    "jais2": EXACT,
    "jamba": Expected(Outcome.refused, "mixing"),
    "jetmoe": EXACT,
    "kimi_linear": Expected(Outcome.refused, "mixing"),
    "kolibri1": EXACT,
    "laguna": EXACT,
    "lara_mini": Expected(Outcome.refused, "mixing"),
    "lfm2": EXACT,
    "lfm2_moe": Expected(Outcome.refused, "mixing"),
    "lfm3": Expected(Outcome.refused, "mixing"),
    "llama": EXACT,
    "llama4_text": EXACT,
    "longcat_flash": EXACT,
    "mamba": Expected(Outcome.refused, "mixing"),
    "mamba2": Expected(Outcome.refused, "mixing"),
    "megatron-bert": Expected(Outcome.refused, "sdpa"),
    "mellum": EXACT,
    "mimo_v2_flash": Expected(Outcome.refused, "sinks"),
    "minicpm3": Expected(Outcome.refused, "logits"),
    "minimax": Expected(Outcome.refused, "mixing"),
    "minimax_m2": EXACT,
    "minimax_m3_vl_text": EXACT,
    "ministral": EXACT,
    "ministral3": EXACT,
    "mistral": EXACT,
    "mixtral": EXACT,
    "modernbert-decoder": EXACT,
    "mpt": Expected(Outcome.refused, "sdpa"),
    "nanochat": Expected(Outcome.refused, "logits"),
    "nemotron": EXACT,
    "nemotron_h": Expected(Outcome.refused, "mixing"),
    "olmo": EXACT,
    "olmo2": EXACT,
    "olmo3": EXACT,
    "olmo_hybrid": Expected(Outcome.refused, "mixing"),
    "olmoe": EXACT,
    "openai-gpt": Expected(Outcome.refused, "sdpa"),
    "opt": EXACT,
    "persimmon": EXACT,
    "phi": EXACT,
    "phi3": EXACT,
    "phimoe": EXACT,
    "qwen2": EXACT,
    "qwen2_moe": EXACT,
    "qwen3": EXACT,
    "qwen3_5_moe_text": Expected(Outcome.refused, "mixing"),
    "qwen3_5_text": Expected(Outcome.refused, "mixing"),
    "qwen3_moe": EXACT,
    "qwen3_next": Expected(Outcome.refused, "mixing"),
    "qwen4_exp_text": Expected(Outcome.refused, "mixing"),
    "recurrent_gemma": Expected(Outcome.refused, "mixing"),
    "reformer": Expected(Outcome.refused, "sdpa"),
    "rembert": Expected(Outcome.refused, "sdpa"),
    "roberta": Expected(Outcome.refused, "not_causal"),
    "roberta-prelayernorm": Expected(Outcome.refused, "not_causal"),
    "roc_bert": Expected(Outcome.refused, "not_causal"),
    "roformer": Expected(Outcome.refused, "sdpa"),
    "rwkv": Expected(Outcome.refused, "sdpa"),
    "sarvam_mla": EXACT,
    "sarvam_moe": EXACT,
    "seed_oss": EXACT,
    "smollm3": EXACT,
    "solar_open": EXACT,
    "stablelm": EXACT,
    "starcoder2": EXACT,
    "trocr": Expected(Outcome.refused, "sdpa"),
    "vaultgemma": Expected(Outcome.refused, "softcap"),
    "xglm": Expected(Outcome.refused, "sdpa"),
    "xlm": Expected(Outcome.refused, "sdpa"),
    "xlm-roberta": Expected(Outcome.refused, "not_causal"),
    "xlm-roberta-xl": Expected(Outcome.refused, "not_causal"),
    "xlnet": Expected(Outcome.refused, "sdpa"),
    "xlstm": Expected(Outcome.refused, "sdpa"),
    "xmod": Expected(Outcome.refused, "fails"),
    "youtu": EXACT,
    "zamba": Expected(Outcome.refused, "mixing"),
    "zamba2": Expected(Outcome.refused, "mixing"),
    "zaya": Expected(Outcome.refused, "mixing"),
    "deepseek_v3+kv2": Expected(Outcome.refused, "kv_heads"),
    "mixtral+aux": EXACT,
    "qwen3_moe+aux": EXACT,
    "qwen2_moe+aux": EXACT,
    "jetmoe+aux": Expected(Outcome.refused, "router_loss"),
    "mistral+window": EXACT,
    "qwen2+window_layers": EXACT,
    "gemma3_text+windows": EXACT,
    "cohere2+own_loss": EXACT,
    "llama4_text+chunk": Expected(Outcome.refused, "chunked"),
}


def families() -> list[str]:
    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def cases() -> list[Case]:
    """Every family not left out by a rule (its OVERRIDES case, else plain), then VARIANTS."""
    plain = [
        OVERRIDES.get(family, Case(family, family))
        for family in families()
        if skip_rule(family) is None
    ]
    return plain + VARIANTS


def battery_step(cfg: JobConfig, options: VerifyOptions) -> Any:
    """verify's comparison on a pool rank kept for every family: Dynamo first forgets the last
    family's graphs, or transformers' shared layer wrappers would count each family's layers as
    one frame's recompiles and reach the limit."""
    torch.compiler.reset()
    with full_fp32():
        return compare_sp_step(cfg, options, pool_dims(cfg.parallel.sp_size))


def families_table() -> str:
    """docs/compiler.md's table of families, from EXPECTED and the skip rules."""
    rows: dict[str, list[str]] = {}
    for name, expected in sorted(EXPECTED.items()):
        if expected.outcome is Outcome.exact:
            label = "exact at SP=2 (verify passes)"
        else:
            label = f"{expected.outcome.value}: {REASONS[expected.reason][1]}"
        rows.setdefault(label, []).append(name)
    for family in families():
        rule = skip_rule(family)
        if rule is not None:
            rows.setdefault(f"not in the battery: {rule[0]}", []).append(family)
    order = sorted(
        rows, key=lambda label: (not label.startswith("exact"), label.startswith("not in"), label)
    )
    lines = ["| outcome | families |", "|---|---|"]
    lines += [f"| {label} | {', '.join(rows[label])} |" for label in order]
    return "\n".join(lines)
