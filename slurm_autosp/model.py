"""The model, built the way the user already builds it: an HF class, a local checkpoint, or
their own constructor."""

from __future__ import annotations

import importlib

import torch
from torch import nn

from slurm_autosp.config import ConfigError, ModelConfig


def build_model(cfg: ModelConfig) -> nn.Module:
    """An fp32 causal LM; precision is the engine's business, not the model's."""
    if cfg.builder:
        return _call_builder(cfg)
    from transformers import AutoModelForCausalLM

    if cfg.pretrained_path:
        return AutoModelForCausalLM.from_pretrained(
            cfg.pretrained_path, attn_implementation=cfg.attn_implementation, dtype=torch.float32
        )
    return AutoModelForCausalLM.from_config(
        _hf_config(cfg), attn_implementation=cfg.attn_implementation, dtype=torch.float32
    )


def build_skeleton(cfg: ModelConfig) -> nn.Module:
    """The HF model's architecture on the meta device, nothing allocated: parameter sharding
    allocates only each rank's shards. A pretrained model's architecture comes from its
    checkpoint's config; its weights are loaded separately."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.from_pretrained(cfg.pretrained_path) if cfg.pretrained_path else _hf_config(cfg)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(
            hf_config, attn_implementation=cfg.attn_implementation, dtype=torch.float32
        )


def _hf_config(cfg: ModelConfig):
    from transformers import AutoConfig

    try:
        hf_config = AutoConfig.for_model(cfg.model_type, **cfg.hf_fields())
    except ValueError as err:
        raise ConfigError(f"model.model_type={cfg.model_type!r}: {err}") from err
    hf_config.use_cache = False
    return hf_config


def _call_builder(cfg: ModelConfig) -> nn.Module:
    assert cfg.builder is not None
    module_name, _, func_name = cfg.builder.partition(":")
    try:
        func = getattr(importlib.import_module(module_name), func_name)
    except (ImportError, AttributeError) as err:
        raise ConfigError(
            f"model.builder={cfg.builder!r}: cannot import it ({err}); the module must be "
            "importable on every node (installed, or on PYTHONPATH)"
        ) from err
    model = func(cfg)
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model.builder={cfg.builder!r} returned {type(model).__name__}, not an nn.Module")
    return model
